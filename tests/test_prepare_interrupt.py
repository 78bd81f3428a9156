"""A terminal's Ctrl-C (or SIGTERM) to the whole process group of ``dasktrain prepare``, and
the leftovers of killed runs: nothing stays behind, and the command says one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import dasktrain as dt
from tests.common.builders import wait_for


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, process group) of a process, None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # after "pid (comm)", which may hold spaces
    return fields[0], int(fields[1]), int(fields[2])


def _processes() -> dict[int, tuple[str, int, int]]:
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _proc_stat(int(entry))) is not None:
            found[int(entry)] = stat
    return found


def _alive(pid: int) -> bool:
    stat = _proc_stat(pid)
    return stat is not None and stat[0] != "Z"  # a zombie has ended; its reaper is not us


def _chunk_files(directory: Path) -> int:
    return sum(1 for p in directory.glob(".*.tmp-*/x/c/**/*") if p.is_file())


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize(("signum", "status", "word"), [
    (signal.SIGINT, 130, "interrupted"),
    (signal.SIGTERM, 143, "terminated"),
])
def test_a_signal_to_the_process_group_leaves_nothing_behind(tmp_path, signum, status, word):
    out = tmp_path / "big.zarr"
    script = Path(sys.executable).parent / "dasktrain"
    # A process group of its own, as a terminal gives a command it runs in the foreground.
    proc = subprocess.Popen(
        [str(script), "prepare", "regression", str(out), "--samples", "4000000", "--width", "32",
         "--chunk-rows", "16384", "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        wait_for(lambda: _chunk_files(tmp_path) >= 2 or proc.poll() is not None, 120,
                 "the first chunks to be written")
        assert proc.poll() is None, proc.communicate()
        children = [pid for pid, (_, parent, _) in _processes().items() if parent == proc.pid]
        assert len(children) >= 2, children  # the embedded cluster's worker processes
        os.killpg(proc.pid, signum)
        _, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    lines = stderr.strip().splitlines()
    assert proc.returncode == status, stderr
    assert lines == [f"dasktrain prepare: {word}; nothing was written"], stderr
    assert list(tmp_path.iterdir()) == []  # no dataset, no hidden build, no scratch
    wait_for(lambda: not any(_alive(pid) for pid in children), 30,
             "the worker processes to end")
    group = [pid for pid, (state, _, pgid) in _processes().items()
             if pgid == proc.pid and state != "Z"]
    assert group == []


def _hold_lock(directory: Path) -> subprocess.Popen:
    """A process that holds a lock on ``directory`` as a live preparation does on its build,
    until its standard input closes."""
    code = ("import fcntl, os, sys\n"
            "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('locked', flush=True)\n"
            "sys.stdin.read()\n")
    holder = subprocess.Popen([sys.executable, "-c", code, str(directory)], text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_leftovers_of_killed_runs_go_at_the_next_prepare_and_live_builds_stay(client, tmp_path):
    out = tmp_path / "d.zarr"
    # What a killed run leaves: its build (some chunks in it) and its scratch.
    dead = tmp_path / ".d.zarr.tmp-0badc0de"
    (dead / "x" / "c").mkdir(parents=True)
    (dead / "x" / "c" / "0").write_bytes(b"\0" * 4096)
    (tmp_path / ".d.zarr.scratch-0badc0de" / "stage").mkdir(parents=True)
    # A build of a run still going, and things that are not leftovers of this output.
    live = tmp_path / ".d.zarr.tmp-1ee7c0de"
    live.mkdir()
    others = [tmp_path / ".other.zarr.tmp-0badc0de", tmp_path / ".d.zarr.tmp-notatoken",
              tmp_path / "notes.txt"]
    for path in others[:2]:
        path.mkdir()
    others[2].write_text("mine")
    holder = _hold_lock(live)
    try:
        dt.prepare("parabola", out, client=client, progress=False)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            ["d.zarr", live.name, *(p.name for p in others)])
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    # Its process gone, the build is a leftover too.
    dt.prepare("parabola", out, client=client, progress=False, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["d.zarr", *(p.name for p in others)])
    assert len(dt.open_dataset(out)) == 50
