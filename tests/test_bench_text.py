"""The text preparation benchmark, run for real with ``--quick`` in a subprocess: every row
a measured ratio, the outputs of both sides checked equal by the script itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.common.builders import REPO


@pytest.mark.slow
def test_text_benchmark_quick_reports_every_tokenizer_against_the_plain_loop(tmp_path):
    out = tmp_path / "ratios.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "text.py"), "--quick",
         "--ratios-json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=170,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-5000:]
    rows = json.loads(out.read_text(encoding="utf-8"))
    assert [row["workload"].split(", ", 2)[2] for row in rows] == [
        "byte tokenizer (default)", "BPE tokenizer.json, 4,096 tokens",
        "byte tokenizer, same Zarr output"]
    assert rows[0]["goal"] == "≥ 1.5x"
    assert all(row["ratio"] > 0 for row in rows), rows
    table = [line for line in result.stderr.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| tokenizer | tokens |") and len(table) == 4
