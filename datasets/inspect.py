"""Describing a dataset (``dasktrain info``) and checking it chunk by chunk (``verify``)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import dask
import numpy as np
import zarr
from distributed import Client

from dasktrain._cluster import cluster_client
from dasktrain._durable import StorageOptions, is_url, storage_errors, url_filesystem
from dasktrain._progress import gather_with_progress
from dasktrain.datasets.arrays.dataset import ArrayDataset
from dasktrain.datasets.arrays.missing import missing_chunks
from dasktrain.datasets.chunks import ChunkError
from dasktrain.datasets.cleaning import cleaning_summary, constant_summary
from dasktrain.datasets.dataset import Dataset, array_path, open_dataset
from dasktrain.datasets.errors import DatasetError
from dasktrain.datasets.sizes import human_bytes
from dasktrain.datasets.stats import merge_all, summary_of

__all__ = ["VerifyReport", "describe", "verify"]


def _stored_bytes(ds: Dataset, name: str, z: zarr.Array) -> int:
    """Bytes an array takes in its store. On object storage one listing of its prefix
    (zarr would ask for each chunk's size, one request per chunk)."""
    if not is_url(ds.url):
        return z.nbytes_stored()
    fs, root = url_filesystem(ds.url, ds.storage_options)
    with storage_errors(ds.url):
        return int(fs.du(f"{root}/{array_path(ds.attrs, name)}"))


def _raw_bytes(ds: Dataset, name: str, z: zarr.Array) -> int:
    """Bytes of an array's values. For variable-length bytes (encoded images) Zarr counts
    one pointer per item; their total is the recorded mean length times the count."""
    if z.dtype != object:
        return z.nbytes
    stat = ds.attrs["stats"].get(name) or {}
    return round(float(stat.get("mean", 0)) * int(stat.get("count", 0)))


#: What an encoded image is, on the images line and in its array's row.
_ENCODED = ("encoded JPEG/PNG/BMP/WebP (the files' bytes, each image its own size), decoded "
            "to H x W x 3 uint8 by the pipeline's ImageTransform")


def _dtype_of(z: zarr.Array) -> str:
    """The dtype column of an array's row: ``encoded`` for the variable-length bytes of
    encoded images (Zarr's ``object``), else the dtype."""
    return "encoded" if z.dtype == object else str(z.dtype)


def _images_line(images: dict[str, Any], classes: list[str] | None) -> str:
    """``images    decoded NCHW 3x32x32 (center-crop), 3 classes: cat, dog, eel``."""
    chosen = images.get("size_from")
    how = (f"decoded {images['layout']} {images['channels']}x"
           f"{'x'.join(map(str, images['size']))} ({images['fit']}"
           + (f"; {chosen}" if chosen and chosen != "--image-size" else "") + ")"
           if images.get("storage") == "decoded" else _ENCODED)
    if classes:
        shown = ", ".join(classes[:8]) + (", ..." if len(classes) > 8 else "")
        how += f", {len(classes):,} classes: {shown}"
    if images.get("skipped"):
        how += f"; {images['skipped']:,} unreadable files skipped"
    return f"images    {how}"


def _text_line(text: dict[str, Any]) -> str:
    """``text      byte tokenizer (257 ids), 31,513,843 tokens of 1,786 documents...``."""
    tokenizer = text["tokenizer"]
    kind = ("byte tokenizer" if tokenizer.get("kind") == "bytes" else
            f"tokenizer.json {tokenizer.get('path', '')}".rstrip())
    return (f"text      {kind} ({tokenizer['vocab_size']:,} ids), {text['tokens']:,} tokens "
            f"of {text['documents']:,} documents in rows of {text['seq_len']:,}: "
            f"{text['input']} inputs, {text['target']} next-token targets")


def _normalized(attrs: dict[str, Any], array: str, norm: dict[str, Any]) -> str:
    constant = constant_summary(attrs, array)
    return f"{array} (fitted on {norm['fitted_on']})" + (f"; {constant}" if constant else "")


def describe(path: str | Dataset, *, storage_options: StorageOptions | None = None) -> str:
    """A human-readable summary: schema, sizes, chunking, compression ratio and splits.

    ``storage_options`` go to fsspec when ``path`` is a URL.
    """
    ds = path if isinstance(path, Dataset) else open_dataset(path,
                                                             storage_options=storage_options)
    attrs = ds.attrs
    lines = [f"dataset   {ds.url}",
             f"samples   {attrs['num_samples']:,} in chunks of {attrs['chunk_rows']:,} rows",
             "integrity " + ("size and CRC-32C of every chunk recorded: a missing or altered "
                             "chunk is an error" if ds.chunks_recorded else _NOT_RECORDED)]
    total_raw = total_stored = 0
    lines.append("arrays")
    for name in ds.array_names:
        z = ds.zarr_array(name)
        raw, stored = _raw_bytes(ds, name, z), _stored_bytes(ds, name, z)
        total_raw += raw
        total_stored += stored
        codecs = ", ".join(type(c).__name__.removesuffix("Codec").lower()
                           for c in z.compressors) or "none"
        ratio = raw / stored if stored else math.inf
        lines.append(f"  {name:<8} {ds.role_of(name):<9} {_dtype_of(z):<8} shape={z.shape} "
                     f"chunks={z.chunks} codec={codecs} {human_bytes(raw)} -> "
                     f"{human_bytes(stored)} ({ratio:.2f}x)")
    ratio = total_raw / total_stored if total_stored else math.inf
    lines.append(f"size      {human_bytes(total_raw)} raw, {human_bytes(total_stored)} stored "
                 f"(compression {ratio:.2f}x)")
    if attrs.get("images"):
        lines.append(_images_line(attrs["images"],
                                  (attrs.get("labels") or {}).get(ds.targets_name or "")))
    text = attrs.get("text")
    if text:
        lines.append(_text_line(text))
    splits = ds.splits
    lines.append("splits    " + (", ".join(f"{k}={b - a:,} [{a:,}:{b:,})"
                                         for k, (a, b) in splits.items()) or "none"))
    dropped = cleaning_summary(attrs)
    if dropped is not None:
        lines.append(f"cleaning  {dropped}")
    norm = attrs.get("normalization")
    lines.append("normalized " + (", ".join(_normalized(attrs, k, v)
                                           for k, v in norm.items()) if norm else "no"))
    for name, stat in attrs["stats"].items():
        if attrs["arrays"].get(name, {}).get("dtype") == "object":
            # Statistics of encoded images are those of the files' sizes
            lines.append(f"  {name}: file sizes mean {human_bytes(float(np.mean(stat['mean'])))}, "
                         f"min {human_bytes(float(np.min(stat['min'])))}, "
                         f"max {human_bytes(float(np.max(stat['max'])))}")
            continue
        mean = np.asarray(stat["mean"]).ravel()
        std = np.asarray(stat["std"]).ravel()
        over = "all values" if stat.get("pooled") else f"avg over {mean.size}"
        text = (f"  {name}: mean {mean.mean():.4g} ({over}), "
                f"std {std.mean():.4g}, min {np.min(stat['min']):.4g}, "
                f"max {np.max(stat['max']):.4g}")
        # Token ids are no classes: the vocabulary is on the text line.
        if "class_counts" in stat and ds.attrs.get("text") is None:
            text += f", {stat['num_classes']} classes"
        lines.append(text)
    prov = attrs["provenance"]
    lines.append(f"source    {prov['source']} (created {prov['created']})")
    return "\n".join(lines)


_NOT_RECORDED = ("chunk integrity is not recorded for this dataset (format version 1): a "
                 "missing chunk reads as zeros and an altered one is not detected; rebuild it "
                 "with `dasktrain prepare ... --overwrite` to record its chunks")


@dataclasses.dataclass(slots=True)
class VerifyReport:
    """What :func:`verify` found; ``problems`` is empty for a good dataset. ``notes`` say
    what could not be checked (a dataset that does not record its chunks), not problems."""

    url: str
    chunks_read: int
    problems: list[str]
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _check_chunk(array: zarr.Array, raw: zarr.Array, name: str, index: int, chunk_rows: int,
                 pooled: bool) -> tuple[Any, list[str], bool]:
    """Check one chunk against its record (through ``array``), then its values.

    Returns its summary (None when it cannot be read), the problems found and whether the
    chunk itself is damaged. A chunk that is there but differs from its record is decoded
    anyway (through ``raw``, which checks nothing): a chunk rewritten with other values then
    also shows what changed in it (NaN, statistics).
    """
    start = index * chunk_rows
    stop = min(start + chunk_rows, array.shape[0])
    where = f"array {name!r} chunk {index} (rows {start}:{stop})"
    problems: list[str] = []
    try:
        block = array[start : start + chunk_rows]
    except ChunkError as exc:
        problems.append(f"{where} {exc.reason}")
        if exc.kind == "missing":
            return None, problems, True
        block = None
    except Exception as exc:  # any decode failure names the chunk, whatever the codec raised
        return None, [f"{where} cannot be read: {type(exc).__name__}: {exc}"], True
    if block is None:
        try:
            block = raw[start : start + chunk_rows]
        except Exception as exc:
            problems.append(f"{where} cannot be read: {type(exc).__name__}: {exc}")
            return None, problems, True
    damaged = bool(problems)
    if block.dtype.kind == "f":
        bad = ~np.isfinite(block.reshape(len(block), -1)).all(axis=1)
        if bad.any():
            problems.append(f"array {name!r} chunk {index} has {int(bad.sum())} row(s) with "
                            f"NaN or infinite values (first at row {start + int(bad.argmax())})")
    return summary_of(block, pooled), problems, damaged


def _close(recorded: Any, found: Any, rtol: float = 1e-4, atol: float = 1e-5) -> bool:
    return np.allclose(np.asarray(recorded, float), np.asarray(found, float), rtol=rtol,
                       atol=atol)


def _run_verify(client: Client, ds: Dataset, progress: bool) -> VerifyReport:
    attrs = ds.attrs
    problems: list[str] = []
    tasks, owners = [], []
    n = attrs["num_samples"]
    for name, meta in attrs["arrays"].items():
        z = ds.zarr_array(name)  # the chunks of a version-1 dataset are not checked
        raw = ds.group[array_path(attrs, name)]
        if list(z.shape) != meta["shape"]:
            problems.append(f"array {name!r} has shape {z.shape}, attributes say {meta['shape']}")
        if str(z.dtype) != meta["dtype"]:
            problems.append(f"array {name!r} has dtype {z.dtype}, attributes say {meta['dtype']}")
        if z.shape[0] != n:
            problems.append(f"array {name!r} has {z.shape[0]} samples, the dataset {n}")
        if z.chunks[0] != min(attrs["chunk_rows"], max(n, 1)) or z.chunks[1:] != z.shape[1:]:
            problems.append(f"array {name!r} is chunked {z.chunks}, not along samples only")
        if problems:
            continue
        # Summarised as they were recorded: token ids over all their values
        pooled = bool((attrs["stats"].get(name) or {}).get("pooled"))
        for index in range(math.ceil(n / z.chunks[0])):
            tasks.append(dask.delayed(_check_chunk, pure=False)(
                z, raw, name, index, z.chunks[0], pooled))
            owners.append(name)
    splits = attrs.get("splits") or {}
    edge = 0
    for split, (a, b) in splits.items():
        if a != edge or b < a:
            problems.append(f"split {split!r} range [{a}, {b}) does not follow on from {edge}")
        edge = b
    if splits and edge != n:
        problems.append(f"splits cover {edge} samples, the dataset has {n}")
    notes = [] if ds.chunks_recorded else [_NOT_RECORDED]
    if problems:
        return VerifyReport(ds.url, 0, problems, notes)
    results = gather_with_progress(client, client.compute(tasks), "verifying", progress)
    by_array: dict[str, list] = {}
    damaged = 0
    for name, (summary, found, chunk_damaged) in zip(owners, results, strict=True):
        problems.extend(found)
        damaged += chunk_damaged
        if summary is not None:
            by_array.setdefault(name, []).append(summary)
    if damaged:
        problems.append(f"{damaged} chunk(s) missing, altered or unreadable: rebuild the "
                        "dataset with `dasktrain prepare SOURCE OUT --overwrite`")
    for name, parts in by_array.items():
        if len(parts) != sum(o == name for o in owners):
            continue  # unreadable chunks already reported; statistics would mislead
        found = merge_all(parts).to_json()
        recorded = attrs["stats"].get(name)
        if recorded is None:
            problems.append(f"array {name!r} has no recorded statistics")
            continue
        for key in ("mean", "std", "min", "max"):
            if not _close(recorded[key], found[key]):
                problems.append(f"array {name!r}: recorded {key} does not match the data "
                                f"(largest difference "
                                f"{np.max(np.abs(np.subtract(recorded[key], found[key]))):.3g})")
        if recorded.get("class_counts") not in (None, found.get("class_counts")):
            problems.append(f"array {name!r}: recorded class counts do not match the data")
    return VerifyReport(ds.url, len(tasks), problems, notes)


def _verify_in_place(ds: ArrayDataset, storage_options: StorageOptions | None
                     ) -> VerifyReport:
    """An in-place dataset's store, listed: every chunk of the variables its samples read
    that is not there (Zarr would read it as the fill value)."""
    variables = ds.variables
    if not ds.source.is_store:
        return VerifyReport(ds.url, 0, [], [f"{ds.url} is not a Zarr store dasktrain opened: "
                                            "no chunks to look for"])
    looked, missing = missing_chunks(ds.url, variables, ds.geometry.sample_dim,
                                     storage_options or ds.source.storage_options)
    return VerifyReport(ds.url, 0, missing,
                        [f"{looked} chunk(s) of {', '.join(variables)} looked for, not read: "
                         "the store's own chunks are not recorded as a prepared dataset's "
                         "are"])


def verify(path: str | Dataset, *, client: Client | None = None, scheduler: str | None = None,
           progress: bool = True, storage_options: StorageOptions | None = None
           ) -> VerifyReport:
    """Read every chunk of every array and check shapes, dtypes, finiteness and statistics,
    and each chunk's stored size and CRC-32C against those the dataset recorded (a missing or
    altered chunk is reported by array, chunk index and rows).

    An in-place dataset (:func:`~dasktrain.open_arrays` of a Zarr store) is listed
    instead: each chunk of its variables missing from the store is a problem, named with
    its steps (Zarr would read it as the fill value).

    Reading happens in Dask tasks, one per chunk, on the given cluster or a LocalCluster.
    Returns a :class:`VerifyReport`; it raises only when the path is not a dataset at all.
    ``storage_options`` go to fsspec when ``path`` is a URL (and travel with the tasks).
    """
    if isinstance(path, ArrayDataset):
        return _verify_in_place(path, storage_options)
    ds = path if isinstance(path, Dataset) else open_dataset(path,
                                                             storage_options=storage_options)
    if ds.split_name is not None:
        raise DatasetError("verify a whole dataset, not a split")
    with cluster_client(client, scheduler) as active:
        return _run_verify(active, ds, progress)
