"""W13, the cost curve, run for real with ``--quick`` on rows in a subprocess: each size
prepared, verified, planned and trained in a process of its own, and the report's tables
of time per row and peak memory per process."""

from __future__ import annotations

import pytest

from tests.common.builders import run_benchmark_quick


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_scale_quick_measures_every_step_at_every_size(tmp_path):
    result, rows = run_benchmark_quick("scale", tmp_path, timeout=200,
                                       arguments=["--kinds", "rows"])
    assert rows == []  # a report, not ratios to a baseline
    out = result.stdout
    sizes = [line for line in out.splitlines() if line.startswith("| 0.0")]
    assert [line.split("|")[1].strip() for line in sizes] == ["0.02 M rows", "0.08 M rows"]
    for line in sizes:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[1] in ("20,000", "80,000")
        assert float(cells[2]) > 0 and float(cells[5]) > 0  # prepare, the epoch
        assert all(int(v.replace(",", "")) > 100 for v in cells[7].split(" / "))
    for step in ("| prepare |", "| verify |", "| epoch |"):
        assert step in out, out
    for process in ("| driver |", "| holder's worker |", "| other worker |",
                    "| a worker preparing |"):
        assert process in out, out
    assert "first batch's wait:" in out and "goals not met:" in out
