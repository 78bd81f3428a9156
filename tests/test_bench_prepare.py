"""The preparation benchmark, run for real with ``--quick`` in a subprocess, as a reader of
the README does: default settings first, every row a measured ratio."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.common.builders import REPO


@pytest.mark.slow
def test_prepare_benchmark_quick_reports_the_defaults_first(tmp_path):
    out = tmp_path / "ratios.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "prepare.py"), "--quick",
         "--ratios-json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=150,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-5000:]
    rows = json.loads(out.read_text(encoding="utf-8"))
    assert len(rows) == 5
    assert rows[0]["workload"].startswith("prepare MB/s, same output, defaults")
    assert rows[0]["goal"] == "≥ 0.8x"
    assert all(row["ratio"] > 0 for row in rows), rows
    # The report itself (on stderr when rows are asked for): the table, defaults first.
    table = [line for line in result.stderr.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| settings | workload |")
    assert table[1].startswith("| defaults (")
