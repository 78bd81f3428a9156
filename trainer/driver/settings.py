"""The Trainer's settings: the checks of its arguments, and the settings as plain data.

The Trainer keeps its settings as attributes (its documented surface); :class:`TrainerSettings`
names the ones the driver's other modules read, so that they depend on this interface and
never on the Trainer's module. Two views of them are plain data: :func:`run_settings`, those
that decide which batches are drawn and how they are applied (a resume must match them), and
:func:`saved_settings`, every setting, as ``Trainer`` keyword arguments (what ``save`` writes
and ``load`` restores). A function is written as its name only: a file never names code to
import.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable
from typing import Any, Protocol

import torch

from dasktrain.trainer.holder.divergence import check_policy
from dasktrain.trainer.holder.shards import check_shards
from dasktrain.trainer.modes import mode_class
from dasktrain.trainer.optim import OptimizerConfig
from dasktrain.trainer.worker.compute import BatchCompute, check_compute_options

__all__ = ["ASSIGNMENTS", "FUNCTION", "PLAIN_KEYWORDS", "MissingLoss", "ModelSpec",
           "TrainerSettings", "check_arguments", "check_loss_given", "function_name",
           "merge_mode_options", "model_factory", "resolve_assignment", "run_settings",
           "saved_settings"]

ASSIGNMENTS = ("auto", "dynamic", "static")
"""How an epoch's batches reach the trainer workers (the Trainer's ``assignment``)."""

ModelSpec = Callable[[], torch.nn.Module] | torch.nn.Module

FUNCTION = "function:"
"""The prefix of a function written by name (``function:module.qualname``)."""

PLAIN_KEYWORDS = ("mode", "workers", "batch_size", "seed", "shuffle", "prefetch",
                  "shuffle_blocks", "block_rows", "drop_last", "device", "holder_worker",
                  "holder_shards", "timeout", "barrier_timeout", "direct_channel",
                  "shared_memory", "balance", "bucket_bytes", "on_nonfinite", "nonfinite_patience",
                  "checkpoint_every", "history_updates", "progress", "torch_threads",
                  "precision", "as_dict",
                  "clip_grad_norm", "clip_grad_value", "assignment", "pause_dask_profiler")
"""The Trainer's keyword arguments whose values are plain scalars (``mode_options`` and
``optimizer`` are plain data too, written as a dict each)."""


class TrainerSettings(Protocol):
    """The settings a Trainer holds, as the driver's modules read them."""

    mode: str
    mode_options: dict[str, Any]
    workers: int
    """The most trainer workers (the number, unless ``min_workers`` is less)."""
    min_workers: int
    """The least: a run with fewer than ``workers`` grows as the cluster does."""
    batch_size: int
    optimizer: OptimizerConfig
    compute: BatchCompute
    pipeline_options: dict[str, Any]
    """``seed``, ``shuffle``, ``transform``, ``prefetch``, ``shuffle_blocks``,
    ``block_rows``, ``drop_last`` and ``as_dict``: each worker's Pipeline options."""
    device: str | None
    holder_worker: str | None
    holder_shards: int
    assignment: str
    """``"auto"``, ``"static"`` or ``"dynamic"`` (see :func:`resolve_assignment`)."""
    timeout: float
    barrier_timeout: float
    direct_channel: bool
    shared_memory: bool
    balance: bool
    bucket_bytes: int
    on_nonfinite: str
    nonfinite_patience: int
    checkpoint_every: int | None
    history_updates: int | None
    show_progress: bool
    torch_threads: int
    pause_dask_profiler: bool
    clip_grad_norm: float | None
    clip_grad_value: float | None


class MissingLoss:
    """The loss of a trainer loaded without the loss (or ``step``) it was saved with.

    A file names functions without their code, so :meth:`Trainer.load` cannot always
    restore the loss; ``predict`` needs none, and ``evaluate`` and ``fit`` refuse to start
    with :meth:`error`, which names the fix. Called anyway, it raises that error."""

    def __init__(self, loss: str | None, step: str | None) -> None:
        self.loss = loss  # the names the file gave (None: it named none)
        self.step = step

    def error(self) -> ValueError:
        saved = (f"step={self.step}" if self.step else
                 f"loss={self.loss}" if self.loss else "a loss the file does not name")
        argument = "step" if self.step else "loss"
        return ValueError(f"this trainer was loaded without its loss (it was saved with "
                          f"{saved}): pass {argument}= to Trainer.load to evaluate or "
                          "train it; predict needs none")

    def __call__(self, *args: Any) -> Any:
        raise self.error()

    def __repr__(self) -> str:
        return f"MissingLoss(loss={self.loss!r}, step={self.step!r})"


def check_loss_given(compute: BatchCompute) -> None:
    """Refuse to evaluate or train with a :class:`MissingLoss`, naming the fix."""
    if compute.step is None and isinstance(compute.loss, MissingLoss):
        raise compute.loss.error()


def _copy_of(module: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(module)


def model_factory(model: ModelSpec) -> Callable[[], torch.nn.Module]:
    """A function returning a fresh model: ``model`` itself, or one copying a module."""
    if isinstance(model, torch.nn.Module):
        return functools.partial(_copy_of, model)
    if callable(model):
        return model
    raise TypeError(f"model must be a torch.nn.Module or a function returning one, got "
                    f"{type(model).__name__}")


def merge_mode_options(given: dict[str, Any] | None, keywords: dict[str, Any]
                       ) -> dict[str, Any]:
    """``mode_options`` and the mode options given as keywords, as one dict."""
    if given is None:
        return keywords
    if not isinstance(given, dict):
        raise TypeError(f"mode_options must be a dict, got {type(given).__name__}")
    both = sorted(set(given) & set(keywords))
    if both:
        raise TypeError(f"mode option(s) {both} given both in mode_options and as keywords")
    return {**given, **keywords}


def _check_clip(norm: float | None, value: float | None) -> None:
    for name, limit in (("clip_grad_norm", norm), ("clip_grad_value", value)):
        if limit is not None and not (isinstance(limit, (int, float)) and
                                      math.isfinite(limit) and limit > 0):
            raise ValueError(f"{name} must be a positive number, got {limit!r}")


def check_arguments(*, loss: Any, step: Any, metrics: dict[str, Any], precision: Any,
                    optimizer: Any, mode: str, mode_options: dict[str, Any], workers: Any,
                    batch_size: Any, holder_shards: Any, clip_grad_norm: Any,
                    clip_grad_value: Any, checkpoint_every: Any, bucket_bytes: Any,
                    timeout: float, barrier_timeout: float, on_nonfinite: Any,
                    nonfinite_patience: Any, history_updates: Any = None) -> None:
    """Refuse bad Trainer arguments by name, before any cluster work."""
    check_compute_options(loss, step, metrics, precision)
    _check_clip(clip_grad_norm, clip_grad_value)
    if not isinstance(optimizer, OptimizerConfig):
        raise TypeError("optimizer must come from dt.optim (e.g. dt.optim.sgd(lr=0.1))")
    workers = worker_range(workers)[1]
    mode_class(mode).check(workers, mode_options)  # unknown modes and options fail here
    check_shards(holder_shards, mode, clip_grad_norm)
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if checkpoint_every is not None and checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every!r}")
    if history_updates is not None and (isinstance(history_updates, bool)
                                        or not isinstance(history_updates, int)
                                        or history_updates < 1):
        raise ValueError(f"history_updates must be a positive integer or None (every "
                         f"update), got {history_updates!r}")
    if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be a positive integer, got {bucket_bytes!r}")
    if timeout <= 0 or barrier_timeout <= 0:
        raise ValueError("timeout and barrier_timeout must be positive")
    check_policy(on_nonfinite, nonfinite_patience)


def worker_range(workers: Any) -> tuple[int, int]:
    """``(least, most)`` trainer workers of a Trainer's ``workers``: a number, or a range
    ``(least, most)`` for a run that grows and shrinks with the cluster."""
    if isinstance(workers, int) and not isinstance(workers, bool):
        least = most = workers
    elif isinstance(workers, (tuple, list)) and len(workers) == 2 \
            and all(isinstance(w, int) and not isinstance(w, bool) for w in workers):
        least, most = workers
    else:
        raise ValueError(f"workers must be a positive integer or a range (least, most), "
                         f"got {workers!r}")
    if not 1 <= least <= most:
        raise ValueError(f"workers must be a positive integer or a range (least, most) with "
                         f"1 <= least <= most, got {workers!r}")
    return least, most


def resolve_assignment(assignment: Any, mode: str, holder_shards: int) -> str:
    """``"static"`` or ``"dynamic"`` for a Trainer's ``assignment``: ``"auto"`` is dynamic
    wherever it applies (every mode but ``sync``, one holder)."""
    if assignment not in ASSIGNMENTS:
        raise ValueError(f"assignment must be one of {ASSIGNMENTS}, got {assignment!r}")
    claims = mode_class(mode).may_claim_work
    if assignment == "auto":
        return "dynamic" if claims and holder_shards == 1 else "static"
    if assignment == "dynamic" and not claims:
        raise ValueError(f"assignment='dynamic' does not apply to mode {mode!r}: its workers "
                         "step in lock-step, each step one batch of every worker (use "
                         "'async', 'ssp', 'soft' or 'average', or assignment='static')")
    if assignment == "dynamic" and holder_shards > 1:
        raise ValueError("assignment='dynamic' needs a single holder (holder_shards=1): "
                         "the holder hands out the work")
    return assignment


def function_name(value: Any) -> Any:
    """A function as a comparable name (``function:module.qualname``); None stays None."""
    if value is None:
        return None
    module = getattr(value, "__module__", None) or "?"
    name = getattr(value, "__qualname__", None) or type(value).__qualname__
    return f"{FUNCTION}{module}.{name}"


def run_settings(trainer: TrainerSettings) -> dict[str, Any]:
    """The settings that define a run (stored in checkpoints; plain values only): a resume
    must match each of them."""
    options = trainer.pipeline_options
    # With work claimed on demand, a run may go on with another number of workers.
    assignment = resolve_assignment(trainer.assignment, trainer.mode, trainer.holder_shards)
    workers = {} if assignment == "dynamic" else {"workers": _workers(trainer)}
    return {"mode": trainer.mode, **workers, "assignment": assignment,
            "batch_size": trainer.batch_size,
            "seed": options["seed"], "shuffle": options["shuffle"],
            "shuffle_blocks": options["shuffle_blocks"],
            "block_rows": options["block_rows"], "drop_last": options["drop_last"],
            "transform": function_name(options["transform"]),
            "as_dict": options["as_dict"], "step": _names(trainer.compute)[1],
            "precision": trainer.compute.precision,
            "clip_grad_norm": trainer.clip_grad_norm,
            "clip_grad_value": trainer.clip_grad_value,
            "optimizer": trainer.optimizer.to_dict(),
            "mode_options": {k: function_name(v) if callable(v) else v
                             for k, v in trainer.mode_options.items()}}


def saved_settings(trainer: TrainerSettings) -> dict[str, Any]:
    """Every setting of ``trainer``, keyed by its ``Trainer`` keyword argument: the
    :func:`run_settings`, the others of :data:`PLAIN_KEYWORDS`, and the functions (``loss``
    and each metric) by name."""
    options = trainer.pipeline_options
    return {**run_settings(trainer), "assignment": trainer.assignment,
            "workers": _workers(trainer),
            "prefetch": options["prefetch"], "device": trainer.device,
            "holder_worker": trainer.holder_worker, "holder_shards": trainer.holder_shards,
            "timeout": trainer.timeout, "barrier_timeout": trainer.barrier_timeout,
            "direct_channel": trainer.direct_channel,
            "shared_memory": trainer.shared_memory, "balance": trainer.balance,
            "bucket_bytes": trainer.bucket_bytes,
            "on_nonfinite": trainer.on_nonfinite,
            "nonfinite_patience": trainer.nonfinite_patience,
            "checkpoint_every": trainer.checkpoint_every,
            "history_updates": trainer.history_updates, "progress": trainer.show_progress,
            "torch_threads": trainer.torch_threads,
            "pause_dask_profiler": trainer.pause_dask_profiler,
            "loss": _names(trainer.compute)[0],
            "metrics": {name: function_name(fn) for name, fn in trainer.compute.metrics.items()}}


def _workers(trainer: TrainerSettings) -> int | list[int]:
    """The ``workers`` argument: a number, or ``[least, most]``."""
    if trainer.min_workers == trainer.workers:
        return trainer.workers
    return [trainer.min_workers, trainer.workers]


def _names(compute: BatchCompute) -> tuple[str | None, str | None]:
    """The names of ``compute``'s loss and step; those a file gave, where a trainer was
    loaded without them (so that saving it again keeps them)."""
    if isinstance(compute.loss, MissingLoss):
        return compute.loss.loss, compute.loss.step
    return function_name(compute.loss), function_name(compute.step)
