"""Optimizers that run on the parameter holder, described by small config objects.

``dt.optim.sgd(lr=0.1, momentum=0.9)`` is a :class:`OptimizerConfig`: plain data, cheap to
send to the holder's worker and to store in a checkpoint. The holder builds the
``torch.optim`` optimizer from it over one flat parameter buffer: SGD (momentum, Nesterov,
weight decay), Adam and AdamW all update element by element, so optimising the flat buffer
is the same as optimising the model's tensors one by one.

The large-batch optimizers LARS and LAMB are not element-wise: each scales a tensor's
update by a *trust ratio* of that tensor's norms. They take the flat buffer together with
its segments (:meth:`dasktrain.trainer.flat.FlatLayout.param_segments`, one per model
tensor) and compute one ratio per segment, so the holder's flat buffer gives the same
updates as the model's own tensors.

The learning rate at update ``t`` is ``lr x warmup(t) x schedule(t)``, set on the optimizer
before every step (no ``torch.optim.lr_scheduler`` object: its state would hold callables,
which a safe checkpoint cannot).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from dasktrain.trainer.large_batch import Segment

__all__ = ["OptimizerConfig", "adam", "adamw", "get_optimizer", "lamb", "lars", "sgd"]

_SCHEDULES = ("constant", "cosine", "linear", "step")

@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class OptimizerConfig:
    """What optimizer the holder runs and how its learning rate changes."""

    name: str
    """``"sgd"``, ``"adam"``, ``"adamw"``, or the large-batch ``"lars"`` or ``"lamb"``
    (see :func:`lars`, :func:`lamb`)."""
    lr: float
    """Base learning rate."""
    momentum: float = 0.0
    """SGD and LARS momentum."""
    nesterov: bool = False
    """SGD Nesterov momentum (needs ``momentum > 0``)."""
    weight_decay: float = 0.0
    """L2 penalty (SGD, Adam, LARS) or decoupled decay (AdamW, LAMB)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam/AdamW/LAMB moment decay rates."""
    eps: float = 1e-8
    """Adam/AdamW/LAMB denominator term; LARS: added to the gradient norm."""
    trust_coefficient: float = 0.001
    """LARS: the trust ratio is ``trust_coefficient * |w| / |g|``."""
    exclude_bias_and_norm: bool = True
    """LARS/LAMB: tensors of at most one dimension (biases, norm-layer weights) get no
    weight decay and a trust ratio of 1."""
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
        if self.nesterov and self.name != "sgd":
            raise ValueError(f"nesterov=True is an SGD option; {self.name!r} has none")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay!r}")
        if not all(0 <= b < 1 for b in self.betas) or len(self.betas) != 2:
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        if not (isinstance(self.eps, (int, float)) and math.isfinite(self.eps)
                and self.eps >= 0):
            raise ValueError(f"eps must be a finite number >= 0, got {self.eps!r}")
        if not (isinstance(self.trust_coefficient, (int, float))
                and math.isfinite(self.trust_coefficient) and self.trust_coefficient > 0):
            raise ValueError("trust_coefficient must be a positive number, got "
                             f"{self.trust_coefficient!r}")
        if not isinstance(self.exclude_bias_and_norm, bool):
            raise TypeError("exclude_bias_and_norm must be True or False, got "
                            f"{self.exclude_bias_and_norm!r}")
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

    def build(self, params: list[Any], segments: Sequence[Segment] | None = None) -> Any:
        """A ``torch.optim`` optimizer over ``params``.

        Parameters
        ----------
        params
            The tensors to optimise: a model's own parameters, or the holder's one flat
            parameter.
        segments
            Where each model tensor lies in ``params[0]`` when that is a flat buffer
            (:meth:`~dasktrain.trainer.flat.FlatLayout.param_segments`). LARS and LAMB
            compute one trust ratio per segment; SGD, Adam and AdamW are element-wise and
            ignore them. Without segments each tensor of ``params`` is one segment.
        """
        return _OPTIMIZERS[self.name](self, params, segments)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (for checkpoints and reports)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> OptimizerConfig:
        values = dict(values)
        if "betas" in values:
            values["betas"] = tuple(values["betas"])
        return cls(**values)



def _sgd(config: OptimizerConfig, params: list[Any], segments: Sequence[Segment] | None
         ) -> torch.optim.Optimizer:
    import torch  # on first build: configs are plain data, cheap to import and send

    # Element-wise: the segments change nothing (so for Adam and AdamW).
    return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum,
                           nesterov=config.nesterov, weight_decay=config.weight_decay)


def _fused_if_possible(kind: Any, params: list[Any], **options: Any) -> torch.optim.Optimizer:
    """``kind(params, fused=True)`` where torch has a fused kernel for these tensors (one
    kernel per step instead of a dozen: it halves the holder's time per update for small
    models), else the default implementation."""
    try:
        return kind(params, fused=True, **options)
    except (RuntimeError, ValueError, TypeError):
        return kind(params, **options)


def _adam(config: OptimizerConfig, params: list[Any], segments: Sequence[Segment] | None
          ) -> torch.optim.Optimizer:
    import torch

    return _fused_if_possible(torch.optim.Adam, params, lr=config.lr, betas=config.betas,
                              eps=config.eps, weight_decay=config.weight_decay)


def _adamw(config: OptimizerConfig, params: list[Any], segments: Sequence[Segment] | None
           ) -> torch.optim.Optimizer:
    import torch

    return _fused_if_possible(torch.optim.AdamW, params, lr=config.lr, betas=config.betas,
                              eps=config.eps, weight_decay=config.weight_decay)


def _lars(config: OptimizerConfig, params: list[Any], segments: Sequence[Segment] | None
          ) -> torch.optim.Optimizer:
    from dasktrain.trainer.large_batch import LARS

    return LARS(params, config.lr, momentum=config.momentum,
                weight_decay=config.weight_decay, trust_coefficient=config.trust_coefficient,
                eps=config.eps, exclude_bias_and_norm=config.exclude_bias_and_norm,
                segments=segments)


def _lamb(config: OptimizerConfig, params: list[Any], segments: Sequence[Segment] | None
          ) -> torch.optim.Optimizer:
    from dasktrain.trainer.large_batch import LAMB

    return LAMB(params, config.lr, betas=config.betas, eps=config.eps,
                weight_decay=config.weight_decay,
                exclude_bias_and_norm=config.exclude_bias_and_norm, segments=segments)


# The one front door: adding an optimizer is a builder and an entry here.
_OPTIMIZERS = {"sgd": _sgd, "adam": _adam, "adamw": _adamw, "lars": _lars, "lamb": _lamb}


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


def lars(lr: float, *, momentum: float = 0.9, weight_decay: float = 0.0,
         trust_coefficient: float = 0.001, eps: float = 1e-8,
         exclude_bias_and_norm: bool = True, **schedule: Any) -> OptimizerConfig:
    """LARS: momentum SGD with a per-tensor learning rate ``trust_coefficient * |w| / |g|``.

    For large global batches (You et al. 2017, "Large Batch Training of Convolutional
    Networks"); the update is written out in :class:`LARS`. Learning rates are typically
    far larger than plain SGD's, since ``trust_coefficient`` scales them down.

    Parameters
    ----------
    lr
        Base learning rate (times warm-up and schedule).
    momentum
        Momentum of the (learning-rate-scaled) update.
    weight_decay
        L2 penalty added to the gradient before the trust ratio.
    trust_coefficient
        How far one update may move a tensor, relative to its norm.
    eps
        Added to the gradient norm in the trust ratio.
    exclude_bias_and_norm
        Tensors of at most one dimension (biases, norm layers) get no weight decay and a
        trust ratio of 1: plain momentum SGD at ``lr``.
    **schedule
        ``warmup_steps``, ``schedule``, ``total_steps``, ``step_size``, ``gamma`` (see
        :class:`OptimizerConfig`).
    """
    return OptimizerConfig(name="lars", lr=lr, momentum=momentum, weight_decay=weight_decay,
                           trust_coefficient=trust_coefficient, eps=eps,
                           exclude_bias_and_norm=exclude_bias_and_norm, **schedule)


def lamb(lr: float = 1e-3, *, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
         weight_decay: float = 0.01, exclude_bias_and_norm: bool = True, **schedule: Any
         ) -> OptimizerConfig:
    """LAMB: an AdamW step rescaled per tensor to ``lr * |w|`` (trust ratio ``|w| / |u|``).

    For large global batches (You et al. 2019, "Large Batch Optimization for Deep
    Learning: Training BERT in 76 minutes"); the update is written out in :class:`LAMB`.

    Parameters
    ----------
    lr
        Base learning rate (times warm-up and schedule): roughly the fraction of its norm
        one update moves a tensor.
    betas
        Decay rates of the first and second moments.
    eps
        Added to the square root of the second moment.
    weight_decay
        Decoupled decay, added to the Adam direction before the trust ratio.
    exclude_bias_and_norm
        Tensors of at most one dimension (biases, norm layers) get no weight decay and a
        trust ratio of 1: a plain Adam step at ``lr``.
    **schedule
        ``warmup_steps``, ``schedule``, ``total_steps``, ``step_size``, ``gamma`` (see
        :class:`OptimizerConfig`).
    """
    return OptimizerConfig(name="lamb", lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                           exclude_bias_and_norm=exclude_bias_and_norm, **schedule)
