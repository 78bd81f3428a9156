"""Examples stay runnable: each is run as a user would, in a subprocess."""

from __future__ import annotations

import os
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
    lines = [line for line in result.stdout.splitlines() if line.startswith("epoch")]
    assert len(lines) == 2
    accuracy = float(lines[-1].split("val accuracy ")[1].split()[0])
    assert accuracy > 0.8, lines
