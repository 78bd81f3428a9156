"""Datasets and checkpoints on object storage: a real S3 server (moto) on 127.0.0.1.

The workers of the session cluster were started before the server: they reach it only
through the storage options travelling with the tasks, never through the environment.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch

import dasktrain as dt
from dasktrain._durable import url_filesystem
from dasktrain.datasets.publish_lock import LOCK_NAME, publish_lock
from dasktrain.datasets.remote import BUILD_PREFIX
from dasktrain.trainer.driver.checkpoint import load_checkpoint
from dasktrain.trainer.driver.update_log import UpdateLog, split_kinds
from tests.common.builders import run_cli, wait_for
from tests.common.meanwhile import meanwhile
from tests.common.object_storage import BUCKET, s3_server  # noqa: F401  (the s3 fixture)
from tests.common.training import mlp, mse


@pytest.fixture
def s3_default(s3, monkeypatch):
    """The options as fsspec's configuration in this process (where checkpoints are
    written), for the APIs that take a bare URL."""
    monkeypatch.setitem(fsspec.config.conf, "s3", dict(s3.options))
    return s3


def _idle(client) -> bool:
    return not any(client.processing().values())


# -- datasets ------------------------------------------------------------------------------
def test_prepare_open_verify_and_batches_on_s3(client, s3):
    url = s3.url("reg.zarr")
    ds = dt.prepare("regression", url, client=client, storage_options=s3.options,
                    samples=600, width=4, chunk_rows=100, split="train=0.75,val=0.25",
                    normalize=True, seed=3, progress=False)
    names = s3.names("reg.zarr")
    assert "zarr.json" in names and len(names) == 2 and names[0].startswith(BUILD_PREFIX)
    again = dt.open_dataset(url, storage_options=s3.options)
    assert again.identity == ds.identity and len(again) == 600
    assert dt.verify(url, storage_options=s3.options, client=client, progress=False).ok
    text = dt.describe(url, storage_options=s3.options)
    assert "train=450" in text and "stored" in text

    with pytest.raises(FileExistsError, match="already exists; pass --overwrite"):
        dt.prepare("parabola", url, client=client, storage_options=s3.options,
                   progress=False)

    x = again.x.compute()
    pipe = dt.Pipeline(again.split("train"), batch_size=50, seed=1, client=client)
    seen = np.concatenate([batch.numpy() for batch, _ in pipe])
    assert seen.shape == (450, 4)
    # Every row of the split exactly once, in the epoch's shuffled order.
    train = x[:450]
    np.testing.assert_array_equal(seen[np.lexsort(seen.T)], train[np.lexsort(train.T)])


def test_memory_urls_need_workers_in_this_process(client):
    with pytest.raises(OSError, match="memory:// is per process"):
        dt.prepare("parabola", "memory://dasktrain-test/p.zarr", client=client,
                   progress=False)


def test_a_failed_rebuild_keeps_the_dataset_and_removes_its_build(client, s3, tmp_path):
    url = s3.url("keep.zarr")
    good = dt.prepare("parabola", url, client=client, storage_options=s3.options,
                      progress=False)
    before, names = good.x.compute(), s3.names("keep.zarr")
    # A .npy whose header promises more rows than the file holds fails on a worker
    # while the chunks are being written.
    bad = tmp_path / "truncated.npy"
    np.save(bad, np.ones((100_000, 4), dtype=np.float32))
    with bad.open("r+b") as fh:
        fh.truncate(bad.stat().st_size // 2)
    with pytest.raises(ValueError, match="mmap length is greater than file size"):
        dt.prepare(bad, url, client=client, storage_options=s3.options, progress=False,
                   overwrite=True, chunk_rows=10_000)
    wait_for(lambda: _idle(client), 30, "the failed build's tasks to end")
    assert s3.names("keep.zarr") == names
    np.testing.assert_array_equal(
        dt.open_dataset(url, storage_options=s3.options).x.compute(), before)


def test_a_dataset_copied_up_from_disk_opens_and_is_replaced_whole(client, s3, tmp_path):
    local = dt.prepare("parabola", tmp_path / "p.zarr", client=client, progress=False)
    s3.fs.put(str(tmp_path / "p.zarr"), f"{BUCKET}/copied.zarr", recursive=True)
    url = s3.url("copied.zarr")
    copied = dt.open_dataset(url, storage_options=s3.options)
    np.testing.assert_array_equal(copied.x.compute(), local.x.compute())
    assert s3.names("copied.zarr") == ["x", "y", "zarr.json"]

    dt.prepare("regression", url, client=client, storage_options=s3.options, samples=200,
               width=2, chunk_rows=100, overwrite=True, progress=False)
    names = s3.names("copied.zarr")
    assert len(names) == 2 and names[0].startswith(BUILD_PREFIX)  # the old arrays are gone
    assert dt.open_dataset(url, storage_options=s3.options).x.shape == (200, 2)


def test_overwrite_swaps_whole_datasets_under_a_reader(client, s3):
    url = s3.url("swap.zarr")
    old = dt.prepare("parabola", url, client=client, storage_options=s3.options,
                     progress=False)
    expected = {old.identity: old.x.compute()}
    seen: dict[str, int] = {}
    problems: list[str] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            try:
                ds = dt.open_dataset(url, storage_options=s3.options)
                x = ds.zarr_array("x")[:]
            except (dt.DatasetError, KeyError):
                continue  # the old build's arrays went between reading metadata and arrays
            want = expected.get(ds.identity)
            if want is None:
                continue  # the new build, before this thread learns its values
            if not np.array_equal(x, want):
                # Only a reader whose dataset was replaced under it may see other values.
                now = dt.open_dataset(url, storage_options=s3.options)
                if now.identity == ds.identity:
                    problems.append(f"build {ds.identity} read back wrong values")
                continue
            seen[ds.identity] = seen.get(ds.identity, 0) + 1

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        wait_for(lambda: seen.get(old.identity, 0) > 0, 30, "the reader to see the old data")
        new = dt.prepare("regression", url, client=client, storage_options=s3.options,
                         samples=500, width=1, chunk_rows=50, overwrite=True,
                         progress=False)
        expected[new.identity] = new.x.compute()
        wait_for(lambda: seen.get(new.identity, 0) > 0, 30, "the reader to see the new data")
    finally:
        stop.set()
        reader.join(timeout=30)
    assert not reader.is_alive()
    assert problems == []
    assert len(s3.names("swap.zarr")) == 2  # the old build is gone


def _source(url: str, s3) -> str:
    return dt.open_dataset(url, storage_options=s3.options).attrs["provenance"]["source"]


@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "overwrite"])
def test_a_dataset_published_meanwhile_is_kept_whole(client, s3, overwrite):
    url = s3.url(f"meanwhile-{overwrite}.zarr")
    options = {"client": client, "storage_options": s3.options, "progress": False,
               "overwrite": overwrite}
    if overwrite:
        dt.prepare("classification", url, samples=40, width=2, **options)
    # Without --overwrite the late one is refused by name; with it, the build of the one
    # that published first was retired by that publish: it says so (its tasks only saw the
    # build gone).
    error, message = ((FileNotFoundError, "another preparation into .* published first and "
                       "retired this build") if overwrite else
                      (dt.OutputExistsError, f"output {url} was written by another "
                       "preparation while this one ran; pass --overwrite"))
    with meanwhile(lambda: dt.prepare("parabola", url, **options)) as other, \
            pytest.raises(error, match=message):
        dt.prepare("regression", url, samples=200, width=2, chunk_rows=50, **options)
    assert other.ran and _source(url, s3) == "parabola"
    assert dt.verify(url, storage_options=s3.options, client=client, progress=False).ok
    wait_for(lambda: _idle(client), 30, "the late build's tasks to end")
    names = s3.names(f"meanwhile-{overwrite}.zarr")
    assert len(names) == 2 and "zarr.json" in names, names  # one build: the late one is gone


class _Said(logging.Handler):
    def __init__(self, start: str) -> None:
        super().__init__()
        self.start, self.said = start, threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith(self.start):
            self.said.set()


def test_one_publish_at_a_time_holds_the_urls_lock(client, s3):
    url = s3.url("locked.zarr")
    fs, root = url_filesystem(url, s3.options)
    log = logging.getLogger("dasktrain.datasets.publish_lock")
    waiting = _Said("waiting for another preparation's publish")
    log.addHandler(waiting)
    log.setLevel(logging.INFO)
    outcome: dict = {}

    def prepare() -> None:
        try:
            outcome["ds"] = dt.prepare("parabola", url, client=client, progress=False,
                                       storage_options=s3.options)
        except BaseException as exc:  # reported by the assertions below
            outcome["error"] = exc

    try:
        with publish_lock(fs, root, url):  # as another preparation's publish holds it
            thread = threading.Thread(target=prepare)
            thread.start()
            assert waiting.said.wait(60), outcome
            assert "zarr.json" not in s3.names("locked.zarr")  # it waits: nothing published
        thread.join(60)
    finally:
        log.removeHandler(waiting)
        log.setLevel(logging.NOTSET)
    assert "error" not in outcome and len(outcome["ds"]) == 50
    assert LOCK_NAME not in s3.names("locked.zarr")


def test_a_lock_left_by_a_stopped_publish_is_taken_over(client, s3):
    url = s3.url("stale.zarr")
    fs, root = url_filesystem(url, s3.options)
    left = {"owner": "a preparation killed while publishing", "since": time.time() - 600}
    fs.pipe_file(f"{root}/{LOCK_NAME}", json.dumps(left).encode())
    ds = dt.prepare("parabola", url, client=client, progress=False, storage_options=s3.options)
    assert len(ds) == 50 and LOCK_NAME not in s3.names("stale.zarr")


@pytest.mark.slow
def test_a_killed_prepare_leaves_nothing_to_open_and_a_rerun_succeeds(client, s3):
    url = s3.url("killed.zarr")
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "dasktrain"), "prepare", "regression", url,
         "--samples", "400000", "--width", "16", "--chunk-rows", "4000", "--no-progress",
         "--scheduler", client.scheduler.address, *s3.cli_options()],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    opened: list[str] = []

    def started() -> bool:
        # A reader polling all along never finds a dataset there.
        with contextlib.suppress(dt.DatasetError):
            opened.append(repr(dt.open_dataset(url, storage_options=s3.options)))
        return s3.chunk_objects("killed.zarr") >= 3 or proc.poll() is not None

    try:
        wait_for(started, 120, "the first chunks to be written")
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert opened == []
    wait_for(lambda: _idle(client), 60, "the killed client's tasks to end")
    with pytest.raises(dt.DatasetError, match="nothing there"):
        dt.open_dataset(url, storage_options=s3.options)
    leftovers = s3.names("killed.zarr")
    assert leftovers and all(n.startswith(BUILD_PREFIX) for n in leftovers)

    # No --overwrite needed: leftovers are not a dataset. They go once the new one is in.
    ds = dt.prepare("regression", url, client=client, storage_options=s3.options,
                    samples=300, width=4, chunk_rows=100, progress=False)
    assert len(ds) == 300 and dt.verify(ds, client=client, progress=False).ok
    names = s3.names("killed.zarr")
    assert len(names) == 2 and "zarr.json" in names and names[0] not in leftovers


# -- checkpoints ---------------------------------------------------------------------------
def test_fit_checkpoints_resumes_and_loads_from_s3(client, s3_default, tmp_path):
    s3 = s3_default
    data = dt.prepare("regression", s3.url("fit.zarr"), client=client,
                      storage_options=s3.options, samples=320, width=4, chunk_rows=80,
                      split="train=0.75,val=0.25", seed=6, progress=False)
    run, models = s3.url("runs/a"), s3.url("runs/models")

    def trainer() -> dt.Trainer:
        return dt.Trainer(mlp, mse, dt.optim.sgd(0.05), mode="sync", workers=2,
                          batch_size=16, progress=False)

    first = trainer()
    first.fit(data.split("train"), epochs=1, client=client, checkpoint=run,
              validation=data.split("val"),
              callbacks=[dt.ModelCheckpoint(models, keep_last=1)])
    assert s3.names("runs/a") == ["checkpoint-updates.jsonl", "checkpoint.pt"]
    updates, others = split_kinds(UpdateLog(run).read())
    assert [r["version"] for r in updates] == first.history.version
    assert others["epochs"] == first.history.epochs

    resumed = trainer()
    history = resumed.fit(data.split("train"), epochs=2, client=client, checkpoint=run,
                          resume=run, validation=data.split("val"),
                          callbacks=[dt.ModelCheckpoint(models, keep_last=1)])
    assert history.loss[: first.history.updates] == first.history.loss
    assert load_checkpoint(run)["complete_epochs"] == 2
    assert len(split_kinds(UpdateLog(run).read())[0]) == history.updates
    assert s3.names("runs/models") == ["best.pt", "epoch-0001.pt"]  # epoch 0's was deleted

    loaded = dt.Trainer.load(run, model=mlp, loss=mse)
    assert loaded.history.loss == history.loss
    for a, b in zip(loaded.model.parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(a, b)

    saved = resumed.save(s3.url("runs/final.pt"))
    assert saved == s3.url("runs/final.pt")
    final = dt.Trainer.load(saved, model=mlp, loss=mse)
    for a, b in zip(final.model.parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        dt.Trainer.load(s3.url("runs/nothing"), model=mlp, loss=mse)


# -- the command line ----------------------------------------------------------------------
def test_cli_prepare_info_verify_with_storage_options(client, s3):
    url = s3.url("cli.zarr")
    done = run_cli("prepare", "parabola", url, "--scheduler", client.scheduler.address,
                   "--no-progress", *s3.cli_options())
    assert done.returncode == 0, done.stderr
    assert f"dataset   {url}" in done.stdout
    info = run_cli("info", url, *s3.cli_options())
    assert info.returncode == 0 and "samples   50" in info.stdout, info.stderr
    checked = run_cli("verify", url, "--scheduler", client.scheduler.address,
                      "--no-progress", *s3.cli_options())
    assert checked.returncode == 0 and checked.stdout.startswith("ok:"), checked.stderr


def _assert_one_line_error(result, *fragments: str) -> None:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


# One attempt, not botocore's five with back-off: the error is the point, not the wait.
UNREACHABLE = ["endpoint_url=http://127.0.0.1:1", "key=a", "secret=b",
               'config_kwargs={"retries": {"max_attempts": 1}}']


@pytest.mark.parametrize(("out", "options", "fragments"), [
    ("s3://{bucket}/down.zarr", UNREACHABLE, ["cannot reach s3://"]),
    ("s3://", [], ["names no bucket"]),
    ("s3://{bucket}/x.zarr", ["no-equals-sign"], ["KEY=VALUE"]),
    ("s3://{bucket}/stranger", [], ["not a dasktrain dataset", "refusing"]),
])
def test_cli_bad_urls_are_one_line_and_exit_2(s3, out, options, fragments):
    s3.fs.pipe_file(f"{BUCKET}/stranger/notes.txt", b"not ours")
    url = out.format(bucket=BUCKET)
    given = [a for o in options for a in ("--storage-option", o)] if options else \
        s3.cli_options()
    # No cluster is started for a refused output: --scheduler points nowhere.
    done = run_cli("prepare", "parabola", url, "--scheduler", "tcp://127.0.0.1:1", *given)
    _assert_one_line_error(done, *fragments)
    assert s3.names("stranger") == ["notes.txt"]
    assert s3.names("x.zarr") == [] and s3.names("down.zarr") == []


def test_cli_info_of_an_unreachable_store_is_one_line(s3):
    done = run_cli("info", s3.url("cli.zarr"),
                   *[a for o in UNREACHABLE for a in ("--storage-option", o)])
    _assert_one_line_error(done, "cannot reach")
