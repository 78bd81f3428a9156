"""Two preparations into one local output: the one that publishes second never silently
replaces the other. Without --overwrite it fails by name and leaves nothing behind; with it
the last to publish wins and the output is one whole dataset."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

import dasktrain as dt
from dasktrain.datasets.rename import rename_no_replace
from tests.common.builders import REPO
from tests.common.meanwhile import meanwhile


def _source(path) -> str:
    return dt.open_dataset(path).attrs["provenance"]["source"]


def test_a_dataset_published_meanwhile_is_kept_and_the_late_build_removed(client, tmp_path):
    out = tmp_path / "out.zarr"
    late = (rf"^output {re.escape(str(out))} was written by another preparation while this "
            r"one ran; pass --overwrite to replace it$")
    with meanwhile(lambda: dt.prepare("parabola", out, client=client, progress=False)) as other, \
            pytest.raises(dt.OutputExistsError, match=late) as caught:
        dt.prepare("regression", out, client=client, progress=False, samples=64, width=2)
    assert other.ran
    assert isinstance(caught.value, dt.DasktrainError) and isinstance(caught.value,
                                                                      FileExistsError)
    assert _source(out) == "parabola" and dt.verify(out, client=client, progress=False).ok
    assert [p.name for p in tmp_path.iterdir()] == ["out.zarr"]  # no build, no scratch left


def test_with_overwrite_the_last_to_publish_wins_and_the_output_is_whole(client, tmp_path):
    out = tmp_path / "out.zarr"
    dt.prepare("parabola", out, client=client, progress=False)

    def first() -> None:
        dt.prepare("classification", out, client=client, progress=False, samples=48, width=3,
                   overwrite=True)

    with meanwhile(first) as other:
        ds = dt.prepare("regression", out, client=client, progress=False, samples=64, width=2,
                        overwrite=True)
    assert other.ran and _source(out) == "regression" and len(ds) == 64
    assert dt.verify(out, client=client, progress=False).ok
    assert [p.name for p in tmp_path.iterdir()] == ["out.zarr"]


def test_the_move_into_place_never_replaces_anything(tmp_path):
    build = tmp_path / "build"
    build.mkdir()
    (build / "data").write_text("new")
    for kind in ("empty directory", "directory", "file"):
        target = tmp_path / kind
        if kind == "file":
            target.write_text("old")
        else:
            target.mkdir()
            if kind == "directory":
                (target / "data").write_text("old")
        with pytest.raises(FileExistsError):
            rename_no_replace(build, target)
        assert (build / "data").read_text() == "new"
    rename_no_replace(build, tmp_path / "free")
    assert (tmp_path / "free" / "data").read_text() == "new" and not build.exists()


_CLI_RACE = textwrap.dedent("""
    import logging, sys
    import dasktrain as dt
    from dasktrain.cli.main import main
    from tests.common.meanwhile import meanwhile

    out, scheduler = sys.argv[1:]
    logging.getLogger("dasktrain.datasets.prepare").propagate = False  # only the command's
    with meanwhile(lambda: dt.prepare("parabola", out, scheduler=scheduler, progress=False)):
        status = main(["prepare", "regression", out, "--samples", "64", "--width", "2",
                       "--no-progress", "--scheduler", scheduler])
    sys.exit(status)
""")


def test_the_command_says_so_in_one_line_and_exits_2(client, tmp_path):
    out = tmp_path / "out.zarr"
    result = subprocess.run([sys.executable, "-c", _CLI_RACE, str(out),
                             client.scheduler.address], capture_output=True, text=True,
                            timeout=120, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 2, result.stderr
    assert result.stderr == (f"dasktrain prepare: error: output {out} was written by another "
                             "preparation while this one ran; pass --overwrite to replace "
                             "it\n")
    assert _source(out) == "parabola" and [p.name for p in tmp_path.iterdir()] == ["out.zarr"]
