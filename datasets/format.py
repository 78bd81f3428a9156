"""The on-disk format: what a dasktrain Zarr group records and how it is chunked.

A dataset is a Zarr v3 group whose arrays share axis 0 (samples) and are chunked only along
it. Everything else lives in the group attribute ``"dasktrain"``::

    {
      "format_version": 2,
      "dataset_id": "5f0c...",   # random, new for every build (absent in older datasets)
      "num_samples": 1797,
      "chunk_rows": 4096,
      "arrays": {"x": {"role": "features", "dtype": "float32", "shape": [1797, 64]},
                 "y": {"role": "targets", "dtype": "int64", "shape": [1797]}},
      "stats": {"x": {"mean": [...], "std": [...], "min": [...], "max": [...]}, ...},
      "normalization": {"x": {"mean": [...], "std": [...], "fitted_on": "train"}} | null,
      "splits": {"train": [0, 1438], "val": [1438, 1797]},
      "classes": {"y": {"num_classes": 10, "counts": [...], "labels": null}},
      "provenance": {"source": "digits", "options": {...}, "created": "...", "dasktrain": "0.1.0"},
      "chunks": {"x": {"count": 1, "bytes": [...], "crc32c": [...]}, "y": {...}}
    }

Version 2 stores every chunk (none is left out for equalling the fill value) and records each
chunk's stored size and CRC-32C under ``"chunks"`` (see :mod:`dasktrain.datasets.chunks`), so
that a missing or altered chunk is an error, never rows of fill values. Version 1 datasets
(no ``"chunks"``) still open and read; their chunks are not checked.

Splits are contiguous sample ranges, so a split is a slice and reading it touches only the
chunks it covers.

An array's entry may name its ``"path"`` within the group (default: its name). Datasets on
object storage use it: each build writes its arrays under its own prefix
(``dasktrain-build-<dataset_id>/x``) and the group's ``zarr.json``, written last in one
PUT, points at them; see :mod:`dasktrain.datasets.remote`.

A token dataset (a text corpus, see :mod:`dasktrain.datasets.sources.text`) also records
``"text"``: its tokenizer (``{"kind": "bytes", ...}`` or ``{"kind": "huggingface", "path":
..., "sha256": ...}``, with ``vocab_size`` and ``eot_id``), ``seq_len``, the token dtype,
which arrays are the input and the target (``"x"``, ``"y"``), and the documents and tokens
counted (``tokens_dropped``: the tail shorter than one sequence).
"""

from __future__ import annotations

import math
import re
import warnings
from typing import Any

import numpy as np
import zarr
from zarr.dtype import VariableLengthBytes
from zarr.errors import UnstableSpecificationWarning

__all__ = [
    "ATTRS_KEY",
    "DEFAULT_CHUNK_BYTES",
    "FORMAT_VERSION",
    "READABLE_VERSIONS",
    "ROLES",
    "chunk_lengths",
    "chunk_rows_for",
    "create_sample_array",
    "parse_size",
]

#: The version :func:`~dasktrain.prepare` writes; 2 added the chunk record.
FORMAT_VERSION = 2
#: Versions :func:`~dasktrain.open_dataset` reads.
READABLE_VERSIONS = (1, 2)
ATTRS_KEY = "dasktrain"
#: What an array is for. ``features``: model inputs (float32; normalised by ``normalize``).
#: ``targets``: what the loss compares the output with (integers int64, else float32; never
#: normalised). ``other``: served by name beside them, neither an input nor a target by
#: default (sample weights, ids, masks for a custom step; stored as targets are).
ROLES = ("features", "targets", "other")
#: 4 MiB of rows (all arrays together) per chunk: large enough that a read task does real
#: work, small enough that a prefetch window of a few blocks stays in the tens of MiB.
DEFAULT_CHUNK_BYTES = 4 * 2**20

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str | int) -> int:
    """Parse ``"4MiB"``, ``"8 MB"`` or ``1048576`` into a number of bytes."""
    if isinstance(text, int):
        if text <= 0:
            raise ValueError(f"size must be positive, got {text}")
        return text
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"cannot read {text!r} as a size; use e.g. 4MiB, 8MB or 1048576")
    unit = (match.group(2) or "").lower().removesuffix("b")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return value


def chunk_rows_for(row_bytes: int, target_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Rows per chunk so that one chunk of every array together is about ``target_bytes``."""
    if row_bytes <= 0:
        raise ValueError(f"row size must be positive, got {row_bytes}")
    return max(1, math.floor(target_bytes / row_bytes))


def chunk_lengths(num_samples: int, chunk_rows: int) -> tuple[int, ...]:
    """Rows of each chunk of ``num_samples`` rows cut every ``chunk_rows`` (the last one
    shorter)."""
    return tuple(min(chunk_rows, num_samples - s) for s in range(0, num_samples, chunk_rows))


def row_bytes(dtypes_and_shapes: list[tuple[np.dtype, tuple[int, ...]]]) -> int:
    """Bytes one sample takes across arrays given as (dtype, per-sample shape) pairs."""
    return sum(np.dtype(dt).itemsize * math.prod(shape) for dt, shape in dtypes_and_shapes)


def create_sample_array(group: zarr.Group, name: str, *, dtype: np.dtype, **options: Any
                        ) -> zarr.Array:
    """``group.create_array(name, dtype=dtype, **options)``, where an ``object`` dtype means
    variable-length bytes (encoded images): zarr's ``VariableLengthBytes``.

    Zarr warns that this type has no Zarr v3 specification yet; its chunks are numcodecs'
    ``vlen-bytes`` encoding, unchanged since Zarr v2, and the docs say so once (datasets,
    "Images") instead of every build.
    """
    if np.dtype(dtype) != np.dtype(object):
        return group.create_array(name, dtype=dtype, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnstableSpecificationWarning)
        return group.create_array(name, dtype=VariableLengthBytes(), **options)
