"""Metrics a config file can name: ``metrics = ["accuracy", "top5", "mae"]``.

Each is a ``fn(output, target)`` as :class:`~dasktrain.Trainer` takes in ``metrics=``,
measured on the training batches and on validation; the History keeps their
sample-weighted means per epoch. They live in a module of the package, so workers import
them by name.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import torch

__all__ = ["METRICS", "accuracy", "get_metric", "mean_absolute_error", "mean_squared_error",
           "metric_names", "top_k_accuracy"]

MetricFunction = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_TOP_K = re.compile(r"top([1-9][0-9]*)")


def _predicted_classes(output: torch.Tensor) -> torch.Tensor:
    if output.ndim == 1 or output.shape[-1] == 1:  # one logit: binary, positive above 0
        return (output.reshape(-1) > 0).long()
    return output.argmax(dim=-1)


def accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Fraction of samples whose highest-scoring class (one logit: above 0) is the label."""
    predicted = _predicted_classes(output)
    return (predicted == target.reshape(predicted.shape).long()).float().mean()


def top_k_accuracy(output: torch.Tensor, target: torch.Tensor, k: int) -> torch.Tensor:
    """Fraction of samples whose label is among the ``k`` highest-scoring classes."""
    best = output.topk(min(k, output.shape[-1]), dim=-1).indices  # (N, k)
    return (best == target.reshape(-1, 1)).any(dim=-1).float().mean()


def mean_absolute_error(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean of ``|output - target|`` (target reshaped to the output's shape)."""
    return (output - target.reshape(output.shape)).abs().mean()


def mean_squared_error(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean of ``(output - target)**2`` (target reshaped to the output's shape)."""
    return (output - target.reshape(output.shape)).pow(2).mean()


METRICS: dict[str, MetricFunction] = {
    "accuracy": accuracy,
    "mae": mean_absolute_error,
    "mse": mean_squared_error,
}


def metric_names() -> list[str]:
    """The names :func:`get_metric` knows (``topK`` stands for any ``k``)."""
    return [*METRICS, "topK"]


def get_metric(name: str) -> MetricFunction:
    """The metric called ``name``: one of :data:`METRICS` or ``topK`` (e.g. ``top5``)."""
    if name in METRICS:
        return METRICS[name]
    match = _TOP_K.fullmatch(name)
    if match:
        return functools.partial(top_k_accuracy, k=int(match.group(1)))
    raise ValueError(f"unknown metric {name!r}; built-in metrics: {', '.join(metric_names())} "
                     "(or name a function as 'file.py:function' or 'module:function')")
