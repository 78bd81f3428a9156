"""The real ``dasktrain`` command in a subprocess: good runs, and every bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from tests.common.builders import (
    assert_user_error,
    run_cli,
    run_cli_batch,
    write_npy_pair,
    write_table,
)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    d = tmp_path_factory.mktemp("sources")
    _xp, _yp, _, _ = write_npy_pair(d, rows=50)
    write_table(d / "t.csv", rows=40)
    np.save(d / "short_y.npy", np.zeros(49, dtype=np.int64))
    np.save(d / "empty.npy", np.zeros((0, 3), dtype=np.float32))
    np.save(d / "strings.npy", np.array(["a", "b"]))
    (d / "empty.csv").write_text("")
    (d / "header_only.csv").write_text("a,b,label\n")
    pd.DataFrame({"a": [1.0, 2.0], "city": ["Oslo", "Lima"]}).to_csv(d / "text.csv", index=False)
    (d / "notes.txt").write_text("hello")
    (d / "a_file").write_text("not a directory")
    return d


BAD_INPUTS = [
    (["prepare", "{d}/missing.npy", "{out}"], ["missing.npy", "neither a file"]),
    (["prepare", "{d}/t.csv", "{out}", "--target", "nope"], ["no column 'nope'"]),
    (["prepare", "{d}/t.csv", "{out}", "--features", "a,zz", "--target", "label"],
     ["no column 'zz'"]),
    (["prepare", "{d}/x.npy", "{out}", "--target", "{d}/short_y.npy"], ["mismatched lengths"]),
    (["prepare", "{d}/empty.npy", "{out}"], ["empty"]),
    (["prepare", "{d}/empty.csv", "{out}"], ["empty"]),
    (["prepare", "{d}/header_only.csv", "{out}", "--target", "label"], ["empty"]),
    (["prepare", "{d}/strings.npy", "{out}"], ["non-numeric"]),
    (["prepare", "{d}/text.csv", "{out}"], ["non-numeric column 'city'",
                                            "--encode-categorical"]),
    (["prepare", "{d}/notes.txt", "{out}"], ["notes.txt holds 6 tokens", "--seq-len"]),
    (["prepare", "parabola", "{d}/a_file/out.zarr"], ["not a directory"]),
    (["prepare", "parabola", "/proc/dasktrain-out.zarr"], ["/proc"]),
    (["prepare", "parabola", "{out}", "--split", "train=0.9,val=0.2"], ["sum to"]),
    (["prepare", "parabola", "{out}", "--chunk-size", "lots"], ["lots"]),
    (["prepare", "parabola", "{out}", "--samples", "0"], ["samples must be positive"]),
    (["prepare", "parabola", "{out}", "--scheduler", "tcp://127.0.0.1:1"], ["cannot reach"]),
    (["prepare", "parabola"], ["required"]),
    (["info", "{d}"], ["not a dasktrain dataset"]),
    (["info", "{d}/nothing.zarr"], ["no dataset"]),
    (["verify", "{d}/nothing.zarr"], ["no dataset"]),
]


@pytest.fixture(scope="module")
def bad_input_runs(sources, tmp_path_factory):
    """Every bad input's run (one interpreter for all), and the output each must not leave."""
    outs = [tmp_path_factory.mktemp("bad") / "out.zarr" for _ in BAD_INPUTS]
    argvs = [[a.format(d=sources, out=out) for a in args]
             for (args, _), out in zip(BAD_INPUTS, outs, strict=True)]
    return list(zip(run_cli_batch(argvs), outs, strict=True))


@pytest.mark.parametrize("case", range(len(BAD_INPUTS)))
def test_bad_input_is_one_line_and_exit_2(bad_input_runs, case):
    result, out = bad_input_runs[case]
    assert_user_error(result, *BAD_INPUTS[case][1])
    assert not out.exists()
    leftovers = [p.name for p in out.parent.iterdir()]  # no build or scratch either
    assert leftovers == [], leftovers


def _on(client) -> tuple[str, str]:
    """The option that runs a command on the session's cluster: tests of what a command
    checks and says need no embedded cluster of their own (its own tests start one)."""
    return "--scheduler", client.scheduler.address


def test_existing_output_needs_overwrite_and_is_kept(client, tmp_path):
    out = tmp_path / "p.zarr"
    first = run_cli("prepare", "parabola", str(out), "--no-progress", *_on(client))
    assert first.returncode == 0, first.stderr
    before = (out / "zarr.json").read_bytes()
    assert_user_error(run_cli("prepare", "parabola", str(out), "--samples", "10"),
                      "already exists", "--overwrite")
    assert (out / "zarr.json").read_bytes() == before
    again = run_cli("prepare", "parabola", str(out), "--samples", "10", "--overwrite",
                    "--no-progress", *_on(client))
    assert again.returncode == 0, again.stderr
    assert json.loads((out / "zarr.json").read_text())["attributes"]["dasktrain"][
        "num_samples"] == 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.zarr"]


def test_overwrite_refuses_a_directory_that_is_not_a_dataset(tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    assert_user_error(run_cli("prepare", "parabola", str(precious), "--overwrite"),
                      "not a dasktrain dataset")
    assert (precious / "thesis.tex").read_text() == "years of work"


def test_prepare_info_verify_happy_path(tmp_path):
    out = tmp_path / "d.zarr"
    result = run_cli("prepare", "digits", str(out), "--split", "train=0.8,val=0.2",
                     "--normalize", "--chunk-rows", "500", "--no-progress")
    assert result.returncode == 0, result.stderr
    assert "train=1,438" in result.stdout and "val=359" in result.stdout
    info = run_cli("info", str(out))
    assert info.returncode == 0, info.stderr
    for fragment in ("samples   1,797 in chunks of 500 rows", "codec=zstd", "compression",
                     "normalized x (fitted on train)", "10 classes"):
        assert fragment in info.stdout, info.stdout
    verify = run_cli("verify", str(out), "--no-progress")
    assert verify.returncode == 0, verify.stderr
    assert "8 chunks read" in verify.stdout


def test_verify_names_a_corrupt_chunk(client, tmp_path):
    out = tmp_path / "d.zarr"
    assert run_cli("prepare", "regression", str(out), "--samples", "3000", "--width", "4",
                   "--chunk-rows", "1000", "--no-progress", *_on(client)).returncode == 0
    chunk = out / "x" / "c" / "1" / "0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    result = run_cli("verify", str(out), "--no-progress", *_on(client))
    assert result.returncode == 1
    assert "array 'x' chunk 1 (rows 1000:2000) cannot be read" in result.stderr
    assert "Traceback" not in result.stderr


def test_verify_catches_statistics_and_nan_tampering(client, tmp_path):
    import zarr

    out = tmp_path / "d.zarr"
    assert run_cli("prepare", "regression", str(out), "--samples", "3000", "--width", "4",
                   "--chunk-rows", "1000", "--no-progress", *_on(client)).returncode == 0
    group = zarr.open_group(str(out), mode="r+")
    group["x"][2500, 2] = np.nan
    result = run_cli("verify", str(out), "--no-progress", *_on(client))
    assert result.returncode == 1
    assert "array 'x' chunk 2 has 1 row(s) with NaN" in result.stderr
    group["x"][2500, 2] = 1e6
    result = run_cli("verify", str(out), "--no-progress", *_on(client))
    assert result.returncode == 1
    assert "array 'x': recorded mean does not match" in result.stderr


def test_prepare_on_an_existing_cluster(client, tmp_path):
    out = tmp_path / "r.zarr"
    result = run_cli("prepare", "classification", str(out), "--samples", "5000", "--classes",
                     "3", "--no-progress", *_on(client))
    assert result.returncode == 0, result.stderr
    assert "3 classes" in result.stdout
    assert client.status == "running"  # the command disconnected, the cluster lives on


def test_an_internal_error_shows_its_traceback_and_exits_1(tmp_path):
    """A bug of ours (here: describe() failing with a KeyError) is not dressed up as bad
    input: the traceback shows and the status is 1, not the user-error status 2."""
    code = ("import sys, dasktrain.datasets as d\n"
            "def broken(path):\n"
            "    return {}['internal']\n"
            "d.describe = broken\n"
            "from dasktrain.cli import main\n"
            "sys.exit(main(['info', sys.argv[1]]))\n")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1
    assert "Traceback" in done.stderr and "KeyError: 'internal'" in done.stderr


def test_a_bad_dataset_path_is_still_one_line_and_exit_2(tmp_path):
    done = run_cli("info", str(tmp_path / "missing.zarr"))
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
