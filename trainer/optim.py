"""Optimizers that run on the parameter holder, described by small config objects.

``dt.optim.sgd(lr=0.1, momentum=0.9)`` is a :class:`OptimizerConfig`: plain data, cheap to
send to the holder's worker and to store in a checkpoint. The holder builds the
``torch.optim`` optimizer from it over one flat parameter buffer: SGD (momentum, Nesterov,
weight decay), Adam and AdamW all update element by element, so optimising the flat buffer
is the same as optimising the model's tensors one by one.

The learning rate at update ``t`` is ``lr x warmup(t) x schedule(t)``, set on the optimizer
before every step (no ``torch.optim.lr_scheduler`` object: its state would hold callables,
which a safe checkpoint cannot).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = ["OptimizerConfig", "adam", "adamw", "get_optimizer", "sgd"]

_SCHEDULES = ("constant", "cosine", "linear", "step")


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class OptimizerConfig:
    """What optimizer the holder runs and how its learning rate changes."""

    name: str
    """``"sgd"``, ``"adam"`` or ``"adamw"``."""
    lr: float
    """Base learning rate."""
    momentum: float = 0.0
    """SGD momentum."""
    nesterov: bool = False
    """SGD Nesterov momentum (needs ``momentum > 0``)."""
    weight_decay: float = 0.0
    """L2 penalty (SGD, Adam) or decoupled decay (AdamW)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam/AdamW moment decay rates."""
    eps: float = 1e-8
    """Adam/AdamW denominator term."""
    warmup_steps: int = 0
    """Updates over which the rate rises linearly from ``lr / warmup_steps`` to ``lr``."""
    schedule: str = "constant"
    """After warm-up: ``"constant"``, ``"cosine"`` or ``"linear"`` decay to 0 over
    ``total_steps``, or ``"step"`` (times ``gamma`` every ``step_size`` updates)."""
    total_steps: int | None = None
    """Length of the cosine/linear decay; default: the number of updates of the fit."""
    step_size: int = 1000
    gamma: float = 0.1

    def __post_init__(self) -> None:
        if self.name not in _OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.name!r}; choose one of "
                             f"{sorted(_OPTIMIZERS)}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive number, got {self.lr!r}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must lie in [0, 1), got {self.momentum!r}")
        if self.nesterov and self.momentum <= 0:
            raise ValueError("nesterov=True needs momentum > 0")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay!r}")
        if not all(0 <= b < 1 for b in self.betas) or len(self.betas) != 2:
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps!r}")
        if self.schedule not in _SCHEDULES:
            raise ValueError(f"schedule must be one of {_SCHEDULES}, got {self.schedule!r}")
        if self.total_steps is not None and self.total_steps <= 0:
            raise ValueError(f"total_steps must be positive, got {self.total_steps!r}")
        if self.step_size <= 0 or not 0 < self.gamma <= 1:
            raise ValueError("step_size must be positive and gamma in (0, 1]")

    def lr_at(self, step: int, total_steps: int | None = None) -> float:
        """Learning rate of update number ``step`` (0-based)."""
        factor = 1.0
        if step < self.warmup_steps:
            factor = (step + 1) / self.warmup_steps
        after = step - self.warmup_steps
        total = (self.total_steps or total_steps or 0) - self.warmup_steps
        if self.schedule == "step":
            factor *= self.gamma ** (max(after, 0) // self.step_size)
        elif self.schedule in ("cosine", "linear") and total > 0 and after >= 0:
            progress = min(after / total, 1.0)
            factor *= (0.5 * (1 + math.cos(math.pi * progress)) if self.schedule == "cosine"
                       else 1.0 - progress)
        return self.lr * factor

    def build(self, params: list[Any]) -> Any:
        """A ``torch.optim`` optimizer over ``params`` (a list of tensors)."""
        return _OPTIMIZERS[self.name](self, params)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (for checkpoints and reports)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> OptimizerConfig:
        values = dict(values)
        if "betas" in values:
            values["betas"] = tuple(values["betas"])
        return cls(**values)


def _sgd(config: OptimizerConfig, params: list[Any]) -> Any:
    import torch

    return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum,
                           nesterov=config.nesterov, weight_decay=config.weight_decay)


def _adam(config: OptimizerConfig, params: list[Any]) -> Any:
    import torch

    return torch.optim.Adam(params, lr=config.lr, betas=config.betas, eps=config.eps,
                            weight_decay=config.weight_decay)


def _adamw(config: OptimizerConfig, params: list[Any]) -> Any:
    import torch

    return torch.optim.AdamW(params, lr=config.lr, betas=config.betas, eps=config.eps,
                             weight_decay=config.weight_decay)


# The one front door: adding an optimizer is a builder and an entry here.
_OPTIMIZERS = {"sgd": _sgd, "adam": _adam, "adamw": _adamw}


def get_optimizer(name: str, **options: Any) -> OptimizerConfig:
    """An optimizer config by name: ``get_optimizer("sgd", lr=0.1, momentum=0.9)``."""
    return OptimizerConfig(name=name, **options)


def sgd(lr: float, *, momentum: float = 0.0, nesterov: bool = False,
        weight_decay: float = 0.0, **schedule: Any) -> OptimizerConfig:
    """SGD with optional momentum, Nesterov and weight decay.

    ``schedule`` takes ``warmup_steps``, ``schedule``, ``total_steps``, ``step_size`` and
    ``gamma`` (see :class:`OptimizerConfig`).
    """
    return OptimizerConfig(name="sgd", lr=lr, momentum=momentum, nesterov=nesterov,
                           weight_decay=weight_decay, **schedule)


def adam(lr: float = 1e-3, *, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
         weight_decay: float = 0.0, **schedule: Any) -> OptimizerConfig:
    """Adam (L2 weight decay added to the gradient, as ``torch.optim.Adam``)."""
    return OptimizerConfig(name="adam", lr=lr, betas=betas, eps=eps,
                           weight_decay=weight_decay, **schedule)


def adamw(lr: float = 1e-3, *, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
          weight_decay: float = 0.01, **schedule: Any) -> OptimizerConfig:
    """AdamW (decoupled weight decay)."""
    return OptimizerConfig(name="adamw", lr=lr, betas=betas, eps=eps,
                           weight_decay=weight_decay, **schedule)
