"""The wheel holds every subpackage and works from outside the repository."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile

import pytest

from tests.common.builders import REPO


@pytest.mark.slow
def test_wheel_installs_and_imports_outside_the_repo(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(wheels), str(REPO)], check=True, timeout=300)
    (wheel,) = wheels.glob("dasktrain-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    # Every source file of every room, however deep (a sub-package missing from
    # pyproject's list would install without it).
    for folder, installed in (("dasktrain", "dasktrain"), ("datasets", "dasktrain/datasets"),
                              ("pipeline", "dasktrain/pipeline"),
                              ("trainer", "dasktrain/trainer"),
                              ("evolve", "dasktrain/evolve")):
        for source in (REPO / folder).rglob("*.py"):
            if "__pycache__" not in source.parts:
                module = f"{installed}/{source.relative_to(REPO / folder).as_posix()}"
                assert module in names, module

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)],
                   check=True, timeout=300)
    # Dependencies come from the test environment; dasktrain itself only from the wheel.
    env = {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"]}
    code = ("import dasktrain, dasktrain.datasets.sources, sys; "
            "print(dasktrain.__file__); print(dasktrain.__version__)")
    shown = subprocess.run([str(python), "-c", code], cwd=tmp_path, env=env, check=True,
                           capture_output=True, text=True, timeout=120).stdout.split()
    assert shown[0].startswith(str(venv)), shown
    assert shown[1] == "0.1.0"
    result = subprocess.run([str(venv / "bin" / "dasktrain"), "prepare", "parabola",
                             str(tmp_path / "p.zarr"), "--no-progress"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    assert "samples   50" in result.stdout


def test_the_docs_say_which_commands_take_scheduler_and_the_cluster_cap():
    """The docs and code agree: the commands with ``--scheduler`` are the ones named, and the
    embedded LocalCluster's worker cap is stated."""
    import re

    from dasktrain._cluster import MAX_LOCAL_WORKERS, default_local_cluster_options
    from dasktrain.cli.main import _build_parser

    parser = _build_parser()
    commands = parser._subparsers._group_actions[0].choices
    with_scheduler = {name for name, sub in commands.items()
                      if any("--scheduler" in a.option_strings for a in sub._actions)}
    readme = (REPO / "docs" / "datasets.md").read_text()
    claim = re.search(r"The commands that run work on a cluster, (.+?), take `--scheduler",
                      readme)
    assert claim, "docs/datasets.md must say which commands take --scheduler"
    assert set(re.findall(r"`(\w+)`", claim.group(1))) == with_scheduler
    assert "Every command takes `--scheduler" not in readme
    cores = os.cpu_count() or 1
    assert default_local_cluster_options()["n_workers"] == min(cores, MAX_LOCAL_WORKERS)
    assert f"core, at most {MAX_LOCAL_WORKERS}," in " ".join(readme.split())
