"""Checkpoints stay small and durable; per-update records live in an append-only log."""

from __future__ import annotations

import contextlib
import functools
import os
import stat
import subprocess
import sys

import numpy as np
import pytest

import dasktrain as dt
from dasktrain.datasets.atomic import StagedDirectory
from dasktrain.trainer.driver.checkpoint import load_checkpoint, save_checkpoint
from dasktrain.trainer.driver.resume import checkpoint_history
from dasktrain.trainer.driver.run import FitRun
from dasktrain.trainer.driver.update_log import UpdateLog, split_kinds
from dasktrain.trainer.exchange.handle import HolderHandle
from dasktrain.trainer.flat import FlatModel
from dasktrain.trainer.worker.compute import BatchCompute
from dasktrain.trainer.worker.config import WorkerConfig
from tests.common.training import mlp, mse, zeros, zeros_holder


@pytest.fixture(scope="module")
def regression(client, tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "reg.zarr"
    return dt.prepare("regression", out, client=client, samples=320, width=4, chunk_rows=80,
                      seed=6, progress=False)


def _trainer():
    return dt.Trainer(mlp, mse, dt.optim.sgd(0.05), mode="sync", workers=2, batch_size=16,
                      progress=False)


def test_the_checkpoint_keeps_no_per_update_lists_and_resume_restores_them(
        client, regression, tmp_path):
    run = tmp_path / "run"
    sizes = []
    first = _trainer()
    # Epoch callbacks run before their epoch's checkpoint is written (it holds their
    # state): the sizes are read between fits, the second resuming the first.
    first.fit(regression, epochs=1, client=client, checkpoint=run)
    sizes.append(os.path.getsize(run / "checkpoint.pt"))
    first.fit(regression, epochs=2, client=client, checkpoint=run, resume=run)
    sizes.append(os.path.getsize(run / "checkpoint.pt"))
    state = load_checkpoint(run)
    assert "loss" not in state["history"] and "staleness" not in state["history"]
    # Constant size, whatever the number of updates and epochs.
    assert abs(sizes[1] - sizes[0]) < 64, sizes
    rows, others = split_kinds(UpdateLog(run).read())
    assert others["epochs"] == first.history.epochs
    assert [r["version"] for r in rows] == first.history.version
    assert [r["loss"] for r in rows] == first.history.loss
    assert sum(len(r["staleness"]) for r in rows) == len(first.history.staleness)

    resumed = _trainer()
    history = resumed.fit(regression, epochs=4, client=client, resume=run, checkpoint=run)
    assert history.loss[: first.history.updates] == first.history.loss
    assert history.version == list(range(1, history.updates + 1))
    assert history.updates == 2 * first.history.updates
    assert len(split_kinds(UpdateLog(run).read())[0]) == history.updates
    loaded = dt.Trainer.load(run, model=mlp, loss=mse)
    assert loaded.history.loss == history.loss


_WRITER = "dasktrain.trainer.driver.run_checkpoints"  # the logger of the writes


def _saved_versions(caplog) -> list[int]:
    """The versions of the checkpoints the driver wrote, in the order it wrote them."""
    return [int(r.args[0]) for r in caplog.records
            if r.name == _WRITER and r.msg.startswith("checkpoint at")]


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_checkpoints_keep_a_constant_size_and_never_go_backwards(client, regression, tmp_path,
                                                                caplog, mode):
    """A checkpoint every update, over fits of 2 and 8 epochs: the file is as large after
    the long fit as after the short one (the History's events, claims and epoch records
    are in the run's log, not rewritten whole at every save), and no save is of an older
    state than the one before it, although the holder runs into each next epoch while the
    driver saves the boundary of the last (a mid-epoch state of epoch e + 1 polled before
    the boundary of e was saved waits for that save)."""
    caplog.set_level("INFO", logger=_WRITER)
    sizes = {}
    for epochs in (2, 8):
        trainer = dt.Trainer(mlp, mse, dt.optim.sgd(0.05), mode=mode, workers=2,
                             batch_size=16, checkpoint_every=1, progress=False)
        run = tmp_path / f"run-{epochs}"
        history = trainer.fit(regression, epochs=epochs, client=client, checkpoint=run)
        sizes[epochs] = os.path.getsize(run / "checkpoint.pt")
        versions = _saved_versions(caplog)
        caplog.clear()
        assert versions == sorted(versions), versions
        assert versions[-1] == history.version[-1]
        state = load_checkpoint(run)
        assert not state["history"]["events"] and not state["history"]["epochs"]
        resumed = dt.Trainer(mlp, mse, dt.optim.sgd(0.05), mode=mode, workers=2,
                             batch_size=16, progress=False)
        again = resumed.fit(regression, epochs=epochs, client=client, resume=run)
        assert again.epochs == history.epochs and again.events == history.events
        assert again.claims == history.claims and again.loss == history.loss
    assert abs(sizes[8] - sizes[2]) < 64, sizes


_SUMMARY_PEAK = """
import sys, tracemalloc
from dasktrain.trainer.driver.update_log import KINDS
from dasktrain.trainer.view.history import History

updates = int(sys.argv[1])
history = History(mode="async", workers=2)
rows = range(updates)
history.extend({"version": list(rows), "loss": [0.5] * updates,
                "samples": [64] * updates, "contributors": [1] * updates,
                "gradients": [1] * updates, "time": [0.1] * updates,
                "staleness": [1] * updates, "staleness_worker": [0] * updates,
                "scale": [1.0] * updates, "compensated": [False] * updates,
                "dropped": [False] * updates})
history.events += [f"v{v}: an event" for v in range(updates // 10)]
history.claims += [[0, v, 0, v, v + 1] for v in range(updates // 10)]
history.epochs += [{"epoch": e, "train": {"loss": 0.1}} for e in range(updates // 50)]
tracemalloc.start()
summary = history.to_dict(per_update=False, empty=KINDS.values())
peak = tracemalloc.get_traced_memory()[1]
tracemalloc.stop()
assert "loss" not in summary and summary["extra"] == {}
assert summary["events"] == summary["claims"] == summary["epochs"] == []
assert summary["mode"] == "async" and summary["workers"] == 2
print(peak)
"""


def test_a_checkpoints_summary_costs_the_same_however_long_the_history():
    """The History's summary in every checkpoint leaves out the per-update lists, events,
    claims and epoch records (the run's log has them) without copying them first: once it
    deep-copied the whole History and dropped the lists after, so that a soak's epochs
    grew slower by 2 ms each (W14). Measured in a fresh interpreter: tracemalloc's peak
    counts every thread's allocations, and this module's cluster allocates in its own."""
    def allocated(updates: int) -> int:
        done = subprocess.run([sys.executable, "-c", _SUMMARY_PEAK, str(updates)],
                              capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        return int(done.stdout.split()[-1])

    assert allocated(200_000) < 2 * allocated(2_000) + 4096


def test_a_bounded_history_keeps_the_last_updates_and_counts_the_whole_run(
        client, regression, tmp_path):
    def trainer(**options) -> dt.Trainer:
        return dt.Trainer(mlp, mse, dt.optim.sgd(0.05), mode="async", workers=2,
                          batch_size=16, progress=False, **options)

    full = trainer().fit(regression, epochs=2, client=client)
    run = tmp_path / "run"
    bounded = trainer(history_updates=10).fit(regression, epochs=2, client=client,
                                              checkpoint=run)
    assert bounded.updates == full.updates > 10
    assert bounded.version == list(range(full.updates - 9, full.updates + 1))
    assert len(bounded.loss) == len(bounded.samples) == 10
    assert len(bounded.staleness) == sum(bounded.gradients)
    assert bounded.samples_before + sum(bounded.samples) == sum(full.samples)
    assert len(bounded.epochs) == len(full.epochs) == 2
    # The claims of the updates let go went with them (work is claimed on demand here).
    assert full.claims and len(bounded.claims) < len(full.claims)
    assert all(claim[1] >= bounded.version[0] for claim in bounded.claims), bounded.claims
    # Resumed, the History is rebuilt from the run's log (which keeps every update) and
    # bounded again; the log goes on keeping every update.
    again = trainer(history_updates=10).fit(regression, epochs=3, client=client,
                                            checkpoint=run, resume=run)
    assert again.updates == again.version[-1] == len(split_kinds(UpdateLog(run).read())[0])
    assert again.updates > full.updates and len(again.loss) == 10
    with pytest.raises(ValueError, match="history_updates must be a positive integer"):
        trainer(history_updates=0)


@contextlib.contextmanager
def _driven_into_epoch_1(client, regression, tmp_path):
    """A fit's run whose one worker (this test) pushes two updates of epoch 0 and one of
    epoch 1, the driver polling between them, until it holds a state of epoch 1 while
    epoch 0's boundary is not yet taken: the holder went on while the driver learned of
    the end."""
    worker = WorkerConfig(model=functools.partial(zeros, 4), compute=BatchCompute(mse),
                          data=regression, workers=1, batch_size=16, pipeline_options={},
                          timeout=30)
    run = FitRun(client, zeros_holder(4, workers=1, mode="sync"), worker, holder_worker=None,
                 timeout=30, checkpoint=str(tmp_path / "run"), checkpoint_every=1,
                 checkpoint_extra=dict, history=dt.History(mode="sync", workers=1),
                 progress=None)
    handle = HolderHandle(run.holder, 30, client)
    grads = np.ones(4, dtype=np.float32)
    try:
        run.call("begin_epoch", 0, True, None, 1, "state")
        run.call("queue_epoch", 1, None, "state")
        info = handle.join(0, None, FlatModel(zeros(4)).layout)
        _, version = handle.wait(handle.push(info["version"], grads, 16, 0.1, (0, 1)), "a push")
        run.poll()  # asks for the state at version 2, the epoch's last
        _, version = handle.wait(handle.push(version, grads, 16, 0.1, (0, 2)), "a push")
        info = handle.next_epoch(0, {"epoch": 0, "worker": 0, "steps": 2})
        assert info["epoch"] == 1
        handle.wait(handle.push(info["version"], grads, 16, 0.1, (1, 1)), "a push")
        run.poll()  # writes the state at version 2, asks for the next: epoch 1's
        run.poll()  # brings the state at version 3, of epoch 1
        yield run
    finally:
        handle.close()
        run.close()


def test_a_state_of_the_next_epoch_is_written_after_the_boundary_before_it(
        client, regression, tmp_path, caplog):
    """The driver's last poll of an epoch may bring a mid-epoch state of the next one: it
    is written only after the boundary of the epoch before, never overwritten by that
    older state. Driven step by step: this test pushes as the fit's one worker, and the
    driver's run polls."""
    caplog.set_level("INFO", logger=_WRITER)
    with _driven_into_epoch_1(client, regression, tmp_path) as run:
        _, boundary = run.boundary(0)
        run.save(complete_epochs=1, holder_state=boundary)
    assert _saved_versions(caplog) == [2, 2, 3]  # mid-epoch 0, its boundary, mid-epoch 1
    state = load_checkpoint(tmp_path / "run")
    assert (state["holder"]["version"], state["complete_epochs"]) == (3, 1)


def test_a_state_of_the_next_epoch_written_as_the_holder_is_lost_keeps_a_record_per_epoch(
        client, regression, tmp_path):
    """The holder lost before the driver took epoch 0's boundary: the state of epoch 1 it
    handed over is written (it counts epoch 0 complete), and epoch 0, whose end the driver
    never recorded, has a record that says so. A resume's History has one per epoch (it
    had none for epoch 0, a flake of the killed-holder resume with holder shards)."""
    with _driven_into_epoch_1(client, regression, tmp_path) as run, \
            pytest.raises(dt.HolderLost, match="died at version"):
        run._holder_lost()  # what the driver does on finding the holder's worker gone
    state = load_checkpoint(tmp_path / "run")
    assert (state["holder"]["version"], state["complete_epochs"]) == (3, 1)
    history = checkpoint_history(state, tmp_path / "run")
    assert [r["epoch"] for r in history.epochs] == [0]
    assert "lost before the driver recorded" in history.epochs[0]["unrecorded"]


def test_the_update_log_keeps_what_a_checkpoint_counts_on(tmp_path):
    log = UpdateLog(tmp_path / "run")
    (tmp_path / "run").mkdir()
    log.rewrite({"version": [1, 2], "time": [0.0, 0.0], "loss": [1.0, 0.5],
                 "samples": [4, 4], "contributors": [2, 1], "staleness": [0, 0, 1],
                 "staleness_worker": [0, 1, 1]})
    log.append({"version": [3], "time": [0.0], "loss": [0.25], "samples": [4],
                "contributors": [1], "staleness": [2], "staleness_worker": [0]})
    with log.path.open("a") as f:
        f.write('{"version": 4, "lo')  # cut short by a crash
    rows = log.read()
    assert [r["version"] for r in rows] == [1, 2, 3]
    assert rows[1]["staleness"] == [1] and rows[1]["staleness_worker"] == [1]
    assert [r["version"] for r in log.read(up_to_version=2)] == [1, 2]


def _fsyncs(monkeypatch) -> list[str]:
    """Record what every os.fsync flushes ("dir" or "file"), in order; it still flushes."""
    done = []
    real = os.fsync

    def spy(fd):
        done.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return done


def test_a_saved_checkpoint_survives_a_power_cut(tmp_path, monkeypatch):
    done = _fsyncs(monkeypatch)
    save_checkpoint(tmp_path / "run", {"x": 1})
    # The file's bytes, then the directory entry of the rename.
    assert done == ["file", "dir"]


def test_a_published_dataset_directory_is_flushed(tmp_path, monkeypatch):
    staged = StagedDirectory(tmp_path / "out.zarr")
    (staged.path / "zarr.json").write_text("{}")
    done = _fsyncs(monkeypatch)
    staged.publish()
    assert done[-1] == "dir"
