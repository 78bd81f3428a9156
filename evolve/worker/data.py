"""Which batches a generation is evaluated on, and reading them in a worker's process.

Every member of generation ``g`` is evaluated on the same ``batches`` batches (common
random numbers: the ranking compares members, not batches): global batches
``g x batches .. (g + 1) x batches - 1`` of the stream of epochs a :class:`Pipeline` with the
run's seed yields, continuing into the next epoch where one ends. A worker reads them with
its own Pipeline, in its own process (``placement="consumer"``: threads, no Dask tasks),
claiming exactly that run of batches; the batches are kept for the generation's other
members, so a process reads each generation's data once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from dasktrain.datasets import Dataset
from dasktrain.pipeline import Pipeline

__all__ = ["BatchReader", "GenerationBatches"]


@dataclasses.dataclass(frozen=True, slots=True)
class GenerationBatches:
    """Where a generation's batches come from (plain settings: sent inside a run's
    snapshot)."""

    dataset: Dataset
    batch_size: int
    batches: int
    seed: int = 0
    shuffle: bool = True
    transform: Callable | None = None
    drop_last: bool = False

    def pipeline(self) -> Pipeline:
        """A pipeline that reads in the calling process."""
        return Pipeline(self.dataset, self.batch_size, shuffle=self.shuffle, seed=self.seed,
                        transform=self.transform, drop_last=self.drop_last,
                        placement="consumer", prefetch=1, prefetch_next_epoch=False)

    def spans(self, generation: int, per_epoch: int) -> list[tuple[int, range]]:
        """The generation's batches as ``(epoch, run of batches)``, given ``per_epoch``
        batches in an epoch."""
        first = generation * self.batches
        spans = []
        for index in range(first, first + self.batches):
            epoch, batch = divmod(index, per_epoch)
            if spans and spans[-1][0] == epoch:
                spans[-1] = (epoch, range(spans[-1][1].start, batch + 1))
            else:
                spans.append((epoch, range(batch, batch + 1)))
        return spans


class BatchReader:
    """Reads generations' batches in this process (one Pipeline, made on first use)."""

    def __init__(self, source: GenerationBatches) -> None:
        self.source = source
        self._pipeline: Pipeline | None = None
        self._kept: tuple[int, list[Any]] | None = None

    def read(self, generation: int) -> list[Any]:
        """The generation's batches (kept until another generation's are read)."""
        if self._kept is not None and self._kept[0] == generation:
            return self._kept[1]
        if self._pipeline is None:
            self._pipeline = self.source.pipeline()
        pipe = self._pipeline
        batches: list[Any] = []
        for epoch, run in self.source.spans(generation, pipe.plan(0).num_batches):
            pipe.set_epoch(epoch)
            runs = iter([run])
            batches.extend(batch for _, batch in
                           pipe.claiming(lambda stop, runs=runs: next(runs, None), ahead=1))
        self._kept = (generation, batches)
        return batches

    def close(self) -> None:
        if self._pipeline is not None:
            self._pipeline.close()
            self._pipeline = None
