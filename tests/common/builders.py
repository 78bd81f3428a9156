"""Small source files and helpers shared by the tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parents[2]


def write_npy_pair(directory: Path, rows: int = 1000, width: int = 5, seed: int = 0
                   ) -> tuple[Path, Path, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, width)).astype(np.float32)
    y = rng.integers(0, 3, size=rows).astype(np.int64)
    xp, yp = directory / "x.npy", directory / "y.npy"
    np.save(xp, x)
    np.save(yp, y)
    return xp, yp, x, y


def write_table(path: Path, rows: int = 500, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    df = pd.DataFrame({
        "a": rng.standard_normal(rows),
        "b": rng.uniform(0, 10, rows),
        "c": rng.integers(0, 100, rows).astype(float),
        "label": rng.integers(0, 4, rows),
    })
    if path.suffix == ".csv":
        df.to_csv(path, index=False)
    else:
        df.to_parquet(path, index=False)
    return df


def _cli_env() -> dict[str, str]:
    # Every scheduler a test names is on 127.0.0.1: one that cannot be reached in 5 s never
    # will be (the CLI would otherwise retry for Dask's default 30 s).
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "5s"}


def run_cli(*args: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    """Run the real ``dasktrain`` command in a subprocess."""
    env = _cli_env()
    script = Path(sys.executable).parent / "dasktrain"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "dasktrain.cli"]
    return subprocess.run([*command, *args], capture_output=True,
                          text=True, timeout=timeout, env=env, **kwargs)


# Runs the command's entry point once per argv in one interpreter: what the user sees of
# each (exit status, stdout, stderr) without paying the imports once per run.
_BATCH = """
import contextlib, io, json, logging, sys
from dasktrain.cli.main import main
results = []
for argv in json.loads(sys.stdin.read()):
    logging.root.handlers.clear()  # basicConfig binds to the stderr of its first run
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 1
    results.append([code, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""


def run_cli_batch(argvs: list[list[str]], timeout: float = 300
                  ) -> list[subprocess.CompletedProcess]:
    """Each ``argv`` through the ``dasktrain`` command's entry point, all in one subprocess
    (for the many one-line errors, which need no process of their own)."""
    env = _cli_env()
    done = subprocess.run([sys.executable, "-c", _BATCH], input=json.dumps(argvs),
                          capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stderr[-5000:]
    return [subprocess.CompletedProcess(["dasktrain", *argv], code, out, err)
            for argv, (code, out, err) in zip(argvs, json.loads(done.stdout), strict=True)]


def run_benchmark(name: str, timeout: float, arguments: Sequence[str] = ()
                  ) -> subprocess.CompletedProcess:
    """Run ``benchmarks/<name>.py --quick`` (and ``arguments``) for real in a subprocess,
    as a reader of the README would; returns the finished process, checked to have
    succeeded."""
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / f"{name}.py"), "--quick", *arguments],
        cwd=REPO, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-5000:]
    return result


def run_benchmark_quick(name: str, directory: Path, timeout: float,
                        arguments: Sequence[str] = ()
                        ) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """:func:`run_benchmark`, and the ratio rows it wrote."""
    out = directory / f"{name}-ratios.json"
    result = run_benchmark(name, timeout, ["--ratios-json", str(out), *arguments])
    return result, json.loads(out.read_text(encoding="utf-8"))


def assert_user_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    """A CLI user error: exit 2, one line on stderr holding every fragment, no traceback."""
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def wait_for(predicate, timeout: float, what: str) -> None:
    """Wait for a condition with a deadline (the tests' only way of waiting)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def claim_marker(marker: Path, text: str) -> bool:
    """Create ``marker`` holding ``text``, unless it exists (True if this call made it):
    one process of many gets to act once per test. Written whole before it appears (a link
    is made or refused at once), so another process that sees the marker reads it all."""
    # A process's threads (a feeder's claims, a push) may reach a fault point at once.
    draft = marker.with_name(f"{marker.name}.{os.getpid()}.{threading.get_ident()}")
    draft.write_text(text)
    try:
        os.link(draft, marker)
    except FileExistsError:
        return False
    finally:
        draft.unlink(missing_ok=True)
    return True
