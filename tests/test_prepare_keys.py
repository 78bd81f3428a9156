"""Task keys name what they read: work sharing one Dask client never trades results.

Dask reuses any result a client still holds under the same key, silently. Each test holds
the results of one graph (as a client that ran it moments ago, or runs it beside us, does)
and then builds a second graph over other data that a careless key would confuse with it:
a file of the same name elsewhere, a compressed ``.npz`` member inflated to the same
scratch name, a file or a dataset rewritten in place.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import zarr
from distributed import Client, Future, wait

import dasktrain as dt
from dasktrain.datasets.format import ATTRS_KEY
from dasktrain.datasets.sources import SourceOptions
from dasktrain.datasets.sources.arrays import NumpySource
from tests.common.builders import write_npy_pair

ROWS, CHUNK_ROWS = 300, 64


def _prepare(client: Client, source: Path, out: Path, **options) -> dt.Dataset:
    return dt.prepare(source, out, client=client, progress=False, chunk_rows=CHUNK_ROWS,
                      **options)


def _hold_read(client: Client, source: Path, **options) -> list:
    """Keep the results of ``source``'s read graph in the cluster (the caller holds them)."""
    arrays = NumpySource(str(source), SourceOptions(**options)).to_dask(CHUNK_ROWS)
    held = client.persist(list(arrays.values()))
    wait(held)
    return held


def _stored(ds: dt.Dataset, name: str = "x") -> np.ndarray:
    # Read with zarr, not dask: the check must not go through the keys under test.
    return ds.zarr_array(name)[:]


def _same_named_pairs(root: Path) -> dict[str, tuple[Path, Path, np.ndarray, np.ndarray]]:
    """``a/x.npy`` and ``b/x.npy`` (with targets): same names and shapes, other values."""
    pairs = {}
    for seed, name in enumerate("ab", start=1):
        (root / name).mkdir()
        pairs[name] = write_npy_pair(root / name, rows=ROWS, width=4, seed=seed)
    return pairs


def test_concurrent_preparations_of_same_named_files(client, tmp_path):
    pairs = _same_named_pairs(tmp_path)
    start = threading.Barrier(len(pairs))
    built: dict[str, dt.Dataset] = {}
    errors: list[BaseException] = []

    def run(name: str) -> None:
        xp, yp, _, _ = pairs[name]
        try:
            start.wait(timeout=30)
            built[name] = _prepare(client, xp, tmp_path / f"{name}.zarr", target=str(yp))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(name,)) for name in pairs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    for name, (_, _, x, y) in pairs.items():
        np.testing.assert_array_equal(_stored(built[name]), x, err_msg=f"{name}/x.npy")
        np.testing.assert_array_equal(_stored(built[name], "y"), y, err_msg=f"{name}/y.npy")


def test_same_named_file_while_another_is_held(client, tmp_path):
    pairs = _same_named_pairs(tmp_path)
    held = _hold_read(client, pairs["a"][0], target=str(pairs["a"][1]))
    xp, yp, x, y = pairs["b"]
    ds = _prepare(client, xp, tmp_path / "b.zarr", target=str(yp))
    np.testing.assert_array_equal(_stored(ds), x, err_msg="rows of b/x.npy")
    np.testing.assert_array_equal(_stored(ds, "y"), y, err_msg="rows of b/y.npy")
    del held


def test_compressed_npz_members_of_same_name(client, tmp_path):
    members = {}
    for seed, name in enumerate("ab", start=1):
        (tmp_path / name).mkdir()
        rng = np.random.default_rng(seed)
        members[name] = rng.standard_normal((ROWS, 3)).astype(np.float32)
        np.savez_compressed(tmp_path / name / "d.npz", x=members[name])
    # Both archives inflate member x to a scratch file named x.npy.raw.
    held = _hold_read(client, tmp_path / "a" / "d.npz", scratch_dir=str(tmp_path / "scratch"))
    ds = _prepare(client, tmp_path / "b" / "d.npz", tmp_path / "b.zarr")
    np.testing.assert_array_equal(_stored(ds), members["b"], err_msg="rows of b/d.npz")
    del held


def test_source_rewritten_in_place_is_read_again(client, tmp_path):
    xp, _, old, _ = write_npy_pair(tmp_path, rows=ROWS, width=4, seed=1)
    held = _hold_read(client, xp)
    first = _prepare(client, xp, tmp_path / "first.zarr")
    np.testing.assert_array_equal(_stored(first), old)
    new = old + 100.0  # same path, size and inode: only the contents (and mtime) change
    np.save(xp, new)
    second = _prepare(client, xp, tmp_path / "second.zarr")
    np.testing.assert_array_equal(_stored(second), new, err_msg="rows of the rewritten file")
    del held


def _indexed(tmp_path: Path, name: str, offset: float) -> tuple[Path, np.ndarray]:
    """A source whose row ``i`` is ``offset + i`` (twice), saved under ``name``."""
    x = (offset + np.arange(ROWS, dtype=np.float32))[:, None].repeat(2, axis=1)
    np.save(tmp_path / name, x)
    return tmp_path / name, x


def test_pipeline_over_a_dataset_rewritten_at_the_same_path(client, tmp_path):
    out = tmp_path / "data.zarr"
    old_source, old = _indexed(tmp_path, "old.npy", 0.0)
    new_source, new = _indexed(tmp_path, "new.npy", 1000.0)
    first = dt.Pipeline(_prepare(client, old_source, out), 32, shuffle=False, client=client)
    known = set(client.futures)
    batches = iter(first)
    got = [next(batches)]
    # Hold the tasks submitted so far (a prefetch window), as an unfinished consumer does.
    held = [Future(key, client) for key in set(client.futures) - known]
    got.extend(batches)
    first.close()
    wait(held)
    np.testing.assert_array_equal(np.concatenate([b.numpy() for b in got]), old)

    _prepare(client, new_source, out, overwrite=True)
    second = dt.Pipeline(dt.open_dataset(out), 32, shuffle=False, client=client)
    rows = np.concatenate([b.numpy() for b in second])
    np.testing.assert_array_equal(rows, new, err_msg="batches of the rewritten dataset")
    del held


def test_dataset_arrays_of_a_dataset_rewritten_at_the_same_path(client, tmp_path):
    out = tmp_path / "data.zarr"
    old_source, _ = _indexed(tmp_path, "old.npy", 0.0)
    new_source, new = _indexed(tmp_path, "new.npy", 1000.0)
    held = client.persist(_prepare(client, old_source, out).x)
    wait(held)
    _prepare(client, new_source, out, overwrite=True)
    rows = dt.open_dataset(out).x.compute()
    np.testing.assert_array_equal(rows, new, err_msg="ds.x of the rewritten dataset")
    del held


def _strip_dataset_id(path: Path) -> None:
    """Make ``path`` look like a dataset written before builds recorded their id."""
    group = zarr.open_group(str(path), mode="r+")
    attrs = dict(group.attrs[ATTRS_KEY])
    del attrs["dataset_id"]
    group.attrs[ATTRS_KEY] = attrs


def test_every_build_has_its_own_identity(client, tmp_path):
    out = tmp_path / "data.zarr"
    source, _ = _indexed(tmp_path, "x.npy", 0.0)
    first = _prepare(client, source, out, split="train=0.5,val=0.5")
    again = dt.open_dataset(out)
    assert first.identity == again.identity == again.split("train").identity
    second = _prepare(client, source, out, overwrite=True)
    assert second.identity != first.identity
    # Datasets from before the id: identity from the build time and the metadata's mtime.
    _strip_dataset_id(out)
    legacy = dt.open_dataset(out)
    assert legacy.identity == dt.open_dataset(out).identity != second.identity
    _prepare(client, source, out, overwrite=True)
    _strip_dataset_id(out)
    assert dt.open_dataset(out).identity != legacy.identity
