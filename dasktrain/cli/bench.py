"""``dasktrain bench``: run the repository's benchmarks and print one table of ratios.

The benchmarks are the scripts in ``benchmarks/`` of a source checkout, not modules of the
installed package: they carry their baselines (gloo process groups, torch DataLoaders, plain
loops), are run one by one by hand as often as all together here, and the README gives each
one's command. This module finds them beside the package (where an editable install, ``make
setup``, leaves it) and runs each in a process of its own, exactly as by hand, so that none
inherits another's threads, clusters or memory. A script run with ``--ratios-json PATH``
writes its rows of the summary there (:func:`write_ratios`); its own report goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

__all__ = [
    "BENCHMARKS",
    "BenchResult",
    "Ratio",
    "baseline_environment",
    "benchmarks_directory",
    "format_table",
    "ratio_of",
    "run_benchmarks",
    "write_ratios",
]

#: The benchmarks of the summary, in the order they run (the shortest first).
BENCHMARKS: tuple[str, ...] = ("pipeline", "holder", "updates", "scaling", "stragglers",
                               "e2e", "images", "text")

#: Seconds one benchmark may run before it is interrupted (its full run takes minutes).
TIMEOUT_S = {True: 600.0, False: 3600.0}


# The allocator variables of this process's user, before distributed added any.
_USER_MALLOC = frozenset(key for key in os.environ if key.startswith("MALLOC_"))


@dataclass(kw_only=True, slots=True, frozen=True)
class Ratio:
    """One row of the summary: a dasktrain figure against its baseline's, side by side."""

    workload: str
    """What was measured, with its unit."""
    ours: str
    """dasktrain's figure, formatted."""
    baseline: str
    """The baseline's figure, formatted, with what the baseline is."""
    ratio: float | None
    """ours / baseline; None where there is none (a target never reached)."""
    goal: str = "—"
    """The figure to reach (from the workload's definition), or ``—`` where none is set."""
    benchmark: str = field(default="")
    """The script that measured it (filled in by the runner)."""


@dataclass(slots=True)
class BenchResult:
    """The rows of the benchmarks that ran, and why the others failed."""

    rows: list[Ratio]
    failed: dict[str, str]


def parse_with_quick(parser: argparse.ArgumentParser, argv: list[str] | None,
                     quick: dict[str, Any], quick_help: str) -> argparse.Namespace:
    """Give a benchmark script ``--quick`` (``quick`` becomes its defaults; options given
    still win) and ``--ratios-json PATH`` (its rows for :func:`run_benchmarks`), and parse
    ``argv``."""
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--ratios-json", metavar="PATH",
                        help="also write the summary rows of `dasktrain bench` there")
    args = parser.parse_args(argv)
    if args.quick:
        parser.set_defaults(**quick)
        args = parser.parse_args(argv)
    return args


@contextlib.contextmanager
def baseline_environment() -> Iterator[None]:
    """Start a baseline's processes (DDP, gloo) as a user's own script would: without the
    allocator setting distributed writes into this process's environment when it starts a
    LocalCluster's workers (``MALLOC_TRIM_THRESHOLD_``, see :mod:`dasktrain._malloc`),
    which slows a spawned torch process's training steps by a third."""
    saved = {key: os.environ.pop(key) for key in list(os.environ)
             if key.startswith("MALLOC_") and key not in _USER_MALLOC}
    try:
        yield
    finally:
        os.environ.update(saved)


def timed(run: Callable[[], object]) -> float:
    """Seconds ``run()`` takes."""
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def interleaved_medians(runs: dict[str, Callable[[], object]], repeats: int,
                        failed: dict[str, str]) -> dict[str, float]:
    """Median seconds of each run, after one unmeasured warm-up run of each (imports on the
    workers, page cache); runs interleaved so that drift hits every path alike. A run whose
    name does not start with ``base`` and that fails is recorded in ``failed``, not timed,
    and the others still run."""
    for name, run in runs.items():
        try:
            run()
        except Exception as exc:
            if name.startswith("base"):
                raise
            traceback.print_exc()
            failed[name] = f"{type(exc).__name__}: {exc}"
    times: dict[str, list[float]] = {name: [] for name in runs if name not in failed}
    for _ in range(repeats):
        for name in times:
            times[name].append(timed(runs[name]))
    return {name: statistics.median(t) for name, t in times.items()}


def ratio_of(ours: float, baseline: float) -> float | None:
    """``ours / baseline``, or None where that is no number."""
    if not (math.isfinite(ours) and math.isfinite(baseline)) or baseline == 0:
        return None
    return ours / baseline


def write_ratios(path: str | os.PathLike, rows: Iterable[Ratio]) -> None:
    """Write a benchmark's rows as JSON, atomically (a killed run leaves no partial file)."""
    target = Path(path)
    # The runner, not the script, names the benchmark of a row.
    text = json.dumps([{k: v for k, v in asdict(row).items() if k != "benchmark"}
                       for row in rows], indent=1, ensure_ascii=False)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_ratios(path: Path, benchmark: str) -> list[Ratio]:
    rows = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        raise ValueError("not a list of rows")
    return [Ratio(**{**row, "benchmark": benchmark}) for row in rows]


def benchmarks_directory(directory: str | os.PathLike | None = None) -> Path:
    """The directory of the benchmark scripts: ``directory``, else ``benchmarks/`` beside
    the package's own directory (a source checkout)."""
    found = (Path(directory) if directory is not None
             else Path(__file__).resolve().parents[2] / "benchmarks")
    missing = [f"{name}.py" for name in BENCHMARKS if not (found / f"{name}.py").is_file()]
    if missing:
        where = "" if directory is not None else (
            " (the benchmarks are scripts of the source repository, not installed with the "
            "package: run `dasktrain bench` from an editable install of a checkout, or give "
            "--benchmarks DIR)")
        raise FileNotFoundError(f"no benchmark scripts {', '.join(missing)} in {found}{where}")
    return found


def run_benchmarks(names: Iterable[str] = BENCHMARKS, *, quick: bool = False,
                   directory: str | os.PathLike | None = None,
                   log: TextIO | None = None) -> BenchResult:
    """Run the benchmarks ``names`` one after the other, each in its own process.

    Parameters
    ----------
    names
        Benchmarks among :data:`BENCHMARKS`.
    quick
        Run each for seconds (``--quick``): checks that they work; the figures are rough.
    directory
        Where the scripts are; default: ``benchmarks/`` of the source checkout.
    log
        Where the scripts' own reports go, line by line (default: stderr).
    """
    names = list(names)
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown:
        raise ValueError(f"unknown benchmark(s) {unknown}; known: {list(BENCHMARKS)}")
    scripts = benchmarks_directory(directory)
    log = log if log is not None else sys.stderr
    result = BenchResult(rows=[], failed={})
    with tempfile.TemporaryDirectory(prefix="dasktrain-bench-") as tmp:
        for name in names:
            out = Path(tmp) / f"{name}.json"
            command = [sys.executable, str(scripts / f"{name}.py"), "--ratios-json", str(out)]
            if quick:
                command.append("--quick")
            print(f"== {name}: {' '.join(command[1:])}", file=log, flush=True)
            status = _run(command, cwd=scripts.parent, log=log, timeout=TIMEOUT_S[quick])
            if status != 0:
                result.failed[name] = (f"timed out after {TIMEOUT_S[quick]:.0f} s"
                                       if status is None else f"exit status {status}")
            elif not out.is_file():
                result.failed[name] = "it wrote no ratios"
            else:
                try:
                    result.rows.extend(_read_ratios(out, name))
                except (ValueError, TypeError) as exc:  # not JSON, or not rows
                    result.failed[name] = f"its ratios are unreadable: {exc}"
    return result


def _run(command: list[str], *, cwd: Path, log: TextIO, timeout: float) -> int | None:
    """Run ``command``, copying its output to ``log``; its exit status, or None when it ran
    past ``timeout`` (it is then interrupted like Ctrl-C, so it closes its clusters)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, errors="replace")
    copier = threading.Thread(target=_copy, args=(process.stdout, log), daemon=True)
    copier.start()
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGINT)  # as Ctrl-C would: it closes its clusters
        return None
    finally:
        # Timed out, or interrupted here (Ctrl-C reaches the script as well): it gets 30 s
        # to clean up, then it is killed.
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
        copier.join(timeout=5)


def _copy(stream: TextIO, log: TextIO) -> None:
    for line in stream:
        log.write(line)
        log.flush()


def format_table(rows: Iterable[Ratio]) -> str:
    """The rows as one Markdown table."""
    lines = ["| benchmark | workload | dasktrain | baseline | ratio | goal |",
             "|---|---|---:|---:|---:|---|"]
    for row in rows:
        ratio = "—" if row.ratio is None else f"{row.ratio:.2f}x"
        lines.append(f"| {row.benchmark} | {row.workload} | {row.ours} | {row.baseline} "
                     f"| {ratio} | {row.goal} |")
    return "\n".join(lines)
