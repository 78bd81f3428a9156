"""One generation in flight on the driver: the tasks it has handed out, what came back,
and what it cost (:class:`GenerationReport`, which becomes a row of the history)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from distributed import Future

from dasktrain.evolve.driver.shared import Shared

__all__ = ["GenerationReport", "Round", "Task"]


@dataclasses.dataclass(slots=True)
class GenerationReport:
    """What one generation cost and who did it."""

    values: np.ndarray
    seconds: float = 0.0
    tasks: int = 0
    missed: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    record_bytes: int = 0
    snapshot_bytes: int = 0
    compute_seconds: float = 0.0
    members_per_worker: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(slots=True)
class Task:
    """A task of the generation: the index of its members' chunk."""

    chunk: int
    check: bool = False
    """Ask for the checksum whatever the worker sent before."""


@dataclasses.dataclass(slots=True)
class Round:
    """The generation ``generation`` in flight; ``state`` is the driver's, ``digest`` its
    checksum, ``base`` the first generation whose ranks its record carries."""

    generation: int
    base: int
    state: Any
    digest: int
    report: GenerationReport
    record: Shared | None = None
    pending: dict[Future, Task] = dataclasses.field(default_factory=dict)
    evaluated: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    """The chunks each worker (by id) evaluated."""
    checked: set[int] = dataclasses.field(default_factory=set)
    """Workers (by id) whose checksum matched."""
    retries: int = 0
