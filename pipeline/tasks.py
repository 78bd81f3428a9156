"""What runs on the workers: read a window of blocks, transform, shuffle; cut out batches."""

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

from dasktrain.pipeline.plan import EpochPlan, Piece

__all__ = ["BlockFailed", "EpochContext", "Transform", "assemble_batches", "load_unit",
           "load_window"]

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
    """The Zarr arrays a pipeline reads (zarr handles pickle as a store URL and metadata)."""

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

    @classmethod
    def pack(cls, ref: ArraysRef, plan: EpochPlan, transform: Transform | None
             ) -> EpochContext:
        blob = pickle.dumps((ref, plan, transform))
        return cls(hashlib.blake2b(blob, digest_size=16).hexdigest(), blob)

    def open(self) -> tuple[ArraysRef, EpochPlan, Transform | None]:
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


def _read_block(ref: ArraysRef, a: int, b: int, block: int, epoch: int) -> dict[str, np.ndarray]:
    out = {}
    for name, array in zip(ref.names, ref.arrays, strict=True):
        try:
            out[name] = array[a:b]
        except Exception as exc:
            chunk_rows = array.chunks[0]
            chunks = f"{a // chunk_rows}" if (b - 1) // chunk_rows == a // chunk_rows \
                else f"{a // chunk_rows}-{(b - 1) // chunk_rows}"
            raise BlockFailed(
                f"cannot read array {name!r} chunk {chunks} (rows {a}:{b}) for block {block} "
                f"of epoch {epoch}: {type(exc).__name__}: {exc}", exc) from None
    return out


def load_window(context: EpochContext, window: int) -> dict[str, np.ndarray]:
    """Read the window's blocks, transform each with its own RNG, shuffle the rows."""
    ref, plan, transform = context.open()
    parts = []
    for block in plan.windows[window]:
        a, b = plan.block_range(block)
        arrays = _read_block(ref, a, b, block, plan.epoch)
        if transform is not None:
            rng = np.random.default_rng(plan.block_seed(block))
            try:
                result = transform(arrays, rng)
            except Exception as exc:
                raise BlockFailed(
                    f"transform failed on block {block} (rows {a}:{b}) of epoch {plan.epoch}: "
                    f"{type(exc).__name__}: {exc}", exc) from None
            arrays = _check_transformed(result, b - a, block, plan.epoch)
        parts.append(arrays)
    names = parts[0].keys()
    window_arrays = {n: np.concatenate([p[n] for p in parts]) if len(parts) > 1 else parts[0][n]
                     for n in names}
    order = plan.window_permutation(window)
    if order is not None:
        window_arrays = {n: v[order] for n, v in window_arrays.items()}
    return window_arrays


def _check_transformed(result: Any, rows: int, block: int, epoch: int) -> dict[str, np.ndarray]:
    if not isinstance(result, dict):
        raise BlockFailed(f"transform must return a dict of arrays, got {type(result).__name__} "
                          f"for block {block} of epoch {epoch}", None)
    for name, value in result.items():
        if len(value) != rows:
            raise BlockFailed(
                f"transform changed the number of samples of {name!r} from {rows} to "
                f"{len(value)} on block {block} of epoch {epoch}; transforms map samples to "
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
