"""Epoch plans: which rows, in which order, in which batch, for which rank — no I/O.

An epoch plan is a pure function of (sample range, block size, batch size, seed, epoch,
shuffle settings). It fixes one *global* sequence of samples per epoch:

1. the range is cut into blocks of ``block_rows`` rows, and the blocks are permuted;
2. consecutive runs of ``shuffle_blocks`` permuted blocks form *groups*; rows are shuffled
   within each group (a buffer shuffle of ``shuffle_blocks`` blocks);
3. the groups, concatenated, are cut into global batches of ``batch_size``; or, with
   ``shares`` (rows per rank, ``world_size x batch_size`` in all), into lock-step *steps* of
   that many rows, of which rank ``r`` takes the ``shares[r]`` rows after those of ranks
   ``0..r-1``: global batch ``kW + r`` is rank ``r``'s part of step ``k``. Even shares are the
   global batches of ``batch_size``; uneven ones give a faster rank more of each step's rows
   while the rows of every step, and so what a lock-step mode trains on, stay the same.

The transform sees each group's shuffled rows in *pieces* of ``piece_rows`` rows (a multiple
of the batch size), each with an RNG seeded by (seed, epoch, group, piece): neither the order
nor what the transform makes of a row depends on how the work is cut into tasks. The epoch's
first piece is one batch (and the next one the rest of a regular piece), so that the first
batch waits for one batch of transform work, not two or more.

Work is cut into *windows*: runs of whole pieces of one group, the rows one task reads and
transforms. A window holds at most ``task_rows`` rows (whole pieces, at least one), so that
a task stays short whatever the block size; with ``ramp``, the first windows of an epoch
are smaller still (1, 2, 4, ... pieces) so that the first batch waits for one piece of
transform work, not a whole group's.

Work is handed out in one of two ways. Claimed on demand (:meth:`EpochPlan.unit_of`, for a
trainer's asynchronous modes), a run of consecutive global batches is one unit, whoever
takes it. Or by rank:
rank ``r`` of ``world_size`` takes global batches ``r, r + W, r + 2W, ...``: every sample is
seen once per epoch across ranks, and step ``k`` of W ranks together covers exactly global
batches ``kW .. kW + W - 1`` whatever W is. Nothing depends on the cluster or on which worker
computes what.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

__all__ = ["EpochPlan", "Piece", "Unit", "Window", "check_shares", "run_pieces"]

#: Fewest rows the transform sees at a time (rounded up to whole batches).
MIN_PIECE_ROWS = 256
#: Default cap on the rows of one window (one task's work).
TASK_ROWS = 2048


@dataclasses.dataclass(frozen=True, slots=True)
class Window:
    """Positions ``[start, stop)`` of group ``group``'s shuffled rows: one task's work."""

    group: int
    start: int
    stop: int


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
    task_rows: int = TASK_ROWS
    ramp: bool = True
    shares: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.stop <= self.start:
            raise ValueError(f"empty sample range [{self.start}, {self.stop})")
        for name in ("block_rows", "batch_size", "shuffle_blocks", "task_rows"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.epoch < 0 or self.seed < 0:
            raise ValueError("seed and epoch must be non-negative")
        if self.shares is not None:
            check_shares(self.shares, len(self.shares), self.batch_size, self.drop_last)

    @functools.cached_property
    def _step_offsets(self) -> np.ndarray:
        """Where each rank's part of a step starts in it, and the step's rows last (one
        part of ``batch_size`` rows without shares)."""
        return np.concatenate([[0], np.cumsum(self.shares or (self.batch_size,))]
                              ).astype(np.int64)

    def batch_span(self, batch: int) -> tuple[int, int]:
        """Positions ``[g0, g1)`` of global batch ``batch`` in the epoch's sequence."""
        offsets = self._step_offsets
        step, part = divmod(batch, len(offsets) - 1)
        base = step * int(offsets[-1])
        return (min(base + int(offsets[part]), self.num_samples),
                min(base + int(offsets[part + 1]), self.num_samples))

    def batch_at(self, position: int) -> int:
        """The global batch holding ``position`` of the epoch's sequence."""
        offsets = self._step_offsets
        step, rest = divmod(position, int(offsets[-1]))
        return step * (len(offsets) - 1) + int(np.searchsorted(offsets, rest, "right")) - 1

    @property
    def num_samples(self) -> int:
        return self.stop - self.start

    @property
    def num_batches(self) -> int:
        """Global batches in the epoch (the last one partial unless ``drop_last``)."""
        if self.drop_last:
            return self.num_samples // self.batch_size
        return self.batch_at(self.num_samples - 1) + 1

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
    def groups(self) -> list[tuple[int, ...]]:
        """Block ids of each group (rows shuffled together), in epoch order."""
        order = self.block_order.tolist()
        k = self.shuffle_blocks
        return [tuple(order[i : i + k]) for i in range(0, len(order), k)]

    def group_size(self, group: int) -> int:
        return sum(b - a for a, b in map(self.block_range, self.groups[group]))

    @property
    def piece_rows(self) -> int:
        """Rows the transform sees at a time (the last piece of a group may be shorter)."""
        return self.batch_size * math.ceil(MIN_PIECE_ROWS / self.batch_size)

    def group_permutation(self, group: int) -> np.ndarray | None:
        """Row order inside a group (None: kept as read); read-only, made once per process
        for the group's windows."""
        if not self.shuffle:
            return None
        return _permutation(self.seed, self.epoch, group, self.group_size(group))

    def piece_seed(self, group: int, piece: int) -> list[int]:
        """Seed of the RNG the transform gets for piece ``piece`` of ``group``."""
        return [self.seed, self.epoch, 2, group, piece]

    @functools.cached_property
    def first_split(self) -> int | None:
        """Where the epoch's first piece is cut in two, after its first batch (a position
        in group 0), which is all the first batch then waits for; None where that piece is
        one batch already."""
        return self.batch_size if self.batch_size < min(self.piece_rows, self.group_size(0)) \
            else None

    def piece_starts(self, group: int) -> list[int]:
        """Where each piece of ``group`` starts (positions in its shuffled rows), and the
        group's size last: pieces of :attr:`piece_rows`, the epoch's first cut at
        :attr:`first_split`."""
        starts = [*range(0, self.group_size(group), self.piece_rows), self.group_size(group)]
        if group == 0 and self.first_split is not None:
            starts.insert(1, self.first_split)
        return starts

    def pieces_in(self, span: Window) -> list[tuple[int, int, int]]:
        """``(piece, start, stop)`` of each piece of a window."""
        starts = self.piece_starts(span.group)
        first = starts.index(span.start)
        last = starts.index(span.stop)
        return [(k, starts[k], starts[k + 1]) for k in range(first, last)]

    @functools.cached_property
    def window_spans(self) -> list[Window]:
        """The windows, in epoch order: whole pieces of one group each, growing from one
        piece (with ``ramp``) to ``task_rows``."""
        cap = max(1, self.task_rows // self.piece_rows)
        size = 1 if self.ramp else cap
        spans = []
        for group in range(len(self.groups)):
            starts = self.piece_starts(group)
            at = 0
            while at < len(starts) - 1:
                stop = min(at + size, len(starts) - 1)
                spans.append(Window(group, starts[at], starts[stop]))
                # The rest of the split first piece follows it alone: the second batch
                # waits for no more work than the first.
                split = group == 0 and starts[stop] == self.first_split
                at, size = stop, size if split else min(size * 2, cap)
        return spans

    @functools.cached_property
    def windows(self) -> list[tuple[int, ...]]:
        """Block ids each window reads (all of its group's), in epoch order."""
        return [self.groups[span.group] for span in self.window_spans]

    @functools.cached_property
    def window_offsets(self) -> np.ndarray:
        """Offset of each window in the global sequence, plus the total at the end."""
        sizes = [span.stop - span.start for span in self.window_spans]
        return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    def sample_order(self) -> np.ndarray:
        """Absolute row of every position of the global sequence (O(samples) memory: for
        tests and inspection, never needed to iterate)."""
        parts = []
        for g, blocks in enumerate(self.groups):
            rows = np.concatenate([np.arange(*self.block_range(b)) for b in blocks])
            order = self.group_permutation(g)
            parts.append(rows if order is None else rows[order])
        return np.concatenate(parts)

    def batch_pieces(self, batch: int) -> tuple[Piece, ...]:
        """Where global batch ``batch``'s rows lie, window by window."""
        g0, g1 = self.batch_span(batch)
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
        if self.shares is not None and len(self.shares) != world_size:
            raise ValueError(f"the plan's shares are for {len(self.shares)} ranks, not "
                             f"{world_size}")
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

    def unit_of(self, batches: range) -> Unit:
        """The unit of a run of consecutive global ``batches`` (work claimed on demand, see
        :meth:`dasktrain.pipeline.Pipeline.claiming`), whatever rank takes it."""
        if not batches or batches.step != 1 or batches.start < 0 \
                or batches.stop > self.num_batches:
            raise ValueError(f"{batches} is not a run of this epoch's {self.num_batches} "
                             "batches")
        pieces = tuple(self.batch_pieces(b) for b in batches)
        window = pieces[0][0].window
        touched = tuple(sorted({p.window for per in pieces for p in per}))
        exclusive = touched == (window,) and self.window_batches(window) == batches
        return Unit(window, touched, tuple(batches), pieces, exclusive)

    def claim_bounds(self) -> list[int]:
        """The first global batch of each window's run (batches that start in one window):
        work claimed on demand is cut at these, so a claim reads as few windows as it can.
        The epoch's first piece (one batch, for a quick first batch in order) is not cut
        apart: a claim of one batch would make whoever takes it push after one step."""
        offsets = self.window_offsets
        first = -(-offsets[:-1] // self.batch_size)  # the first batch starting in each
        after = -(-offsets[1:] // self.batch_size)
        bounds = [int(b) for b in first[(first < after) & (first < self.num_batches)]]
        # The split is after batch 0: the window it opens starts batch 1
        return bounds if self.first_split is None else [b for b in bounds if b != 1]

    def window_batches(self, window: int) -> range:
        """Global batches with rows in ``window``."""
        offsets = self.window_offsets
        first = self.batch_at(int(offsets[window]))
        last = min(self.batch_at(int(offsets[window + 1]) - 1), self.num_batches - 1)
        return range(first, last + 1)


def check_shares(shares: tuple[int, ...], world_size: int, batch_size: int,
                 drop_last: bool = False) -> None:
    """Refuse shares that are not ``world_size`` positive row counts summing to
    ``world_size x batch_size`` (the rows of a step), and any with ``drop_last`` (which
    drops a partial global batch of ``batch_size``, not a partial step)."""
    if drop_last:
        raise ValueError("shares cannot be given with drop_last=True")
    if len(shares) != world_size or not all(
            isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shares):
        raise ValueError(f"shares must be {world_size} positive row counts, one per rank, "
                         f"got {shares!r}")
    if sum(shares) != world_size * batch_size:
        raise ValueError(f"shares must add up to the {world_size} x {batch_size} rows of a "
                         f"step, got {shares!r} ({sum(shares)})")


@functools.lru_cache(maxsize=4)  # the groups a worker process is cutting into windows
def _permutation(seed: int, epoch: int, group: int, size: int) -> np.ndarray:
    order = np.random.default_rng([seed, epoch, 1, group]).permutation(size)
    order.flags.writeable = False
    return order


def run_pieces(run: range, piece: int | None) -> list[range]:
    """A claimed ``run`` of global batches cut into consecutive pieces of ``piece`` batches
    (the last may be shorter; None: the whole run), each pushed as one (``average``'s
    local steps between two averages)."""
    step = piece or len(run)
    return [range(first, min(first + step, run.stop))
            for first in range(run.start, run.stop, step)]
