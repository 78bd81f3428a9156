"""What a preparation source provides, and the registry that finds one by name or path."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import dask.array as da
import numpy as np

from dasktrain.datasets.errors import SourceError
from dasktrain.datasets.image_codec import IMAGE_SUFFIXES

__all__ = [
    "ArraySpec",
    "BlockReader",
    "Source",
    "SourceOptions",
    "SourceSettings",
    "get_source",
    "register_builtin",
    "register_layout",
    "register_options",
    "register_suffix",
    "source_settings",
]


@dataclasses.dataclass(frozen=True, slots=True)
class ArraySpec:
    """One array a source yields: its role, stored dtype and per-sample shape."""

    role: str
    dtype: np.dtype
    sample_shape: tuple[int, ...]
    item_bytes: int | None = None
    """Bytes one sample takes where its dtype cannot say: an estimate for variable-length
    bytes (dtype ``object``, e.g. encoded images), which chunk sizes are planned with."""
    pooled: bool = False
    """Statistics of all its values as one feature, not per position (token ids)."""

    @property
    def sample_bytes(self) -> int:
        """Bytes one sample of this array takes (estimated for variable-length bytes)."""
        if self.item_bytes is not None:
            return self.item_bytes
        return self.dtype.itemsize * math.prod(self.sample_shape)


@dataclasses.dataclass(kw_only=True, slots=True)
class SourceSettings:
    """What a person chooses about a source; each source reads the ones that apply to it.

    Declared once, here: :class:`~dasktrain.datasets.PrepareConfig` (the Python API, the
    CLI and config files) and :class:`SourceOptions` (what a source is given) both derive
    from it, and :func:`source_settings` copies them from one to the other.
    """

    features: list[str] | None = None
    """Feature columns (tabular) or array name (npz); default: every column but the
    target / autodetect."""
    target: str | None = None
    """Target column (tabular), array name (npz) or path of a ``.npy`` file of targets."""
    arrays: list[str] | None = None
    """Several named arrays, each ``NAME[=FROM][:ROLE]``: members of an ``.npz`` (``all``
    for every member) or column groups of a table (``image=a,b,c``); see
    :mod:`dasktrain.datasets.sources.named`. Replaces ``features`` and ``target``."""
    encode_categorical: bool = False
    """Encode non-numeric columns as integer category codes instead of refusing them."""
    samples: int | None = None
    """Number of samples a synthetic generator makes."""
    width: int | None = None
    """Number of features a synthetic generator makes."""
    classes: int | None = None
    """Number of classes of ``classification``."""
    noise: float | None = None
    """Standard deviation of the noise a synthetic generator adds."""
    seed: int = 0
    """Seed of synthetic generators (and, when preparing, of the split assignment)."""
    text_column: str | None = None
    """Column of a CSV/Parquet source whose cells are documents: prepares a token dataset."""
    text_glob: str | None = None
    """Which files of a directory are documents of a text corpus: comma-separated patterns
    matched against paths below it (``*`` crosses ``/``), ``!`` to leave some out, e.g.
    ``"*.py,!site-packages/*"``; default ``*.txt``."""
    tokenizer: str | None = None
    """Tokenizer of a text source: ``bytes`` (default; bytes 0-255 + end-of-text 256) or
    the path of a Hugging Face ``tokenizer.json``."""
    seq_len: int | None = None
    """Tokens per packed sequence of a text source (default 1024)."""
    eot_token: str | None = None
    """End-of-text token of a ``tokenizer.json`` (default: the first of
    ``<|endoftext|>``, ``</s>``, ... it knows)."""
    image_storage: str | None = None
    """How an image source stores its images: ``decoded`` (default; uint8 pixels of a fixed
    size, NCHW) or ``encoded`` (the files' bytes, decoded by the pipeline's transform)."""
    image_size: str | int | None = None
    """Size of decoded images, ``N`` or ``HxW``; default: the median size of 64 files spread
    over the source (read from their headers), refused where it would make a dataset of
    more than 16 GiB."""
    image_fit: str = "center-crop"
    """How an image of another size is brought to ``image_size``: ``center-crop`` (scale to
    cover it, keep the middle) or ``stretch``."""
    image_column: str | None = None
    """Column of a CSV/Parquet manifest naming image files (paths or URLs; relative ones
    from the manifest's folder): prepares an image dataset; labels from ``target``."""
    skip_bad: bool = False
    """Leave out files of an image source that are not readable images (counted, named in
    the attributes) instead of refusing the source."""


@dataclasses.dataclass(kw_only=True, slots=True)
class SourceOptions(SourceSettings):
    """Options a source may use: the person's :class:`SourceSettings`, and where it may
    stage data."""

    scratch_dir: str | None = None
    """A directory, visible to every worker, where a source may stage data it cannot map in
    place (compressed ``.npz`` members); the caller removes it afterwards."""


def source_settings(settings: SourceSettings) -> dict[str, Any]:
    """The :class:`SourceSettings` fields of ``settings`` (of any class derived from it), as
    keyword arguments."""
    return {f.name: getattr(settings, f.name) for f in dataclasses.fields(SourceSettings)}


#: Reads rows ``[start, stop)`` of every array of a source: ``{name: rows}``, dtypes as in
#: the source's ``specs``. Picklable: it travels to the workers inside tasks.
BlockReader = Callable[[int, int], dict[str, np.ndarray]]


class Source(Protocol):
    """A source of samples: a schema known up front, then dask arrays chunked as asked."""

    #: ``{name: ArraySpec}`` in output order; all arrays share axis 0.
    specs: dict[str, ArraySpec]
    #: Number of samples before cleaning (for sources that must count, known after to_dask).
    num_samples: int
    #: True when the source cannot hold NaN or infinities (cleaning pass skipped).
    known_finite: bool
    #: JSON-able description recorded as provenance.
    provenance: dict[str, Any]
    #: Category labels of encoded columns: ``{array name: [label, ...]}``.
    labels: dict[str, list[str]]

    def to_dask(self, chunk_rows: int) -> dict[str, da.Array]:
        """Dask arrays chunked by ``chunk_rows`` along axis 0 (only), dtypes as in ``specs``."""
        ...

    def block_reader(self) -> BlockReader | None:
        """A reader of any row range that needs no Dask graph, or None.

        Preparation calls it inside the task that writes a chunk, so rows are read where
        they are written: no task per source block and no transfer between workers. A
        source whose chunks depend on one another (a table rechunked across partitions)
        returns None and is read through :meth:`to_dask`.
        """
        ...


SourceFactory = Callable[[str, SourceOptions], Source]
_BUILTINS: dict[str, SourceFactory] = {}
_SUFFIXES: dict[str, SourceFactory] = {}


def register_builtin(name: str) -> Callable[[SourceFactory], SourceFactory]:
    """Register a named source (a bundled dataset or a generator)."""

    def deco(factory: SourceFactory) -> SourceFactory:
        _BUILTINS[name] = factory
        return factory

    return deco


def register_suffix(*suffixes: str) -> Callable[[SourceFactory], SourceFactory]:
    """Register a source for files (or directories of files) with these suffixes."""

    def deco(factory: SourceFactory) -> SourceFactory:
        for suffix in suffixes:
            _SUFFIXES[suffix] = factory
        return factory

    return deco


_BY_OPTIONS: list[tuple[tuple[str, ...], SourceFactory]] = []


def register_options(*names: str) -> Callable[[SourceFactory], SourceFactory]:
    """Register a source chosen by settings rather than by name or suffix: when any of the
    :class:`SourceSettings` fields ``names`` is set, it reads the source, whatever it is
    (a CSV's text column makes a text corpus of a table)."""

    def deco(factory: SourceFactory) -> SourceFactory:
        _BY_OPTIONS.append((names, factory))
        return factory

    return deco


Recognise = Callable[[str, SourceOptions], bool]
_BY_LAYOUT: list[tuple[Recognise, SourceFactory]] = []


def register_layout(recognise: Recognise) -> Callable[[SourceFactory], SourceFactory]:
    """Register a source for paths or URLs told by their layout, not a suffix (a folder of
    class sub-folders of images): ``recognise(path_or_url, options)`` says whether it reads
    it, and must be cheap (a listing of a folder or two)."""

    def deco(factory: SourceFactory) -> SourceFactory:
        _BY_LAYOUT.append((recognise, factory))
        return factory

    return deco


def builtin_names() -> list[str]:
    return sorted(_BUILTINS)


def suffix_of(path: Path) -> str:
    if path.is_dir():
        suffixes = {p.suffix.lower() for p in path.iterdir() if p.is_file() and p.suffix}
        known = suffixes & set(_SUFFIXES)
        if not known:
            # An image folder is told by its layout (sources registered by layout); it was
            # not one: say what it would hold too.
            raise SourceError(
                f"source directory {path} holds no files of a known kind "
                f"({', '.join(sorted(_SUFFIXES))}), nor class sub-folders of images "
                f"({', '.join(IMAGE_SUFFIXES)}: {path}/<class>/<image>)"
            )
        if len(known) > 1:
            raise SourceError(
                f"source directory {path} mixes file kinds {sorted(known)}; keep one kind"
            )
        return known.pop()
    return path.suffix.lower()


def get_source(source: str | os.PathLike, options: SourceOptions | None = None) -> Source:
    """Find the source for a built-in name (``digits``, ``parabola``...) or a path.

    Raises
    ------
    SourceError
        When the name is unknown, the path is missing or of an unknown kind, or the data is
        unusable (empty, not numeric, mismatched lengths).
    """
    options = options or SourceOptions()
    text = os.fspath(source)
    for names, factory in _BY_OPTIONS:
        if any(getattr(options, name) is not None for name in names):
            return factory(text, options)
    if text in _BUILTINS:
        return _BUILTINS[text](text, options)
    for recognise, factory in _BY_LAYOUT:
        if recognise(text, options):
            return factory(text, options)
    path = Path(text)
    if not path.exists():
        raise SourceError(
            f"source {text!r} is neither a file or directory that exists nor a built-in source "
            f"({', '.join(builtin_names())})"
        )
    suffix = suffix_of(path)
    if suffix not in _SUFFIXES:
        raise SourceError(
            f"source {text!r}: files ending in {suffix or '(no suffix)'!r} are not supported; "
            f"use one of {', '.join(sorted(_SUFFIXES))}"
        )
    return _SUFFIXES[suffix](text, options)


def check_numeric(name: str, dtype: np.dtype, what: str = "array") -> None:
    """Refuse data that is not numbers, naming it."""
    if dtype.kind not in "biuf":
        raise SourceError(
            f"{what} {name!r} has non-numeric dtype {dtype}; dasktrain stores numbers only"
        )


def stored_dtype(role: str, dtype: np.dtype) -> np.dtype:
    """Features become float32; integer targets (class labels) and integer arrays of role
    ``other`` int64; all else float32."""
    if role in ("targets", "other") and dtype.kind in "biu":
        return np.dtype("int64")
    return np.dtype("float32")
