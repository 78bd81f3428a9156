"""How to build a parameter holder: the model, optimizer and mode it hosts, how long it waits
for workers, how pushes reach it and what it does with non-finite ones."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from dasktrain.trainer.exchange.buckets import BUCKET_BYTES
from dasktrain.trainer.holder.divergence import check_policy
from dasktrain.trainer.holder.shards import check_shards
from dasktrain.trainer.modes import mode_class
from dasktrain.trainer.optim import OptimizerConfig

__all__ = ["HolderConfig", "ModelFactory"]

ModelFactory = Callable[[], torch.nn.Module]


@dataclasses.dataclass(kw_only=True, slots=True)
class HolderConfig:
    """How to build a holder."""

    model: ModelFactory
    """Called once on the holder's worker: its parameters are everyone's starting point."""
    optimizer: OptimizerConfig
    """The optimizer the holder runs."""
    workers: int
    """Trainer workers that push to this holder."""
    batch_size: int | None = None
    """Samples in one worker's full batch: what the asynchronous modes scale each update's
    learning rate by (its samples / (``workers`` x ``batch_size``), see
    :mod:`dasktrain.trainer.modes.adjust`). None: every update at the optimizer's own rate
    (a holder driven by hand; the Trainer always gives it)."""
    mode: str = "sync"
    """Update mode (see :data:`dasktrain.trainer.modes.MODES`)."""
    mode_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Options of the mode."""
    total_steps: int | None = None
    """Updates in the whole fit (for learning-rate schedules)."""
    barrier_timeout: float = 120.0
    """Seconds an update waits for a live worker before going on without it."""
    check_interval: float = 1.0
    """Seconds between liveness checks of the workers an update waits for."""
    torch_threads: int = 1
    """Intra-op threads of torch in the holder's process."""
    direct_channel: bool = True
    """Pushes from workers in other processes go over a direct TCP connection to the
    holder (see :mod:`dasktrain.trainer.exchange.protocol`); False keeps them on the actor's
    calls."""
    shared_memory: bool = True
    """Workers on the holder's host push through memory shared with it instead of bytes
    over the direct channel's socket (see :mod:`dasktrain.trainer.exchange.shared`)."""
    balance: bool = True
    """Cut each step's rows unevenly among the workers by their measured speeds, in modes
    where the update stays the same (see :mod:`dasktrain.trainer.holder.balance`)."""
    bucket_bytes: int = BUCKET_BYTES
    """Least bytes of a bucket of the direct channel's payload order (see
    :mod:`dasktrain.trainer.exchange.buckets`)."""
    on_nonfinite: str = "raise"
    """A non-finite gradient or loss stops the run (``"raise"``) or is refused and skipped
    (``"skip"``); see :mod:`dasktrain.trainer.holder.divergence`."""
    nonfinite_patience: int = 10
    """With ``"skip"``: rounds (one gradient per worker) all refused in a row that still
    stop the run, since no update is possible any more."""
    clip_grad_norm: float | None = None
    """Clip each applied (averaged) gradient to this global norm."""
    clip_grad_value: float | None = None
    """Clip each value of an applied gradient to ``[-v, v]`` (before the norm)."""
    elastic: bool = False
    """Workers join and leave during the run (the Trainer's ``workers=(least, most)``):
    ``workers`` is the most; a rerun task landing beside another is surplus."""
    min_workers: int | None = None
    """In an elastic run, the least workers an epoch begins with (default: ``workers``)."""
    assignment: str = "static"
    """How the epoch's batches reach workers: ``"static"`` (rank r takes global batches
    r, r + W, ...) or ``"dynamic"`` (claimed on demand, see :mod:`.ledger`)."""
    shard: tuple[int, int] | None = None
    """``(k, K)``: this holder is shard k of K and keeps slice k of the parameters (see
    :mod:`dasktrain.trainer.holder.shards`)."""

    def __post_init__(self) -> None:
        if not callable(self.model):
            raise TypeError("model must be a callable returning a torch.nn.Module")
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"workers must be a positive integer, got {self.workers!r}")
        if self.batch_size is not None and (not isinstance(self.batch_size, int)
                                            or isinstance(self.batch_size, bool)
                                            or self.batch_size < 1):
            raise ValueError(f"batch_size must be a positive integer or None, got "
                             f"{self.batch_size!r}")
        # Unknown modes and bad options fail here, before any cluster work.
        mode_class(self.mode).check(self.workers, self.mode_options)
        if self.barrier_timeout <= 0 or self.check_interval <= 0:
            raise ValueError("barrier_timeout and check_interval must be positive")
        check_policy(self.on_nonfinite, self.nonfinite_patience)
        if self.assignment not in ("static", "dynamic"):
            raise ValueError(f"assignment must be 'static' or 'dynamic', got "
                             f"{self.assignment!r}")
        if self.shard is not None:
            check_shards(self.shard[1], self.mode, self.clip_grad_norm)
            if not 0 <= self.shard[0] < self.shard[1]:
                raise ValueError(f"shard must be (k, K) with 0 <= k < K, got {self.shard!r}")
