"""The text preparation benchmark, run for real with ``--quick`` in a subprocess: every row
a measured ratio, the outputs of both sides checked equal by the script itself."""

from __future__ import annotations

import pytest

from tests.common.builders import run_benchmark_quick


@pytest.mark.slow
def test_text_benchmark_quick_reports_every_tokenizer_against_the_plain_loop(tmp_path):
    result, rows = run_benchmark_quick("text", tmp_path, timeout=170)
    assert [row["workload"].split(", ", 2)[2] for row in rows] == [
        "byte tokenizer (default)", "BPE tokenizer.json, 4,096 tokens",
        "byte tokenizer, same Zarr output"]
    # The byte tokenizer's goal is against the loop writing the same output; the BPE's
    # against the loop writing .npy (its tokenising is the work)
    assert [row["goal"] for row in rows] == ["—", "≥ 1.5x", "≥ 1.5x"]
    assert all(row["ratio"] > 0 for row in rows), rows
    table = [line for line in result.stderr.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| tokenizer | tokens |") and len(table) == 4
