"""Text corpora as token datasets for language modelling: files, a directory of them, or
a text column of CSV/Parquet files, tokenised on the cluster and packed into fixed-length
(input, next-token target) pairs.

The dataset holds two arrays of ``seq_len`` tokens per row, ``x`` (features) and ``y``
(targets), ``y`` being ``x`` shifted by one token (see :mod:`.text_packing`). Storing the
target beside the input costs twice the bytes of one array of ``seq_len + 1`` tokens, and
buys that a token dataset is a dataset like any other: the pipeline in every placement,
``evaluate``, ``predict``, splits, ``verify`` and ``sync``'s equality with one process all
serve ``(x, y)`` pairs with no code of their own for text. Tokens are stored as the
smallest unsigned integers that hold the vocabulary (uint16 for the byte tokenizer's 257
ids and for vocabularies up to 65,536; uint8 and uint32 where those fit).

Preparation takes one pass where the token count of every document is known up front (the
byte tokenizer over files: a file's tokens are its bytes), else two: a count pass
tokenises each piece of the corpus into the build's scratch directory (Dask tasks, memory
bounded by a piece), then the write tasks read their rows' tokens from there.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import dask.array as da
import numpy as np
from dask.base import tokenize
from distributed import Client

from dasktrain._progress import gather_with_progress
from dasktrain.datasets.errors import SourceError
from dasktrain.datasets.format import chunk_lengths
from dasktrain.datasets.sources.base import (
    ArraySpec,
    BlockReader,
    SourceOptions,
    register_options,
    register_suffix,
    suffix_of,
)
from dasktrain.datasets.sources.text_corpus import (
    PIECE_BYTES,
    file_pieces,
    list_files,
    table_pieces,
)
from dasktrain.datasets.sources.text_packing import (
    FileStream,
    PackedRows,
    ScratchStream,
    sequences_in,
    write_file_index,
    write_piece_offsets,
)
from dasktrain.datasets.sources.text_tokenize import tokenize_files, tokenize_table
from dasktrain.datasets.tokenizers import get_tokenizer, token_dtype

__all__ = ["DEFAULT_SEQ_LEN", "TEXT_OPTIONS", "TextSource"]

#: Tokens per sequence when ``seq_len`` is not given (GPT-2's context).
DEFAULT_SEQ_LEN = 1024
#: The settings that make any source a text corpus.
TEXT_OPTIONS = ("text_column", "text_glob", "tokenizer", "seq_len", "eot_token")
#: The smallest piece the count pass cuts (below it a task costs more than its work).
_MIN_PIECE_BYTES = 64 * 2**10
_TABLES = (".csv", ".parquet", ".pq")
_ARRAYS = (".npy", ".npz")


def _block(reader: PackedRows, name: str, block_info: dict | None = None) -> np.ndarray:
    (start, stop) = block_info[None]["array-location"][0]
    return reader(start, stop)[name]


class TextSource:
    """A text corpus, tokenised and packed into rows of ``seq_len`` (input, target) pairs.

    * a file (any suffix but a table's or an array's), or a directory whose files
      ``text_glob`` chooses (default ``*.txt``): each file is a document;
    * a CSV or Parquet file (or a directory of them) with ``text_column``: each non-empty
      cell is a document.
    """

    known_finite = True

    def __init__(self, source: str, options: SourceOptions) -> None:
        path = Path(source)
        if not path.exists():
            raise SourceError(
                f"text source {source!r} is not a file or directory that exists (text "
                f"options such as --seq-len apply to text files, directories of them and "
                f"table columns)")
        self.seq_len = DEFAULT_SEQ_LEN if options.seq_len is None else options.seq_len
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) \
                or self.seq_len < 1:
            raise SourceError(f"seq_len must be a positive integer, got {self.seq_len!r}")
        self.tokenizer = get_tokenizer(options.tokenizer, options.eot_token)
        self.dtype = token_dtype(self.tokenizer.vocab_size)
        self.specs = {"x": ArraySpec("features", self.dtype, (self.seq_len,), pooled=True),
                      "y": ArraySpec("targets", self.dtype, (self.seq_len,), pooled=True)}
        self.labels: dict[str, list[str]] = {}
        self._scratch = options.scratch_dir or tempfile.mkdtemp(prefix="dasktrain-text-")
        self._path = path
        self.num_samples = -1  # known once the tokens are counted
        self._documents = self._empty = self._tokens = 0
        self._stream: FileStream | ScratchStream | None = None
        self._files: list = []
        self._pieces: list = []
        kind = (self._table(path, options) if options.text_column is not None
                else self._text_files(path, options))
        self.provenance: dict[str, Any] = {
            "kind": "text", "path": str(path.resolve()), **kind,
            "tokenizer": self.tokenizer.record(), "seq_len": self.seq_len}

    def _table(self, path: Path, options: SourceOptions) -> dict[str, Any]:
        """A table's text column: its pieces, counted by :meth:`scan`."""
        if options.text_glob is not None:
            raise SourceError("--text-glob chooses files of a directory of text; a "
                              "table's documents are the cells of --text-column")
        suffix = suffix_of(path)
        if suffix not in _TABLES:
            raise SourceError(f"--text-column names a column of CSV or Parquet files; "
                              f"{path} is not one")
        self._pieces = table_pieces(path, suffix, options.text_column)
        return {"corpus": "table", "column": options.text_column}

    def _text_files(self, path: Path, options: SourceOptions) -> dict[str, Any]:
        """Files of text, each a document: with the byte tokenizer their rows are known
        now, from their sizes; else :meth:`scan` counts their tokens."""
        suffix = path.suffix.lower()
        if path.is_file() and suffix in _TABLES:
            raise SourceError(f"{path} is a table: name its column of documents with "
                              "--text-column")
        if path.is_file() and suffix in _ARRAYS:
            raise SourceError(f"{path} holds arrays, not text; text options such as "
                              "--seq-len apply to text sources")
        self._files, self._empty = list_files(path, options.text_glob)
        self._documents = len(self._files)
        if self.tokenizer.counts_are_bytes:
            # Every token's place is known from the files' sizes: no count pass.
            Path(self._scratch).mkdir(parents=True, exist_ok=True)
            starts = write_file_index(self._scratch, self._files)
            self._stream = FileStream(self._scratch, self.dtype.str, self.tokenizer.eot_id)
            self._counted(int(starts[-1]))
        return {"corpus": "files", "files": len(self._files), "glob": options.text_glob}

    def _counted(self, tokens: int) -> None:
        """Rows known: the stream holds ``tokens`` tokens."""
        self._tokens = tokens
        self.num_samples = sequences_in(tokens, self.seq_len)
        if self.num_samples == 0:
            raise SourceError(
                f"text corpus {self._path} holds {tokens:,} tokens, fewer than the "
                f"{self.seq_len + 1:,} one sequence needs (--seq-len {self.seq_len} + 1); "
                "use a smaller --seq-len or more text")

    def scan(self, client: Client, progress: bool) -> None:
        """The count pass (where the tokens are not known from the files' sizes): every
        piece tokenised into the scratch directory by a Dask task, its tokens counted."""
        if self._stream is not None:
            return
        Path(self._scratch).mkdir(parents=True, exist_ok=True)
        if self._files:
            # Pieces small enough that every worker thread gets several (so that the last
            # ones leave none idle for long), up to PIECE_BYTES.
            slots = max(1, sum(client.nthreads().values()))
            total = sum(f.size for f in self._files)
            self._pieces = file_pieces(self._files, min(PIECE_BYTES, max(
                _MIN_PIECE_BYTES, -(-total // (8 * slots)))))
        # One copy per worker, not one per task: a tokenizer.json may weigh megabytes.
        [tokenizer] = client.scatter([self.tokenizer], broadcast=True, hash=False)
        dtype = self.dtype.str
        task = tokenize_files if self._files else tokenize_table
        futures = [client.submit(task, tokenizer, dtype, self._scratch, index, piece,
                                 pure=False)
                   for index, piece in enumerate(self._pieces)]
        try:
            results = gather_with_progress(client, futures, "tokenising", progress)
        finally:
            client.cancel([tokenizer])
        if self._files:
            counts = results
        else:
            counts = [tokens for tokens, _, _ in results]
            self._documents = sum(documents for _, documents, _ in results)
            self._empty = sum(empty for _, _, empty in results)
            if self._documents == 0:
                column = self.provenance["column"]
                raise SourceError(f"text corpus {self._path} is empty: its {self._empty:,} "
                                  f"cell(s) of column {column!r} are all empty or missing")
        offsets = write_piece_offsets(self._scratch, counts)
        self._stream = ScratchStream(self._scratch, self.dtype.str)
        self._counted(int(offsets[-1]))

    @property
    def attributes(self) -> dict[str, Any]:
        """The ``"text"`` entry of the dataset's attributes: how to read its tokens."""
        kept = self.num_samples * self.seq_len + 1
        return {"text": {
            "tokenizer": self.tokenizer.record(), "seq_len": self.seq_len,
            "dtype": str(self.dtype), "input": "x", "target": "y",
            "documents": self._documents, "empty_documents_skipped": self._empty,
            "tokens": self._tokens, "tokens_dropped": self._tokens - kept}}

    def _reader(self) -> PackedRows:
        if self._stream is None:
            raise RuntimeError("the corpus is read before its tokens are counted: call "
                               "scan(client, progress) first")
        return PackedRows(self._stream, self.seq_len)

    def to_dask(self, chunk_rows: int) -> dict[str, da.Array]:
        reader = self._reader()
        n = self.num_samples
        chunks = chunk_lengths(n, chunk_rows)
        # Safe as a key: the scratch directory is the build's own, and what it holds a
        # pure function of the listed corpus (file versions), tokenizer and seq_len.
        token = tokenize(self.provenance, [f.row() for f in self._files], self._pieces,
                         self._scratch, chunk_rows)
        return {name: da.map_blocks(
                    _block, reader, name, dtype=spec.dtype,
                    chunks=(chunks, (self.seq_len,)),
                    meta=np.empty((0, self.seq_len), spec.dtype), name=f"text-{name}-{token}")
                for name, spec in self.specs.items()}

    def block_reader(self) -> BlockReader:
        return self._reader()


@register_suffix(".txt")
@register_options(*TEXT_OPTIONS)
def _text_source(source: str, options: SourceOptions) -> TextSource:
    return TextSource(source, options)

