"""Tokenizers of text corpora: a built-in byte-level one, and any Hugging Face
``tokenizer.json`` given by path.

A token dataset records its tokenizer in its attributes (``attrs["text"]["tokenizer"]``):
the byte tokenizer by name, a ``tokenizer.json`` by path and SHA-256, so that
:func:`load_tokenizer` gives back the same tokenizer to decode with, and refuses a file
that has changed since. Nothing is ever fetched from a hub: a ``tokenizer.json`` is a file
the user has.

Both kinds pickle small enough to travel inside Dask tasks: the byte tokenizer is a few
fields, a ``tokenizer.json`` travels as its text and is parsed once per process.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from dasktrain.datasets.errors import DatasetError, SourceError

if TYPE_CHECKING:
    from dasktrain.datasets.dataset import Dataset

__all__ = [
    "EOT_CANDIDATES",
    "ByteTokenizer",
    "HuggingFaceTokenizer",
    "Tokenizer",
    "get_tokenizer",
    "load_tokenizer",
    "token_dtype",
    "vocabulary_of",
]

#: End-of-text tokens looked for, in this order, in a ``tokenizer.json`` when none is named.
EOT_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<|eot_id|>")
#: How :meth:`ByteTokenizer.decode` writes the end-of-text token.
BYTE_EOT_TEXT = "<|endoftext|>"
_INSTALL = "reading a tokenizer.json needs the tokenizers package: pip install 'dasktrain[text]'"


class Tokenizer(Protocol):
    """What a text source needs of a tokenizer."""

    #: Number of token ids (every id lies in ``[0, vocab_size)``).
    vocab_size: int
    #: The id that ends every document in a packed token stream.
    eot_id: int
    #: Whether a document's token count is its size in bytes (then a corpus of files is
    #: packed without counting its tokens first).
    counts_are_bytes: bool

    def encode(self, text: bytes | str) -> np.ndarray:
        """Token ids of ``text`` (bytes are UTF-8; no special tokens added), as an integer
        array."""
        ...

    def decode(self, ids: Any) -> str:
        """The text of token ids (end-of-text tokens written as text)."""
        ...

    def record(self) -> dict[str, Any]:
        """What identifies this tokenizer, JSON-able, for the dataset's attributes."""
        ...


def vocabulary_of(dataset: Dataset) -> tuple[str, int] | None:
    """``(input array, vocabulary size)`` of a token dataset, from its attributes (the
    tokenizer it was prepared with); None for any other dataset."""
    text = dataset.attrs.get("text") or {}
    size = (text.get("tokenizer") or {}).get("vocab_size")
    if size is None or text.get("input") is None:
        return None
    return str(text["input"]), int(size)


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned integer type that holds ids ``0 .. vocab_size - 1``."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise SourceError(f"a vocabulary of {vocab_size:,} tokens does not fit in 32 bits")


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0-255 are the bytes, 256 is the end of a text.

    Needs no file and never fails: any bytes are text to it, and decoding the ids of a
    document gives back its bytes exactly. A document's token count is its size in bytes,
    which lets a corpus of files be packed without counting first.
    """

    vocab_size = 257
    eot_id = 256
    #: A document's token count is its size in bytes (no count pass needed).
    counts_are_bytes = True

    def encode(self, text: bytes | str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8") if isinstance(text, str) else text,
                             dtype=np.uint8)

    def decode(self, ids: Any) -> str:
        """Bytes decoded as UTF-8 (a sequence cut inside a character shows U+FFFD there),
        each end-of-text id written as ``<|endoftext|>``."""
        ids = np.asarray(ids).ravel().astype(np.int64)
        if ids.size and (ids.min() < 0 or ids.max() > self.eot_id):
            raise ValueError(f"byte token ids lie in [0, {self.eot_id}], got {ids.min()}.."
                             f"{ids.max()}")
        texts, start = [], 0
        for end in [*np.flatnonzero(ids == self.eot_id).tolist(), len(ids)]:
            texts.append(ids[start:end].astype(np.uint8).tobytes().decode("utf-8",
                                                                          errors="replace"))
            start = end + 1
        return BYTE_EOT_TEXT.join(texts)

    def record(self) -> dict[str, Any]:
        return {"kind": "bytes", "vocab_size": self.vocab_size, "eot_id": self.eot_id,
                "eot_token": BYTE_EOT_TEXT}

    def __repr__(self) -> str:
        return "ByteTokenizer()"


@functools.lru_cache(maxsize=4)
def _parsed(sha256: str, text: str) -> Any:
    """A tokenizer.json parsed once per process (tasks of one build share it)."""
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError:
        raise SourceError(_INSTALL) from None
    return HFTokenizer.from_str(text)


class HuggingFaceTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer read from a ``tokenizer.json`` file.

    Parameters
    ----------
    path
        The ``tokenizer.json`` (made with ``tokenizer.save(...)`` or shipped with a model).
    eot_token
        The token that ends each document; default: the first of :data:`EOT_CANDIDATES`
        the tokenizer knows.
    """

    counts_are_bytes = False

    def __init__(self, path: str | os.PathLike, eot_token: str | None = None) -> None:
        file = Path(path)
        if not file.is_file():
            raise SourceError(f"tokenizer file {os.fspath(path)!r} does not exist; give "
                              "--tokenizer bytes or the path of a tokenizer.json")
        try:
            text = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise SourceError(f"cannot read tokenizer file {file}: {exc}") from exc
        self.path = str(file.resolve())
        self.sha256 = hashlib.sha256(text.encode("utf-8")).hexdigest()
        self._text = text
        try:
            tokenizer = _parsed(self.sha256, text)
        except SourceError:
            raise
        except Exception as exc:  # the Rust side raises plain Exceptions on bad files
            raise SourceError(f"cannot load tokenizer {file}: it is not a valid "
                              f"tokenizer.json ({exc})") from None
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        if eot_token is None:
            eot_token = next((t for t in EOT_CANDIDATES if tokenizer.token_to_id(t) is not None),
                             None)
            if eot_token is None:
                raise SourceError(
                    f"tokenizer {file} has none of the end-of-text tokens "
                    f"{', '.join(EOT_CANDIDATES)}; name its end-of-text token with "
                    "--eot-token")
        eot_id = tokenizer.token_to_id(eot_token)
        if eot_id is None:
            raise SourceError(f"tokenizer {file} has no token {eot_token!r} (--eot-token)")
        self.eot_token = eot_token
        self.eot_id = int(eot_id)

    @property
    def _tokenizer(self) -> Any:
        return _parsed(self.sha256, self._text)

    def encode(self, text: bytes | str) -> np.ndarray:
        # Bytes that are no UTF-8 raise UnicodeDecodeError: the caller names the file.
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.int64)

    def decode(self, ids: Any) -> str:
        return self._tokenizer.decode([int(i) for i in np.asarray(ids).ravel()],
                                      skip_special_tokens=False)

    def record(self) -> dict[str, Any]:
        return {"kind": "huggingface", "path": self.path, "sha256": self.sha256,
                "vocab_size": self.vocab_size, "eot_id": self.eot_id,
                "eot_token": self.eot_token}

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "sha256": self.sha256, "_text": self._text,
                "vocab_size": self.vocab_size, "eot_id": self.eot_id,
                "eot_token": self.eot_token}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"HuggingFaceTokenizer({self.path!r}, eot_token={self.eot_token!r})"


def get_tokenizer(spec: str | os.PathLike | None, eot_token: str | None = None
                  ) -> ByteTokenizer | HuggingFaceTokenizer:
    """The tokenizer ``spec`` names: ``None`` or ``"bytes"`` for the byte tokenizer, else
    the path of a ``tokenizer.json``.

    Raises
    ------
    SourceError
        The file is missing or not a tokenizer, the ``tokenizers`` package is not installed,
        or the end-of-text token is unknown.
    """
    if spec is None or os.fspath(spec) == "bytes":
        if eot_token is not None:
            raise SourceError("--eot-token names a token of a tokenizer.json; the byte "
                              f"tokenizer's end of text is id {ByteTokenizer.eot_id}")
        return ByteTokenizer()
    return HuggingFaceTokenizer(spec, eot_token)


def load_tokenizer(dataset: Dataset | str | os.PathLike, *,
                   path: str | os.PathLike | None = None
                   ) -> ByteTokenizer | HuggingFaceTokenizer:
    """The tokenizer a token dataset was prepared with, to decode its tokens (or encode a
    prompt).

    Parameters
    ----------
    dataset
        A token dataset (``dasktrain prepare`` of a text corpus), or its path.
    path
        Where its ``tokenizer.json`` is now, if it has moved; by default the path recorded.
        Either way the file must be the one recorded (same SHA-256).

    Raises
    ------
    DatasetError
        The dataset holds no tokens, or its ``tokenizer.json`` is gone or has changed.
    """
    from dasktrain.datasets.dataset import Dataset, open_dataset

    ds = dataset if isinstance(dataset, Dataset) else open_dataset(dataset)
    record = (ds.attrs.get("text") or {}).get("tokenizer")
    if record is None:
        raise DatasetError(f"{ds.url} is not a token dataset: it records no tokenizer")
    if record["kind"] == "bytes":
        return ByteTokenizer()
    where = os.fspath(path) if path is not None else record["path"]
    try:
        tokenizer = HuggingFaceTokenizer(where, record["eot_token"])
    except SourceError as exc:
        raise DatasetError(f"{ds.url} was tokenised with {record['path']}: {exc}; give "
                           "its new place with path=") from None
    if tokenizer.sha256 != record["sha256"]:
        raise DatasetError(f"{where} is not the tokenizer {ds.url} was prepared with: its "
                           f"SHA-256 is {tokenizer.sha256[:12]}..., the dataset records "
                           f"{record['sha256'][:12]}...")
    return tokenizer
