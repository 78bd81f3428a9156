"""`dasktrain bench`: the real command runs the benchmark scripts and prints one table."""

from __future__ import annotations

import re
import textwrap
from collections import defaultdict

import pytest

from dasktrain.cli.bench import BENCHMARKS
from tests.common.builders import run_benchmark, run_cli

HEADER = ["benchmark", "workload", "dasktrain", "baseline", "ratio", "goal"]
RATIO = re.compile(r"(\d+\.\d\d)x|—")


def _table(stdout: str) -> list[list[str]]:
    """The rows of the one Markdown table that is the whole of stdout."""
    lines = stdout.strip().splitlines()
    assert lines and all(line.startswith("|") and line.endswith("|") for line in lines), stdout
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    assert cells[0] == HEADER
    return cells[2:]


# Those with a quick run and checks of their own elsewhere (test_bench_e2e.py,
# test_bench_prepare.py, test_bench_text.py, test_images.py) are not run again here, nor
# holder.py, whose step and gloo baseline the scaling benchmark runs (test_bench_e2e.py).
OWN_TESTS = ("e2e", "scaling", "prepare", "images", "text", "holder")
SHARED = [name for name in BENCHMARKS if name not in OWN_TESTS]


@pytest.mark.slow
@pytest.mark.timeout(600)  # three benchmarks, each starting its own processes
def test_bench_quick_prints_a_table_of_ratios_with_rows_of_every_benchmark():
    result = run_cli("bench", "--quick", "--only", *SHARED, timeout=570)
    assert result.returncode == 0, result.stderr[-5000:]
    rows = _table(result.stdout)
    by_benchmark = defaultdict(list)
    for row in rows:
        assert len(row) == len(HEADER) and all(row[:4]), row
        by_benchmark[row[0]].append(row)
    assert list(by_benchmark) == list(SHARED)
    for name, found in by_benchmark.items():
        ratios = [RATIO.fullmatch(row[4]) for row in found]
        assert all(ratios), found
        numbers = [float(m.group(1)) for m in ratios if m.group(1)]
        assert numbers and all(n > 0 for n in numbers), (name, found)
    goals = {row[1]: row[5] for row in rows}
    assert goals["W1 data stall, C = 5 ms/batch, first epoch"] == "≤ 2 % stall"
    # Each benchmark's own report went to stderr, whole.
    for name in SHARED:
        assert f"== {name}: " in result.stderr
    assert "| C ms/batch | loader |" in result.stderr and "Reading:" in result.stderr


def _script(body: str) -> str:
    return textwrap.dedent("""\
        import argparse, json, sys
        parser = argparse.ArgumentParser()
        parser.add_argument("--ratios-json")
        parser.add_argument("--quick", action="store_true")
        args = parser.parse_args()
        print("report of", sys.argv[0], "quick" if args.quick else "full")
        """) + textwrap.dedent(body)


def test_a_failing_benchmark_is_named_and_the_others_still_make_the_table(tmp_path):
    (tmp_path / "pipeline.py").write_text(_script("""\
        from dasktrain.cli.bench import Ratio, write_ratios
        write_ratios(args.ratios_json, [Ratio(workload="w", ours="1.0", baseline="2.0 (b)",
                                              ratio=0.5, goal="≤ 1x")])
        """))
    (tmp_path / "holder.py").write_text(_script("sys.exit(3)\n"))
    (tmp_path / "updates.py").write_text(_script("pass  # writes no ratios\n"))
    (tmp_path / "stragglers.py").write_text(_script("""\
        row = {"workload": "never reached", "ours": "—", "baseline": "1.00 (sync)",
               "ratio": None, "goal": "—"}
        open(args.ratios_json, "w").write(json.dumps([row]))
        """))
    for name in ("scaling", "e2e", "images", "text"):  # rows of none
        (tmp_path / f"{name}.py").write_text(_script("""\
            open(args.ratios_json, "w").write("[]")
            """))
    result = run_cli("bench", "--quick", "--benchmarks", str(tmp_path), timeout=120)
    assert result.returncode == 1, result.stderr
    assert _table(result.stdout) == [
        ["pipeline", "w", "1.0", "2.0 (b)", "0.50x", "≤ 1x"],
        ["stragglers", "never reached", "—", "1.00 (sync)", "—", "—"],
    ]
    assert "report of" in result.stderr and "quick" in result.stderr
    assert "dasktrain bench: holder failed: exit status 3" in result.stderr
    assert "dasktrain bench: updates failed: it wrote no ratios" in result.stderr

    (tmp_path / "updates.py").write_text(_script("""\
        open(args.ratios_json, "w").write('{"not": "rows"}')
        """))
    result = run_cli("bench", "--only", "updates", "--benchmarks", str(tmp_path), timeout=60)
    assert result.returncode == 1
    assert "updates failed: its ratios are unreadable: not a list of rows" in result.stderr


def test_bench_without_the_scripts_is_one_line_and_exit_2(tmp_path):
    result = run_cli("bench", "--benchmarks", str(tmp_path), timeout=60)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert "no benchmark scripts pipeline.py, holder.py" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_gpu_script_times_each_part_of_a_step_with_the_librarys_own_pieces():
    """benchmarks/gpu.py runs on a machine lent for minutes: its parts of a W11 step (the
    replica's flat model, the holder's arithmetic, the optimizer on the device) are run here
    on the processor, so that a change to those pieces cannot first fail there."""
    result = run_benchmark("gpu", timeout=120, arguments=["--only", "parts"])
    lines = [line for line in result.stdout.splitlines() if line.startswith("| tiny |")]
    assert [line.split("|")[2].strip() for line in lines] == ["sgd", "adam"]
    for line in lines:
        times = [float(cell) for cell in line.strip("|").split("|")[2:]]
        assert len(times) == 9 and all(t >= 0 for t in times)
        # Today's step is the sum of its first five parts (each rounded to 0.1 ms).
        assert times[7] == pytest.approx(sum(times[:5]), abs=0.3)
        assert times[0] > 0  # forward and backward take time on any machine
