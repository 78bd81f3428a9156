"""Preparation settings: one dataclass shared by the Python API, the CLI and config files."""

from __future__ import annotations

import dataclasses

from dasktrain.datasets.format import DEFAULT_CHUNK_BYTES, parse_size
from dasktrain.datasets.image_codec import FITS, parse_image_size
from dasktrain.datasets.sources.base import SourceSettings
from dasktrain.datasets.sources.named import parse_array_choices
from dasktrain.datasets.splits import parse_splits

__all__ = ["COMPRESSIONS", "PrepareConfig"]

COMPRESSIONS = ("zstd", "blosc", "none")


@dataclasses.dataclass(kw_only=True, slots=True)
class PrepareConfig(SourceSettings):
    """How :func:`dasktrain.prepare` builds a dataset.

    The fields that choose what is read from the source (``features``, ``target``,
    ``encode_categorical``, ``samples``, ``width``, ``classes``, ``noise``, ``seed``) are
    declared once, on :class:`~dasktrain.datasets.sources.base.SourceSettings`, and
    inherited; the ones below say how the dataset is written.
    """

    chunk_rows: int | None = None
    """Samples per chunk; default: as many as fit in ``chunk_size``."""
    chunk_size: str | int = DEFAULT_CHUNK_BYTES
    """Target bytes per chunk of all arrays together, e.g. ``"4MiB"``."""
    normalize: bool = False
    """Standardise features with the mean and std of the first split (train)."""
    split: str | dict[str, float] | None = None
    """Named random splits, e.g. ``"train=0.9,val=0.1"``; sizes are exact."""
    compression: str = "zstd"
    """Chunk codec: ``zstd``, ``blosc`` (zstd inside, byte-shuffled) or ``none``."""
    overwrite: bool = False
    """Replace an existing dataset at the output path."""

    def __post_init__(self) -> None:
        if isinstance(self.features, str):
            self.features = [c.strip() for c in self.features.split(",") if c.strip()]
        if self.arrays is not None:
            # One string is one choice (its commas are a column group's): checked here, so
            # that a mistake is refused before any cluster starts.
            self.arrays = [self.arrays] if isinstance(self.arrays, str) else list(self.arrays)
            parse_array_choices(self.arrays)
            if self.features or self.target is not None:
                raise ValueError("give either arrays (--array) or features/target "
                                 "(--features/--target), not both")
        if self.chunk_rows is not None and self.chunk_rows <= 0:
            raise ValueError(f"chunk_rows must be positive, got {self.chunk_rows}")
        self.chunk_size = parse_size(self.chunk_size)
        self.split = parse_splits(self.split)
        if self.compression not in COMPRESSIONS:
            raise ValueError(
                f"compression {self.compression!r} is unknown; use one of {COMPRESSIONS}"
            )
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        if self.samples is not None and self.samples <= 0:
            raise ValueError(f"samples must be positive, got {self.samples}")
        if self.seq_len is not None and (isinstance(self.seq_len, bool)
                                         or not isinstance(self.seq_len, int)
                                         or self.seq_len < 1):
            raise ValueError(f"seq_len must be a positive integer, got {self.seq_len!r}")
        if self.image_storage not in (None, "decoded", "encoded"):
            raise ValueError(f"image_storage must be 'decoded' or 'encoded', got "
                             f"{self.image_storage!r}")
        if self.image_fit not in FITS:
            raise ValueError(f"image_fit must be one of {FITS}, got {self.image_fit!r}")
        parse_image_size(self.image_size)  # refuses what is not N or HxW
