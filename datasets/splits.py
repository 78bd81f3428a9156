"""Deterministic random splits of N samples into named parts of exact sizes.

The assignment is planned once on the client, in O(N / block) work and memory: sample counts
per split are dealt to fixed blocks of rows by sequential multivariate hypergeometric draws
(so every assignment of exactly ``size_s`` rows to split ``s`` is equally likely), and each
block's rows are then permuted from its own RNG stream. Any row range can be assigned on any
worker from a small slice of the plan, independently of chunking.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["SplitPlan", "parse_splits"]

_BLOCK = 65_536


def parse_splits(spec: str | dict[str, float] | None) -> dict[str, float]:
    """Parse ``"train=0.9,val=0.1"`` (or a dict) into fractions that sum to 1."""
    if spec is None or spec == "" or spec == {}:
        return {}
    if isinstance(spec, str):
        parts: dict[str, float] = {}
        for item in spec.split(","):
            name, sep, value = item.partition("=")
            name = name.strip()
            if not sep or not name:
                raise ValueError(f"cannot read split {item!r}; write e.g. train=0.9,val=0.1")
            if name in parts:
                raise ValueError(f"split {name!r} is given twice in {spec!r}")
            try:
                parts[name] = float(value)
            except ValueError:
                raise ValueError(f"split {name!r} has fraction {value!r}, not a number") from None
        spec = parts
    fractions = dict(spec)
    for name, value in fractions.items():
        if not name.isidentifier():
            raise ValueError(f"split name {name!r} must be a plain name like train or val")
        if not 0.0 < value <= 1.0:
            raise ValueError(f"split {name!r} has fraction {value}; fractions lie in (0, 1]")
    total = sum(fractions.values())
    if abs(total - 1.0) > 1e-6:
        raise ValueError(f"split fractions {fractions} sum to {total:g}, not 1")
    return fractions


def split_sizes(fractions: dict[str, float], n: int) -> dict[str, int]:
    """Exact sizes that sum to ``n`` (largest remainders)."""
    raw = {k: v * n for k, v in fractions.items()}
    sizes = {k: int(np.floor(v)) for k, v in raw.items()}
    leftover = n - sum(sizes.values())
    for k in sorted(raw, key=lambda k: raw[k] - sizes[k], reverse=True)[:leftover]:
        sizes[k] += 1
    return sizes


@dataclasses.dataclass(frozen=True, slots=True)
class SplitPlan:
    """Which split each of ``num_samples`` rows belongs to (split ids index ``names``)."""

    names: tuple[str, ...]
    seed: int
    first_block: int
    #: (blocks, splits) rows of each split in each block, from ``first_block`` on.
    counts: np.ndarray

    @classmethod
    def make(cls, fractions: dict[str, float], num_samples: int, seed: int) -> SplitPlan:
        sizes = split_sizes(fractions, num_samples)
        rng = np.random.default_rng([seed, 7])
        remaining = np.array(list(sizes.values()), dtype=np.int64)
        blocks = -(-num_samples // _BLOCK)
        counts = np.zeros((blocks, len(sizes)), dtype=np.int64)
        for b in range(blocks):
            rows = min(_BLOCK, num_samples - b * _BLOCK)
            counts[b] = rng.multivariate_hypergeometric(remaining, rows)
            remaining -= counts[b]
        return cls(tuple(sizes), seed, 0, counts)

    @property
    def sizes(self) -> dict[str, int]:
        return dict(zip(self.names, self.counts.sum(axis=0).tolist(), strict=True))

    def slice_for(self, start: int, stop: int) -> SplitPlan:
        """The part of the plan that rows ``[start, stop)`` need (small enough to ship)."""
        first, last = start // _BLOCK, (stop - 1) // _BLOCK
        rel = slice(first - self.first_block, last - self.first_block + 1)
        return SplitPlan(self.names, self.seed, first, self.counts[rel])

    def assign(self, start: int, stop: int) -> np.ndarray:
        """Split id (int8) of each row in ``[start, stop)``."""
        first, last = start // _BLOCK, (stop - 1) // _BLOCK
        parts = []
        for b in range(first, last + 1):
            ids = np.repeat(np.arange(len(self.names), dtype=np.int8),
                            self.counts[b - self.first_block])
            np.random.default_rng([self.seed, 8, b]).shuffle(ids)
            parts.append(ids)
        ids = np.concatenate(parts)
        offset = start - first * _BLOCK
        return ids[offset : offset + stop - start]
