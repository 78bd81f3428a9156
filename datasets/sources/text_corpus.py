"""Which documents a text corpus holds and how its reading is cut into pieces (client side).

A corpus is the files of a directory that its patterns choose (or one file), or a text
column of CSV/Parquet files: every file, or every non-empty cell, is one document. The
documents are listed once, in a fixed order (paths sorted; rows in file order), with the
version of each file (size, modification time) so that a file changed while it is being
prepared is an error, never a silently different dataset.

Reading is cut into *pieces* of text, each tokenised by one task: small files are grouped,
a file larger than :data:`PIECE_BYTES` is cut into parts at fixed offsets. A part that
starts or stops inside a file starts or stops at a line start (see :mod:`.text_tokenize`),
so that no tokenizer sees a line cut in two; a file is tokenised whole up to
:data:`PIECE_BYTES`, so its tokens are those of one ``encode`` of it. A table's piece is
one file (CSV) or one row group (Parquet).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import re
import stat
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from dasktrain.datasets.errors import SourceError

__all__ = [
    "DEFAULT_GLOB",
    "PIECE_BYTES",
    "CorpusFile",
    "FilePart",
    "TablePiece",
    "file_pieces",
    "list_files",
    "table_pieces",
]

#: Text one tokenising task reads at a time: pieces this size keep a task's memory to a few
#: times it (text, ids, stored tokens) while tasks stay long next to their scheduling.
PIECE_BYTES = 4 * 2**20
#: Which files of a directory are documents when no patterns are given.
DEFAULT_GLOB = "*.txt"


@dataclasses.dataclass(frozen=True, slots=True)
class CorpusFile:
    """One document file, as it was when the corpus was listed."""

    path: str
    """Absolute path."""
    name: str
    """Path relative to the corpus directory (what patterns match, what errors name)."""
    size: int
    mtime_ns: int

    def row(self) -> tuple[str, str, int, int]:
        """The fields as a tuple (``dataclasses.astuple`` deep-copies: 100 times slower on a
        corpus of thousands of files)."""
        return self.path, self.name, self.size, self.mtime_ns


@dataclasses.dataclass(frozen=True, slots=True)
class FilePart:
    """Bytes ``[start, stop)`` of a file, nominally: a bound inside the file moves forward
    to the next line start when the part is read."""

    file: CorpusFile
    start: int
    stop: int

    @property
    def ends_document(self) -> bool:
        return self.stop == self.file.size


@dataclasses.dataclass(frozen=True, slots=True)
class TablePiece:
    """The text cells of one CSV file, or of one row group of a Parquet file."""

    file: CorpusFile
    column: str
    row_group: int | None
    """Row group of a Parquet file; None for a CSV file (read whole: quoted cells may hold
    newlines, so a CSV file cannot be cut at arbitrary lines)."""


def _patterns(text: str) -> tuple[list[str], list[str]]:
    """``"*.py,!site-packages/*"`` -> (patterns to take, patterns to leave out)."""
    take, leave = [], []
    for item in (p.strip() for p in text.split(",")):
        if item.startswith("!") and item[1:]:
            leave.append(item[1:])
        elif item and not item.startswith("!"):
            take.append(item)
    if not take:
        raise SourceError(f"--text-glob {text!r} names no files to take; write e.g. "
                          "'*.txt' or '*.py,!tests/*'")
    return take, leave


def _version(path: str, name: str) -> CorpusFile | None:
    """The file as it is now, or None where ``path`` is no regular file (or a dangling
    link)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return CorpusFile(path, name, st.st_size, st.st_mtime_ns)


def _matcher(patterns: list[str]) -> re.Pattern:
    # One regular expression for all of them: a corpus directory may hold 100,000 files.
    return re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in patterns))


def list_files(root: Path, glob: str | None) -> tuple[list[CorpusFile], int]:
    """The documents of ``root`` (a file, or a directory whose files ``glob`` chooses),
    sorted by relative path, and how many empty files were left out.

    ``glob`` is comma-separated shell patterns matched against each file's path relative
    to ``root``, where ``*`` also crosses ``/`` (``*.py`` takes every ``.py`` file below
    ``root``); a pattern starting with ``!`` leaves the files it matches out.
    """
    if root.is_file():
        if glob is not None:
            raise SourceError(f"--text-glob chooses files of a directory; {root} is a file")
        files = [_version(os.path.abspath(root), root.name)]
    else:
        take, leave = _patterns(glob or DEFAULT_GLOB)
        takes, leaves = _matcher(take), _matcher(leave) if leave else None
        # A pattern ending in * that matches "dir/" matches everything below dir: such a
        # directory is not walked at all (site-packages below the standard library).
        prunes = _matcher([p for p in leave if p.endswith("*")]) \
            if any(p.endswith("*") for p in leave) else None
        top = os.path.abspath(root)
        files = []
        for directory, subdirectories, names in os.walk(top):
            rel = os.path.relpath(directory, top)
            prefix = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            if prunes is not None:
                subdirectories[:] = [d for d in subdirectories
                                     if not prunes.match(f"{prefix}{d}/")]
            for name in names:
                relative = prefix + name
                if takes.match(relative) and not (leaves and leaves.match(relative)):
                    files.append(_version(os.path.join(directory, name), relative))
        if not any(files):
            raise SourceError(f"no files in {root} match --text-glob {glob or DEFAULT_GLOB!r}")
    chosen = sorted((f for f in files if f is not None), key=lambda f: f.name)
    documents = [f for f in chosen if f.size > 0]
    if not documents:
        raise SourceError(f"text corpus {root} is empty: its {len(chosen)} file(s) hold no "
                          "bytes")
    return documents, len(chosen) - len(documents)


def file_pieces(files: list[CorpusFile], piece_bytes: int = PIECE_BYTES,
                cut_bytes: int = PIECE_BYTES) -> list[list[FilePart]]:
    """The files in order, grouped into pieces of about ``piece_bytes``.

    A file larger than ``cut_bytes`` is cut into parts at fixed offsets (multiples of
    ``cut_bytes``, moved to line starts when read), whatever ``piece_bytes`` is: how a
    corpus is grouped into tasks then never changes its tokens.
    """
    pieces: list[list[FilePart]] = []
    current: list[FilePart] = []
    room = piece_bytes
    for file in files:
        for start in range(0, file.size, cut_bytes):
            part = FilePart(file, start, min(file.size, start + cut_bytes))
            if current and part.stop - part.start > room:
                pieces.append(current)
                current, room = [], piece_bytes
            current.append(part)
            room -= part.stop - part.start
    if current:
        pieces.append(current)
    return pieces


def _table_files(path: Path, suffix: str) -> list[Path]:
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() == suffix) \
        if path.is_dir() else [path]
    if not files:
        raise SourceError(f"{path} holds no {suffix} files")
    return files


def _check_column(path: Path, column: str, parquet: bool) -> None:
    """Refuse a missing column, or a Parquet column that holds no text, by name."""
    try:
        if parquet:
            schema = pq.read_schema(path)
            names = list(schema.names)
        else:
            names = list(pd.read_csv(path, nrows=0).columns)
    except (OSError, ValueError, pa.ArrowException, pd.errors.ParserError) as exc:
        raise SourceError(f"cannot read {path}: {exc}") from exc
    if column not in names:
        raise SourceError(f"{path} has no column {column!r} (--text-column); columns: {names}")
    if parquet:
        kind = schema.field(column).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
                or getattr(pa.types, "is_string_view", lambda _: False)(kind)):
            raise SourceError(f"column {column!r} of {path} holds {kind}, not text "
                              "(--text-column takes a column of strings)")


def table_pieces(path: Path, suffix: str, column: str) -> list[TablePiece]:
    """The pieces of a table's text column: CSV files whole, Parquet files by row group.

    Raises
    ------
    SourceError
        A file lacks the column, a Parquet column is not text, or the table has no rows.
    """
    parquet = suffix in (".parquet", ".pq")
    pieces, rows = [], 0
    for file in _table_files(path, suffix):
        _check_column(file, column, parquet)
        version = _version(os.path.abspath(file), file.name)
        if parquet:
            metadata = pq.ParquetFile(file).metadata
            rows += metadata.num_rows
            pieces.extend(TablePiece(version, column, g) for g in range(metadata.num_row_groups)
                          if metadata.row_group(g).num_rows)
        else:
            try:
                rows += len(pd.read_csv(file, nrows=1, usecols=[column]))
            except pd.errors.EmptyDataError:
                continue
            pieces.append(TablePiece(version, column, None))
    if rows == 0:
        raise SourceError(f"text corpus {path} is empty: no rows")
    return pieces
