"""Pipeline telemetry: cheap counters, kept by the consumer; only the count of units in
flight is also moved by the feeder, under a lock."""

from __future__ import annotations

import dataclasses
import threading
import time

__all__ = ["PipelineStats"]

_LOCK = threading.Lock()


@dataclasses.dataclass(slots=True)
class PipelineStats:
    """What the consumer saw. Times are seconds of ``time.perf_counter``.

    ``wait_per_batch`` keeps the wait before each batch of the current epoch; ``stall`` is
    the fraction of wall time since the epoch started that was spent waiting for data.
    """

    batches: int = 0
    samples: int = 0
    bytes_received: int = 0
    wait_total: float = 0.0
    wait_per_batch: list[float] = dataclasses.field(default_factory=list)
    blocks_in_flight: int = 0
    max_blocks_in_flight: int = 0
    blocks_done: int = 0
    started: float | None = None
    finished: float | None = None

    def start_epoch(self) -> None:
        self.batches = self.samples = self.bytes_received = self.blocks_done = 0
        self.wait_total = 0.0
        self.wait_per_batch = []
        self.max_blocks_in_flight = self.blocks_in_flight
        self.started = time.perf_counter()
        self.finished = None

    def record_batch(self, wait: float, samples: int, nbytes: int) -> None:
        self.batches += 1
        self.samples += samples
        self.bytes_received += nbytes
        self.wait_total += wait
        self.wait_per_batch.append(wait)

    def add_in_flight(self, delta: int) -> None:
        """Called by the feeder (+1 per unit submitted, -1 per unit it releases itself) and
        the consumer (-1 per unit used up or released)."""
        with _LOCK:
            self.blocks_in_flight += delta
            self.max_blocks_in_flight = max(self.max_blocks_in_flight, self.blocks_in_flight)

    @property
    def elapsed(self) -> float:
        if self.started is None:
            return 0.0
        return (self.finished or time.perf_counter()) - self.started

    @property
    def stall(self) -> float:
        """Fraction of the epoch's wall time spent waiting for the next batch."""
        return self.wait_total / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.elapsed if self.elapsed > 0 else 0.0

    def summary(self) -> dict[str, float]:
        return {"batches": self.batches, "samples": self.samples, "wait_s": self.wait_total,
                "stall": self.stall, "samples_per_s": self.samples_per_second,
                "bytes_received": self.bytes_received,
                "max_blocks_in_flight": self.max_blocks_in_flight}
