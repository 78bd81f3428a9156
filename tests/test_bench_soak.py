"""W14, the soak, run for real with ``--quick`` in a subprocess: every series sampled, and
what must not grow (the checkpoint file, the holder's tables, the processes' descriptors and
threads) flat even over its half minute."""

from __future__ import annotations

import pytest

from tests.common.builders import run_benchmark_quick


def _table(stdout: str) -> dict[str, list[str]]:
    lines = stdout[stdout.index("| series |"):].splitlines()[2:]
    rows = [[cell.strip() for cell in line.strip("|").split("|")]
            for line in lines if line.startswith("| ")]
    return {row[0]: row[1:] for row in rows}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_soak_quick_samples_every_series_and_nothing_that_must_stay_flat_grows(tmp_path):
    result, rows = run_benchmark_quick("soak", tmp_path, timeout=200)
    assert [row["goal"] for row in rows] == ["≤ 1.05x"]
    table = _table(result.stdout)
    for name in ("epoch wall (s)", "driver RSS (MiB)", "holder's worker RSS (MiB)",
                 "other worker RSS (MiB)", "checkpoint file (KiB)", "run log (KiB)",
                 "History entries", "holder records (count)", "holder state_waiters (count)",
                 "holder epoch_reports (count)"):
        assert name in table, (name, result.stdout)
    must_stay = [name for name in table
                 if name.startswith("holder ") or name == "checkpoint file (KiB)"
                 or name.endswith(("fds (count)", "threads (count)"))]
    assert len(must_stay) > 20
    for name in must_stay:
        assert table[name][-1] == "flat", (name, table[name])
    # The run's log grows by design, and says so.
    assert table["run log (KiB)"][-1].startswith("grows by design")
