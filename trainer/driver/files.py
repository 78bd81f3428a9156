"""Writing a run's output files so that a reader never finds half of one."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dasktrain._durable import write_bytes_atomic

__all__ = ["read_saved", "write_atomically"]


def write_atomically(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write ``data`` to ``path`` through a temporary sibling and a rename.

    An interrupted write leaves the previous file (or none), never a truncated one; the
    directory is flushed after the rename so a completed write survives a power cut.
    """
    target = Path(path)
    write_bytes_atomic(target, data.encode() if isinstance(data, str) else data)
    return target


def read_saved(path: str | os.PathLike, document_format: str, kind: str) -> Any:
    """The ``"history"`` of a JSON document that ``kind.save`` wrote in ``document_format``
    at ``path``; a ``ValueError`` naming the file where it is not one."""
    path = Path(path)
    try:
        document = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not a saved {kind} (not JSON: {exc})") from None
    if not isinstance(document, dict) or document.get("format") != document_format:
        raise ValueError(f"{path} is not a saved {kind} ({kind}.save writes format "
                         f"{document_format!r})")
    return document["history"]
