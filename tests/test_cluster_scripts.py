"""examples/cluster as a user runs it: `dask scheduler` and `dask worker` started by the
scripts, then train.py connecting to them, over plain TCP and over TLS."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from distributed import Client, Security

import dasktrain as dt
from dasktrain._cluster import worker_info
from tests.common.builders import REPO

SCRIPTS = REPO / "examples" / "cluster"
WORKERS = 2


def _env(**settings: str) -> dict[str, str]:
    """The scripts' environment: this interpreter's `dask` first on PATH, loopback only."""
    bin_dir = Path(sys.executable).parent
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "OMP_NUM_THREADS": "1", "HOST": "127.0.0.1", **settings}


@contextlib.contextmanager
def _started(command: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen]:
    """Run ``command`` in a process group of its own, stopped (with every process it started)
    when the block ends, however it ends."""
    with open(log, "wb") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        yield process
    finally:
        _stop_group(process)


def _stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to the whole group (Dask's processes close gracefully on it), SIGKILL to
    whatever is left of it after 30 s."""
    def signal_group(sig: int) -> bool:
        process.poll()  # reap the leader: a zombie would keep the group alive
        try:
            os.killpg(process.pid, sig)
            return True
        except ProcessLookupError:  # the group is empty
            return False

    signal_group(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while signal_group(0) and time.monotonic() < deadline:
        time.sleep(0.1)
    signal_group(signal.SIGKILL)
    process.wait(timeout=10)


def _poll(condition, what: str, timeout: float, *watched: tuple[subprocess.Popen, Path]):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        for process, log in watched:
            if process.poll() is not None:
                pytest.fail(f"{process.args[0]} exited ({process.returncode}) before {what}:\n"
                            f"{log.read_text()[-3000:]}")
        time.sleep(0.1)
    pytest.fail(f"no {what} within {timeout:.0f}s")


def _load_train_module():
    spec = importlib.util.spec_from_file_location("cluster_train", SCRIPTS / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["tcp", "tls"])
def test_train_script_on_a_scheduler_and_workers_started_by_the_scripts(tmp_path, protocol):
    settings = {}
    tls_args: list[str] = []
    security = None
    if protocol == "tls":
        certs = tmp_path / "certs"
        subprocess.run([str(SCRIPTS / "make_certs.sh"), str(certs)], check=True, timeout=60,
                       capture_output=True)
        settings["TLS_DIR"] = str(certs)
        tls_args = ["--tls-ca-file", str(certs / "ca.pem"), "--tls-cert", str(certs / "cert.pem"),
                    "--tls-key", str(certs / "key.pem")]
        security = Security(tls_ca_file=str(certs / "ca.pem"),
                            tls_client_cert=str(certs / "cert.pem"),
                            tls_client_key=str(certs / "key.pem"), require_encryption=True)
    scheduler_file = tmp_path / "scheduler.json"
    scheduler_log, workers_log = tmp_path / "scheduler.log", tmp_path / "workers.log"
    with _started([str(SCRIPTS / "start_scheduler.sh"), "--no-dashboard",
                   "--scheduler-file", str(scheduler_file)],
                  _env(PORT="0", **settings), scheduler_log) as scheduler:
        address = _poll(lambda: scheduler_file.exists() and
                        json.loads(scheduler_file.read_text() or "{}").get("address"),
                        "scheduler address", 60, (scheduler, scheduler_log))
        assert address.startswith(f"{protocol}://127.0.0.1:")
        with _started([str(SCRIPTS / "start_workers.sh"), address, "--no-dashboard"],
                      _env(NWORKERS=str(WORKERS), GPUS="0", MEMORY_LIMIT="2GiB", **settings),
                      workers_log) as workers:
            with Client(address, security=security, timeout="30s") as client:
                _poll(lambda: len(worker_info(client)) == WORKERS,
                      f"{WORKERS} connected workers", 90,
                      (workers, workers_log), (scheduler, scheduler_log))
                info = worker_info(client).values()
                assert all(w["host"] == "127.0.0.1" and w["nthreads"] == 1 for w in info)
                assert all(w["memory_limit"] == 2 * 2**30 for w in info)
            shared = tmp_path / "shared"
            result = subprocess.run(
                [sys.executable, str(SCRIPTS / "train.py"), "--scheduler", address,
                 "--shared", str(shared), "--samples", "4096", "--epochs", "2", *tls_args],
                capture_output=True, text=True, timeout=150, env=_env(), cwd=tmp_path)
            assert result.returncode == 0, (result.stdout + result.stderr
                                            + workers_log.read_text()[-3000:])
    assert workers.returncode is not None and scheduler.returncode is not None

    runs = shared / "runs" / "regression"
    assert (runs / "checkpoint" / "checkpoint.pt").is_file()
    assert f"saved the model to {runs / 'model.pt'}" in result.stdout
    trainer = dt.Trainer.load(runs / "model.pt", model=_load_train_module().regressor)
    assert len(trainer.history.epochs) == 2
    # A replica outside the holder's process pushes over the direct channel on TCP, through
    # the actor's (encrypted) calls on TLS.
    ways = {"local", "direct"} if protocol == "tcp" else {"local", "actor"}
    for epoch in trainer.history.epochs:
        assert set(epoch["exchange_via"]) <= ways and sum(epoch["exchange_via"].values()) == 2
    val = dt.open_dataset(shared / "regression.zarr").split("val")
    x = torch.from_numpy(np.asarray(val.x.compute(scheduler="sync")))
    y = torch.from_numpy(np.asarray(val.y.compute(scheduler="sync")))
    with torch.no_grad():
        loss = torch.nn.functional.mse_loss(trainer.model(x), y).item()
    # Predicting the mean costs var(y); the untrained model, more. The model learned y.
    assert loss < 0.3 * y.var().item()
    assert loss < 0.3 * trainer.history.loss[0]


def jitter(arrays: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A transform, so the pipeline reads its blocks in Dask tasks on the cluster."""
    out = dict(arrays)
    out["x"] = arrays["x"] + rng.normal(0, 1e-3, arrays["x"].shape).astype(np.float32)
    return out


def fit_beside_cpu_workers(dataset: dt.Dataset, tmp_path: Path, **options
                           ) -> tuple[dt.History, str]:
    """Two epochs of ``sync`` with one replica on a cluster the scripts started as the docs
    say for a GPU machine (``GPUS=1``: one worker declaring ``GPU=1``; ``NWORKERS=2`` CPU
    workers beside it). Returns the History and the GPU worker's address, after checking
    that the pipeline's block tasks ran, and none on the GPU worker (whose process is the
    replica's)."""
    from distributed import get_task_stream

    from tests.common.training import mlp, mse

    scheduler_file = tmp_path / "scheduler.json"
    scheduler_log, workers_log = tmp_path / "scheduler.log", tmp_path / "workers.log"
    # The scheduler and workers unpickle the tests' functions: they import them from here.
    python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    with _started([str(SCRIPTS / "start_scheduler.sh"), "--no-dashboard",
                   "--scheduler-file", str(scheduler_file)],
                  _env(PORT="0", PYTHONPATH=python_path), scheduler_log) as scheduler:
        address = _poll(lambda: scheduler_file.exists() and
                        json.loads(scheduler_file.read_text() or "{}").get("address"),
                        "scheduler address", 60, (scheduler, scheduler_log))
        with _started([str(SCRIPTS / "start_workers.sh"), address, "--no-dashboard"],
                      _env(GPUS="1", NWORKERS="2", MEMORY_LIMIT="2GiB",
                           PYTHONPATH=python_path), workers_log) as workers, \
                Client(address, timeout="30s") as client:
            _poll(lambda: len(worker_info(client)) == 3, "3 connected workers", 90,
                  (workers, workers_log), (scheduler, scheduler_log))
            gpu = [a for a, w in worker_info(client).items()
                   if (w.get("resources") or {}).get("GPU") == 1]
            assert len(gpu) == 1, worker_info(client)
            with get_task_stream(client) as stream:
                trainer = dt.Trainer(mlp, mse, dt.optim.sgd(0.05), "sync", workers=1,
                                     batch_size=16, transform=jitter, progress=False,
                                     **options)
                history = trainer.fit(dataset, epochs=2, client=client)
    blocks = [t for t in stream.data if "dasktrain-batches-" in str(t["key"])]
    assert blocks, "the pipeline ran no block task on the cluster"
    assert not [t for t in blocks if t["worker"] == gpu[0]]
    return history, gpu[0]


@pytest.mark.slow
def test_a_declared_gpu_worker_gets_the_replica_and_the_cpu_workers_the_blocks(
        regression, tmp_path):
    # No GPU is needed to check the placement: the resource is what the scheduler sees (a
    # replica pinned to a CPU worker while asking for GPU=1 failed the fit in the scheduler).
    history, gpu = fit_beside_cpu_workers(regression, tmp_path)
    assert [w["address"] for w in history.epochs[-1]["per_worker"]] == [gpu]
    assert len(history.epochs) == 2 and history.loss[-1] < history.loss[0]
