"""Epoch plans: which rows, in which order, in which batch, for which rank — no I/O.

An epoch plan is a pure function of (sample range, block size, batch size, seed, epoch,
shuffle settings). It fixes one *global* sequence of samples per epoch:

1. the range is cut into blocks of ``block_rows`` rows, and the blocks are permuted;
2. consecutive runs of ``shuffle_blocks`` permuted blocks form windows; rows are shuffled
   within each window (a buffer shuffle of ``shuffle_blocks`` blocks);
3. the windows, concatenated, are cut into global batches of ``batch_size``.

Rank ``r`` of ``world_size`` takes global batches ``r, r + W, r + 2W, ...``: every sample is
seen once per epoch across ranks, and step ``k`` of W ranks together covers exactly global
batches ``kW .. kW + W - 1`` whatever W is. Nothing depends on the cluster or on which worker
computes what.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

__all__ = ["EpochPlan", "Piece", "Unit"]


@dataclasses.dataclass(frozen=True, slots=True)
class Piece:
    """Rows ``[start, stop)`` of window ``window`` (positions in the shuffled window)."""

    window: int
    start: int
    stop: int


@dataclasses.dataclass(frozen=True, slots=True)
class Unit:
    """The batches of one rank that start in one window: one prefetchable piece of work."""

    window: int
    windows: tuple[int, ...]  # every window the batches touch (this one, maybe the next)
    batches: tuple[int, ...]  # global batch indices, in order
    pieces: tuple[tuple[Piece, ...], ...]  # per batch, where its rows are
    # True when every batch touching this window is in this unit and none leaves it: the
    # window can then be read and cut in one task, shared with nobody.
    exclusive: bool = False


@dataclasses.dataclass(frozen=True)
class EpochPlan:
    """The order of one epoch over rows ``[start, stop)``; see the module docstring."""

    start: int
    stop: int
    block_rows: int
    batch_size: int
    seed: int
    epoch: int
    shuffle: bool = True
    shuffle_blocks: int = 1
    drop_last: bool = False

    def __post_init__(self) -> None:
        if self.stop <= self.start:
            raise ValueError(f"empty sample range [{self.start}, {self.stop})")
        for name in ("block_rows", "batch_size", "shuffle_blocks"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.epoch < 0 or self.seed < 0:
            raise ValueError("seed and epoch must be non-negative")

    @property
    def num_samples(self) -> int:
        return self.stop - self.start

    @property
    def num_batches(self) -> int:
        """Global batches in the epoch (the last one partial unless ``drop_last``)."""
        if self.drop_last:
            return self.num_samples // self.batch_size
        return math.ceil(self.num_samples / self.batch_size)

    @functools.cached_property
    def block_order(self) -> np.ndarray:
        """Block ids (0 = first ``block_rows`` rows of the range) in epoch order."""
        count = math.ceil(self.num_samples / self.block_rows)
        if not self.shuffle:
            return np.arange(count)
        return np.random.default_rng([self.seed, self.epoch, 0]).permutation(count)

    def block_range(self, block: int) -> tuple[int, int]:
        """Absolute rows ``[a, b)`` of a block."""
        a = self.start + block * self.block_rows
        return a, min(a + self.block_rows, self.stop)

    @functools.cached_property
    def windows(self) -> list[tuple[int, ...]]:
        """Block ids of each window, in epoch order."""
        order = self.block_order.tolist()
        k = self.shuffle_blocks
        return [tuple(order[i : i + k]) for i in range(0, len(order), k)]

    @functools.cached_property
    def window_offsets(self) -> np.ndarray:
        """Offset of each window in the global sequence, plus the total at the end."""
        sizes = [sum(b - a for a, b in map(self.block_range, w)) for w in self.windows]
        return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    def window_permutation(self, window: int) -> np.ndarray | None:
        """Row order inside a window (None: kept as read)."""
        if not self.shuffle:
            return None
        size = int(self.window_offsets[window + 1] - self.window_offsets[window])
        return np.random.default_rng([self.seed, self.epoch, 1, window]).permutation(size)

    def block_seed(self, block: int) -> list[int]:
        """Seed of the RNG a transform gets for ``block`` in this epoch."""
        return [self.seed, self.epoch, 2, block]

    def sample_order(self) -> np.ndarray:
        """Absolute row of every position of the global sequence (O(samples) memory: for
        tests and inspection, never needed to iterate)."""
        parts = []
        for w, blocks in enumerate(self.windows):
            rows = np.concatenate([np.arange(*self.block_range(b)) for b in blocks])
            order = self.window_permutation(w)
            parts.append(rows if order is None else rows[order])
        return np.concatenate(parts)

    def batch_pieces(self, batch: int) -> tuple[Piece, ...]:
        """Where global batch ``batch``'s rows lie, window by window."""
        g0 = batch * self.batch_size
        g1 = min(g0 + self.batch_size, self.num_samples)
        offsets = self.window_offsets
        pieces = []
        w = int(np.searchsorted(offsets, g0, side="right")) - 1
        while g0 < g1:
            w_end = int(offsets[w + 1])
            take = min(g1, w_end)
            pieces.append(Piece(w, g0 - int(offsets[w]), take - int(offsets[w])))
            g0 = take
            w += 1
        return tuple(pieces)

    def rank_batches(self, rank: int, world_size: int) -> range:
        """Global batch indices of ``rank``, in order."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        return range(rank, self.num_batches, world_size)

    def units(self, rank: int = 0, world_size: int = 1) -> list[Unit]:
        """The rank's batches grouped by the window they start in, in order."""
        groups: dict[int, list[tuple[int, tuple[Piece, ...]]]] = {}
        for batch in self.rank_batches(rank, world_size):
            pieces = self.batch_pieces(batch)
            groups.setdefault(pieces[0].window, []).append((batch, pieces))
        units = []
        for window, items in groups.items():
            touched = tuple(sorted({p.window for _, pieces in items for p in pieces}))
            batches = tuple(b for b, _ in items)
            units.append(Unit(window, touched, batches, tuple(p for _, p in items),
                              touched == (window,)
                              and set(self.window_batches(window)) <= set(batches)))
        return units

    def window_batches(self, window: int) -> range:
        """Global batches with rows in ``window``."""
        offsets = self.window_offsets
        first = int(offsets[window]) // self.batch_size
        last = min((int(offsets[window + 1]) - 1) // self.batch_size, self.num_batches - 1)
        return range(first, last + 1)
