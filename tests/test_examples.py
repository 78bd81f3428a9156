"""Examples stay runnable: each is run as a user would, in a subprocess; the evolution
example, seconds of work behind seconds of imports, as ``__main__`` in this process."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys

import pytest

import dasktrain as dt
from tests.common.builders import REPO


@pytest.mark.slow
def test_pipeline_digits_example_trains(client, tmp_path):
    dt.prepare("digits", tmp_path / "digits.zarr", client=client, split="train=0.8,val=0.2",
               normalize=True, progress=False)
    result = subprocess.run(
        [sys.executable, str(REPO / "examples" / "pipeline_digits.py"),
         str(tmp_path / "digits.zarr"), "--epochs", "2"],
        capture_output=True, text=True, timeout=170, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    # It closes in order: nothing logged as the cluster goes (the pipelines' work in flight
    # is done before the cluster closes, and the cluster before Python's thread pools).
    for word in ("ERROR", "Traceback"):
        assert word not in result.stdout + result.stderr, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("epoch")]
    assert len(lines) == 2
    accuracy = float(lines[-1].split("val accuracy ")[1].split()[0])
    assert accuracy > 0.8, lines


def _run_example(name: str, *args: str, cwd) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, str(REPO / "examples" / name), *args],
        capture_output=True, text=True, timeout=170, cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    return result


@pytest.mark.slow
def test_parabola_example_sync_agrees_with_one_process(tmp_path):
    out = _run_example("parabola.py", "--epochs", "5", cwd=tmp_path).stdout
    sync = next(line for line in out.splitlines() if line.startswith("sync"))
    gap = float(sync.rsplit("= ", 1)[1])
    assert gap < 1e-5
    one = next(line for line in out.splitlines() if line.startswith("one process"))
    assert one.split("final loss ")[1] == sync.split("final loss ")[1].split(",")[0]
    assert "staleness mean" in next(line for line in out.splitlines()
                                    if line.startswith("async"))


@pytest.mark.slow
def test_digits_example_compares_every_mode(client, tmp_path):
    dt.prepare("digits", tmp_path / "digits.zarr", client=client, split="train=0.8,val=0.2",
               normalize=True, progress=False)
    out = _run_example("digits.py", str(tmp_path / "digits.zarr"), "--epochs", "2",
                       "--out", str(tmp_path / "runs"), "--scheduler",
                       client.scheduler.address, cwd=tmp_path).stdout
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:]
            if line.split() and line.split()[0] in
            {"sync", "average", "soft", "ssp", "async", "async+dc"}}
    assert set(rows) == {"sync", "average", "soft", "ssp", "async", "async+dc"}, out
    for label, row in rows.items():
        assert float(row[1].rstrip("%")) > 80, (label, out)  # 2 epochs: already > 80 %
        assert (tmp_path / "runs" / label / "index.html").exists()
    assert (tmp_path / "runs" / "compare.png").stat().st_size > 10_000


@pytest.mark.slow
def test_out_of_core_example_streams_and_reports_memory_and_stall(tmp_path):
    out = _run_example("out_of_core.py", "--rows", "40000", "--dir", str(tmp_path),
                       cwd=tmp_path).stdout
    assert "data stall:" in out
    peaks = [line for line in out.splitlines() if line.startswith("peak memory")]
    assert len(peaks) == 2, out
    # Streaming keeps every worker under its limit.
    assert all(int(line.rsplit("(", 1)[1].rstrip("%)")) < 100 for line in peaks), out


@pytest.mark.slow
def test_tiny_lm_example_prepares_trains_and_writes_a_sample(tmp_path):
    out = _run_example("tiny_lm.py", "--max-mb", "0.05", "--seq-len", "32", "--d-model", "32",
                       "--layers", "1", "--epochs", "1", "--sample", "40", "--no-progress",
                       "--out", str(tmp_path / "lm"), cwd=tmp_path).stdout
    assert out.startswith("prepared "), out
    epoch = next(line for line in out.splitlines() if line.startswith("epoch 0:"))
    bits = float(epoch.split("= ")[1].split()[0])
    assert bits < 7.0, epoch  # a uniform guess over 257 ids is 8.0 bits per byte
    assert "sample after 'def ':" in out


@pytest.mark.slow
def test_images_example_prepares_both_ways_trains_two_modes_and_draws_a_grid(client,
                                                                              tmp_path):
    out = _run_example("images.py", "--dir", str(tmp_path / "images"), "--per-class", "24",
                       "--epochs", "1", "--scheduler", client.scheduler.address,
                       cwd=tmp_path).stdout
    assert "prepared decoded: 96 images" in out and "prepared encoded: 96 images" in out
    modes = [line for line in out.splitlines() if "val accuracy" in line]
    assert [line.split()[0] for line in modes] == ["sync", "async"], out
    assert "4 classes: circle, cross, square, triangle" in out
    assert (tmp_path / "images" / "augmented.png").stat().st_size > 10_000


def _run_example_here(name: str, *args: str, monkeypatch, capsys) -> str:
    """Run ``examples/name`` as ``__main__`` in this process, as ``python name args``
    would (in the test's own directory); returns what it printed. A fresh interpreter would
    spend most of a short run importing torch and dasktrain."""
    monkeypatch.setattr(sys, "argv", [name, *args])
    runpy.run_path(str(REPO / "examples" / name), run_name="__main__")
    return capsys.readouterr().out


@pytest.mark.slow
def test_evolve_example_runs_both_tasks_and_draws_their_fitness(client, tmp_path,
                                                                 monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out = _run_example_here("evolve.py", "--out", str(tmp_path / "runs"), "--data",
                            str(tmp_path / "data"), "--population", "8",
                            "--cartpole-generations", "2", "--digits-generations", "2",
                            "--episodes", "2", "--max-steps", "50",
                            "--scheduler", client.scheduler.address,
                            monkeypatch=monkeypatch, capsys=capsys)
    lines = out.splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith("generation")] == [
        "generation   0", "generation   1"], out
    assert any(line.startswith("CartPole not solved (mean return") for line in lines), out
    assert any(line.startswith("digits: validation accuracy") for line in lines), out
    for name in ("cartpole.png", "digits.png"):
        assert (tmp_path / "runs" / name).stat().st_size > 10_000


@pytest.mark.slow
def test_forecast_example_trains_from_the_store_in_place_and_beats_persistence(tmp_path):
    out = _run_example("forecast.py", "--steps", "600", "--lat", "40", "--lon", "64",
                       "--epochs", "2", "--no-progress", "--out", str(tmp_path / "fc"),
                       cwd=tmp_path).stdout
    assert out.startswith("generated "), out
    line = next(line for line in out.splitlines() if line.startswith("validation mse:"))
    model = float(line.split("model ")[1].split(",")[0])
    persistence = float(line.split("persistence ")[1].split()[0])
    assert model < 0.8 * persistence, line
    assert (tmp_path / "fc" / "era-statistics.json").exists()
