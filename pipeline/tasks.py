"""What runs on the workers: read a window of blocks, transform, shuffle; cut out batches."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import zarr

from dasktrain.pipeline.plan import EpochPlan, Piece

__all__ = ["BlockFailed", "Transform", "assemble_batches", "load_window"]

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


def load_window(ref: ArraysRef, plan: EpochPlan, window: int,
                transform: Transform | None) -> dict[str, np.ndarray]:
    """Read the window's blocks, transform each with its own RNG, shuffle the rows."""
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
