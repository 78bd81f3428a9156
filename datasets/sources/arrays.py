"""``.npy`` and ``.npz`` sources, read through memory maps chunk by chunk, never whole."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import zipfile
from pathlib import Path
from typing import Any, BinaryIO

import dask.array as da
import numpy as np
from dask.base import tokenize

from dasktrain.datasets.errors import SourceError
from dasktrain.datasets.sources.base import (
    ArraySpec,
    BlockReader,
    SourceOptions,
    check_numeric,
    register_suffix,
    stored_dtype,
)
from dasktrain.datasets.sources.named import resolve_choices

__all__ = ["NumpySource"]

_FEATURE_KEYS = ("x", "X", "features", "data", "inputs")
_TARGET_KEYS = ("y", "Y", "target", "targets", "labels", "label")


@dataclasses.dataclass(frozen=True, slots=True)
class _MappedArray:
    """A picklable handle on an array stored raw in a file at ``offset``.

    Only the path travels to Dask workers; each ``__getitem__`` maps the file and copies out
    the rows asked for, so no worker ever holds more than one chunk.
    """

    path: str
    offset: int
    dtype: np.dtype
    shape: tuple[int, ...]
    fortran_order: bool
    identity: str
    """Token of the file version the bytes come from (for an inflated ``.npz`` member: the
    archive's, and the member's name), taken once on the client when the file is opened."""

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def mapped(self) -> np.memmap:
        """The whole array, mapped read-only (nothing is read until indexed)."""
        return np.memmap(
            self.path, dtype=self.dtype, mode="r", offset=self.offset, shape=self.shape,
            order="F" if self.fortran_order else "C",
        )

    def __getitem__(self, key: Any) -> np.ndarray:
        return np.array(self.mapped()[key])


@dataclasses.dataclass(frozen=True, slots=True)
class _MappedRows:
    """Rows of every mapped array of a source, cast to their stored dtypes."""

    arrays: dict[str, tuple[_MappedArray, np.dtype]]

    def __call__(self, start: int, stop: int) -> dict[str, np.ndarray]:
        # Rows already of the stored dtype stay views of the mapping, not copies: the task
        # reading them writes them within the same call (the mapping lives as long as they do).
        return {name: np.asarray(m.mapped()[start:stop]).astype(dtype, copy=False)
                for name, (m, dtype) in self.arrays.items()}


def _read_header(fh: Any) -> tuple[tuple[int, ...], bool, np.dtype]:
    version = np.lib.format.read_magic(fh)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(fh)
    return np.lib.format.read_array_header_2_0(fh)


def _file_version(path: Path, fh: BinaryIO) -> tuple[str, int, int, int]:
    """Which file, and which version of it: resolved path, size, mtime (ns) and inode.

    Stat of the open handle, so the version is that of the bytes being read even if the
    path is swapped meanwhile. A file rewritten in place keeps its path, often its size and
    inode; its mtime moves.
    """
    st = os.fstat(fh.fileno())
    return str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino


def _map_npy(path: Path) -> _MappedArray:
    try:
        with path.open("rb") as fh:
            identity = tokenize(_file_version(path, fh))
            shape, fortran, dtype = _read_header(fh)
            offset = fh.tell()
    except ValueError as exc:
        raise SourceError(f"{path} is not a valid .npy file: {exc}") from exc
    return _MappedArray(str(path), offset, dtype, tuple(shape), fortran, identity)


def _map_npz_member(path: Path, member: str, scratch: Path) -> _MappedArray:
    """Map one member of an ``.npz``; a compressed member is first inflated into ``scratch``.

    Either way the identity is the archive's version and the member's name: the scratch
    file's name is the member's, the same for every archive that holds one so named.
    """
    with path.open("rb") as raw_archive, zipfile.ZipFile(raw_archive) as archive:
        identity = tokenize(_file_version(path, raw_archive), member)
        info = archive.getinfo(member)
        with archive.open(info) as fh:
            shape, fortran, dtype = _read_header(fh)
            header_len = fh.tell()
            if info.compress_type == zipfile.ZIP_STORED:
                # Stored members lie raw in the archive: map them in place.
                with path.open("rb") as raw:
                    raw.seek(info.header_offset)
                    local = raw.read(30)
                    name_len = int.from_bytes(local[26:28], "little")
                    extra_len = int.from_bytes(local[28:30], "little")
                offset = info.header_offset + 30 + name_len + extra_len + header_len
                return _MappedArray(str(path), offset, dtype, tuple(shape), fortran, identity)
            scratch.mkdir(parents=True, exist_ok=True)
            target = scratch / f"{member.replace('/', '_')}.raw"
            with target.open("wb") as out:
                while block := fh.read(16 * 2**20):
                    out.write(block)
    return _MappedArray(str(target), 0, dtype, tuple(shape), fortran, identity)


def _pick(keys: list[str], wanted: str | None, defaults: tuple[str, ...], what: str,
          path: Path) -> str | None:
    if wanted is not None:
        if wanted not in keys:
            raise SourceError(f"{path} has no array {wanted!r} for the {what}; arrays: {keys}")
        return wanted
    return next((k for k in defaults if k in keys), None)


def _named_members(path: Path, options: SourceOptions
                   ) -> tuple[dict[str, tuple[str, _MappedArray]], dict[str, Any]]:
    """The members of an ``.npz`` that ``options.arrays`` choose, under their names and
    roles (see :mod:`dasktrain.datasets.sources.named`)."""
    if path.suffix.lower() != ".npz":
        raise SourceError(f"{path}: arrays= chooses members of an .npz (or column groups of "
                          "a table); an .npy holds one array")
    try:
        with zipfile.ZipFile(path) as archive:
            keys = [n.removesuffix(".npy") for n in archive.namelist()]
    except zipfile.BadZipFile as exc:
        raise SourceError(f"{path} is not a valid .npz archive: {exc}") from exc
    if options.features or options.target is not None:
        raise SourceError("give either arrays= (--array) or features=/target= "
                          "(--features/--target), not both")
    choices = resolve_choices(options.arrays or [], keys, where=str(path), what="member",
                              one_each=True)
    scratch = Path(options.scratch_dir or tempfile.mkdtemp(prefix="dasktrain-npz-"))
    mapped = {c.name: (c.role, _map_npz_member(path, f"{c.sources[0]}.npy", scratch))
              for c in choices}
    return mapped, {"arrays": {c.name: {"from": c.sources[0], "role": c.role}
                               for c in choices}}


class NumpySource:
    """Features (and optionally targets) from ``.npy`` files or one ``.npz`` archive.

    * ``.npy``: the file holds the features; ``target=`` names a second ``.npy`` of targets.
    * ``.npz``: ``features=[name]`` and ``target=name`` pick arrays; by default ``x``/``X``
      and ``y``/``Y`` (and a few common spellings) are used. ``arrays=`` writes several
      members under names and roles of their own instead.
    """

    known_finite = False

    def __init__(self, source: str, options: SourceOptions):
        path = Path(source)
        self.labels: dict[str, list[str]] = {}
        mapped: dict[str, tuple[str, _MappedArray]] = {}
        if path.is_dir():
            raise SourceError(f"{path}: give a .npy or .npz file, not a directory")
        if options.arrays is not None:
            mapped, provenance = _named_members(path, options)
        elif path.suffix.lower() == ".npz":
            try:
                with zipfile.ZipFile(path) as archive:
                    keys = [n.removesuffix(".npy") for n in archive.namelist()]
            except zipfile.BadZipFile as exc:
                raise SourceError(f"{path} is not a valid .npz archive: {exc}") from exc
            if not keys:
                raise SourceError(f"{path} is empty: it holds no arrays")
            if options.features and len(options.features) != 1:
                raise SourceError("an .npz source takes one features array name")
            fname = _pick(keys, options.features[0] if options.features else None,
                          _FEATURE_KEYS, "features", path)
            if fname is None:
                raise SourceError(
                    f"{path}: cannot tell which array holds the features among {keys}; "
                    "name it with --features"
                )
            tname = _pick(keys, options.target, _TARGET_KEYS, "target", path)
            scratch = Path(options.scratch_dir or tempfile.mkdtemp(prefix="dasktrain-npz-"))
            mapped["x"] = ("features", _map_npz_member(path, f"{fname}.npy", scratch))
            if tname is not None:
                mapped["y"] = ("targets", _map_npz_member(path, f"{tname}.npy", scratch))
            provenance = {"features": fname, "target": tname}
        else:
            mapped["x"] = ("features", _map_npy(path))
            if options.target is not None:
                target = Path(options.target)
                if not target.is_file():
                    raise SourceError(f"target file {options.target!r} does not exist")
                mapped["y"] = ("targets", _map_npy(target))
            provenance = {"target": options.target}
        self._mapped = {name: m for name, (_, m) in mapped.items()}
        lengths = {name: m.shape[0] if m.shape else None for name, m in self._mapped.items()}
        for name, (role, m) in mapped.items():
            check_numeric(name, m.dtype)
            if not m.shape:
                raise SourceError(f"{path}: the {role} array {name!r} is a scalar, not "
                                  "samples")
        if len(set(lengths.values())) > 1:
            raise SourceError(f"{path}: arrays have mismatched lengths along axis 0: {lengths}")
        self.num_samples = next(iter(lengths.values()))
        if self.num_samples == 0:
            raise SourceError(f"{path} is empty: 0 samples")
        self.specs = {
            name: ArraySpec(role, stored_dtype(role, m.dtype), m.shape[1:])
            for name, (role, m) in mapped.items()
        }
        self.provenance = {"kind": "numpy", "path": str(path.resolve()), **provenance}

    def to_dask(self, chunk_rows: int) -> dict[str, da.Array]:
        # Keys name exactly what a task reads (file version, place, layout, rows), never only
        # the file's name: a client holding results under an equal key hands them over as
        # ours, silently. The path read is in too, so a key never outlives its scratch file.
        return {
            name: da.from_array(
                m, chunks=(chunk_rows, *m.shape[1:]), asarray=False, fancy=False,
                name=f"read-{Path(m.path).name}-" + tokenize(
                    m.identity, m.path, m.offset, m.dtype, m.shape, m.fortran_order,
                    chunk_rows),
            ).astype(self.specs[name].dtype)
            for name, m in self._mapped.items()
        }

    def block_reader(self) -> BlockReader:
        return _MappedRows({name: (m, self.specs[name].dtype) for name, m in self._mapped.items()})


@register_suffix(".npy", ".npz")
def _numpy_source(source: str, options: SourceOptions) -> NumpySource:
    return NumpySource(source, options)
