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

Parameter groups (:func:`group`) give tensors chosen by name their own learning rate and
weight decay, and ``exclude_bias_and_norm=True`` takes biases and normalisation weights out
of weight decay, as the usual ``no_decay`` list of a torch training script does. The holder
keeps its flat buffer: it optimises each run of consecutive tensors that share settings as
one view of it (:mod:`dasktrain.trainer.flat_optim`).

The learning rate at update ``t`` is ``lr x warmup(t) x schedule(t)``, set on the optimizer
before every step (no ``torch.optim.lr_scheduler`` object: its state would hold callables,
which a safe checkpoint cannot).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from dasktrain.trainer.large_batch import Segments

__all__ = ["OptimizerConfig", "ParamGroup", "adam", "adamw", "get_optimizer", "group", "lamb",
           "lars", "sgd"]

_SCHEDULES = ("constant", "cosine", "linear", "step")
_PER_TENSOR = ("lars", "lamb")  # optimizers that are not element-wise


@dataclasses.dataclass(frozen=True, slots=True)
class ParamGroup:
    """Tensors chosen by name, with their own learning rate and weight decay.

    Built by :func:`group`; a tensor belongs to the first group with a matching pattern,
    and to the optimizer's own settings when none matches.
    """

    patterns: tuple[str, ...]
    """``fnmatch`` patterns over ``model.named_parameters()`` names (``"encoder.*"``)."""
    lr: float | None = None
    """Base learning rate of the group (it follows the same warm-up and schedule); default:
    the optimizer's."""
    weight_decay: float | None = None
    """Weight decay of the group; default: the optimizer's."""

    def __post_init__(self) -> None:
        if isinstance(self.patterns, str) or not self.patterns or not all(
                isinstance(p, str) and p for p in self.patterns):
            raise ValueError(f"a parameter group needs name patterns (strings), got "
                             f"{self.patterns!r}")
        if self.lr is not None and not (isinstance(self.lr, (int, float))
                                        and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"group {self.patterns}: lr must be a positive number, got "
                             f"{self.lr!r}")
        if self.weight_decay is not None and not (
                isinstance(self.weight_decay, (int, float)) and self.weight_decay >= 0):
            raise ValueError(f"group {self.patterns}: weight_decay must be >= 0, got "
                             f"{self.weight_decay!r}")

    def matches(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.patterns)


def group(*patterns: str, lr: float | None = None,
          weight_decay: float | None = None) -> ParamGroup:
    """A parameter group: the tensors whose names match any of ``patterns`` (``fnmatch``
    style, e.g. ``"encoder.*"``, ``"*.bias"``), trained at ``lr`` with ``weight_decay``.

    ``dt.optim.adamw(1e-3, groups=[dt.optim.group("backbone.*", lr=1e-4)])`` trains a
    pretrained backbone ten times slower than the head.
    """
    return ParamGroup(tuple(patterns), lr, weight_decay)

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
    exclude_bias_and_norm: bool | None = None
    """Tensors of at most one dimension (biases, norm-layer weights) get no weight decay;
    under LARS/LAMB also a trust ratio of 1. Default: on for LARS and LAMB, off for SGD,
    Adam and AdamW (as in ``torch.optim``)."""
    groups: tuple[ParamGroup, ...] = ()
    """Per-group learning rates and weight decays (:func:`group`); the first matching group
    wins, and ``exclude_bias_and_norm`` still applies inside a group."""
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
        if self.exclude_bias_and_norm is not None and not isinstance(
                self.exclude_bias_and_norm, bool):
            raise TypeError("exclude_bias_and_norm must be True or False, got "
                            f"{self.exclude_bias_and_norm!r}")
        if not isinstance(self.groups, tuple):
            object.__setattr__(self, "groups", tuple(self.groups))
        for g in self.groups:
            if not isinstance(g, ParamGroup):
                raise TypeError(f"groups must come from dt.optim.group(...), got {g!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps!r}")
        if self.schedule not in _SCHEDULES:
            raise ValueError(f"schedule must be one of {_SCHEDULES}, got {self.schedule!r}")
        if self.total_steps is not None and self.total_steps <= 0:
            raise ValueError(f"total_steps must be positive, got {self.total_steps!r}")
        if self.step_size <= 0 or not 0 < self.gamma <= 1:
            raise ValueError("step_size must be positive and gamma in (0, 1]")

    @property
    def excludes_bias_and_norm(self) -> bool:
        """Whether biases and norm weights are kept out of weight decay (resolved default)."""
        if self.exclude_bias_and_norm is None:
            return self.name in _PER_TENSOR
        return self.exclude_bias_and_norm

    def tensor_settings(self, name: str, shape: tuple[int, ...]) -> tuple[float, float]:
        """``(base lr, weight decay)`` of the model tensor ``name`` of ``shape``."""
        lr, decay = self.lr, self.weight_decay
        for g in self.groups:
            if g.matches(name):
                lr = g.lr if g.lr is not None else lr
                decay = g.weight_decay if g.weight_decay is not None else decay
                break
        # LARS and LAMB exclude such tensors inside their update (trust ratio too).
        if self.name not in _PER_TENSOR and self.excludes_bias_and_norm and len(shape) <= 1:
            decay = 0.0
        return lr, decay

    def check_names(self, names: Sequence[str]) -> None:
        """Refuse a group whose patterns match none of the model's parameter ``names``."""
        for g in self.groups:
            if not any(g.matches(n) for n in names):
                shown = ", ".join(list(names)[:8]) + (", ..." if len(names) > 8 else "")
                raise ValueError(f"parameter group {list(g.patterns)} matches no parameter "
                                 f"of the model; its parameters are: {shown}")

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

    def build(self, params: list[Any], segments: Segments | None = None) -> Any:
        """A ``torch.optim`` optimizer over ``params``.

        Parameters
        ----------
        params
            The tensors to optimise (a model's own parameters, or the holder's one flat
            parameter), or ``torch.optim``-style group dicts of them. ``groups`` and
            ``exclude_bias_and_norm`` are not applied here: use
            :class:`~dasktrain.trainer.flat_optim.FlatOptimizer` or :meth:`build_for`.
        segments
            Where each model tensor lies in ``params[0]`` when that is a flat buffer
            (:meth:`~dasktrain.trainer.flat.FlatLayout.param_segments`), or one such list
            per tensor when several flat pieces are given. LARS and LAMB compute one trust
            ratio per segment; SGD, Adam and AdamW are element-wise and ignore them.
            Without segments each tensor of ``params`` is one segment.
        """
        return _OPTIMIZERS[self.name](self, params, segments)

    def build_for(self, model: Any) -> Any:
        """The same optimizer over ``model``'s own tensors, with its groups applied: what a
        one-process torch script would build."""
        self.check_names([n for n, _ in model.named_parameters()])
        by_settings: dict[tuple[float, float], list[Any]] = {}
        for name, p in model.named_parameters():
            if p.requires_grad:
                by_settings.setdefault(self.tensor_settings(name, tuple(p.shape)), []).append(p)
        return self.build([{"params": ps, "lr": lr, "weight_decay": decay}
                           for (lr, decay), ps in by_settings.items()])

    def to_dict(self) -> dict[str, Any]:
        """Plain values (for checkpoints and reports)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values["groups"] = [{"patterns": list(g.patterns), "lr": g.lr,
                             "weight_decay": g.weight_decay} for g in self.groups]
        return values

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> OptimizerConfig:
        values = dict(values)
        if "betas" in values:
            values["betas"] = tuple(values["betas"])
        values["groups"] = tuple(
            ParamGroup(tuple(g["patterns"]), g.get("lr"), g.get("weight_decay"))
            for g in values.get("groups", ()))
        return cls(**values)



def _sgd(config: OptimizerConfig, params: list[Any], segments: Segments | None
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


def _adam(config: OptimizerConfig, params: list[Any], segments: Segments | None
          ) -> torch.optim.Optimizer:
    import torch

    return _fused_if_possible(torch.optim.Adam, params, lr=config.lr, betas=config.betas,
                              eps=config.eps, weight_decay=config.weight_decay)


def _adamw(config: OptimizerConfig, params: list[Any], segments: Segments | None
           ) -> torch.optim.Optimizer:
    import torch

    return _fused_if_possible(torch.optim.AdamW, params, lr=config.lr, betas=config.betas,
                              eps=config.eps, weight_decay=config.weight_decay)


def _lars(config: OptimizerConfig, params: list[Any], segments: Segments | None
          ) -> torch.optim.Optimizer:
    from dasktrain.trainer.large_batch import LARS

    return LARS(params, config.lr, momentum=config.momentum,
                weight_decay=config.weight_decay, trust_coefficient=config.trust_coefficient,
                eps=config.eps, exclude_bias_and_norm=config.excludes_bias_and_norm,
                segments=segments)


def _lamb(config: OptimizerConfig, params: list[Any], segments: Segments | None
          ) -> torch.optim.Optimizer:
    from dasktrain.trainer.large_batch import LAMB

    return LAMB(params, config.lr, betas=config.betas, eps=config.eps,
                weight_decay=config.weight_decay,
                exclude_bias_and_norm=config.excludes_bias_and_norm, segments=segments)


# The one front door: adding an optimizer is a builder and an entry here.
_OPTIMIZERS = {"sgd": _sgd, "adam": _adam, "adamw": _adamw, "lars": _lars, "lamb": _lamb}


def get_optimizer(name: str, **options: Any) -> OptimizerConfig:
    """An optimizer config by name: ``get_optimizer("sgd", lr=0.1, momentum=0.9)``."""
    return OptimizerConfig(name=name, **options)


def sgd(lr: float, *, momentum: float = 0.0, nesterov: bool = False,
        weight_decay: float = 0.0, **options: Any) -> OptimizerConfig:
    """SGD with optional momentum, Nesterov and weight decay.

    ``options`` takes ``exclude_bias_and_norm`` and ``groups`` (parameter groups, see
    :func:`group`) and the schedule: ``warmup_steps``, ``schedule``, ``total_steps``,
    ``step_size`` and ``gamma`` (see :class:`OptimizerConfig`); so do :func:`adam` and
    :func:`adamw`.
    """
    return OptimizerConfig(name="sgd", lr=lr, momentum=momentum, nesterov=nesterov,
                           weight_decay=weight_decay, **options)


def adam(lr: float = 1e-3, *, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
         weight_decay: float = 0.0, **options: Any) -> OptimizerConfig:
    """Adam (L2 weight decay added to the gradient, as ``torch.optim.Adam``)."""
    return OptimizerConfig(name="adam", lr=lr, betas=betas, eps=eps,
                           weight_decay=weight_decay, **options)


def adamw(lr: float = 1e-3, *, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
          weight_decay: float = 0.01, **options: Any) -> OptimizerConfig:
    """AdamW (decoupled weight decay)."""
    return OptimizerConfig(name="adamw", lr=lr, betas=betas, eps=eps,
                           weight_decay=weight_decay, **options)


def lars(lr: float, *, momentum: float = 0.9, weight_decay: float = 0.0,
         trust_coefficient: float = 0.001, eps: float = 1e-8,
         exclude_bias_and_norm: bool = True, **schedule: Any) -> OptimizerConfig:
    """LARS: momentum SGD with a per-tensor learning rate
    ``trust_coefficient * |w| / (|g| + weight_decay * |w|)``.

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
        L2 penalty: added to the gradient, and ``weight_decay * |w|`` to the trust
        ratio's denominator (the paper's and apex LARC's ratio).
    trust_coefficient
        How far one update may move a tensor, relative to its norm.
    eps
        Added to the gradient norm in the trust ratio.
    exclude_bias_and_norm
        Tensors of at most one dimension (biases, norm layers) get no weight decay and a
        trust ratio of 1: plain momentum SGD at ``lr``.
    **schedule
        ``groups`` (:func:`group`), and ``warmup_steps``, ``schedule``, ``total_steps``,
        ``step_size``, ``gamma`` (see :class:`OptimizerConfig`).
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
        ``groups`` (:func:`group`), and ``warmup_steps``, ``schedule``, ``total_steps``,
        ``step_size``, ``gamma`` (see :class:`OptimizerConfig`).
    """
    return OptimizerConfig(name="lamb", lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                           exclude_bias_and_norm=exclude_bias_and_norm, **schedule)
