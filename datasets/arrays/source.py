"""What an in-place dataset reads: an xarray Dataset, a Zarr store opened as one, or a
mapping of arrays with named dimensions; and reading a time range of one variable."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from dask.base import tokenize

from dasktrain._durable import is_url, storage_errors
from dasktrain.datasets.errors import DatasetError

__all__ = ["Source", "open_source", "read_span", "read_whole"]


class Source:
    """The variables of an in-place dataset, as an :class:`xarray.Dataset` (lazy: a Zarr
    store is opened without dask, and each read takes only the chunks it needs), with a
    name for messages and a token that changes when the data does."""

    def __init__(self, data: Any, label: str, token: str, *, is_store: bool = False,
                 storage_options: dict | None = None) -> None:
        self.data = data
        self.label = label
        self.token = token
        self.is_store = is_store  # a Zarr store at ``label``, opened here
        self.storage_options = storage_options


def open_source(source: Any, *, dims: Mapping[str, Sequence[str]] | None = None,
                storage_options: dict | None = None) -> Source:
    """``source`` as a :class:`Source`: an ``xarray.Dataset``; a path or URL of a Zarr
    store (opened with xarray, read in place, never written); or a mapping of variable
    names to numpy or dask arrays, whose dimension names ``dims`` gives."""
    import xarray as xr

    if isinstance(source, xr.Dataset):
        return Source(source, "an xarray.Dataset", _token_of(source))
    if isinstance(source, str | os.PathLike):
        return _open_store(os.fspath(source), storage_options)
    if isinstance(source, Mapping):
        return _from_mapping(source, dims)
    raise DatasetError(f"open_arrays takes an xarray.Dataset, the path or URL of a Zarr "
                       f"store, or a dict of arrays; got {type(source).__name__}")


def _open_store(path: str, storage_options: dict | None) -> Source:
    import xarray as xr

    url = path if "://" in path else os.path.abspath(path)
    if not is_url(url) and not os.path.exists(url):
        raise DatasetError(f"no Zarr store at {url}: nothing there")
    with storage_errors(url):
        try:
            # chunks=None: no dask arrays, a read takes the chunks of what it selects.
            with warnings.catch_warnings():
                # A store without consolidated metadata (Zarr v3's own) is read as it is.
                warnings.filterwarnings("ignore", "Failed to open Zarr store with consolidated")
                data = xr.open_zarr(url, chunks=None, consolidated=None,
                                    storage_options=storage_options)
        except (FileNotFoundError, KeyError, ValueError, TypeError) as exc:
            raise DatasetError(f"{url} is not a Zarr store xarray can open: {exc}") from exc
    modified = None
    if not is_url(url):
        with contextlib.suppress(OSError):
            modified = os.stat(os.path.join(url, "zarr.json")).st_mtime_ns
    structure = {name: (v.dims, v.shape, str(v.dtype)) for name, v in data.variables.items()}
    return Source(data, url, tokenize(url, modified, structure), is_store=True,
                  storage_options=storage_options)


def _from_mapping(arrays: Mapping[str, Any], dims: Mapping[str, Sequence[str]] | None
                  ) -> Source:
    import xarray as xr

    if not dims:
        raise DatasetError("a dict of arrays needs dims={name: (dimension names...)} for "
                           "each array: windows are taken along named dimensions")
    variables = {}
    for name, array in arrays.items():
        if name not in dims:
            raise DatasetError(f"dims names no dimensions for array {name!r}")
        names = tuple(dims[name])
        if len(names) != np.ndim(array):
            raise DatasetError(f"array {name!r} has {np.ndim(array)} dimension(s) but dims "
                               f"names {len(names)}: {names}")
        variables[name] = xr.Variable(names, array)
    try:
        data = xr.Dataset(variables)
    except ValueError as exc:
        raise DatasetError(f"the arrays do not fit together: {exc}") from exc
    return Source(data, "a dict of arrays", _token_of(data))


def _token_of(data: Any) -> str:
    """A token of an in-memory or dask-backed dataset (its values, or its dask keys); a
    lazily opened store's variables are named by their encoding's source instead of being
    read whole."""
    source = data.encoding.get("source")
    if source is not None and not any(v.chunks for v in data.variables.values()):
        structure = {n: (v.dims, v.shape, str(v.dtype)) for n, v in data.variables.items()}
        return tokenize(source, structure)
    return tokenize(data)


def read_span(variable: Any, dim: str, start: int, stop: int) -> np.ndarray:
    """``variable[dim=start:stop]`` as a numpy array, read where this runs (a dask-backed
    variable computes here, in this thread: a read runs inside a Dask task or a read
    thread). The scheduler is given to this computation alone: setting it in Dask's
    configuration would change it for every thread of the process meanwhile."""
    return read_whole(variable.isel({dim: slice(start, stop)}))


def read_whole(variable: Any) -> np.ndarray:
    """All of ``variable`` (a static field) as a numpy array, read here."""
    return np.asarray(variable.compute(scheduler="synchronous").values)
