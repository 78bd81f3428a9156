"""What a trainer worker computes on one batch: the loss, the training metrics, and the
precision it runs in.

By default a batch is ``(x, y)`` and the loss is ``loss(model(x), y)``, as in Keras'
``compile(loss=...)``; a dict batch of a dataset of named arrays (:class:`NamedBatch`,
``as_dict=True``) gives ``loss(model(**batch.inputs), batch.target)``: the model takes its
features arrays as keyword arguments, by name. A custom ``step(model, batch)`` takes over
for anything else (models of several inputs, dict batches from ``as_dict=True``, auxiliary
losses), as Lightning's ``training_step`` does: it returns the loss, or a dict with
``"loss"`` and further metrics.

``metrics`` are named ``fn(output, target)`` computed on each training batch (with the
default step) and on validation; their batch-size weighted means per epoch go in the
History. Mixed precision runs the forward pass and the loss under ``torch.autocast``:
``"bf16"`` as it is (bfloat16 has float32's range), ``"fp16"`` with dynamic loss scaling
(:class:`LossScale`). Gradients reach the holder in float32 either way, where the master
parameters stay float32.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from dasktrain.pipeline.named import NamedBatch
from dasktrain.trainer.errors import InvalidLoss

__all__ = ["PRECISIONS", "BatchCompute", "LossScale", "MetricFunction", "StepFunction",
           "batch_size_of", "check_scalar_loss", "clip_gradient"]

StepFunction = Callable[[torch.nn.Module, Any], "torch.Tensor | Mapping[str, Any]"]
MetricFunction = Callable[[torch.Tensor, torch.Tensor], "torch.Tensor | float"]
PRECISIONS = ("32", "bf16", "fp16")
_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def batch_size_of(batch: Any) -> int:
    """Samples in a batch: the length of its first tensor (a tuple, dict or tensor)."""
    if isinstance(batch, Mapping):
        batch = next(iter(batch.values()))
    elif isinstance(batch, (tuple, list)):
        batch = batch[0]
    return len(batch)


def check_compute_options(loss: Any, step: Any, metrics: Any, precision: Any) -> None:
    """Refuse bad settings by name (called by the Trainer before any cluster work)."""
    if step is not None and not callable(step):
        raise TypeError(f"step must be a function step(model, batch) -> loss or dict, got "
                        f"{type(step).__name__}")
    if step is None and not callable(loss):
        raise TypeError("loss must be a callable loss(output, target) -> tensor (or give "
                        "step=fn(model, batch))")
    if not isinstance(metrics, Mapping) or not all(
            isinstance(k, str) and callable(v) for k, v in metrics.items()):
        raise TypeError("metrics must be a dict of name -> fn(output, target)")
    if "loss" in metrics:
        raise ValueError("'loss' is measured already; give the metric another name")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class BatchCompute:
    """Forward and loss of one batch (backward is the caller's, so the loss scale applies)."""

    loss: Callable[..., torch.Tensor] | None
    step: StepFunction | None = None
    metrics: Mapping[str, MetricFunction] = dataclasses.field(default_factory=dict)
    precision: str = "32"

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        dtype = _AUTOCAST.get(self.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=dtype)

    def __call__(self, model: torch.nn.Module, batch: Any, device: torch.device
                 ) -> tuple[torch.Tensor, dict[str, float], Any]:
        """(loss, metrics of this batch, (output, target) or None for a custom step)."""
        with self.autocast(device):
            if self.step is not None:
                loss, values = _loss_and_metrics(self.step(model, batch))
                return check_scalar_loss(loss), values, None
            if isinstance(batch, NamedBatch):
                output, y = model(**batch.inputs), batch.target
            else:
                x, y = batch if isinstance(batch, tuple) else (batch, None)
                output = model(x)
            loss = self.loss(output, y) if y is not None else self.loss(output)
        check_scalar_loss(loss)
        values = {}
        if self.metrics and y is not None:
            with torch.no_grad():
                detached = output.detach().float()
                values = {name: float(fn(detached, y)) for name, fn in self.metrics.items()}
        return loss, values, (output, y)


def check_scalar_loss(loss: Any) -> torch.Tensor:
    """``loss`` if it is one value to differentiate, else :class:`InvalidLoss` naming what
    it is. Reads shapes only: no device synchronisation."""
    if not isinstance(loss, torch.Tensor):
        raise InvalidLoss(f"the loss must return a scalar tensor; it returned a "
                          f"{type(loss).__name__}")
    if loss.numel() != 1:  # e.g. reduction="none": one loss per sample, shape (batch,)
        raise InvalidLoss(f"the loss must return a scalar (reduce it, e.g. "
                          f"reduction='mean'); it returned shape {tuple(loss.shape)}")
    return loss


def _loss_and_metrics(result: Any) -> tuple[torch.Tensor, dict[str, float]]:
    if isinstance(result, torch.Tensor):
        return result, {}
    if isinstance(result, Mapping) and isinstance(result.get("loss"), torch.Tensor):
        metrics = {k: float(v.detach()) if isinstance(v, torch.Tensor) else float(v)
                   for k, v in result.items() if k != "loss"}
        return result["loss"], metrics
    raise TypeError(f"step must return the loss tensor or a dict with a 'loss' tensor, got "
                    f"{type(result).__name__}")


class MetricTotals:
    """Batch-size weighted sums of metrics, for their means over an epoch."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def add(self, values: Mapping[str, float], count: int) -> None:
        for name, value in values.items():
            self.sums[name] = self.sums.get(name, 0.0) + value * count
            self.counts[name] = self.counts.get(name, 0) + count

    def merge(self, other: Mapping[str, Any]) -> None:
        for name, total in other.get("sums", {}).items():
            self.sums[name] = self.sums.get(name, 0.0) + total
            self.counts[name] = self.counts.get(name, 0) + other["counts"][name]

    def to_dict(self) -> dict[str, Any]:
        return {"sums": dict(self.sums), "counts": dict(self.counts)}

    def means(self) -> dict[str, float]:
        return {name: self.sums[name] / self.counts[name] for name in self.sums
                if self.counts[name]}


class LossScale:
    """Dynamic loss scaling for float16 (as ``torch.amp.GradScaler``): gradients of a
    scaled loss, divided back before they leave the worker; a step whose gradients overflow
    is skipped and the scale halved, and the scale doubles after ``growth_interval`` clean
    steps."""

    def __init__(self, enabled: bool, initial: float = 2.0 ** 16,
                 growth_interval: int = 2000) -> None:
        self.enabled = enabled
        self.scale = initial
        self.growth_interval = growth_interval
        self._clean = 0
        self.skipped = 0

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def unscale(self, grads: torch.Tensor) -> bool:
        """Divide ``grads`` (in place) by the scale; False if they overflowed (skip)."""
        if not self.enabled:
            return True
        grads.mul_(1.0 / self.scale)
        if bool(torch.isfinite(grads).all()):
            self._clean += 1
            if self._clean >= self.growth_interval:
                self.scale *= 2.0
                self._clean = 0
            return True
        self.scale = max(self.scale / 2.0, 1.0)
        self._clean = 0
        self.skipped += 1
        return False




def clip_gradient(grad: torch.Tensor, norm: float | None, value: float | None
                  ) -> torch.Tensor:
    """``grad`` (a flat gradient) clipped as ``torch.nn.utils.clip_grad_value_`` then
    ``clip_grad_norm_`` do it (same formula, same epsilon), in place."""
    if value is not None:
        grad.clamp_(-value, value)
    if norm is not None:
        total = torch.linalg.vector_norm(grad, 2)
        grad.mul_(torch.clamp(norm / (total + 1e-6), max=1.0))
    return grad
