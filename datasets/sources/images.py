"""Image sources: a folder of class sub-folders of JPEG/PNG files, or a CSV/Parquet manifest
of (path, label) rows; local paths or fsspec URLs.

Two arrays: ``image`` (features) and, where there are labels, ``label`` (targets: class
indices, whose names the dataset's ``labels`` attribute keeps). Images are stored one of
two ways (``image_storage``):

* ``decoded``: RGB ``uint8`` pixels of one size (``image_size``, brought there by
  ``image_fit``), laid out NCHW, the layout torch models take: a batch read straight from
  storage (a pipeline without a transform, ``Trainer.evaluate``) goes into a convolution
  as it is. Fastest to read; largest on disk.
* ``encoded``: the files' own bytes (variable length), decoded on the workers by the
  pipeline's :class:`~dasktrain.pipeline.images.ImageTransform`. Smallest on disk; the
  decoding is paid every epoch.

Files are stored in a random order fixed by ``seed``: a folder lists its classes one after
the other, and the pipeline shuffles rows within a few chunks, not across the dataset, so
a stored order by class would give batches of one class.

The rows are read where they are written (:meth:`ImageSource.block_reader`): each write
task reads and decodes its own files. A file that is not a readable image stops the
preparation with an error naming it, or, with ``skip_bad``, is left out: a first pass of
Dask tasks checks every file (a JPEG is decoded at 1/8 scale, about half a full decode),
and the files left out are counted in a warning and named in the attributes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from typing import Any

import dask.array as da
import fsspec
import numpy as np
from distributed import Client

from dasktrain._progress import gather_with_progress
from dasktrain.datasets.cleaning import CleaningWarning
from dasktrain.datasets.errors import SourceError
from dasktrain.datasets.format import chunk_lengths
from dasktrain.datasets.image_codec import (
    FITS,
    ImageError,
    check_image,
    decode_image,
    fit_image,
    parse_image_size,
)
from dasktrain.datasets.sizes import human_bytes
from dasktrain.datasets.sources.base import (
    ArraySpec,
    SourceOptions,
    register_layout,
    register_options,
)
from dasktrain.datasets.sources.image_files import (
    FileList,
    is_image_folder,
    list_folder,
    list_manifest,
    manifest_image_column,
    read_files,
)
from dasktrain.datasets.sources.image_sizes import check_estimate, median_size

__all__ = ["STORAGES", "ImageSource"]

logger = logging.getLogger(__name__)

#: How images are stored: see the module docstring.
STORAGES = ("decoded", "encoded")
#: Files named in the attributes when some are skipped (the count is always there).
_NAMED = 20
#: Files read to estimate the size of an encoded image (chunks are planned with it).
_SIZE_SAMPLE = 1000
#: Files one checking task reads (``skip_bad``), and how many of them it holds at once.
_CHECK_FILES = 2048
_READ_TOGETHER = 64
#: Rows of an image chunk are a multiple of this (see ImageSource.chunk_rows_for)...
_CHUNK_MULTIPLE = 512
#: ... unless that many rows would pass this: a task holds its chunk whole.
_LARGEST_CHUNK = 256 * 2**20
_SKIP_HINT = "remove it, or prepare with --skip-bad (skip_bad=True) to leave such files out"


def _file_size(file: str) -> int:
    if "://" in file and not file.startswith("file://"):
        filesystem, path = fsspec.core.url_to_fs(file)
        return int(filesystem.size(path))
    return os.path.getsize(file.removeprefix("file://"))


@dataclasses.dataclass(frozen=True, slots=True)
class _ImageRows:
    """Rows of an image source, read and (decoded storage) decoded in the task that writes
    them.

    The client's reader (:meth:`ImageSource.block_reader`) holds the whole list; each task
    carries :meth:`for_rows`'s, which holds its own files' names only: a million names
    unpacked take ~125 MiB, which every worker would otherwise hold, and every task's
    arguments would carry the whole list compressed (~3 MB).
    """

    storage: str
    size: tuple[int, int] | None
    fit: str
    label_dtype: np.dtype | None
    checked: bool
    """Every file was checked already (``skip_bad``): an encoded row is stored as read."""
    files: FileList | None = None
    """The files from row ``first`` on, as they travel; None in the client's reader."""
    first: int = 0
    source: tuple[list[str], np.ndarray | None] | None = None
    """The whole list (files, labels), in the client's reader; never pickled."""

    def __getstate__(self) -> tuple:
        return tuple(getattr(self, f.name) if f.name != "source" else None
                     for f in dataclasses.fields(self))

    def __setstate__(self, state: tuple) -> None:
        for f, value in zip(dataclasses.fields(self), state, strict=True):
            object.__setattr__(self, f.name, value)

    def for_rows(self, start: int, stop: int) -> _ImageRows:
        """The reader of rows ``[start, stop)``, holding those rows' files only."""
        files, labels = self._rows_held()
        start, stop = self._local(start, stop, len(files))
        part = FileList.pack(files[start:stop], None if labels is None else labels[start:stop])
        return dataclasses.replace(self, files=part, first=self.first + start, source=None)

    def _rows_held(self) -> tuple[list[str], np.ndarray | None]:
        if self.source is not None:
            return self.source
        if self.files is None:
            raise RuntimeError("an image reader travelled without its files: give a task "
                               "for_rows()'s reader")
        return self.files.unpack()

    def _local(self, start: int, stop: int, held: int) -> tuple[int, int]:
        if not self.first <= start <= stop <= self.first + held:
            raise ValueError(f"rows {start}..{stop} are outside this reader's "
                             f"{self.first}..{self.first + held}")
        return start - self.first, stop - self.first

    def __call__(self, start: int, stop: int) -> dict[str, np.ndarray]:
        files, labels = self._rows_held()
        rows = self._local(start, stop, len(files))
        chunk = files[rows[0]:rows[1]]
        if self.storage == "decoded":
            assert self.size is not None, "decoded storage has a size"
            images: np.ndarray = np.empty((len(chunk), 3, *self.size), np.uint8)
        else:
            images = np.empty(len(chunk), dtype=object)
        for i, (file, data) in enumerate(zip(chunk, read_files(chunk), strict=True)):
            if isinstance(data, BaseException):
                raise SourceError(f"cannot read image file {file}: {data}")
            try:
                if self.storage == "decoded":
                    # (H, W, 3) as decoded, stored (3, H, W)
                    images[i] = fit_image(decode_image(data, file), self.size,
                                          self.fit).transpose(2, 0, 1)
                else:
                    if not self.checked:
                        check_image(data, file)
                    images[i] = data
            except ImageError as exc:
                raise ImageError(f"{exc}; {_SKIP_HINT}") from None
        out = {"image": images}
        if labels is not None and self.label_dtype is not None:
            out["label"] = labels[rows[0]:rows[1]].astype(self.label_dtype)
        return out


def _check_files(files: list[str], first: int) -> list[tuple[int, str]]:
    """Runs in a Dask task: the files among ``files`` (numbered from ``first``) that are
    not readable images, and why."""
    bad = []
    for a in range(0, len(files), _READ_TOGETHER):  # a few files' bytes in memory at once
        batch = files[a:a + _READ_TOGETHER]
        for k, (file, data) in enumerate(zip(batch, read_files(batch), strict=True)):
            try:
                if isinstance(data, BaseException):
                    raise ImageError(f"cannot read it: {data}")
                check_image(data, file)
            except ImageError as exc:
                bad.append((first + a + k, str(exc).removeprefix(f"{file} ")))
    return bad


def _block(reader: _ImageRows, name: str, block_info: dict | None = None) -> np.ndarray:
    (start, stop) = block_info[None]["array-location"][0]
    return reader(start, stop)[name]


class ImageSource:
    """Images of a folder of class sub-folders or of a manifest; see the module docstring."""

    known_finite = True

    def __init__(self, source: str, options: SourceOptions) -> None:
        storage = options.image_storage or "decoded"
        if storage not in STORAGES:
            raise SourceError(f"image_storage must be one of {STORAGES}, got {storage!r}")
        if options.image_fit not in FITS:
            raise SourceError(f"image_fit must be one of {FITS}, got {options.image_fit!r}")
        try:
            size = parse_image_size(options.image_size)
        except ValueError as exc:
            raise SourceError(str(exc)) from None
        if size is not None and storage == "encoded":
            raise SourceError("image_size applies to decoded storage; encoded images keep "
                              "their own size (give the size to the pipeline's transform: "
                              "RandomResizedCrop or Resize)")
        folder = is_image_folder(source)
        if folder:
            if options.target is not None:
                raise SourceError(f"image folder {source}: its labels are its class "
                                  "sub-folders; drop --target (target=)")
            listing = list_folder(source)
        else:
            listing = list_manifest(source, options.image_column, options.target)
        self._source, self._skip_bad = source, options.skip_bad
        self._bad = list(listing.bad)
        if self._bad and not options.skip_bad:
            file, why = self._bad[0]
            more = f" (and {len(self._bad) - 1:,} more)" if len(self._bad) > 1 else ""
            raise SourceError(f"image source {source}: {file}: {why}{more}; {_SKIP_HINT}")
        bad_files = {f for f, _ in self._bad}
        keep = [i for i, f in enumerate(listing.files) if f not in bad_files]
        if not keep:
            raise SourceError(f"image source {source} holds no image files")
        chosen = None
        if storage == "decoded" and size is None:
            chosen = median_size([listing.files[i] for i in keep], options.skip_bad,
                                 _SKIP_HINT)
            size = chosen.size
            logger.info("images of %s: decoded at %dx%d, %s (--image-size sets it)", source,
                        *size, chosen.how)
        self._size_from = chosen.how if chosen is not None else "--image-size"
        # Stored in a random order (see the module docstring): a stream of its own, apart
        # from the split assignment's.
        order = np.random.default_rng([options.seed, 7]).permutation(keep)
        self._files = [listing.files[i] for i in order]
        self._labels = None if listing.labels is None else listing.labels[order]
        self._storage, self._size, self._fit = storage, size, options.image_fit
        self._checked = False
        self._reader: _ImageRows | None = None
        self.num_samples = len(self._files)
        self.labels: dict[str, list[str]] = (
            {"label": listing.classes} if listing.classes is not None else {})
        self.specs = {"image": self._image_spec()}
        if self._labels is not None:
            self.specs["label"] = ArraySpec("targets", self._labels.dtype, ())
        self.provenance: dict[str, Any] = {
            "kind": "images", "path": source, "layout": "folder" if folder else "manifest",
            "storage": storage, "files_listed": len(listing.files)}
        # What the preparation says before it writes; a default size too large is refused
        self.note = (check_estimate(self.num_samples, size, chosen) if size is not None
                     else "encoded: the files' own bytes")

    def _image_spec(self) -> ArraySpec:
        if self._storage == "decoded":
            assert self._size is not None, "decoded storage has a size"
            return ArraySpec("features", np.dtype(np.uint8), (3, *self._size))
        picks = np.random.default_rng(0).choice(
            len(self._files), min(_SIZE_SAMPLE, len(self._files)), replace=False)
        sizes = [_file_size(self._files[i]) for i in picks]
        return ArraySpec("features", np.dtype(object), (), item_bytes=max(1, int(np.mean(sizes))))

    @staticmethod
    def chunk_rows_for(row_bytes: int, chunk_bytes: int) -> int:
        """Rows of a chunk: about ``chunk_bytes``, in whole multiples of 512 rows; or, for
        images so large that 512 of them would pass 256 MiB (and ``chunk_bytes``), the
        largest power of two of them within that (at least one).

        The pipeline reads a block (a chunk by default) per task and cuts batches from it;
        a block of whole batches (512 rows are 2, 4, 8 or 16 batches of 256, 128, 64 or 32)
        goes to one task with no batch straddling two blocks. Chunks of 4 MiB of 96x96
        images would be 151 rows: most batches then need two tasks, and the pipeline
        spends about a third more CPU time per image than with 512 (benchmarks/images.py).
        A power of two still divides those batches or is divided by them. Without it, 512
        images of 1200x1200 made one chunk of 2.1 GiB, held whole by the task writing it.
        """
        row_bytes = max(row_bytes, 1)
        largest = max(chunk_bytes, _LARGEST_CHUNK)
        if _CHUNK_MULTIPLE * row_bytes <= largest:
            return max(1, round(chunk_bytes / row_bytes / _CHUNK_MULTIPLE)) * _CHUNK_MULTIPLE
        return 1 << max(0, (largest // row_bytes).bit_length() - 1)

    def memory_hint(self) -> str:
        """What a worker preparing these images holds, and what makes it less: said when
        workers die during the preparation."""
        if self._storage == "encoded":
            return "encoded images are held as the files' bytes: give a smaller --chunk-size"
        height, width = self._size
        return (f"each decoded image of {height}x{width} takes "
                f"{human_bytes(3 * height * width)} ({self._size_from}): give a smaller "
                "--image-size")

    # -- the pass before the build (skip_bad) ------------------------------------------------
    def scan(self, client: Client, progress: bool) -> None:
        """With ``skip_bad``, check every file in Dask tasks and leave out the bad ones."""
        if not self._skip_bad:
            return
        step = _CHECK_FILES
        futures = client.map(_check_files, [self._files[a:a + step]
                                            for a in range(0, len(self._files), step)],
                             range(0, len(self._files), step), pure=False)
        found = [b for part in gather_with_progress(client, futures, "checking images",
                                                    progress) for b in part]
        self._checked, self._reader = True, None
        if found:
            drop = {i for i, _ in found}
            self._bad += [(self._files[i], why) for i, why in found]
            keep = [i for i in range(len(self._files)) if i not in drop]
            if not keep:
                raise SourceError(f"image source {self._source}: none of its "
                                  f"{len(self._files):,} files is a readable image")
            self._files = [self._files[i] for i in keep]
            if self._labels is not None:
                self._labels = self._labels[keep]
            self.num_samples = len(self._files)
        if self._bad:
            shown = ", ".join(f for f, _ in self._bad[:3]) + (", ..." if len(self._bad) > 3
                                                              else "")
            warnings.warn(f"skipped {len(self._bad):,} of {len(self._bad) + self.num_samples:,}"
                          f" files that are not readable images: {shown} (named in the "
                          "dataset's attributes, images.skipped_files)", CleaningWarning,
                          stacklevel=2)

    # -- the build ---------------------------------------------------------------------------
    def to_dask(self, chunk_rows: int) -> dict[str, da.Array]:
        n = self.num_samples
        chunks = chunk_lengths(n, chunk_rows)
        # Every block's task reads from the whole list: packed once (a million names in
        # a second or two), unpacked once per worker process.
        reader = self.block_reader().for_rows(0, n)
        assert reader.files is not None
        return {
            name: da.map_blocks(
                _block, reader, name, dtype=spec.dtype,
                chunks=(chunks, *[(d,) for d in spec.sample_shape]),
                meta=np.empty((0, *spec.sample_shape), spec.dtype),
                # The list's digest names the files, in their order; the rest how they are
                # stored.
                name=f"images-{name}-{reader.files.digest}-{self._storage}-{self._size}-"
                     f"{self._fit}-{chunk_rows}".replace(" ", ""))
            for name, spec in self.specs.items()
        }

    def block_reader(self) -> _ImageRows:
        # Made once, after scan(); each task carries its own rows' part (for_rows).
        if self._reader is None:
            label = self.specs.get("label")
            self._reader = _ImageRows(self._storage, self._size, self._fit,
                                      None if label is None else label.dtype, self._checked,
                                      source=(self._files, self._labels))
        return self._reader

    @property
    def attributes(self) -> dict[str, Any]:
        """The ``"images"`` entry of the dataset's attributes: how its images are stored."""
        return {"images": {
            "storage": self._storage,
            "layout": "NCHW" if self._storage == "decoded" else "encoded bytes",
            "size": list(self._size) if self._size is not None else None,
            "size_from": self._size_from if self._size is not None else None,
            "fit": self._fit if self._storage == "decoded" else None,
            "channels": 3,
            "files": self.num_samples,
            "skipped": len(self._bad),
            "skipped_files": [[f, why] for f, why in self._bad[:_NAMED]],
        }}


def _is_folder(text: str, options: SourceOptions) -> bool:
    return is_image_folder(text)


def _is_manifest(text: str, options: SourceOptions) -> bool:
    """A table whose first row names an image file, unless columns are chosen for a table
    (``features``, ``arrays``): then it is read as the table it also is."""
    return (options.features is None and options.arrays is None
            and manifest_image_column(text) is not None)


@register_options("image_column")
@register_layout(_is_folder)
@register_layout(_is_manifest)
def _image_source(source: str, options: SourceOptions) -> ImageSource:
    return ImageSource(source, options)
