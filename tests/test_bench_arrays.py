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
    for loader in ("xbatcher 0.4", "xarray + DataLoader"):
        assert sum(line.strip().startswith(loader) for line in lines) == 2, result.stdout
    # dasktrain: a whole epoch at each consumer step (the goals' figures), one epoch's
    # reads, then its first batches at each, as the baselines run.
    ours = [line.strip() for line in lines if line.strip().startswith("dasktrain in place")]
    assert len(ours) == 5, result.stdout
    assert "one whole epoch: 114 samples" in ours[0], result.stdout
    assert "one whole epoch at C = 30 ms" in ours[1], result.stdout
    assert "one epoch's reads" in ours[2], result.stdout
    assert any(line.strip().startswith("the copy avoided:") for line in lines)
