"""Synthetic generators built chunk by chunk, so a dataset may be far larger than memory.

Every value is a pure function of (seed, row): rows are generated in fixed blocks of
``_BLOCK`` samples, each from its own RNG stream, so the data does not depend on how the
dataset is chunked or which worker made which chunk.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import dask.array as da
import numpy as np

from dasktrain.datasets.errors import SourceError
from dasktrain.datasets.format import chunk_lengths
from dasktrain.datasets.sources.base import (
    ArraySpec,
    BlockReader,
    SourceOptions,
    register_builtin,
)

__all__ = ["SyntheticSource", "generate_rows"]

_BLOCK = 4096


@dataclasses.dataclass(frozen=True, slots=True)
class _Recipe:
    kind: str  # "parabola" | "regression" | "classification"
    num_samples: int
    width: int
    classes: int
    noise: float
    seed: int

    def block(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``[index * _BLOCK, ...)`` of features and targets."""
        start = index * _BLOCK
        stop = min(start + _BLOCK, self.num_samples)
        n = stop - start
        rng = np.random.default_rng([self.seed, 1, index])
        if self.kind == "parabola":
            # An evenly spaced grid on [-1, 1]: the classic y = x^2 toy problem.
            denom = max(self.num_samples - 1, 1)
            x = (-1.0 + 2.0 * np.arange(start, stop) / denom).reshape(n, 1)
            y = x**2 + self.noise * rng.standard_normal((n, 1))
            return x.astype(np.float32), y.astype(np.float32)
        params = np.random.default_rng([self.seed, 0])
        x = rng.standard_normal((n, self.width))
        if self.kind == "regression":
            weights = params.standard_normal(self.width) / np.sqrt(self.width)
            y = x @ weights + 0.5 * np.sin(2.0 * x[:, 0]) + self.noise * rng.standard_normal(n)
            return x.astype(np.float32), y.reshape(n, 1).astype(np.float32)
        centers = params.standard_normal((self.classes, self.width)) * 2.0
        labels = rng.integers(0, self.classes, size=n)
        x = centers[labels] + (1.0 + self.noise) * x
        return x.astype(np.float32), labels.astype(np.int64)


def generate_rows(recipe: _Recipe, start: int, stop: int, which: int) -> np.ndarray:
    """Rows ``[start, stop)`` of array ``which`` (0 features, 1 targets)."""
    first, last = start // _BLOCK, (stop - 1) // _BLOCK
    parts = [recipe.block(b)[which] for b in range(first, last + 1)]
    joined = np.concatenate(parts) if len(parts) > 1 else parts[0]
    offset = start - first * _BLOCK
    return joined[offset : offset + (stop - start)]


@dataclasses.dataclass(frozen=True, slots=True)
class _RecipeRows:
    """Rows of both arrays of a recipe (features, then targets)."""

    recipe: _Recipe
    names: tuple[str, str]

    def __call__(self, start: int, stop: int) -> dict[str, np.ndarray]:
        return {name: generate_rows(self.recipe, start, stop, which)
                for which, name in enumerate(self.names)}


def _chunk(recipe: _Recipe, which: int, block_info: dict | None = None) -> np.ndarray:
    (start, stop) = block_info[None]["array-location"][0]
    return generate_rows(recipe, start, stop, which)


class SyntheticSource:
    """``parabola``, ``regression`` or ``classification`` data of any size."""

    known_finite = True

    def __init__(self, kind: str, options: SourceOptions):
        defaults = {"parabola": (50, 1, 0.0), "regression": (10_000, 16, 0.1),
                    "classification": (10_000, 16, 0.5)}
        samples, width, noise = defaults[kind]
        samples = options.samples if options.samples is not None else samples
        width = 1 if kind == "parabola" else (options.width or width)
        classes = options.classes if options.classes is not None else 2
        noise = options.noise if options.noise is not None else noise
        if samples <= 0:
            raise SourceError(f"{kind}: samples must be positive, got {samples}")
        if kind == "parabola" and options.width not in (None, 1):
            raise SourceError("parabola has exactly one feature; drop --width")
        if width <= 0:
            raise SourceError(f"{kind}: width must be positive, got {width}")
        if kind == "classification" and classes < 2:
            raise SourceError(f"classification needs at least 2 classes, got {classes}")
        if noise < 0:
            raise SourceError(f"{kind}: noise must be >= 0, got {noise}")
        self.recipe = _Recipe(kind, samples, width, classes, float(noise), options.seed)
        self.num_samples = samples
        target_spec = (ArraySpec("targets", np.dtype("int64"), ()) if kind == "classification"
                       else ArraySpec("targets", np.dtype("float32"), (1,)))
        self.specs = {"x": ArraySpec("features", np.dtype("float32"), (width,)), "y": target_spec}
        self.labels: dict[str, list[str]] = {}
        self.provenance: dict[str, Any] = {"kind": "synthetic", **dataclasses.asdict(self.recipe)}
        if kind != "classification":
            del self.provenance["classes"]

    def to_dask(self, chunk_rows: int) -> dict[str, da.Array]:
        n = self.num_samples
        chunks = chunk_lengths(n, chunk_rows)
        out = {}
        for which, (name, spec) in enumerate(self.specs.items()):
            out[name] = da.map_blocks(
                _chunk, self.recipe, which, dtype=spec.dtype,
                chunks=(chunks, *[(d,) for d in spec.sample_shape]),
                meta=np.empty((0, *spec.sample_shape), spec.dtype),
                # Safe as a key: every value is a pure function of the recipe, named in full.
                name=f"synthetic-{name}-{self.recipe}-{chunk_rows}".replace(" ", ""),
            )
        return out

    def block_reader(self) -> BlockReader:
        return _RecipeRows(self.recipe, tuple(self.specs))


for _kind in ("parabola", "regression", "classification"):
    register_builtin(_kind)(SyntheticSource)
