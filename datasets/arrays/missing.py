"""Chunks missing from an in-place dataset's store. Zarr reads a chunk that is not there
as the array's fill value, without a word: the samples over it would be made of that
value. :func:`missing_chunks` lists them where the store can be listed."""

from __future__ import annotations

from typing import Any

import zarr
from zarr.core.sync import sync

from dasktrain._durable import storage_errors

__all__ = ["missing_chunks"]


def missing_chunks(url: str, variables: list[str], sample_dim: str,
                   storage_options: dict | None = None) -> tuple[int, list[str]]:
    """``(chunks looked for, one line per missing chunk)`` of ``variables`` in the Zarr
    store at ``url``; a line names the variable, the chunk and its steps along
    ``sample_dim``, and the value Zarr reads in its place."""
    with storage_errors(url):
        group = zarr.open_group(url, mode="r", storage_options=storage_options)
        looked, lines = 0, []
        for name in variables:
            array = group[name]
            stored = set(sync(_listed(array.store, f"{array.path}/")))
            dims = _dimension_names(array)
            for coords in array._iter_chunk_coords():
                looked += 1
                if f"{array.path}/{array.metadata.encode_chunk_key(coords)}" in stored:
                    continue
                where = _span(array, dims, coords, sample_dim)
                lines.append(f"variable {name!r} chunk {tuple(coords)}{where} is missing"
                             f" from the store: Zarr reads it as the fill value "
                             f"{array.fill_value!r}")
    return looked, lines


async def _listed(store: Any, prefix: str) -> list[str]:
    return [key async for key in store.list_prefix(prefix)]


def _dimension_names(array: Any) -> list[str | None]:
    names = getattr(array.metadata, "dimension_names", None)
    if names:
        return list(names)
    return list(array.attrs.get("_ARRAY_DIMENSIONS", [None] * array.ndim))


def _span(array: Any, dims: list[str | None], coords: tuple[int, ...], sample_dim: str
          ) -> str:
    if sample_dim not in dims:
        return ""
    axis = dims.index(sample_dim)
    size = array.chunks[axis]
    start = coords[axis] * size
    return f" ({sample_dim} {start}:{min(start + size, array.shape[axis])})"
