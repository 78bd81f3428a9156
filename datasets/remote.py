"""Publish a dataset at an fsspec URL (``s3://``, ``gs://``...) atomically, without a rename.

Object stores cannot rename a prefix, but replacing one object is atomic. So a build writes
its arrays under a prefix of its own inside the dataset's URL, and the dataset's group
metadata (``zarr.json``, holding the ``"dasktrain"`` attributes :func:`open_dataset` needs)
is written LAST, in one PUT, pointing at them::

    s3://bucket/digits.zarr/zarr.json                          <- written last
    s3://bucket/digits.zarr/dasktrain-build-3f9c.../x/...      <- this build's arrays
    s3://bucket/digits.zarr/dasktrain-build-3f9c...-scratch/   <- two-pass scratch, removed

Until that PUT a reader finds no dataset (a fresh URL) or the previous one, complete (an
``--overwrite``): never a mix, because the old and the new data live under different
prefixes. After it, the previous build and any leftovers of interrupted preparations
(``dasktrain-build-*`` prefixes) are deleted. A reader that opened the previous dataset
before the swap and still reads from it afterwards loses it, as with a local overwrite:
reopen after an overwrite.

A publish runs its steps (check what is there, write the metadata, retire the other
builds) holding the URL's publish lock (:mod:`dasktrain.datasets.publish_lock`), so two
preparations into one URL never interleave them, and the dataset is always one whole
build. Without ``overwrite`` the metadata is also written only if absent (a conditional
write), and a dataset published by another preparation while this one ran makes this one
fail, by name. A publish retires every other build prefix, running ones too: of two
preparations into one URL at once, with ``overwrite``, the one that publishes first wins
and the other fails (its build was retired); run one at a time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import tempfile
import uuid
from collections.abc import Callable
from typing import Any

import zarr
from zarr.core.buffer import default_buffer_prototype
from zarr.core.group import GroupMetadata
from zarr.storage import FsspecStore

from dasktrain import _stop
from dasktrain._durable import (
    StorageOptions,
    join,
    storage_errors,
    strip_url,
    url_filesystem,
)
from dasktrain.datasets.errors import OutputExistsError
from dasktrain.datasets.format import ATTRS_KEY
from dasktrain.datasets.leftovers import leftovers
from dasktrain.datasets.publish_lock import LOCK_NAME, publish_lock

__all__ = ["BUILD_PREFIX", "StagedPrefix", "check_output_url"]

logger = logging.getLogger(__name__)

#: Prefixes of builds under a dataset's URL; only these are ever deleted by a preparation.
BUILD_PREFIX = "dasktrain-build-"
#: The attribute of a build's own group metadata that names it.
_BUILD_KEY = "dasktrain_build"


def _build_of(name: str) -> str | None:
    """The build a name under a dataset's URL belongs to (its scratch shares it), if any."""
    return name.removesuffix("-scratch") if name.startswith(BUILD_PREFIX) else None


def _names(fs: Any, root: str) -> list[str]:
    """The names directly under ``root`` (objects and prefixes); none if nothing is there."""
    fs.invalidate_cache()  # workers wrote through other instances: never trust a listing cache
    if not fs.isdir(root):
        return [root.rsplit("/", 1)[-1]] if fs.isfile(root) else []
    return [entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(root, detail=False)]


def check_output_url(url: str, overwrite: bool, storage_options: StorageOptions | None,
                     is_replaceable: Callable[[str], bool]) -> None:
    """Refuse URLs that must not be written, before any work starts.

    A URL holding a dataset needs ``overwrite``; one holding anything but a dataset or
    leftovers of our own builds is refused (nothing of a stranger's is ever replaced).
    """
    fs, root = url_filesystem(url, storage_options)
    with storage_errors(url):
        names = _names(fs, root)
        if "zarr.json" in names:
            if not overwrite:
                raise OutputExistsError(f"output {url} already exists; pass --overwrite to "
                                        "replace it")
            if not is_replaceable(url):
                raise OutputExistsError(f"output {url} exists and is not a dasktrain "
                                        "dataset; refusing to replace it")
            return
        strangers = [n for n in names if not n.startswith(BUILD_PREFIX) and n != LOCK_NAME]
        if strangers:
            raise OutputExistsError(
                f"output {url} holds other objects ({', '.join(sorted(strangers)[:3])}) and is "
                "not a dasktrain dataset; refusing to write there")
        if names:
            logger.warning("%s holds leftovers of an interrupted preparation (%s); they are "
                           "deleted once this one is published", url, ", ".join(names))


class StagedPrefix:
    """A build under its own prefix of ``url``; :meth:`publish` makes it the dataset."""

    def __init__(self, url: str, storage_options: StorageOptions | None,
                 overwrite: bool) -> None:
        self.url = strip_url(url)
        self.storage_options = storage_options
        self.overwrite = overwrite
        self.fs, self.root = url_filesystem(self.url, storage_options)
        self.name = f"{BUILD_PREFIX}{uuid.uuid4().hex[:16]}"
        self.scratch_name = f"{self.name}-scratch"
        # Compressed .npz members are inflated here; the source itself is a local file.
        self.source_scratch = tempfile.mkdtemp(prefix="dasktrain-source-")
        try:
            with storage_errors(self.url):
                # The build's own group metadata comes first: it marks the build as alive
                # (tasks refuse to write once it is gone), and writing it proves the URL
                # writable before any cluster starts.
                # Its attributes name the build: a retired build's metadata that zarr
                # writes again (creating an array writes missing parents) names none.
                self._group = zarr.open_group(self._store(self.name), mode="w-",
                                              attributes={_BUILD_KEY: self.name})
        except BaseException:
            shutil.rmtree(self.source_scratch, ignore_errors=True)
            raise

    def _store(self, name: str) -> FsspecStore:
        return FsspecStore.from_url(join(self.url, name), storage_options=self.storage_options,
                                    read_only=False)

    def open_group(self) -> zarr.Group:
        """The build's root group (under its own prefix)."""
        return self._group

    def stage_store(self) -> FsspecStore:
        """Where the two-pass build keeps its scratch Zarr (reachable by every worker)."""
        return self._store(self.scratch_name)

    def publish(self, attrs: dict[str, Any]) -> None:
        """Point the dataset's metadata at this build (one PUT), then delete what it
        replaced and any leftovers of interrupted builds.

        Raises
        ------
        OutputExistsError
            Without ``overwrite``: a dataset was published at the URL while this
            preparation ran. With it: what is there is no dasktrain dataset.
        FileNotFoundError
            This build was retired by another preparation's publish.
        """
        _stop.check()  # a Ctrl-C that Python swallowed: the build is not published
        with storage_errors(self.url):
            self._remove(self.scratch_name)
            with publish_lock(self.fs, self.root, self.url):
                retired = self._swap(attrs)
            # Out of the lock: nothing can publish these any more (their metadata is gone)
            for name in retired:
                self._remove(name)
        shutil.rmtree(self.source_scratch, ignore_errors=True)

    def retired_error(self) -> BaseException | None:
        """Why this build failed, if another preparation's publish retired it (its tasks
        then refuse to write, saying only that the build is gone); None otherwise."""
        with contextlib.suppress(Exception):  # cannot tell: the build's own error stands
            self.fs.invalidate_cache()
            if self._intact() or not self.fs.exists(f"{self.root}/zarr.json"):
                return None
            if not self.overwrite:
                return self._written_meanwhile()
            return FileNotFoundError(
                f"another preparation into {self.url} published first and retired this "
                "build; run one preparation into a URL at a time")
        return None

    def _intact(self) -> bool:
        """Whether this build's metadata is its own: another publish retires a build by
        deleting it (see :meth:`_swap`)."""
        try:
            document = json.loads(self.fs.cat_file(f"{self.root}/{self.name}/zarr.json"))
        except FileNotFoundError:
            return False
        return (document.get("attributes") or {}).get(_BUILD_KEY) == self.name

    def _written_meanwhile(self) -> OutputExistsError:
        return OutputExistsError(f"output {self.url} was written by another preparation "
                                 "while this one ran; pass --overwrite to replace it")

    def _swap(self, attrs: dict[str, Any]) -> list[str]:
        """Under the publish lock: write the dataset's metadata pointing at this build, and
        retire the other builds (their metadata deleted, so none of them can publish);
        returns the names whose data is left to delete."""
        names = _names(self.fs, self.root)
        if "zarr.json" in names and not self.overwrite:
            raise self._written_meanwhile()
        if self.name not in names or not self._intact():
            raise FileNotFoundError(
                f"the build {join(self.url, self.name)} was deleted before it was published: "
                f"another preparation into {self.url} published first; run one at a time")
        previous: list[str] = []
        if "zarr.json" in names:
            found = self._previous_paths()
            if found is None:
                raise OutputExistsError(f"output {self.url} was written while this "
                                        "preparation ran and is not a dasktrain dataset; "
                                        "refusing to replace it")
            previous = [p for p in found if not p.startswith(BUILD_PREFIX)]
        arrays = {name: {**meta, "path": f"{self.name}/{name}"}
                  for name, meta in attrs["arrays"].items()}
        metadata = GroupMetadata(attributes={ATTRS_KEY: {**attrs, "arrays": arrays}})
        document = metadata.to_buffer_dict(default_buffer_prototype())["zarr.json"]
        try:
            # Written only if absent without overwrite: the store itself refuses a second
            # writer, whatever wrote there without taking the lock.
            self.fs.pipe_file(f"{self.root}/zarr.json", document.to_bytes(),
                              mode="overwrite" if self.overwrite else "create")
        except FileExistsError:
            raise self._written_meanwhile() from None
        retired = leftovers(names, _build_of, self.name)
        for name in retired:
            if not name.endswith("-scratch"):
                self._remove(f"{name}/zarr.json")
        # A dataset copied up from a disk keeps its arrays at the top: they go too.
        return retired + previous

    def _previous_paths(self) -> list[str] | None:
        """Top-level paths of the arrays of the dataset being replaced (None: it is none)."""
        try:
            document = json.loads(self.fs.cat_file(f"{self.root}/zarr.json"))
            arrays = document["attributes"][ATTRS_KEY]["arrays"]
            return sorted({str(meta.get("path") or name).split("/", 1)[0]
                           for name, meta in arrays.items()})
        except (FileNotFoundError, KeyError, TypeError, ValueError):
            return None

    def _remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(f"{self.root}/{name}", recursive=True)

    def discard(self) -> None:
        """Delete everything this build wrote; the dataset at the URL is untouched."""
        with contextlib.suppress(Exception):  # best effort: leftovers go at the next publish
            self._remove(self.scratch_name)
            self._remove(self.name)
        shutil.rmtree(self.source_scratch, ignore_errors=True)
