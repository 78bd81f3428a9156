"""Publish a directory atomically: build it in a hidden sibling, rename it into place.

A failed, interrupted or killed build leaves nothing at the destination; a replaced dataset
is moved aside first and restored if the final rename fails, so an existing good dataset is
never lost to a bad run. What a killed build leaves beside the destination is removed by the
next build of it that succeeds (see :mod:`dasktrain.datasets.leftovers`).

The final move never replaces what is there (:func:`~dasktrain.datasets.rename.
rename_no_replace`): without ``overwrite``, a dataset that another preparation published at
the destination while this one ran makes this publish fail, by name, and this build is
discarded. With ``overwrite``, two preparations publishing at once each move aside what they
find and move their own build in; the one that moves in last wins, and the destination
always holds one whole build.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zarr

from dasktrain import _stop
from dasktrain._durable import fsync_directory
from dasktrain.datasets.errors import OutputExistsError
from dasktrain.datasets.format import ATTRS_KEY
from dasktrain.datasets.leftovers import leftovers, lock_directory, locked_by_another
from dasktrain.datasets.rename import rename_no_replace

__all__ = ["Replaceable", "StagedDirectory", "check_output_path"]

Replaceable = Callable[[Path], bool]
"""Whether an existing output may be replaced (only dasktrain datasets are)."""

#: Moves in a row that another preparation may undo before a replacing publish gives up.
_REPLACE_TRIES = 8


def _present(path: Path) -> bool:
    return path.exists() or path.is_symlink()


def _check_replaceable(out: Path, is_replaceable: Replaceable) -> None:
    if not is_replaceable(out):
        raise OutputExistsError(
            f"output {out} exists and is not a dasktrain dataset; refusing to replace it")


def check_output_path(out: Path, overwrite: bool, is_replaceable: Replaceable) -> None:
    """Refuse outputs that cannot or must not be written, before any work starts.

    ``is_replaceable(path)`` tells whether an existing ``out`` may be replaced (only our own
    datasets are: ``--overwrite`` never deletes a stranger's directory).
    """
    if _present(out):
        if not overwrite:
            raise OutputExistsError(f"output {out} already exists; pass --overwrite to "
                                    "replace it")
        _check_replaceable(out, is_replaceable)
    parent = out.parent
    probe = parent
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise NotADirectoryError(f"cannot create {out}: {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write {out}: {probe} is not writable")


class StagedDirectory:
    """A hidden build directory (and a scratch directory) beside ``target``.

    ``overwrite`` lets :meth:`publish` replace what is at ``target`` when
    ``is_replaceable(target)`` says it may (by default anything may).
    """

    def __init__(self, target: Path, overwrite: bool = False,
                 is_replaceable: Replaceable = lambda path: True) -> None:
        self.target = target
        self.overwrite, self.is_replaceable = overwrite, is_replaceable
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
        """Record ``attrs`` as the dataset's attributes, then move the build into place:
        where nothing is, or, with ``overwrite``, replacing (and then deleting) what is
        there.

        Raises
        ------
        OutputExistsError
            Something is at the target (without ``overwrite``: another preparation
            published there while this one ran), or what is there may not be replaced.
            The build stays where it was, for :meth:`discard`.
        """
        _stop.check()  # a Ctrl-C that Python swallowed: the build is not published
        if attrs is not None:
            zarr.open_group(str(self.path), mode="r+").attrs[ATTRS_KEY] = attrs
        shutil.rmtree(self.scratch, ignore_errors=True)
        if self.overwrite:
            self._replace()
        else:
            try:
                rename_no_replace(self.path, self.target)
            except FileExistsError:
                raise OutputExistsError(
                    f"output {self.target} was written by another preparation while this one "
                    "ran; pass --overwrite to replace it") from None
        fsync_directory(self.target.parent)
        self._unlock()
        self._remove_leftovers()

    def _replace(self) -> None:
        """Move what is at the target aside and the build in, until the build is in: a
        preparation that publishes in between is moved aside too (the last one in wins).
        What was moved aside is deleted, or put back if the build cannot go in."""
        asides: list[Path] = []
        try:
            for _ in range(_REPLACE_TRIES):
                if _present(self.target):
                    _check_replaceable(self.target, self.is_replaceable)
                    aside = self.target.parent / f".{self.target.name}.old-{uuid.uuid4().hex[:8]}"
                    try:
                        os.replace(self.target, aside)
                    except FileNotFoundError:
                        continue  # moved aside by another preparation meanwhile
                    asides.append(aside)
                try:
                    rename_no_replace(self.path, self.target)
                    return
                except FileExistsError:
                    continue  # another preparation published meanwhile
            raise OutputExistsError(f"output {self.target} was replaced by other preparations "
                                    f"{_REPLACE_TRIES} times while this one published; "
                                    "run one preparation at a time")
        except BaseException:
            if asides:
                with contextlib.suppress(OSError):  # something else is in place: it stays
                    rename_no_replace(asides[-1], self.target)
                    asides.pop()
            raise
        finally:
            for aside in asides:
                shutil.rmtree(aside, ignore_errors=True)

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
