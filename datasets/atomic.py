"""Publish a directory atomically: build it in a hidden sibling, rename it into place.

A failed, interrupted or killed build leaves nothing at the destination; a replaced dataset
is moved aside first and restored if the final rename fails, so an existing good dataset is
never lost to a bad run. What a killed build leaves beside the destination is removed by the
next build of it that succeeds (see :mod:`dasktrain.datasets.leftovers`).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import zarr

from dasktrain import _stop
from dasktrain._durable import fsync_directory
from dasktrain.datasets.format import ATTRS_KEY
from dasktrain.datasets.leftovers import leftovers, lock_directory, locked_by_another

__all__ = ["StagedDirectory", "check_output_path"]


def check_output_path(out: Path, overwrite: bool, is_replaceable: callable) -> None:
    """Refuse outputs that cannot or must not be written, before any work starts.

    ``is_replaceable(path)`` tells whether an existing ``out`` may be replaced (only our own
    datasets are: ``--overwrite`` never deletes a stranger's directory).
    """
    if out.exists() or out.is_symlink():
        if not overwrite:
            raise FileExistsError(f"output {out} already exists; pass --overwrite to replace it")
        if not is_replaceable(out):
            raise FileExistsError(
                f"output {out} exists and is not a dasktrain dataset; refusing to replace it"
            )
    parent = out.parent
    probe = parent
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise NotADirectoryError(f"cannot create {out}: {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write {out}: {probe} is not writable")


class StagedDirectory:
    """A hidden build directory (and a scratch directory) beside ``target``."""

    def __init__(self, target: Path) -> None:
        self.target = target
        token = self.token = uuid.uuid4().hex[:8]
        self.path = target.parent / f".{target.name}.tmp-{token}"
        self.scratch = target.parent / f".{target.name}.scratch-{token}"
        target.parent.mkdir(parents=True, exist_ok=True)
        # Locked under a private name, then renamed: a build is never seen unlocked.
        starting = target.parent / f".{target.name}.new-{token}"
        starting.mkdir()
        self._lock: int | None = None
        with contextlib.suppress(OSError):  # no flock here: others then never remove it
            self._lock = lock_directory(starting)
        os.replace(starting, self.path)
        # The scratch directory is made by what needs it (most builds never do).
        self.source_scratch = str(self.scratch / "source")

    def open_group(self) -> zarr.Group:
        """The build's root group, new and empty."""
        return zarr.open_group(str(self.path), mode="w")

    def stage_store(self) -> str:
        """Where the two-pass build keeps its scratch Zarr (made by the first write)."""
        return str(self.scratch / "stage")

    def publish(self, attrs: dict[str, Any] | None = None) -> None:
        """Record ``attrs`` as the dataset's attributes, then move the build into place,
        replacing (and then deleting) any previous target."""
        _stop.check()  # a Ctrl-C that Python swallowed: the build is not published
        if attrs is not None:
            zarr.open_group(str(self.path), mode="r+").attrs[ATTRS_KEY] = attrs
        shutil.rmtree(self.scratch, ignore_errors=True)
        aside = None
        if self.target.exists() or self.target.is_symlink():
            aside = self.target.parent / f".{self.target.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(self.target, aside)
        try:
            os.replace(self.path, self.target)
        except BaseException:
            if aside is not None:
                os.replace(aside, self.target)
            raise
        fsync_directory(self.target.parent)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
        self._unlock()
        self._remove_leftovers()

    def discard(self) -> None:
        """Remove everything this build wrote; the target is untouched."""
        shutil.rmtree(self.path, ignore_errors=True)
        shutil.rmtree(self.scratch, ignore_errors=True)
        self._unlock()

    def _unlock(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def _remove_leftovers(self) -> None:
        """Remove the build and scratch directories of killed builds of the same target."""
        parent, name = self.target.parent, self.target.name
        pattern = re.compile(rf"\.{re.escape(name)}\.(?:tmp|scratch)-([0-9a-f]{{8}})")

        def build_of(entry: str) -> str | None:
            match = pattern.fullmatch(entry)
            return match.group(1) if match else None

        with contextlib.suppress(OSError):  # best effort: the dataset is published
            for entry in leftovers(os.listdir(parent), build_of, self.token, lambda token:
                                   locked_by_another(parent / f".{name}.tmp-{token}")):
                shutil.rmtree(parent / entry, ignore_errors=True)
