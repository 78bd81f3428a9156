"""An optimizer over a flat parameter buffer, with parameter groups.

The holder (and a worker in ``average`` mode) keeps a model's parameters as one flat
buffer. Without parameter groups the optimizer works on that buffer as one tensor. With
groups (per-group learning rate or weight decay, biases and norm weights out of weight
decay) tensors of different settings interleave in the buffer, so the buffer is cut into
*runs*: maximal stretches of consecutive model tensors with the same settings, each one
``Parameter`` viewing its stretch. The torch optimizer gets one group per setting, holding
its runs; element-wise optimizers then give exactly what the model's own tensors would, and
LARS/LAMB keep one trust ratio per model tensor through each run's segments.

Plain SGD (no momentum, no weight decay, one run) can step in parts at once: its step is
``p -= lr * g`` element by element, so the holder, whose workers all wait for that step in
lock-step modes, gives half of it to a second core (see ``in_parts`` of :meth:`step`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from dasktrain.trainer.optim.config import OptimizerConfig
from dasktrain.trainer.optim.large_batch import Segment
from dasktrain.trainer.optim.registry import optimizer_kind
from dasktrain.trainer.optim.state import StateLayout

__all__ = ["FlatOptimizer", "Run", "plan_runs", "state_size"]


@dataclasses.dataclass(frozen=True, slots=True)
class Run:
    """Consecutive model tensors ``[start, stop)`` of the flat buffer sharing settings."""

    start: int
    stop: int
    lr: float
    weight_decay: float
    segments: tuple[Segment, ...]  # relative to ``start``


def plan_runs(config: OptimizerConfig, segments: Sequence[Segment],
              names: Sequence[str] | None = None) -> list[Run]:
    """The runs of a flat buffer whose tensors lie at ``segments``; the groups' patterns
    must match some of ``names``, the whole model's parameters (default: the segments',
    which a holder's shard holds only some of)."""
    config.check_names(list(names) if names is not None else [n for n, *_ in segments])
    runs: list[Run] = []
    pending: list[Segment] = []
    settings: tuple[float, float] | None = None

    def close() -> None:
        if pending:
            start = pending[0][1]
            runs.append(Run(start, pending[-1][2], *settings,
                            tuple((n, a - start, b - start, s) for n, a, b, s in pending)))

    for segment in segments:
        name, _, _, shape = segment
        own = config.tensor_settings(name, tuple(shape))
        if own != settings:
            close()
            pending, settings = [], own
        pending.append(segment)
    close()
    return runs


def state_size(config: OptimizerConfig, segments: Sequence[Segment]) -> int:
    """Values in the flat form of the optimizer state over a buffer of ``segments``."""
    runs = plan_runs(config, segments)
    return StateLayout.of(config).size(runs[-1].stop, len(runs))


class FlatOptimizer:
    """``config``'s optimizer over ``params``, a flat buffer of tensors at ``segments``.

    Parameters
    ----------
    config
        The optimizer, with its groups.
    params
        The flat parameter buffer (it is updated in place).
    segments
        Where each model tensor lies in it (``FlatLayout.param_segments()``).
    """

    def __init__(self, config: OptimizerConfig, params: torch.Tensor,
                 segments: Sequence[Segment], names: Sequence[str] | None = None) -> None:
        self.config = config
        self.runs = plan_runs(config, segments, names)
        self.params = [torch.nn.Parameter(params[r.start:r.stop]) for r in self.runs]
        by_settings: dict[tuple[float, float], list[int]] = {}
        for i, r in enumerate(self.runs):
            by_settings.setdefault((r.lr, r.weight_decay), []).append(i)
        # torch groups in first-seen order; segments follow the optimizer's tensor order.
        groups, order = [], []
        self._ratios: list[float] = []
        for (lr, decay), members in by_settings.items():
            groups.append({"params": [self.params[i] for i in members], "lr": lr,
                           "weight_decay": decay})
            order.extend(members)
            self._ratios.append(lr / config.lr)
        per_tensor = [list(self.runs[i].segments) for i in order]
        self.optimizer = config.build(
            groups, segments=per_tensor[0] if len(per_tensor) == 1 else per_tensor)
        self.state_layout = StateLayout.of(config)
        self._first_moment_key = optimizer_kind(config.name).first_moment
        self._first_moment = _first_moment(self.optimizer, self._first_moment_key)

    def repoint(self, params: torch.Tensor) -> None:
        """Make ``params`` (a copy of the buffer) the one optimised; the state is kept."""
        for p, r in zip(self.params, self.runs, strict=True):
            p.data = params[r.start:r.stop]

    def attach_grad(self, grad: torch.Tensor | None) -> None:
        """Take the flat gradient ``grad`` (``None``: drop it) as every run's gradient."""
        for p, r in zip(self.params, self.runs, strict=True):
            p.grad = None if grad is None else grad[r.start:r.stop]

    def set_lr(self, lr: float) -> None:
        """The optimizer's learning rate now; each group keeps its ratio to it."""
        for group, ratio in zip(self.optimizer.param_groups, self._ratios, strict=True):
            group["lr"] = lr * ratio

    def set_first_moment(self, value: float | None) -> None:
        """The decay of the running mean of gradients from now on (SGD's momentum, Adam's
        first beta: see
        :attr:`~dasktrain.trainer.optim.registry.OptimizerKind.first_moment`); None: the one
        it was built with. Does nothing for an optimizer without one."""
        key = self._first_moment_key
        if key is None or self._first_moment is None:
            return
        if value is None:
            value = self._first_moment
        if not 0 <= value < 1:
            raise ValueError(f"a first-moment coefficient must lie in [0, 1), got {value!r}")
        # Compared with the groups' own value, not a flag: a loaded checkpoint brings the
        # coefficient it was saved with.
        if _first_moment(self.optimizer, key) == value:
            return
        for group in self.optimizer.param_groups:
            group[key] = value if key == "momentum" else (value, *group[key][1:])
        if key == "momentum" and value == 0:
            # Steps without momentum leave the buffer as it was: drop it, so that momentum
            # coming back starts from the gradients of then, not from a stale buffer.
            for group in self.optimizer.param_groups:
                for param in group["params"]:
                    self.optimizer.state.get(param, {}).pop("momentum_buffer", None)

    def step(self, grad: torch.Tensor | None = None, lr: float | None = None,
             first_moment: float | None = None,
             in_parts: Callable[[int, Callable[[slice], Any]], Any] | None = None) -> None:
        """One step on ``grad`` (default: the attached gradient) at ``lr``, with the
        running mean of gradients decaying by ``first_moment`` (default: as built).

        ``in_parts(size, fn)`` calls ``fn`` on parts of ``range(size)`` covering it, maybe
        at once: plain SGD then steps part by part, exactly as ``torch.optim.SGD`` does as a
        whole (``p.add_(g, alpha=-lr)``); other optimizers ignore it."""
        if lr is not None:
            self.set_lr(lr)
        self.set_first_moment(first_moment)
        if in_parts is not None and grad is not None and self._plain_sgd():
            param = self.params[0].data
            values = grad[self.runs[0].start:self.runs[0].stop]
            step_lr = self.optimizer.param_groups[0]["lr"]
            in_parts(len(param), lambda part: param[part].add_(values[part], alpha=-step_lr))
            return
        if grad is not None:
            self.attach_grad(grad)
        self.optimizer.step()
        if grad is not None:
            self.attach_grad(None)

    def _plain_sgd(self) -> bool:
        """Whether a step is ``p -= lr * g`` alone (momentum may change between steps)."""
        if type(self.optimizer) is not torch.optim.SGD or len(self.params) != 1:
            return False
        group = self.optimizer.param_groups[0]
        return group["momentum"] == 0 and group["weight_decay"] == 0 \
            and not group["maximize"] and isinstance(group["lr"], float) \
            and not getattr(self.optimizer, "_optimizer_step_pre_hooks", None) \
            and not getattr(self.optimizer, "_optimizer_step_post_hooks", None)

    # -- the state in flat form (``average`` mode averages it) -----------------------------
    def state_size(self) -> int:
        return self.state_layout.size(self.runs[-1].stop, len(self.runs))

    def flatten_state(self, out: np.ndarray) -> None:
        self.state_layout.flatten(self.optimizer, self.params, out)

    def load_state(self, values: np.ndarray) -> None:
        self.state_layout.load(self.optimizer, self.params, values)


def _first_moment(optimizer: torch.optim.Optimizer, key: str | None) -> float | None:
    """The first-moment coefficient ``optimizer`` was built with (``key``: see
    :attr:`~dasktrain.trainer.optim.registry.OptimizerKind.first_moment`); None without
    one."""
    if key is None:
        return None
    value = optimizer.param_groups[0].get(key)
    if key == "betas":
        value = value[0] if isinstance(value, (tuple, list)) and value else None
    return None if value is None else float(value)
