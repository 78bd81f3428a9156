"""A dataset knows its chunks: a missing or altered chunk is an error, never fill values.

Every test damages its own copy of a real prepared dataset (320 rows, chunks of 80, so
chunk 1 holds rows 80:160 and chunk 3 rows 240:320) and reads it the ways a user does: the
pipeline in both placements, ``verify`` in Python and ``dasktrain verify`` in a subprocess.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import google_crc32c
import numpy as np
import pytest
import zarr

import dasktrain as dt
from dasktrain.datasets.chunks import ChunkError
from tests.common.builders import run_cli
from tests.common.object_storage import s3_server  # noqa: F401  (the s3 fixture)
from tests.common.training import mlp, mse

MISSING = "array 'x' chunk 1 (rows 80:160) is missing"
TRUNCATED = "array 'y' chunk 3 (rows 240:320) has"
ALTERED = "array 'x' chunk 2 (rows 160:240) has CRC-32C"
# The pipeline's form of the same: the chunk, then the block that needed it.
IN_PIPELINE = {
    "deleted": "cannot read array 'x' chunk 1 (rows 80:160) for block 1 of epoch 0: it is "
               "missing",
    "truncated": "cannot read array 'y' chunk 3 (rows 240:320) for block 3 of epoch 0: it has ",
    "altered": "cannot read array 'x' chunk 2 (rows 160:240) for block 2 of epoch 0: it has "
               "CRC-32C",
}


def _chunk_file(root: Path, ds: dt.Dataset, name: str, index: int) -> Path:
    z = ds.zarr_array(name)
    key = z.metadata.encode_chunk_key((index, *(0,) * (z.ndim - 1)))
    return root / z.store_path.path / key


@pytest.fixture
def copy(regression, tmp_path) -> Path:
    """A private copy of the session's dataset, to damage."""
    return Path(shutil.copytree(regression.url, tmp_path / "reg.zarr"))


def _delete(path: Path) -> None:
    ds = dt.open_dataset(path)
    _chunk_file(path, ds, "x", 1).unlink()


def _truncate(path: Path) -> None:
    ds = dt.open_dataset(path)
    target = _chunk_file(path, ds, "y", 3)
    data = target.read_bytes()
    target.write_bytes(data[: len(data) // 2])


def _alter(path: Path) -> None:
    """Same size, one byte different."""
    ds = dt.open_dataset(path)
    target = _chunk_file(path, ds, "x", 2)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))


def _as_version_1(path: Path) -> None:
    """What a dataset prepared before chunks were recorded looks like."""
    group = zarr.open_group(str(path), mode="r+")
    attrs = dict(group.attrs["dasktrain"])
    del attrs["chunks"]
    attrs["format_version"] = 1
    group.attrs["dasktrain"] = attrs


def _read_all(ds: dt.Dataset, placement: str, client) -> np.ndarray:
    pipe = dt.Pipeline(ds, batch_size=40, shuffle=False, placement=placement, client=client,
                       timeout=60)
    return np.concatenate([x.numpy() for x, _ in pipe])


# -- writing ---------------------------------------------------------------------------------
def test_prepare_records_size_and_crc_of_every_stored_chunk(regression):
    root = Path(regression.url)
    record = regression.attrs["chunks"]
    assert regression.attrs["format_version"] == 2 and regression.chunks_recorded
    assert set(record) == {"x", "y"}
    for name in ("x", "y"):
        assert record[name]["count"] == 4
        for index in range(4):
            stored = _chunk_file(root, regression, name, index).read_bytes()
            assert record[name]["bytes"][index] == len(stored)
            assert record[name]["crc32c"][index] == google_crc32c.value(stored)


@pytest.mark.parametrize("split", [None, "train=0.5,val=0.5"])
def test_a_chunk_of_zeros_is_stored_and_recorded(client, tmp_path, split):
    # Chunk 1 of x equals the fill value: zarr would not store it by default, and a deleted
    # chunk could not be told from it. The split takes the two-pass build.
    x = np.ones((40, 3), dtype=np.float32)
    x[10:20] = 0.0
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", np.zeros(40, dtype=np.float32))
    out = tmp_path / "zeros.zarr"
    ds = dt.prepare(tmp_path / "x.npy", out, target=str(tmp_path / "y.npy"), chunk_rows=10,
                    client=client, progress=False, split=split)
    zero_chunks = 0
    for name in ("x", "y"):
        files = [_chunk_file(out, ds, name, i) for i in range(4)]
        assert all(f.is_file() for f in files), name
        assert ds.attrs["chunks"][name]["bytes"] == [f.stat().st_size for f in files]
        zero_chunks += sum(not ds.zarr_array(name)[i * 10 : i * 10 + 10].any()
                           for i in range(4))
    # All of y; and x's chunk 1 where no split shuffles its rows.
    assert zero_chunks == (5 if split is None else 4)
    assert dt.verify(ds, client=client, progress=False).ok


# -- reading through the pipeline ------------------------------------------------------------
@pytest.mark.parametrize("placement", ["consumer", "anywhere"])
@pytest.mark.parametrize(("damage", "kind"), [(_delete, "deleted"), (_truncate, "truncated"),
                                              (_alter, "altered")],
                         ids=["deleted", "truncated", "altered"])
def test_the_pipeline_refuses_a_damaged_chunk(client, copy, placement, damage, kind):
    damage(copy)
    with pytest.raises(dt.PipelineError) as caught:
        _read_all(dt.open_dataset(copy), placement, client)
    message = str(caught.value)
    assert IN_PIPELINE[kind] in message, message
    assert "dasktrain prepare ... --overwrite" in message and "dasktrain verify" in message
    cause = caught.value.__cause__
    assert isinstance(cause, ChunkError) and cause.chunk in (1, 2, 3)


@pytest.mark.parametrize("placement", ["consumer", "anywhere"])
def test_an_intact_dataset_reads_every_row_through_its_checks(client, copy, placement):
    ds = dt.open_dataset(copy)
    assert ds.chunks_recorded
    expected = zarr.open_group(str(copy), mode="r")["x"][:]  # plain zarr, no checks
    np.testing.assert_array_equal(_read_all(ds, placement, client), expected)


def test_dataset_arrays_refuse_a_missing_chunk_too(copy):
    _delete(copy)
    with pytest.raises(ChunkError, match=r"array 'x' chunk 1 \(rows 80:160\) is missing"):
        dt.open_dataset(copy).x.compute()


# -- verify ------------------------------------------------------------------------------------
def test_verify_names_every_missing_truncated_and_altered_chunk(client, copy):
    _delete(copy)
    _truncate(copy)
    _alter(copy)
    report = dt.verify(copy, client=client, progress=False)
    assert not report.ok and report.notes == []
    text = "\n".join(report.problems)
    for expected in (MISSING, TRUNCATED, ALTERED):
        assert expected in text, text
    assert "3 chunk(s) missing, altered or unreadable" in text
    assert "recorded mean" not in text  # the chunks are named, not their statistics' drift


def test_verify_names_a_chunk_rewritten_with_other_values_and_what_changed(client, copy):
    zarr.open_group(str(copy), mode="r+")["x"][100, 0] = np.nan  # through zarr: valid zstd
    report = dt.verify(copy, client=client, progress=False)
    text = "\n".join(report.problems)
    assert "array 'x' chunk 1 (rows 80:160) has " in text, text
    assert "array 'x' chunk 1 has 1 row(s) with NaN" in text, text
    assert "1 chunk(s) missing, altered or unreadable" in text


def test_cli_verify_names_both_chunks_and_exits_1(client, copy):
    _delete(copy)
    _truncate(copy)
    done = run_cli("verify", str(copy), "--scheduler", client.scheduler.address,
                   "--no-progress")
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert MISSING in done.stderr and TRUNCATED in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_cli_info_and_verify_pass_an_intact_dataset(client, copy):
    info = run_cli("info", str(copy))
    assert info.returncode == 0, info.stderr
    assert "size and CRC-32C of every chunk recorded" in info.stdout
    done = run_cli("verify", str(copy), "--scheduler", client.scheduler.address,
                   "--no-progress")
    assert done.returncode == 0, done.stderr
    assert "8 chunks read, all checks passed" in done.stdout and "note" not in done.stderr


# -- datasets prepared before chunks were recorded -------------------------------------------
def test_a_dataset_without_a_record_opens_trains_and_says_so(client, copy):
    _as_version_1(copy)
    ds = dt.open_dataset(copy)
    assert not ds.chunks_recorded
    np.testing.assert_array_equal(_read_all(ds, "consumer", client), ds.x.compute())
    trainer = dt.Trainer(mlp, mse, dt.optim.sgd(0.05), workers=2, batch_size=16,
                         progress=False)
    history = trainer.fit(ds, epochs=1, client=client)
    assert len(history.epochs) == 1
    report = dt.verify(ds, client=client, progress=False)
    assert report.ok and report.chunks_read == 8
    assert any("chunk integrity is not recorded" in note for note in report.notes)
    assert "chunk integrity is not recorded" in dt.describe(ds)
    done = run_cli("verify", str(copy), "--scheduler", client.scheduler.address,
                   "--no-progress")
    assert done.returncode == 0, done.stderr
    assert "chunk integrity is not recorded" in done.stderr


def test_a_version_2_dataset_without_its_record_is_refused(copy):
    document = json.loads((copy / "zarr.json").read_text())
    del document["attributes"]["dasktrain"]["chunks"]
    (copy / "zarr.json").write_text(json.dumps(document))
    with pytest.raises(dt.DatasetError, match=r"records no 'chunks'.*--overwrite"):
        dt.open_dataset(copy)


# -- object storage ------------------------------------------------------------------------
def test_on_object_storage_a_damaged_chunk_is_refused_and_named(client, s3):
    url = s3.url("damaged.zarr")
    ds = dt.prepare("regression", url, client=client, storage_options=s3.options,
                    samples=320, width=4, chunk_rows=80, seed=5, progress=False)
    assert dt.verify(ds, client=client, progress=False).ok

    def key(name: str, index: int) -> str:
        z = ds.zarr_array(name)
        chunk = z.metadata.encode_chunk_key((index, *(0,) * (z.ndim - 1)))
        return f"{url.removeprefix('s3://')}/{z.store_path.path}/{chunk}"

    s3.fs.rm(key("x", 1))
    s3.fs.pipe_file(key("y", 3), s3.fs.cat_file(key("y", 3))[:10])
    s3.fs.invalidate_cache()
    again = dt.open_dataset(url, storage_options=s3.options)
    with pytest.raises(dt.PipelineError, match=re.escape(IN_PIPELINE["deleted"])):
        _read_all(again, "anywhere", client)
    report = dt.verify(again, client=client, progress=False)
    text = "\n".join(report.problems)
    assert MISSING in text and TRUNCATED in text, text
