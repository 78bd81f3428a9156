"""Arrays read in place: :func:`open_arrays` and the :class:`ArrayDataset` it gives."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import dask.array as da
from dask.base import tokenize

from dasktrain.datasets.arrays.layout import (
    block_steps,
    check_coordinates,
    normalized,
    parts_of,
    split_ranges,
    statistics_of,
    window_arrays,
)
from dasktrain.datasets.arrays.reader import WindowArray
from dasktrain.datasets.arrays.source import Source, open_source
from dasktrain.datasets.arrays.statistics import over_steps
from dasktrain.datasets.arrays.windows import Geometry
from dasktrain.datasets.dataset import Dataset
from dasktrain.datasets.errors import DatasetError

__all__ = ["ArrayDataset", "open_arrays"]

class ArrayDataset(Dataset):
    """Samples cut as windows out of arrays where they are (a Zarr store, an
    ``xarray.Dataset``, dask arrays): nothing is copied. The :class:`~dasktrain.Pipeline`,
    :meth:`Trainer.fit <dasktrain.Trainer.fit>`, ``evaluate`` and ``predict`` take it as
    they take a prepared dataset, with the same guarantees (every sample once per epoch,
    any world size, mid-epoch resume). Obtain one with :func:`open_arrays`; a split
    (``ds.split("train")``) holds the samples whose every step, inputs and targets, lies in
    the split's range of the sample dimension."""

    _NO_SPLITS = "none (give open_arrays splits={...})"

    def __init__(self, source: Source, arrays: dict[str, WindowArray],
                 attrs: Mapping[str, Any], start: int = 0, stop: int | None = None,
                 split_name: str | None = None, identity: str | None = None) -> None:
        super().__init__(source.label, None, attrs, start, stop, split_name=split_name,
                         identity=identity or tokenize(source.token, attrs))
        self.source = source
        self._arrays = arrays

    def zarr_array(self, name: str, *, checksums: bool = True) -> WindowArray:
        """The samples of ``name`` (all of them, not only this view's range), read by
        ranges: ``array[a:b]`` is samples ``a`` to ``b`` as a numpy array."""
        del checksums  # the store's own chunks, as the store has them
        if name not in self._arrays:
            raise KeyError(f"no array {name!r} in {self.url}; arrays: {self.array_names}")
        return self._arrays[name]

    def __getitem__(self, name: str) -> da.Array:
        array = self.zarr_array(name)
        chunks = (self.chunk_rows, *array.shape[1:])
        dask_name = f"in-place-{tokenize(self.identity, name, chunks)}"
        return da.from_array(array, chunks=chunks, name=dask_name, asarray=True,
                             fancy=False)[self.start:self.stop]

    @property
    def geometry(self) -> Geometry:
        """Where each sample lies in the store."""
        return next(iter(self._arrays.values())).geometry

    @property
    def variables(self) -> list[str]:
        """The store's variables its samples read, sorted."""
        return sorted({p.variable for a in self._arrays.values() for p in a.parts})

    def count_nan(self) -> dict[str, int]:
        """NaN values per variable in the steps this dataset's samples read (a split's
        own), counted with Dask on the client's cluster (the default scheduler)."""
        import dask

        geometry = self.geometry
        steps = geometry.time_span(self.start, self.stop)
        counts = {name: over_steps(self.source.data[name], geometry.sample_dim, steps)
                  .isnull().sum() for name in self.variables}
        (done,) = dask.compute(counts)
        return {n: int(v.values) for n, v in done.items()}

    def _view(self, start: int, stop: int, name: str) -> ArrayDataset:
        return ArrayDataset(self.source, self._arrays, self.attrs, start, stop,
                            split_name=name, identity=self.identity)

    def __repr__(self) -> str:
        what = f" split={self.split_name!r}" if self.split_name else ""
        shapes = ", ".join(f"{n}: {a.dtype}{a.shape[1:]}" for n, a in self._arrays.items())
        return f"<dasktrain.ArrayDataset {self.url}{what} samples={len(self)} [{shapes}]>"


def open_arrays(
    source: Any,
    *,
    window: Mapping[str, int],
    inputs: Sequence[str],
    targets: Sequence[str] = (),
    static: Sequence[str] = (),
    sample_dim: str = "time",
    stride: Mapping[str, int] | None = None,
    input_steps: int = 1,
    lead: int = 0,
    stack: bool = False,
    splits: Mapping[str, Any] | None = None,
    normalize: str | Mapping[str, Any] | None = None,
    normalize_per: Sequence[str] = (),
    statistics_path: str | os.PathLike | None = None,
    nan: str = "raise",
    fill_value: float = 0.0,
    dims: Mapping[str, Sequence[str]] | None = None,
    storage_options: dict | None = None,
) -> ArrayDataset:
    """Train on arrays where they are: samples are windows over named dimensions.

    Parameters
    ----------
    source
        An ``xarray.Dataset``; the path or URL of a Zarr store (``s3://...`` with
        ``storage_options``), opened read-only and read in place; or a dict of numpy or dask
        arrays, with their dimension names in ``dims``.
    window
        The window's size along each window dimension, e.g. ``{"lat": 64, "lon": 64}``.
        Dimensions of a variable that are neither the sample dimension nor in ``window``
        (a ``level``) are taken whole.
    inputs, targets, static
        Variables: inputs (``input_steps`` steps ending at the sample's time), targets
        (at the sample's time plus ``lead``), and static fields without the sample dimension
        (a land mask), cut to the same window and given to every sample as inputs.
    sample_dim
        The dimension samples are taken along.
    stride
        Steps between windows along each window dimension (default: the window's size, no
        overlap; smaller overlaps).
    input_steps, lead
        Input steps per sample, and how many steps after the last of them the targets lie
        (``lead=1``: forecast the next step).
    stack
        Stack the inputs and static fields into one array ``x`` and the targets into ``y``
        (channels first: each variable's steps and other dimensions flattened into
        channels); otherwise one array per variable (a target that is also an input is
        named ``{name}_target``), read as dict batches (``as_dict=True``).
    splits
        Named ranges of the sample dimension's coordinate, e.g. ``{"train": slice(None,
        "2017-12-31"), "val": ("2018-01-01", "2019-12-31")}`` (inclusive, as
        ``xarray.Dataset.sel``): a split holds the samples whose every step, inputs and
        targets, lies in its range.
    normalize
        The name of the split whose steps give each variable's mean and standard
        deviation (``"train"``), computed once with Dask on the client's cluster; or the
        statistics themselves, ``{variable: (mean, std)}``. Every input, target and static
        field is then read as ``(value - mean) / std`` in float32. None: as stored.
    normalize_per
        Dimensions along which the statistics are kept apart (``("level",)``: one mean
        and std per level); every other dimension is reduced.
    statistics_path
        A JSON file for the computed statistics: read back when it holds those of the same
        source, split, variables and ``normalize_per`` (a file for other data is an
        error, never replaced), else computed and written there.
    nan, fill_value
        A NaN in a sample read: ``"raise"`` (a :class:`DatasetError` naming the variable,
        step and window) or ``"fill"`` (replaced by ``fill_value``, after normalization:
        0 is then the mean). :meth:`ArrayDataset.count_nan` counts them beforehand.
    dims
        For a dict of arrays: each array's dimension names.
    storage_options
        Passed to fsspec for a store's URL.

    Raises
    ------
    DatasetError
        A window larger than its dimension, a missing variable or dimension, a coordinate
        that is not monotonic, a split that selects no sample: each named.
    """
    opened = open_source(source, dims=dims, storage_options=storage_options)
    data = opened.data
    stride = dict(window if stride is None else stride)
    for name in (*inputs, *targets, *static):
        if name not in data.data_vars:
            raise DatasetError(f"no variable {name!r} in {opened.label}; variables: "
                               f"{sorted(map(str, data.data_vars))}")
    if not inputs:
        raise DatasetError("inputs names no variable: a sample needs at least one input")
    for dim in (sample_dim, *window):
        if dim not in data.dims:
            raise DatasetError(f"no dimension {dim!r} in {opened.label}; dimensions: "
                               f"{sorted(map(str, data.dims))}")
    unknown = sorted(set(stride) - set(window))
    if unknown:
        raise DatasetError(f"stride names dimension(s) {unknown} that window does not")
    check_coordinates(data, opened.label, sample_dim, list(window))
    geometry = Geometry.of(sample_dim, data.sizes[sample_dim], window, stride,
                           {d: data.sizes[d] for d in window}, input_steps, lead)
    if len(geometry) == 0:
        raise DatasetError(f"no window fits: {opened.label} gives no sample")
    if nan not in ("raise", "fill"):
        raise DatasetError(f"nan must be 'raise' or 'fill', got {nan!r}")
    parts = parts_of(data, opened.label, geometry, inputs, targets, static)
    ranges = split_ranges(data, opened.label, geometry, splits or {})
    variables = sorted({p.variable for p in parts})
    stats = statistics_of(data, opened, geometry, variables, ranges, normalize,
                          tuple(normalize_per), statistics_path, storage_options)
    if stats is not None:
        parts = [normalized(p, data[p.variable].dims, geometry, stats[p.variable],
                             normalize_per) for p in parts]
    token = tokenize(opened.token, geometry, parts, nan, fill_value,
                     None if stats is None else {n: (m.tolist(), s.tolist())
                                                 for n, (m, s) in stats.items()})
    arrays = window_arrays(data[variables], token, geometry, parts, stack,
                           {"nan": nan, "fill": float(fill_value)})
    attrs = {
        "num_samples": len(geometry),
        "chunk_rows": block_steps(data, inputs[0], sample_dim, geometry, arrays) *
        geometry.per_step,
        "arrays": {n: {"role": role, "dtype": a.dtype.str, "shape": list(a.shape)}
                   for n, (a, role) in arrays.items()},
        "splits": ranges,
        "in_place": {"sample_dim": sample_dim, "window": dict(window), "stride": stride,
                     "input_steps": input_steps, "lead": lead},
    }
    return ArrayDataset(opened, {n: a for n, (a, _) in arrays.items()}, attrs)
