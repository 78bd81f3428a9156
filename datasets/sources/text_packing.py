"""Packing a corpus's token stream into (input, next-token target) pairs, and reading any
rows of them where they are written.

The stream ``S`` is every document's tokens followed by the end-of-text id, documents in
corpus order. Row ``r`` of the dataset is the window ``S[r*L : r*L + L + 1]`` of
``L + 1`` tokens (``L`` the sequence length), stored as its input ``x = S[r*L : r*L + L]``
and its target ``y = S[r*L + 1 : r*L + L + 1]``: consecutive windows overlap by one token,
so every token of the stream but the first is a target exactly once. A stream of ``T``
tokens gives ``(T - 1) // L`` rows; the last ``T - 1 - rows*L`` tokens (fewer than ``L``)
are left out, and counted in the dataset's attributes.

Row positions are known once every piece's token count is (:func:`piece_offsets`): a
corpus read with the byte tokenizer knows them from its files' sizes; any other is counted
by tokenising it first (:mod:`.text_tokenize`). Either way a task reads the tokens of its
rows itself, from the files (:class:`FileStream`) or from the pieces' streams in the
scratch directory (:class:`ScratchStream`), so memory stays bounded by a chunk's tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Protocol

import numpy as np

from dasktrain.datasets.errors import SourceError
from dasktrain.datasets.sources.text_corpus import CorpusFile
from dasktrain.datasets.sources.text_tokenize import check_version, piece_path
from dasktrain.datasets.stats import IntegerSums, Moments

__all__ = [
    "FileStream",
    "PackedRows",
    "ScratchStream",
    "TokenStream",
    "pairs",
    "sequences_in",
    "write_file_index",
    "write_piece_offsets",
]


def sequences_in(total_tokens: int, seq_len: int) -> int:
    """Rows of ``seq_len`` (input, target) pairs a stream of ``total_tokens`` gives."""
    return max(0, (total_tokens - 1) // seq_len)


def pairs(tokens: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
    """``{"x": inputs, "y": targets}`` of consecutive windows of ``tokens``, whose length
    is a multiple of ``seq_len`` plus one; views of ``tokens``, no copy."""
    rows = (len(tokens) - 1) // seq_len
    assert len(tokens) == rows * seq_len + 1, "a whole number of windows"
    return {"x": tokens[:-1].reshape(rows, seq_len), "y": tokens[1:].reshape(rows, seq_len)}


class TokenStream(Protocol):
    """Any run of a corpus's token stream, read where it is asked for."""

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the stream, in the stored dtype."""
        ...


def write_piece_offsets(scratch: str, counts: list[int]) -> np.ndarray:
    """Record where each piece's tokens start in the stream (and the total, last)."""
    offsets = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    np.save(os.path.join(scratch, "offsets.npy"), offsets)
    return offsets


@functools.lru_cache(maxsize=8)
def _offsets(scratch: str) -> np.ndarray:
    # Read once per worker process: every build has a scratch directory of its own.
    return np.load(os.path.join(scratch, "offsets.npy"))


@dataclasses.dataclass(frozen=True, slots=True)
class ScratchStream:
    """The stream of a tokenised corpus, kept piece by piece in the scratch directory."""

    scratch: str
    dtype: str

    def read(self, start: int, stop: int) -> np.ndarray:
        offsets = _offsets(self.scratch)
        dtype = np.dtype(self.dtype)
        out = np.empty(stop - start, dtype)
        piece = int(np.searchsorted(offsets, start, side="right")) - 1
        position = start
        while position < stop:
            first = int(offsets[piece])
            low, high = position - first, min(stop, int(offsets[piece + 1])) - first
            if high > low:
                out[position - start : position - start + high - low] = np.fromfile(
                    piece_path(self.scratch, piece), dtype=dtype, count=high - low,
                    offset=low * dtype.itemsize)
            position = first + high
            piece += 1
        return out


def write_file_index(scratch: str, files: list[CorpusFile]) -> np.ndarray:
    """Record the files of a corpus read byte by byte, and where each starts in the stream
    (its bytes, then the end-of-text id): the tasks read it from here rather than each
    carrying the list."""
    starts = np.concatenate([[0], np.cumsum([f.size + 1 for f in files], dtype=np.int64)])
    with open(os.path.join(scratch, "files.json"), "w", encoding="utf-8") as out:
        # One write: json.dump writes each token of the document (tens of thousands here)
        out.write(json.dumps([f.row() for f in files]))
    np.save(os.path.join(scratch, "starts.npy"), starts)
    return starts


@functools.lru_cache(maxsize=8)
def _file_index(scratch: str) -> tuple[list[CorpusFile], np.ndarray]:
    with open(os.path.join(scratch, "files.json"), encoding="utf-8") as index:
        files = [CorpusFile(*entry) for entry in json.load(index)]
    return files, np.load(os.path.join(scratch, "starts.npy"))


def _read_bytes(file: CorpusFile, low: int, high: int) -> np.ndarray:
    try:
        with open(file.path, "rb") as fh:
            check_version(file, fh)
            fh.seek(low)
            data = fh.read(high - low)
    except FileNotFoundError:
        raise SourceError(f"{file.path} was removed while the corpus was being prepared"
                          ) from None
    if len(data) != high - low:
        raise SourceError(f"{file.path} changed while the corpus was being prepared; "
                          "prepare it again")
    return np.frombuffer(data, dtype=np.uint8)


@dataclasses.dataclass(frozen=True, slots=True)
class FileStream:
    """The stream of a corpus read with the byte tokenizer: its files' bytes themselves,
    each file followed by the end-of-text id, so tokenising is reading."""

    scratch: str
    dtype: str
    eot_id: int

    def read(self, start: int, stop: int) -> np.ndarray:
        files, starts = _file_index(self.scratch)
        out = np.empty(stop - start, np.dtype(self.dtype))
        index = int(np.searchsorted(starts, start, side="right")) - 1
        position = start
        while position < stop:
            file, first = files[index], int(starts[index])
            low, high = position - first, min(stop - first, file.size + 1)
            if min(high, file.size) > low:
                at = position - start
                out[at : at + min(high, file.size) - low] = _read_bytes(
                    file, low, min(high, file.size))
            if high == file.size + 1:
                out[first + file.size - start] = self.eot_id
            position = first + high
            index += 1
        return out


@dataclasses.dataclass(frozen=True, slots=True)
class PackedRows:
    """Rows ``[start, stop)`` of a token dataset (a :data:`BlockReader`): the stream's
    tokens ``[start*L, stop*L + 1)``, as inputs and targets."""

    stream: FileStream | ScratchStream
    seq_len: int

    def __call__(self, start: int, stop: int) -> dict[str, np.ndarray]:
        tokens = self.stream.read(start * self.seq_len, stop * self.seq_len + 1)
        return pairs(tokens, self.seq_len)

    @staticmethod
    def summaries(rows: dict[str, np.ndarray]) -> dict[str, Moments]:
        """The pooled statistics of rows this reader gave: the inputs and targets share all
        but one token at each end, so what they share is summed once (the statistics were
        a sixth of a preparation's time, measured with the byte tokenizer). Equal to
        :meth:`Moments.of_all` of each, exactly."""
        x, y = rows["x"].reshape(-1), rows["y"].reshape(-1)
        shared = IntegerSums.of(x[1:])  # == y[:-1]
        if shared is None:
            return {"x": Moments.of_all(x), "y": Moments.of_all(y)}
        return {"x": shared.plus(int(x[0])).moments(), "y": shared.plus(int(y[-1])).moments()}
