"""What runs on the workers: read a group of blocks, shuffle, transform a window of it; cut out
batches."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import zarr
from distributed.protocol import pickle

from dasktrain._malloc import tune_allocator
from dasktrain.datasets.chunks import ChunkError, repair_hint
from dasktrain.pipeline.plan import EpochPlan, Piece

__all__ = ["BlockFailed", "EpochContext", "Transform", "assemble_batches", "claim_read",
           "drop_claim", "forget_groups", "load_unit", "load_window", "read_ahead",
           "window_arrays"]

#: ``transform(arrays, rng) -> arrays`` on a dict of numpy arrays sharing axis 0.
Transform = Callable[[dict[str, np.ndarray], np.random.Generator], dict[str, np.ndarray]]


class BlockFailed(Exception):
    """A block could not be read or transformed; carries where and the original error.

    ``args`` = (message, original exception) so that it pickles across processes; the
    consumer re-raises it as a :class:`~dasktrain.pipeline.PipelineError` chained to the
    original.
    """

    @property
    def original(self) -> BaseException | None:
        return self.args[1] if len(self.args) > 1 else None


@dataclasses.dataclass(frozen=True, slots=True)
class ArraysRef:
    """The Zarr arrays a pipeline reads (zarr handles pickle as a store URL and metadata;
    those of a dataset that records its chunks also carry that record, and refuse a chunk
    that is missing, of another size or another CRC-32C: see
    :mod:`dasktrain.datasets.chunks`)."""

    names: tuple[str, ...]
    arrays: tuple[zarr.Array, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class EpochContext:
    """What every task of an epoch shares (arrays, plan, transform), pickled once.

    A transform defined in a script or notebook is pickled by value, which costs
    milliseconds each time; tasks carry these bytes instead, and each worker process
    unpickles them once per epoch (:meth:`open`).
    """

    digest: str
    blob: bytes
    # Set for a context used in the process that made it (placement "consumer"): nothing
    # to pickle or unpickle.
    objects: tuple | None = dataclasses.field(default=None, compare=False, repr=False)

    @classmethod
    def pack(cls, ref: ArraysRef, plan: EpochPlan, transform: Transform | None
             ) -> EpochContext:
        blob = pickle.dumps((ref, plan, transform))
        return cls(hashlib.blake2b(blob, digest_size=16).hexdigest(), blob)

    @classmethod
    def here(cls, digest: str, ref: ArraysRef, plan: EpochPlan, transform: Transform | None
             ) -> EpochContext:
        """A context for this process only (never sent anywhere)."""
        return cls(digest, b"", (ref, plan, transform))

    def open(self) -> tuple[ArraysRef, EpochPlan, Transform | None]:
        if self.objects is not None:
            return self.objects
        with _OPENED_LOCK:
            found = _OPENED.get(self.digest)
            if found is not None:
                _OPENED.move_to_end(self.digest)
                return found
        found = pickle.loads(self.blob)
        with _OPENED_LOCK:
            _OPENED[self.digest] = found
            while len(_OPENED) > _OPENED_KEEP:
                _OPENED.popitem(last=False)
        return found


_OPENED: collections.OrderedDict[str, tuple] = collections.OrderedDict()
_OPENED_LOCK = threading.Lock()
_OPENED_KEEP = 8  # a few pipelines x (this epoch, the next) per worker process


def _read_block(ref: ArraysRef, a: int, b: int, block: int, epoch: int,
                into: dict[str, np.ndarray] | None = None, rows: np.ndarray | None = None
                ) -> dict[str, np.ndarray]:
    """Rows ``[a, b)`` of every array; with ``into``, written into those arrays at
    ``rows`` (arrays that cut their samples, :meth:`WindowArray.read_into`) instead."""
    out = {}
    for name, array in zip(ref.names, ref.arrays, strict=True):
        try:
            if into is None:
                out[name] = array[a:b]
            else:
                array.read_into(into[name], a, b, rows)
        except ChunkError as exc:
            # The one chunk at fault, not the block's range of them.
            first, last = exc.rows or (a, b)
            raise BlockFailed(
                f"cannot read array {name!r} chunk {exc.chunk} (rows {first}:{last}) for "
                f"block {block} of epoch {epoch}: it {exc.reason}; "
                f"{repair_hint(exc.url or '')}", exc) from None
        except Exception as exc:
            chunk_rows = array.chunks[0]
            chunks = f"{a // chunk_rows}" if (b - 1) // chunk_rows == a // chunk_rows \
                else f"{a // chunk_rows}-{(b - 1) // chunk_rows}"
            raise BlockFailed(
                f"cannot read array {name!r} chunk {chunks} (rows {a}:{b}) for block {block} "
                f"of epoch {epoch}: {type(exc).__name__}: {exc}", exc) from None
    return out if into is None else into


def _read_blocks(ref: ArraysRef, plan: EpochPlan, group: int) -> tuple[dict[str, np.ndarray],
                                                                      bool]:
    """A group's rows, and whether they are shuffled already. Arrays that cut their
    samples out of a store (an in-place dataset's) write each sample straight to its
    shuffled place in the group; others are read block by block in stored order, and the
    rows are taken in shuffled order by each window."""
    order = plan.group_permutation(group)
    blocks = [(block, *plan.block_range(block)) for block in plan.groups[group]]
    if order is not None and all(hasattr(array, "read_into") for array in ref.arrays):
        place = np.empty_like(order)
        place[order] = np.arange(len(order))
        into = {name: np.empty((len(order), *array.shape[1:]), dtype=array.dtype)
                for name, array in zip(ref.names, ref.arrays, strict=True)}
        at = 0
        for block, a, b in blocks:
            _read_block(ref, a, b, block, plan.epoch, into, place[at:at + b - a])
            at += b - a
        return into, True
    parts = [_read_block(ref, a, b, block, plan.epoch) for block, a, b in blocks]
    return {n: np.concatenate([p[n] for p in parts]) if len(parts) > 1 else parts[0][n]
            for n in parts[0]}, False


def _read_group(context: EpochContext, ref: ArraysRef, plan: EpochPlan, group: int,
                keep: bool) -> tuple[dict[str, np.ndarray], bool]:
    """The group's blocks, read, and whether their rows are shuffled already
    (:func:`_read_blocks`; otherwise in stored order, and each window takes its shuffled
    rows: the epoch's first window, one batch, then waits for a quarter of a group's copy,
    not all of it); with ``keep``, kept for the group's next windows, which
    usually run in the same process (a group is read once, not once per window)."""
    key = (context.digest, group)
    mine = None  # this thread's claim of the read, where others may wait for it
    while True:
        with _GROUPS_LOCK:
            found = _GROUPS.get(key)
            if found is not None:
                _GROUPS.move_to_end(key)
                _LEFT[key] -= 1
                if _LEFT[key] <= 0:  # its last window: the group has served its reads
                    del _GROUPS[key], _LEFT[key]
                return found
            reading = _READING.get(key)
            if reading is None:
                _started(key)
                if keep:  # this thread reads it; another that asks meanwhile waits
                    mine = _READING[key] = threading.Event()
                break
        # Another thread of this process is reading the group (a window next to this one,
        # running): wait for it, or take over a read that hangs, with whoever waits.
        if reading.wait(_READ_WAIT):
            continue
        with _GROUPS_LOCK:
            if _READING.get(key) is not reading:  # another window took it over first
                continue
            del _READING[key]
            if keep:
                mine = _READING[key] = threading.Event()
        reading.set()
        break
    try:
        read = _read_blocks(ref, plan, group)
        left = _windows_of(context.digest, plan)[group] - 1 if keep else 0
        if left > 0:
            _keep_group(key, read, left)
    finally:
        if mine is not None:
            _read_over(key, mine)
    return read


def _keep_group(key: tuple[str, int], read: tuple[dict[str, np.ndarray], bool], left: int
                ) -> None:
    """Keep a group read for the ``left`` windows still to take its rows (the oldest kept
    goes past the bound)."""
    with _GROUPS_LOCK:
        _GROUPS[key], _LEFT[key] = read, left
        while len(_GROUPS) > _GROUPS_KEEP:
            _LEFT.pop(next(iter(_GROUPS)), None)
            _GROUPS.popitem(last=False)


def _read_over(key: tuple[str, int], claim: threading.Event, forget: bool = False) -> None:
    """``claim``'s read of ``key``'s group is over (``forget``: given up, as if never
    begun): its windows go on. A later claim of the group (another pipeline's) stays."""
    with _GROUPS_LOCK:
        if forget:
            _STARTED.pop(key, None)
        if _READING.get(key) is claim:
            del _READING[key]
    claim.set()


def claim_read(context: EpochContext, group: int) -> threading.Event | None:
    """Claim a group's read ahead (placement "consumer": see
    :class:`~dasktrain.pipeline.submit.LocalReaders`) unless this process read it, or is
    reading it: its windows then wait for that read. The claim, or None: give it to
    :func:`read_ahead` or :func:`drop_claim`."""
    key = (context.digest, group)
    with _GROUPS_LOCK:
        # A read under way is known by its claim even where its start was forgotten (a
        # pipeline on the same data closed): a second claim would leave the windows
        # waiting for the first without anyone to wake them.
        if key in _STARTED or key in _READING:
            return None
        _started(key)
        claim = _READING[key] = threading.Event()
    return claim


def read_ahead(context: EpochContext, group: int, claim: threading.Event) -> None:
    """Read a group claimed with :func:`claim_read` and keep it for all its windows. A read
    that fails is left to the windows, which read the group again and name the fault."""
    tune_allocator()  # before the first large buffer of this process
    key = (context.digest, group)
    try:
        ref, plan, _ = context.open()
        read = _read_blocks(ref, plan, group)
        _keep_group(key, read, _windows_of(context.digest, plan)[group])
    except BlockFailed:
        _read_over(key, claim, forget=True)
    finally:
        _read_over(key, claim)


def drop_claim(context: EpochContext, group: int, claim: threading.Event) -> None:
    """Give up a read claimed with :func:`claim_read` (cancelled, or failed): the windows
    that wait for it, or ask later, read the group themselves."""
    _read_over((context.digest, group), claim, forget=True)


def forget_groups(token: str) -> None:
    """Let go of the groups kept for the epochs of the pipeline ``token`` names (placement
    "consumer", whose epochs' digests it begins): a closed pipeline's groups read ahead would
    otherwise stay in this process until other groups pushed them out."""
    prefix = f"{token}-"
    with _GROUPS_LOCK:
        for key in [k for k in _GROUPS if k[0].startswith(prefix)]:
            del _GROUPS[key]
            _LEFT.pop(key, None)
        for key in [k for k in _STARTED if k[0].startswith(prefix)]:
            del _STARTED[key]


def _started(key: tuple[str, int]) -> None:
    """``key``'s group is being read in this process (call with the lock held)."""
    _STARTED[key] = None
    while len(_STARTED) > _STARTED_KEEP:
        _STARTED.popitem(last=False)


def _windows_of(digest: str, plan: EpochPlan) -> collections.Counter:
    """Windows per group of the epoch ``digest`` names (counted once per epoch)."""
    with _GROUPS_LOCK:
        found = _WINDOWS.get(digest)
    if found is None:
        found = collections.Counter(span.group for span in plan.window_spans)
        with _GROUPS_LOCK:
            _WINDOWS[digest] = found
            while len(_WINDOWS) > _OPENED_KEEP:
                _WINDOWS.popitem(last=False)
    return found


# A group read for several windows is kept until its last window has taken its rows (the
# windows of one group run at about the same time, in whichever of a process's threads):
# what is kept is the groups being cut, however many threads read, and a group whose
# windows never all come (an epoch left early) goes out oldest first past the bound.
_GROUPS: collections.OrderedDict[tuple[str, int], tuple[dict[str, np.ndarray], bool]] = \
    collections.OrderedDict()
_LEFT: dict[tuple[str, int], int] = {}  # windows still to take each kept group's rows
_WINDOWS: collections.OrderedDict[str, collections.Counter] = collections.OrderedDict()
_GROUPS_LOCK = threading.Lock()
_GROUPS_KEEP = 8
_READING: dict[tuple[str, int], threading.Event] = {}  # groups being read, by whom waits
# Groups read, or being read, lately: never read ahead again (their windows may be done).
_STARTED: collections.OrderedDict[tuple[str, int], None] = collections.OrderedDict()
_STARTED_KEEP = 4096
_READ_WAIT = 300.0  # seconds a window waits for another thread's read of its group


def window_arrays(plan: EpochPlan, transform: Transform | None, window: int,
                  group_arrays: dict[str, np.ndarray], shuffled: bool = False
                  ) -> dict[str, np.ndarray]:
    """A window's rows of its group (read in stored order, or ``shuffled`` already),
    shuffled and transformed piece by piece."""
    span = plan.window_spans[window]
    order = None if shuffled else plan.group_permutation(span.group)

    def rows(a: int, b: int) -> dict[str, np.ndarray]:
        # Copies where a transform follows (it may write into its arrays, and the group is
        # kept for its next windows); take: several times faster than fancy indexing
        if order is None:
            return {n: v[a:b] if transform is None else v[a:b].copy()
                    for n, v in group_arrays.items()}
        return {n: np.take(v, order[a:b], axis=0) for n, v in group_arrays.items()}

    if transform is None:
        return rows(span.start, span.stop)
    where = _where(plan, span.group)
    outs = []
    for piece, a, b in plan.pieces_in(span):
        arrays = rows(a, b)
        rng = np.random.default_rng(plan.piece_seed(span.group, piece))
        try:
            result = transform(arrays, rng)
        except Exception as exc:
            raise BlockFailed(
                f"transform failed on {where} of epoch {plan.epoch}: "
                f"{type(exc).__name__}: {exc} (piece {piece}: rows {a}:{b} of the shuffled "
                "block(s))", exc) from None
        outs.append(_check_transformed(result, b - a, where, plan.epoch))
    if len(outs) == 1:
        return outs[0]
    return {n: np.concatenate([o[n] for o in outs]) for n in outs[0]}


def _where(plan: EpochPlan, group: int) -> str:
    blocks = plan.groups[group]
    if len(blocks) == 1:
        a, b = plan.block_range(blocks[0])
        return f"block {blocks[0]} (rows {a}:{b})"
    return f"blocks {list(blocks)}"


def load_window(context: EpochContext, window: int) -> dict[str, np.ndarray]:
    """Read the window's group (shuffled), and transform the window's pieces of it, each
    with its own RNG."""
    tune_allocator()  # before the first large buffer of this process
    ref, plan, transform = context.open()
    span = plan.window_spans[window]
    whole = span.start == 0 and span.stop == plan.group_size(span.group)
    group, shuffled = _read_group(context, ref, plan, span.group, keep=not whole)
    return window_arrays(plan, transform, window, group, shuffled)


def _check_transformed(result: Any, rows: int, where: str, epoch: int
                       ) -> dict[str, np.ndarray]:
    if not isinstance(result, dict):
        raise BlockFailed(f"transform must return a dict of arrays, got {type(result).__name__} "
                          f"for {where} of epoch {epoch}", None)
    for name, value in result.items():
        if len(value) != rows:
            raise BlockFailed(
                f"transform changed the number of samples of {name!r} from {rows} to "
                f"{len(value)} on {where} of epoch {epoch}; transforms map samples to "
                "samples", None)
    return {n: np.asarray(v) for n, v in result.items()}


def assemble_batches(pieces: tuple[tuple[Piece, ...], ...], windows: tuple[int, ...],
                     *window_data: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """Cut one rank's batches out of the windows they lie in (runs where the windows are)."""
    by_window = dict(zip(windows, window_data, strict=True))
    batches = []
    for batch_pieces in pieces:
        names = by_window[batch_pieces[0].window].keys()
        if len(batch_pieces) == 1:
            p = batch_pieces[0]
            batches.append({n: by_window[p.window][n][p.start : p.stop] for n in names})
        else:
            batches.append({n: np.concatenate([by_window[p.window][n][p.start : p.stop]
                                               for p in batch_pieces]) for n in names})
    return batches


def load_unit(context: EpochContext, window: int,
              pieces: tuple[tuple[Piece, ...], ...]) -> list[dict[str, np.ndarray]]:
    """:func:`load_window` and :func:`assemble_batches` in one task, for a window whose
    batches all go to one consumer: one task per window instead of two, and the batches
    are ready the moment the window is."""
    return assemble_batches(pieces, (window,), load_window(context, window))
