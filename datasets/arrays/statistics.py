"""Normalization of an in-place dataset: each variable's mean and standard deviation,
computed once with Dask over the steps of one split (per variable, or per value of the
dimensions kept apart, e.g. per level), kept in a file where asked and read back from it
rather than computed again."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dasktrain._durable import read_bytes, write_bytes_atomic
from dasktrain.datasets.errors import DatasetError

__all__ = ["Statistics", "as_dask", "compute_statistics", "given", "load_or_compute",
           "over_steps"]

#: ``{variable: (mean, std)}``: arrays over the variable's dimensions kept apart (in the
#: variable's order), or scalars.
Statistics = dict[str, tuple[np.ndarray, np.ndarray]]


def compute_statistics(data: Any, variables: Sequence[str], sample_dim: str,
                       steps: tuple[int, int], per: Sequence[str]) -> Statistics:
    """Mean and standard deviation of each variable over store steps ``[a, b)`` of the
    sample dimension (a static field: all of it), every dimension reduced but ``per``;
    NaN skipped. One Dask computation for all of them, on the default scheduler (the
    cluster of a client, where there is one)."""
    import dask

    lazy = {}
    for name in variables:
        variable = over_steps(data[name], sample_dim, steps)
        keep = [d for d in variable.dims if d in per]
        reduce = [d for d in variable.dims if d not in keep]
        values = variable.astype(np.float64)
        lazy[name] = (values.mean(reduce), values.std(reduce))
    (computed,) = dask.compute(lazy)
    out: Statistics = {}
    for name, (mean, std) in computed.items():
        mean, std = np.asarray(mean.values), np.asarray(std.values)
        if not (np.all(np.isfinite(mean)) and np.all(np.isfinite(std))):
            raise DatasetError(f"variable {name!r} has no finite value over steps "
                               f"{steps[0]}:{steps[1]} of {sample_dim!r}: no statistics")
        out[name] = (mean, np.where(std > 0, std, 1.0))  # a constant field: centred only
    return out


def over_steps(variable: Any, sample_dim: str, steps: tuple[int, int]) -> Any:
    """``variable``'s store steps ``[a, b)`` (a static field: all of it), dask-backed, for
    one Dask reduction over them."""
    if sample_dim in variable.dims:
        variable = variable.isel({sample_dim: slice(*steps)})
    return as_dask(variable)


def as_dask(variable: Any) -> Any:
    """``variable`` as dask-backed, in its store's chunks where it has them (a store opened
    without dask), so that a reduction over it runs as one Dask task per chunk."""
    if variable.chunks:
        return variable
    preferred = variable.encoding.get("preferred_chunks")
    return variable.chunk(preferred if preferred else "auto")


def load_or_compute(path: str | os.PathLike | None, key: Mapping[str, Any], compute: Any,
                    storage_options: dict | None = None) -> Statistics:
    """The statistics kept at ``path`` when they were computed for ``key`` (the source,
    split, variables and dimensions kept apart), else ``compute()``'s, written there. A
    file for another key is an error, never silently replaced."""
    if path is not None:
        try:
            kept = json.loads(read_bytes(path, storage_options))
        except FileNotFoundError:
            kept = None
        except (OSError, ValueError) as exc:
            raise DatasetError(f"cannot read the statistics at {path}: {exc}") from exc
        if kept is not None:
            if kept.get("key") != json.loads(json.dumps(key)):
                raise DatasetError(
                    f"the statistics at {path} were computed for {kept.get('key')}, not for "
                    f"{dict(key)}: remove the file to compute them again, or give another "
                    "path")
            return {n: (np.asarray(m, dtype=np.float64), np.asarray(s, dtype=np.float64))
                    for n, (m, s) in kept["statistics"].items()}
    stats = compute()
    if path is not None:
        body = {"key": key, "statistics": {n: (m.tolist(), s.tolist())
                                           for n, (m, s) in stats.items()}}
        write_bytes_atomic(path, json.dumps(body, indent=1).encode(), storage_options)
    return stats


def given(statistics: Mapping[str, Any], variables: Sequence[str]) -> Statistics:
    """Statistics a user gave, ``{variable: (mean, std)}``, checked."""
    out: Statistics = {}
    for name in variables:
        if name not in statistics:
            raise DatasetError(f"normalize gives no (mean, std) for variable {name!r}")
        try:
            mean, std = statistics[name]
        except (TypeError, ValueError):
            raise DatasetError(f"normalize[{name!r}] must be a (mean, std) pair, got "
                               f"{statistics[name]!r}") from None
        mean, std = np.asarray(mean, dtype=np.float64), np.asarray(std, dtype=np.float64)
        if not (np.all(np.isfinite(mean)) and np.all(np.isfinite(std)) and np.all(std > 0)):
            raise DatasetError(f"normalize[{name!r}]: the mean must be finite and the std "
                               "finite and > 0")
        out[name] = (mean, std)
    return out
