"""Checkpoints stay small and durable; per-update records live in an append-only log."""

from __future__ import annotations

import os
import stat

import pytest

import dasktrain as dt
from dasktrain.datasets.atomic import StagedDirectory
from dasktrain.trainer.driver.checkpoint import load_checkpoint, save_checkpoint
from dasktrain.trainer.driver.update_log import UpdateLog
from tests.common.training import mlp, mse


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
    # Constant size, whatever the number of updates: only an epoch's record is added.
    assert sizes[1] - sizes[0] < 1024
    rows = UpdateLog(run).read()
    assert [r["version"] for r in rows] == first.history.version
    assert [r["loss"] for r in rows] == first.history.loss
    assert sum(len(r["staleness"]) for r in rows) == len(first.history.staleness)

    resumed = _trainer()
    history = resumed.fit(regression, epochs=4, client=client, resume=run, checkpoint=run)
    assert history.loss[: first.history.updates] == first.history.loss
    assert history.version == list(range(1, history.updates + 1))
    assert history.updates == 2 * first.history.updates
    assert len(UpdateLog(run).read()) == history.updates
    loaded = dt.Trainer.load(run, model=mlp, loss=mse)
    assert loaded.history.loss == history.loss


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
