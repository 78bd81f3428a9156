"""What optimizer the holder runs, as plain data: :class:`OptimizerConfig` and parameter
groups (:class:`ParamGroup`).

A config is cheap to send to the holder's worker and to store in a checkpoint; the holder
builds the ``torch.optim`` optimizer from it (:meth:`OptimizerConfig.build`, through the
registry in :mod:`.registry`). The learning rate at update ``t`` is
``lr x warmup(t) x schedule(t)``, set on the optimizer before every step (no
``torch.optim.lr_scheduler`` object: its state would hold callables, which a safe checkpoint
cannot).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:

    from dasktrain.trainer.optim.large_batch import Segments

__all__ = ["OptimizerConfig", "ParamGroup", "group"]

_SCHEDULES = ("constant", "cosine", "linear", "step")


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
    """A name of the registry (:data:`dasktrain.trainer.optim.OPTIMIZERS`): ``"sgd"``,
    ``"adam"``, ``"adamw"``, the large-batch ``"lars"`` or ``"lamb"``, ``"torch"`` (any
    element-wise ``torch.optim`` class, :func:`~dasktrain.trainer.optim.torch_optimizer`), or
    one registered with :func:`~dasktrain.trainer.optim.register_optimizer`."""
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
    """LARS: the trust ratio is ``trust_coefficient * |w| / (|g| + weight_decay * |w|)``."""
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
    """``"step"`` schedule: updates between two decays."""
    gamma: float = 0.1
    """``"step"`` schedule: factor of each decay."""
    torch_class: str | None = None
    """``"torch"``: the optimizer class, by import path (``"torch.optim.RMSprop"``)."""
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """More keyword arguments of the optimizer's constructor (``"torch"`` and registered
    optimizers): plain values, as they are stored in checkpoints."""

    def __post_init__(self) -> None:
        from dasktrain.trainer.optim.registry import optimizer_kind

        kind = optimizer_kind(self.name)  # a clear error for unknown names
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
        if not isinstance(self.options, dict) or not all(isinstance(k, str)
                                                        for k in self.options):
            raise TypeError(f"options must be a dict of keyword arguments, got "
                            f"{self.options!r}")
        kind.check(self)

    @property
    def excludes_bias_and_norm(self) -> bool:
        """Whether biases and norm weights are kept out of weight decay (resolved default)."""
        if self.exclude_bias_and_norm is None:
            return self._kind.per_tensor
        return self.exclude_bias_and_norm

    @property
    def first_moment(self) -> float | None:
        """The decay of the optimizer's running mean of gradients as configured: SGD's and
        LARS's ``momentum``, the first of Adam's, AdamW's and LAMB's ``betas`` (from
        ``options`` for a registered optimizer that declares one); None for an optimizer
        without one the holder knows of (``"torch"`` classes, registered ones that declare
        none)."""
        key = self._kind.first_moment
        if key is None:
            return None
        value = self.options.get(key, getattr(self, key, None))
        if key == "betas":
            value = value[0] if isinstance(value, (tuple, list)) and value else None
        return None if value is None else float(value)

    @property
    def first_moment_is_average(self) -> bool:
        """Whether the running mean of gradients is an average (Adam's, AdamW's and LAMB's
        ``(1 - beta) x g`` per step: the step's size does not grow with the decay) rather
        than a heavy ball (SGD's and LARS's ``buffer = momentum x buffer + g``: a step of
        ``lr / (1 - momentum)`` in the steady state)."""
        return self._kind.first_moment == "betas"

    @property
    def _kind(self) -> Any:
        from dasktrain.trainer.optim.registry import optimizer_kind

        return optimizer_kind(self.name)

    def tensor_settings(self, name: str, shape: tuple[int, ...]) -> tuple[float, float]:
        """``(base lr, weight decay)`` of the model tensor ``name`` of ``shape``."""
        lr, decay = self.lr, self.weight_decay
        for g in self.groups:
            if g.matches(name):
                lr = g.lr if g.lr is not None else lr
                decay = g.weight_decay if g.weight_decay is not None else decay
                break
        # LARS and LAMB exclude such tensors inside their update (trust ratio too).
        if not self._kind.per_tensor and self.excludes_bias_and_norm and len(shape) <= 1:
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
            :class:`~dasktrain.trainer.optim.flat.FlatOptimizer` or :meth:`build_for`.
        segments
            Where each model tensor lies in ``params[0]`` when that is a flat buffer
            (:meth:`~dasktrain.trainer.flat.FlatLayout.param_segments`), or one such list
            per tensor when several flat pieces are given. LARS and LAMB compute one trust
            ratio per segment; SGD, Adam and AdamW are element-wise and ignore them.
            Without segments each tensor of ``params`` is one segment.
        """
        return self._kind.build(self, params, segments)

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
        values["options"] = dict(self.options)
        return values

    def __reduce__(self) -> tuple[Any, ...]:
        # An optimizer registered in this process travels with its config, so the holder's
        # worker (another process) can build it without importing the module that
        # registered it; built-in names travel as names.
        from dasktrain.trainer.optim.registry import travelling_kind

        return (_restore, (self.to_dict(), travelling_kind(self.name)))

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> OptimizerConfig:
        values = dict(values)
        if "betas" in values:
            values["betas"] = tuple(values["betas"])
        values["groups"] = tuple(
            ParamGroup(tuple(g["patterns"]), g.get("lr"), g.get("weight_decay"))
            for g in values.get("groups", ()))
        return cls(**values)


def _restore(values: dict[str, Any], kind: Any) -> OptimizerConfig:
    """Unpickle a config, registering the optimizer it carries where it is missing."""
    if kind is not None:
        from dasktrain.trainer.optim.registry import adopt

        adopt(values["name"], kind)
    return OptimizerConfig.from_dict(values)
