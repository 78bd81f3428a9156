"""W12, windows from a store, run for real with ``--quick`` in a subprocess: every loader
measured at both consumer steps, the bytes read and the copy avoided reported."""

from __future__ import annotations

import pytest

from tests.common.builders import run_benchmark_quick


@pytest.mark.slow
def test_arrays_benchmark_quick_measures_every_loader_and_the_bytes_read(tmp_path):
    result, rows = run_benchmark_quick("arrays", tmp_path, timeout=170)
    assert [row["goal"] for row in rows] == ["≥ 3x", "≤ 5 % stall", "≤ 1.5x"]
    assert all(row["ratio"] is not None and row["ratio"] > 0 for row in rows), rows
    lines = result.stdout.splitlines()
    for loader in ("xbatcher 0.4", "xarray + DataLoader", "dasktrain in place"):
        assert sum(line.strip().startswith(loader) for line in lines) == 2, result.stdout
    assert any("one whole epoch: 114 samples" in line for line in lines), result.stdout
    assert any(line.strip().startswith("the copy avoided:") for line in lines)
