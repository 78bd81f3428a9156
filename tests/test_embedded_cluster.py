"""One embedded LocalCluster per process: started by the first call that needs a cluster,
reused by every later one, its dashboard on 127.0.0.1 announced once, closed at exit; a
client the user made wins. Each case runs as a fresh user process would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import psutil
import pytest

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    import dasktrain as dt

    def main(out, own_client):
        torch.set_num_threads(1)
        user = None
        if own_client:
            from distributed import Client, LocalCluster
            cluster = LocalCluster(n_workers=1, threads_per_worker=1, host="127.0.0.1",
                                   dashboard_address=None)
            user = Client(cluster)
        data = dt.prepare("regression", os.path.join(out, "a.zarr"), samples=400, width=4,
                          chunk_rows=100, progress=False)
        dt.prepare("regression", os.path.join(out, "b.zarr"), samples=400, width=4,
                   chunk_rows=100, progress=False)
        batches = sum(1 for _ in dt.Pipeline(data, 50))
        trainer = dt.Trainer(lambda: torch.nn.Linear(4, 1), torch.nn.functional.mse_loss,
                             dt.optim.sgd(0.01), workers=2, batch_size=25, progress=False)
        trainer.fit(data, epochs=1)
        from dasktrain import _cluster
        embedded = _cluster._embedded
        pids = [] if embedded is None else list(
            embedded[1].run(os.getpid).values())
        users = [] if user is None else list(user.run(os.getpid).values())
        print(json.dumps({"batches": batches, "pids": pids, "users": users}))

    if __name__ == "__main__":
        main(sys.argv[1], sys.argv[2] == "own")
""")


def _run(tmp_path, mode: str) -> tuple[subprocess.CompletedProcess, dict]:
    script = tmp_path / "user.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(tmp_path), mode],
                          capture_output=True, text=True, timeout=170,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    return done, json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_one_embedded_cluster_serves_every_call_and_closes_at_exit(tmp_path):
    done, result = _run(tmp_path, "embedded")
    assert result["batches"] == 8
    announcements = [line for line in done.stderr.splitlines()
                     if "started a local Dask cluster" in line]
    # Two prepares, a pipeline and a fit: one cluster, announced once, with its dashboard
    # on loopback.
    assert len(announcements) == 1, done.stderr
    assert "dashboard: http://127.0.0.1:" in announcements[0]
    # Its worker processes are gone once the process has exited.
    assert result["pids"] and not any(psutil.pid_exists(p) for p in result["pids"])


@pytest.mark.slow
def test_a_client_the_user_made_wins(tmp_path):
    done, result = _run(tmp_path, "own")
    assert "started a local Dask cluster" not in done.stderr
    assert result["pids"] == [] and len(result["users"]) == 1



@pytest.fixture
def spawned():
    """Workers started by spawning, as a user's are: a worker forked from the suite's fork
    server has the server's environment and allocator, whatever was set since it began
    (and the server begins with the first cluster of its pytest process)."""
    import dask

    with dask.config.set({"distributed.worker.multiprocessing-method": "spawn"}):
        yield


def _malloc_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}


@pytest.mark.parametrize("user", [None, "config", "environment", "arenas"])
def test_embedded_workers_reuse_chunk_sized_buffers_unless_the_user_set_malloc(
        user, monkeypatch, spawned):
    import dask
    from distributed import Client

    from dasktrain._cluster import WORKER_MALLOC_ENVIRONMENT, start_local_cluster

    for key in WORKER_MALLOC_ENVIRONMENT:  # as a fresh process has them
        monkeypatch.delenv(key, raising=False)
    if user == "environment":
        monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    if user == "arenas":
        monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    stock = dask.config.get("distributed.nanny.pre-spawn-environ")
    settings = {"distributed.nanny.pre-spawn-environ": {**stock, "MALLOC_TRIM_THRESHOLD_": 0}
                } if user == "config" else {}
    before = _malloc_environment()
    with dask.config.set(settings), start_local_cluster(n_workers=1) as cluster, \
            Client(cluster) as client:
        (found,) = client.run(_malloc_environment).values()
        if user is None:  # ours is put back: clusters started after this one never see it
            assert _malloc_environment() == before
    assert found == {None: WORKER_MALLOC_ENVIRONMENT,
                     "arenas": {"MALLOC_TRIM_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "4"},
                     }.get(user, {"MALLOC_TRIM_THRESHOLD_": "0"})
    assert dask.config.get("distributed.nanny.pre-spawn-environ") == stock


def _arenas_after_threads(threads: int = 8) -> int:
    """glibc's allocator arenas in this process after ``threads`` more threads allocated
    at once (``malloc_info``'s heaps)."""
    import ctypes
    import tempfile
    import threading

    together = threading.Barrier(threads, timeout=30)

    def allocate() -> None:
        # Above pymalloc's 512 bytes and below the mmap threshold: from the thread's arena,
        # held until every thread has one (a finished thread's arena goes to the next).
        held = [bytearray(100_000) for _ in range(10)]
        together.wait()
        del held

    started = [threading.Thread(target=allocate) for _ in range(threads)]
    for thread in started:
        thread.start()
    for thread in started:
        thread.join()
    libc = ctypes.CDLL(None)
    libc.fopen.restype = ctypes.c_void_p
    with tempfile.NamedTemporaryFile("r", suffix=".xml") as report:
        stream = libc.fopen(report.name.encode(), b"w")
        libc.malloc_info(0, ctypes.c_void_p(stream))
        libc.fclose(ctypes.c_void_p(stream))
        return report.read().count("<heap nr=")


def test_embedded_workers_keep_two_allocator_arenas_however_many_threads_allocate(
        monkeypatch, spawned):
    """Each glibc arena keeps up to the trim threshold of freed memory, and a worker's
    threads each made one of their own: W13's image epochs grew its workers epoch after
    epoch. The embedded cluster's workers keep two; a worker started with distributed's
    stock environment makes one per thread (the check can fail)."""
    from distributed import Client, LocalCluster

    from dasktrain._cluster import WORKER_MALLOC_ENVIRONMENT, start_local_cluster

    for key in WORKER_MALLOC_ENVIRONMENT:  # as a fresh process has them
        monkeypatch.delenv(key, raising=False)
    with start_local_cluster(n_workers=1) as cluster, Client(cluster) as client:
        (embedded,) = client.run(_arenas_after_threads).values()
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster, Client(cluster) as client:
        (stock,) = client.run(_arenas_after_threads).values()
    assert embedded <= 2 < 8 <= stock, (embedded, stock)


def _mmapped_for_16_mib() -> int:
    """Bytes glibc maps afresh (rather than taking from its heap) to allocate 16 MiB: all of
    them with its mmap threshold frozen at 128 KiB (a heap with 16 MiB free in one piece,
    which could serve it instead, does not arise from the small blocks it then holds),
    none with the threshold at 32 MiB."""
    import ctypes

    import numpy as np

    class _Info(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _Info
    before = libc.mallinfo2().hblkhd
    buffer = np.ones(1 << 22, np.float32)
    grown = libc.mallinfo2().hblkhd - before
    del buffer
    return grown


@pytest.mark.parametrize("user", [None, "config"])
def test_any_clusters_workers_reuse_large_buffers_once_dasktrain_runs_there(
        user, tmp_path, monkeypatch, spawned):
    """Not only the embedded cluster: a worker of the user's own cluster, started with
    distributed's stock allocator setting, gets the thresholds with dasktrain's first task
    there (see dasktrain._malloc), its environment untouched; one whose allocator the user
    configured keeps it."""
    import dask
    from distributed import Client, LocalCluster

    import dasktrain as dt
    from dasktrain._cluster import WORKER_MALLOC_ENVIRONMENT

    for key in WORKER_MALLOC_ENVIRONMENT:  # as a fresh process has them
        monkeypatch.delenv(key, raising=False)
    stock = dask.config.get("distributed.nanny.pre-spawn-environ")
    settings = {"distributed.nanny.pre-spawn-environ": {**stock, "MALLOC_TRIM_THRESHOLD_": 0}
                } if user == "config" else {}
    with dask.config.set(settings), \
            LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                         host="127.0.0.1", dashboard_address=None) as cluster, \
            Client(cluster) as client:
        (before,) = client.run(_mmapped_for_16_mib).values()
        assert before >= 1 << 24  # either setting freezes glibc's mmap threshold
        dt.prepare("regression", tmp_path / "r.zarr", client=client, samples=64, width=4,
                   progress=False)
        (after,) = client.run(_mmapped_for_16_mib).values()
        (found,) = client.run(_malloc_environment).values()
    if user is None:
        assert found == {"MALLOC_TRIM_THRESHOLD_": "65536"} and after == 0
    else:
        assert found == {"MALLOC_TRIM_THRESHOLD_": "0"} and after >= 1 << 24
