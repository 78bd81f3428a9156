"""The run's log beside a checkpoint, appended as things happen (JSON lines): one line per
update, and the History's events, claims and epoch records.

A checkpoint is rewritten whole at every save; if it carried every update's record, or
every event, claim and epoch record, a long run's checkpoint would grow with the run and
its I/O with the square of its length. The checkpoint therefore holds the run's counters
and settings only, of constant size, and this file holds the rest:

* one line per update: its fields (:data:`~dasktrain.trainer.holder.records.PER_UPDATE`)
  as values and each per-gradient field as a list with one entry per gradient recorded
  for it (``"staleness": […], "staleness_worker": […], "scale": […], …``);
* ``{"version": v, "event": text}``, ``{"version": v, "claim": [epoch, version, worker,
  first, stop]}`` and ``{"version": v, "epoch_record": {...}}``, ``v`` being the holder's
  version when the driver learned of it.

A resume keeps the lines up to the checkpoint's version (later ones are redone) and
rewrites the file to those.

Object storage has no append: beside a checkpoint at a URL the log is kept in memory and
uploaded whole (one PUT, atomic) by :meth:`UpdateLog.sync`, which runs before every
checkpoint, so the object always holds at least what its checkpoint counts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

from dasktrain._durable import (
    StorageOptions,
    fsync_directory,
    read_bytes,
    write_bytes_atomic,
)
from dasktrain.trainer.driver.checkpoint import checkpoint_file
from dasktrain.trainer.holder.records import PER_GRADIENT, PER_UPDATE

__all__ = ["KINDS", "UpdateLog", "records_of", "rows_of", "split_kinds"]

#: The kinds of line besides updates, and the History's list each goes to.
KINDS = {"event": "events", "claim": "claims", "epoch_record": "epochs"}

def rows_of(records: dict[str, list]) -> Iterator[dict[str, Any]]:
    """Column lists (as the holder reports them) as one dict per update: per-update
    fields as values, per-gradient fields (every other name) as lists."""
    per_gradient = [name for name in records if name not in PER_UPDATE]
    at = 0
    for i in range(len(records["version"])):
        row = {name: records[name][i] for name in PER_UPDATE if name in records}
        n = int(row.get("gradients", row["contributors"]))
        row.update({name: records[name][at : at + n] for name in per_gradient})
        at += n
        yield row


def split_kinds(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]],
                                                     dict[str, list[Any]]]:
    """The update rows of ``rows``, and the other kinds' items by History list name."""
    updates: list[dict[str, Any]] = []
    others: dict[str, list[Any]] = {name: [] for name in KINDS.values()}
    for row in rows:
        kind = next((k for k in KINDS if k in row), None)
        if kind is None:
            updates.append(row)
        else:
            others[KINDS[kind]].append(row[kind])
    return updates, others


def records_of(rows: list[dict[str, Any]]) -> dict[str, list]:
    """The inverse of :func:`rows_of` (lists in a row are per-gradient fields)."""
    records: dict[str, list] = {name: [] for name in (*PER_UPDATE, *PER_GRADIENT)}
    for row in rows:
        if "gradients" not in row:  # written before per-update gradient counts
            row = {**row, "gradients": row["contributors"]}
        for name, value in row.items():
            column = records.setdefault(name, [])
            if isinstance(value, list):
                column.extend(value)
            else:
                column.append(value)
    return records


class UpdateLog:
    """The per-update file of the checkpoint at ``checkpoint`` (a directory or a ``.pt``,
    a local path or a URL)."""

    def __init__(self, checkpoint: str | os.PathLike, *,
                 storage_options: StorageOptions | None = None) -> None:
        target = checkpoint_file(checkpoint)
        self.storage_options = storage_options
        self.url: str | None = None
        if isinstance(target, str):
            self.url = f"{target.removesuffix('.pt')}-updates.jsonl"
            self._lines: list[str] = []  # the object's content: what sync uploads
            self._pending: list[str] = []
        else:
            self.path = target.with_name(f"{target.stem}-updates.jsonl")

    def read(self, up_to_version: int | None = None) -> list[dict[str, Any]]:
        """The rows written so far (those of versions up to ``up_to_version``)."""
        if self.url is not None:
            try:
                lines = read_bytes(self.url, self.storage_options).decode().splitlines(True)
            except FileNotFoundError:
                return []
        elif not self.path.is_file():
            return []
        else:
            with self.path.open() as f:
                lines = f.readlines()
        rows = []
        for line in lines:
            if not line.endswith("\n"):
                break  # a line cut short by a crash: the checkpoint never counted it
            row = json.loads(line)
            if up_to_version is None or row["version"] <= up_to_version:
                rows.append(row)
        return rows

    def rewrite(self, records: dict[str, list], others: dict[str, list[Any]] | None = None,
                version: int = 0) -> None:
        """Replace the file with ``records`` and the ``others`` kinds (by History list name,
        as of ``version``) atomically, e.g. when a run starts or resumes."""
        lines = [json.dumps(row) + "\n" for row in rows_of(records)]
        for kind, name in KINDS.items():
            lines += [json.dumps({"version": version, kind: item}) + "\n"
                      for item in (others or {}).get(name, [])]
        if self.url is not None:
            write_bytes_atomic(self.url, "".join(lines).encode(), self.storage_options)
            self._lines, self._pending = lines, []
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with tmp.open("w") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fsync_directory(self.path.parent)

    def append(self, records: dict[str, list]) -> None:
        """Add the updates of ``records`` (column lists, as the holder reports them)."""
        if records["version"]:
            self._write([json.dumps(row) + "\n" for row in rows_of(records)])

    def append_items(self, kind: str, items: list[Any], version: int) -> None:
        """Add ``items`` of ``kind`` (a key of :data:`KINDS`), learned of at ``version``."""
        if items:
            self._write([json.dumps({"version": version, kind: item}) + "\n"
                         for item in items])

    def _write(self, lines: list[str]) -> None:
        if self.url is not None:
            self._pending.extend(lines)
            return
        with self.path.open("a") as f:
            f.writelines(lines)

    def sync(self) -> None:
        """Make what was appended durable (before a checkpoint that counts on it)."""
        if self.url is not None:
            if self._pending:
                lines = self._lines + self._pending
                write_bytes_atomic(self.url, "".join(lines).encode(), self.storage_options)
                self._lines, self._pending = lines, []
            return
        if self.path.is_file():
            with self.path.open("rb+") as f:
                os.fsync(f.fileno())
