"""Opening a prepared dataset: :func:`open_dataset` and the :class:`Dataset` view."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from typing import Any

import dask.array as da
import zarr
from dask.base import tokenize

from dasktrain._durable import is_url, storage_errors, url_filesystem
from dasktrain.datasets.chunks import MANIFEST_KEY, checked_array, validate_manifest
from dasktrain.datasets.errors import DatasetError
from dasktrain.datasets.format import ATTRS_KEY, FORMAT_VERSION, READABLE_VERSIONS

__all__ = ["Dataset", "array_path", "open_dataset"]

PathLike = str | os.PathLike


class Dataset:
    """A prepared dataset, or a contiguous range of its samples (a split).

    Arrays are exposed as dask arrays over the Zarr chunks, so nothing is read until asked.
    Obtain one with :func:`open_dataset`; ``ds.split("train")`` gives the named split.
    """

    def __init__(
        self,
        url: str,
        group: zarr.Group,
        attrs: Mapping[str, Any],
        start: int = 0,
        stop: int | None = None,
        split_name: str | None = None,
        identity: str | None = None,
        storage_options: dict | None = None,
    ) -> None:
        self.url = url
        self.group = group
        self.storage_options = storage_options
        self.attrs: dict[str, Any] = dict(attrs)
        self.start = start
        self.stop = self.attrs["num_samples"] if stop is None else stop
        self.split_name = split_name
        # Taken once, here: a copy pickled to a worker keeps it rather than looking again.
        self._identity = identity or _identity_of(url, self.attrs)

    # -- shape of the data -------------------------------------------------------------
    def __len__(self) -> int:
        return self.stop - self.start

    @property
    def chunk_rows(self) -> int:
        """Rows per Zarr chunk, the same for every array."""
        return int(self.attrs["chunk_rows"])

    @property
    def array_names(self) -> list[str]:
        return list(self.attrs["arrays"])

    def role_of(self, name: str) -> str:
        return self.attrs["arrays"][name]["role"]

    @property
    def roles(self) -> dict[str, str]:
        """Each array's role (``features``, ``targets`` or ``other``), by name, in order."""
        return {name: self.role_of(name) for name in self.array_names}

    @property
    def encoded_arrays(self) -> list[str]:
        """The arrays of variable-length bytes (encoded images): no tensor until decoded."""
        return [name for name, a in self.attrs["arrays"].items() if a["dtype"] == "object"]

    def names_with_role(self, role: str) -> list[str]:
        """The names of the arrays of ``role``, in order (a model of several inputs has
        several ``features`` arrays)."""
        return [n for n in self.array_names if self.role_of(n) == role]

    def _name_with_role(self, role: str) -> str | None:
        names = [n for n in self.array_names if self.role_of(n) == role]
        return names[0] if names else None

    @property
    def features_name(self) -> str:
        name = self._name_with_role("features")
        if name is None:
            raise DatasetError(f"dataset {self.url} has no features array")
        return name

    @property
    def targets_name(self) -> str | None:
        return self._name_with_role("targets")

    @property
    def identity(self) -> str:
        """A token naming this build of the dataset and no other.

        Dask keys of tasks that read the dataset include it: a dataset rewritten at the same
        URL gets new keys, so a client still holding results of the old build never hands
        them over as the new one's. It is the random ``dataset_id`` that
        :func:`~dasktrain.prepare` records; for datasets written before it did, a token of the
        URL, the build time and (local datasets) the modification time of the metadata.
        """
        return self._identity

    @property
    def chunks_recorded(self) -> bool:
        """Whether the dataset records its chunks (format version 2 on): reads then refuse
        a missing or altered chunk. Older datasets read a missing chunk as zeros."""
        return self.attrs.get(MANIFEST_KEY) is not None

    @property
    def splits(self) -> dict[str, tuple[int, int]]:
        """Named splits as ``{name: (start, stop)}`` sample ranges of the whole dataset."""
        return {k: (int(a), int(b)) for k, (a, b) in (self.attrs.get("splits") or {}).items()}

    # -- access ------------------------------------------------------------------------
    def zarr_array(self, name: str, *, checksums: bool = True) -> zarr.Array:
        """The Zarr array behind ``name`` (all samples, not only this view's range).

        Where the dataset records its chunks, the array reads a chunk only if it is stored
        with the recorded size and (unless ``checksums`` is false) CRC-32C, and raises
        :class:`~dasktrain.datasets.chunks.ChunkError` naming the chunk otherwise.
        """
        if name not in self.attrs["arrays"]:
            raise KeyError(f"no array {name!r} in {self.url}; arrays: {self.array_names}")
        array = self.group[array_path(self.attrs, name)]
        record = self.attrs.get(MANIFEST_KEY)
        if record is None:
            return array
        return checked_array(array, url=self.url, name=name, record=record[name],
                             checksums=checksums)

    def __getitem__(self, name: str) -> da.Array:
        z = self.zarr_array(name)
        chunks = (self.chunk_rows, *z.shape[1:])
        # Dask's own name for it tokenizes the zarr handle (URL and metadata), the same for
        # every build at this URL.
        dask_name = f"from-zarr-{tokenize(self.url, self.identity, name, chunks)}"
        return da.from_zarr(z, chunks=chunks, name=dask_name)[self.start : self.stop]

    @property
    def arrays(self) -> dict[str, da.Array]:
        return {name: self[name] for name in self.array_names}

    @property
    def x(self) -> da.Array:
        """The features, as a dask array of shape (len(self), *feature_shape)."""
        return self[self.features_name]

    @property
    def y(self) -> da.Array | None:
        """The targets, or None for a dataset without targets."""
        name = self.targets_name
        return None if name is None else self[name]

    def split(self, name: str) -> Dataset:
        """The named split (e.g. ``"train"``) as a Dataset over its sample range."""
        splits = self.splits
        if name not in splits:
            known = ", ".join(splits) or self._NO_SPLITS
            raise KeyError(f"dataset {self.url} has no split {name!r}; splits: {known}")
        if self.split_name is not None:
            raise ValueError(f"{self!r} is already the split {self.split_name!r}")
        return self._view(*splits[name], name)

    #: What a split error says when there are none.
    _NO_SPLITS = "none (prepare with --split train=0.9,val=0.1)"

    def _view(self, start: int, stop: int, name: str) -> Dataset:
        """Samples ``[start, stop)`` as the split ``name``."""
        return Dataset(self.url, self.group, self.attrs, start, stop, split_name=name,
                       identity=self.identity, storage_options=self.storage_options)

    def __repr__(self) -> str:
        what = f" split={self.split_name!r}" if self.split_name else ""
        shapes = ", ".join(
            f"{n}: {self.attrs['arrays'][n]['dtype']}{tuple(self.attrs['arrays'][n]['shape'][1:])}"
            for n in self.array_names
        )
        return f"<dasktrain.Dataset {self.url}{what} samples={len(self)} [{shapes}]>"


def array_path(attrs: Mapping[str, Any], name: str) -> str:
    """Where the array ``name`` lives in the dataset's group (its own name by default)."""
    return str(attrs["arrays"][name].get("path") or name)


def _identity_of(url: str, attrs: Mapping[str, Any]) -> str:
    """The build's ``dataset_id``, or for older datasets a token of what tells builds apart."""
    if attrs.get("dataset_id"):
        return str(attrs["dataset_id"])
    created = (attrs.get("provenance") or {}).get("created")
    local = url.removeprefix("file://")
    modified = None
    if "://" not in local:
        # ``created`` has whole seconds only; the metadata's mtime splits rebuilds within one.
        with contextlib.suppress(OSError):
            modified = os.stat(os.path.join(local, "zarr.json")).st_mtime_ns
    return tokenize(url, created, modified)


def _as_url(path: PathLike) -> str:
    text = os.fspath(path)
    return text if "://" in text else os.path.abspath(text)


def open_dataset(path: PathLike, *, storage_options: dict | None = None) -> Dataset:
    """Open a dataset written by :func:`dasktrain.prepare`.

    Parameters
    ----------
    path
        A local path or any fsspec URL zarr can open (``file://``, ``s3://``, ``memory://``).
    storage_options
        Passed to fsspec for URLs (credentials, endpoints).

    Raises
    ------
    DatasetError
        When nothing is there, or it is not a dasktrain dataset of a known format version.
    """
    url = _as_url(path)
    with storage_errors(url):  # an unreachable store or a missing fsspec package
        if is_url(url):
            # One plain request first: zarr asks for several keys at once, and when the
            # store cannot be reached the abandoned requests litter stderr at exit.
            fs, root = url_filesystem(url, storage_options)
            fs.invalidate_cache(root)  # written by another process, maybe since a listing
            if not fs.exists(f"{root}/zarr.json"):
                raise DatasetError(f"no dataset at {url}: nothing there")
        try:
            group = zarr.open_group(url, mode="r", storage_options=storage_options)
        except (FileNotFoundError, zarr.errors.GroupNotFoundError) as exc:
            if "://" not in url and os.path.exists(url):
                raise DatasetError(f"{url} is not a dasktrain dataset: no Zarr group there"
                                   ) from exc
            raise DatasetError(f"no dataset at {url}: nothing there") from exc
        except (zarr.errors.BaseZarrError, ValueError, TypeError) as exc:
            raise DatasetError(f"{url} is not a Zarr v3 group: {exc}") from exc
    attrs = group.attrs.get(ATTRS_KEY)
    if not isinstance(attrs, Mapping):
        raise DatasetError(
            f"{url} is a Zarr group but not a dasktrain dataset (no {ATTRS_KEY!r} attributes); "
            "create one with `dasktrain prepare`"
        )
    version = attrs.get("format_version")
    if version not in READABLE_VERSIONS:
        raise DatasetError(
            f"{url} has dataset format version {version!r}; this dasktrain reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))} (it writes {FORMAT_VERSION})"
        )
    validate_manifest(url, attrs)
    with storage_errors(url):
        missing = [name for name in attrs["arrays"] if array_path(attrs, name) not in group]
    if missing:
        raise DatasetError(f"{url} lists arrays {missing} that are not in the group")
    return Dataset(url, group, attrs, storage_options=storage_options)
