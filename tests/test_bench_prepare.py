"""The preparation benchmark, run for real with ``--quick`` in a subprocess, as a reader of
the README does: default settings first, every row a measured ratio."""

from __future__ import annotations

import pytest

from tests.common.builders import run_benchmark_quick


@pytest.mark.slow
def test_prepare_benchmark_quick_reports_the_defaults_first(tmp_path):
    result, rows = run_benchmark_quick("prepare", tmp_path, timeout=150)
    assert len(rows) == 5
    assert rows[0]["workload"].startswith("prepare MB/s, same output, defaults")
    assert rows[0]["goal"] == "≥ 0.8x"
    assert all(row["ratio"] > 0 for row in rows), rows
    # The report itself (on stderr when rows are asked for): the table, defaults first.
    table = [line for line in result.stderr.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| settings | workload |")
    assert table[1].startswith("| defaults (")
