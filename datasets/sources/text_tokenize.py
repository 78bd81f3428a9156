"""What runs on the workers to count a corpus's tokens: each task tokenises one piece,
writes its token stream to the build's scratch directory and returns how many tokens it
holds.

A piece's stream is the tokens of its text, with the end-of-text id after every document
that ends in it; the corpus's stream is the pieces' streams in order. A task run twice
(a worker lost) writes the same bytes again, through a rename: a reader never sees half a
piece.
"""

from __future__ import annotations

import os
from typing import BinaryIO

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from dasktrain.datasets.errors import SourceError
from dasktrain.datasets.sources.text_corpus import CorpusFile, FilePart, TablePiece
from dasktrain.datasets.tokenizers import Tokenizer

__all__ = ["check_version", "piece_path", "read_part", "tokenize_files", "tokenize_table"]

_SCAN = 64 * 2**10  # bytes read at a time while looking for the next line start


def piece_path(scratch: str, index: int) -> str:
    """Where piece ``index`` keeps its token stream (raw, in the stored dtype)."""
    return os.path.join(scratch, f"tokens-{index:07d}.bin")


def check_version(file: CorpusFile, fh: BinaryIO) -> None:
    """Refuse a file that changed since the corpus was listed: its tokens would not be
    the ones counted, or the dataset not the corpus named in its provenance."""
    st = os.fstat(fh.fileno())
    if (st.st_size, st.st_mtime_ns) != (file.size, file.mtime_ns):
        raise SourceError(f"{file.path} changed while the corpus was being prepared (size "
                          f"{file.size:,} -> {st.st_size:,}); prepare it again")


def _line_start(fh: BinaryIO, position: int, size: int) -> int:
    """The first line start at or after ``position`` (a line starts after a newline)."""
    fh.seek(position - 1)
    while position - 1 < size:
        block = fh.read(_SCAN)
        if not block:
            break
        found = block.find(b"\n")
        if found >= 0:
            return position + found
        position += len(block)
    return size


def read_part(part: FilePart) -> tuple[bytes, int]:
    """The bytes of a part, its bounds moved to line starts, and where they start."""
    file = part.file
    try:
        with open(file.path, "rb") as fh:
            check_version(file, fh)
            start = 0 if part.start == 0 else _line_start(fh, part.start, file.size)
            stop = file.size if part.ends_document else _line_start(fh, part.stop, file.size)
            if stop <= start:
                return b"", start
            fh.seek(start)
            return fh.read(stop - start), start
    except FileNotFoundError:
        raise SourceError(f"{file.path} was removed while the corpus was being prepared"
                          ) from None


def _encode(tokenizer: Tokenizer, text: bytes, where: str) -> np.ndarray:
    try:
        return tokenizer.encode(text)
    except UnicodeDecodeError as exc:
        raise SourceError(f"{where} is not UTF-8 text ({exc.reason} at byte {exc.start:,} "
                          "of the part read); leave it out (--text-glob '...,!NAME') or use "
                          "--tokenizer bytes, which reads any bytes") from None


def _write_piece(scratch: str, index: int, parts: list[np.ndarray], dtype: np.dtype) -> int:
    tokens = np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)
    target = piece_path(scratch, index)
    tmp = f"{target}.{os.getpid()}.tmp"
    tokens.tofile(tmp)
    os.replace(tmp, target)
    return len(tokens)


def tokenize_files(tokenizer: Tokenizer, dtype: str, scratch: str, index: int,
                   parts: list[FilePart]) -> int:
    """Tokenise piece ``index`` (parts of files, in order) into the scratch directory;
    returns its number of tokens."""
    eot = np.array([tokenizer.eot_id], dtype=np.int64)
    stream = []
    for part in parts:
        text, start = read_part(part)
        stream.append(_encode(tokenizer, text, f"{part.file.path} (from byte {start:,})"))
        if part.ends_document:
            stream.append(eot)
    return _write_piece(scratch, index, stream, np.dtype(dtype))


def _cells(piece: TablePiece) -> list:
    file = piece.file
    with open(file.path, "rb") as fh:
        check_version(file, fh)
        if piece.row_group is not None:
            table = pq.ParquetFile(fh).read_row_group(piece.row_group, columns=[piece.column])
            return table.column(piece.column).to_pylist()
        # Every cell as it is written: "NA" or "null" are words of a text, not missing.
        frame = pd.read_csv(fh, usecols=[piece.column], dtype=str, keep_default_na=False,
                            na_filter=False)
        return frame[piece.column].tolist()


def tokenize_table(tokenizer: Tokenizer, dtype: str, scratch: str, index: int,
                   piece: TablePiece) -> tuple[int, int, int]:
    """Tokenise the cells of a table piece into the scratch directory, each a document.

    Returns (tokens, documents, cells left out as empty or missing).
    """
    eot = np.array([tokenizer.eot_id], dtype=np.int64)
    stream, documents, empty = [], 0, 0
    where = piece.file.path + ("" if piece.row_group is None
                               else f" row group {piece.row_group}")
    for row, cell in enumerate(_cells(piece)):
        if not cell:  # None (a missing cell) or ""
            empty += 1
            continue
        text = cell.encode("utf-8", errors="surrogatepass")
        stream.append(_encode(tokenizer, text, f"{where} row {row:,}"))
        stream.append(eot)
        documents += 1
    return _write_piece(scratch, index, stream, np.dtype(dtype)), documents, empty
