"""When a run must stop because its updates went non-finite.

The holder refuses every non-finite gradient (and every gradient whose batch loss is not
finite): applying one would make the parameters NaN for good. What happens next is the
policy's call:

* ``"raise"`` (the default): the first refusal stops the run with
  :class:`~dasktrain.trainer.errors.TrainingDiverged`.
* ``"skip"``: the bad batch is skipped and the run goes on, unless every gradient is refused
  for ``patience`` rounds in a row (a round is one gradient per worker): then no update is
  possible any more (parameters already diverged, or a learning rate that blows up every
  step), and the run stops with the same error instead of running out its epochs.

:func:`finite_mean` is the refusal itself, which the holder runs on every update's
gradients before it averages them; :class:`NonFiniteGuard` decides whether a refusal ends
the run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np
import torch

from dasktrain.trainer.holder.arithmetic import all_finite
from dasktrain.trainer.holder.mean import as_tensor

__all__ = ["NONFINITE_POLICIES", "NonFiniteGuard", "all_finite", "check_policy", "finite_mean"]

NONFINITE_POLICIES = ("raise", "skip")


class Pushed(Protocol):
    """What a refusal names of a pushed gradient (a mode's ``Contribution``)."""

    worker: int
    loss: float


P = TypeVar("P", bound=Pushed)
Item = tuple[P, np.ndarray, float, dict[str, Any]]  # (push, payload, weight, record fields)
Average = Callable[..., "torch.Tensor | None"]  # (payloads, weights, overflow_safe=) -> mean


def check_policy(policy: str, patience: int) -> None:
    """Refuse an unknown policy or a patience below one round."""
    if policy not in NONFINITE_POLICIES:
        raise ValueError(f"on_nonfinite must be one of {NONFINITE_POLICIES}, got {policy!r}")
    if not isinstance(patience, int) or patience < 1:
        raise ValueError(f"nonfinite_patience must be a positive integer, got {patience!r}")


class NonFiniteGuard:
    """Counts refusals in a row and remembers the last finite loss, for the error message."""

    def __init__(self, policy: str, patience: int, workers: int) -> None:
        check_policy(policy, patience)
        self.policy = policy
        self.limit = patience * workers  # gradients refused in a row that end a "skip" run
        self.patience = patience
        self.in_a_row = 0
        self.last_finite: tuple[float, int] | None = None  # (loss, update it came from)

    def applied(self, loss: float, update: int) -> None:
        self.in_a_row = 0
        if math.isfinite(loss):
            self.last_finite = (loss, update)

    def refused(self, reason: str, update: int, lr: float) -> str | None:
        """Count one refused gradient; the reason to stop the run, if it must stop now."""
        self.in_a_row += 1
        if self.policy == "skip" and self.in_a_row < self.limit:
            return None
        if self.policy == "raise":
            what = reason
            fix = ("pass on_nonfinite='skip' to skip such batches and go on, or lower the "
                   "learning rate")
        else:
            what = (f"every gradient of the last {self.patience} round(s) was refused "
                    f"({self.in_a_row} in a row; the last: {reason})")
            fix = "lower the learning rate"
        if self.last_finite is None:
            before = "no update had a finite loss yet"
        else:
            before = f"the last finite loss was {self.last_finite[0]:.6g} at update " \
                     f"{self.last_finite[1]}"
        return (f"training diverged at update {update}: {what}; {before}. Try: {fix} "
                f"(now {lr:.3g}), a warm-up (warmup_steps=...), or check the data and loss "
                "for NaN or infinite values")

    def state_dict(self) -> dict[str, Any]:
        return {"in_a_row": self.in_a_row,
                "last_finite": list(self.last_finite) if self.last_finite else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.in_a_row = int(state.get("in_a_row", 0))
        last = state.get("last_finite")
        self.last_finite = (float(last[0]), int(last[1])) if last else None


def finite_mean(items: list[Item[P]], average: Average,
                finite: Callable[[torch.Tensor], bool] = all_finite
                ) -> tuple[list[Item[P]], torch.Tensor | None, list[tuple[P, str]]]:
    """The items that can be applied, their weighted mean (None if none), and each refused
    push with the reason.

    Refused: a non-finite batch loss; then, only when the mean is not finite (the common
    case costs one reduction), each non-finite payload, and the rest averaged again as a
    weighted sum; if even that is not finite (finite payloads at the float32 limit), all.
    ``average(payloads, weights, overflow_safe=False)`` is the holder's weighted mean,
    ``finite(mean)`` its check of the mean.
    """
    refusals = [(push, f"worker {push.worker}: non-finite batch loss ({push.loss})")
                for push, *_ in items if not math.isfinite(push.loss)]
    used = [item for item in items if math.isfinite(item[0].loss)]
    grad = average(_payloads(used), _weights(used))
    if grad is None or finite(grad):
        return used, grad, refusals
    # By identity: an item holds an array, which has no truth value to compare by.
    bad = {id(item) for item in used if not all_finite(as_tensor(item[1]))}
    refusals += [(item[0], f"worker {item[0].worker}: non-finite gradient")
                 for item in used if id(item) in bad]
    used = [item for item in used if id(item) not in bad]
    grad = average(_payloads(used), _weights(used), overflow_safe=True)
    if grad is not None and not all_finite(grad):
        refusals += [(item[0], f"worker {item[0].worker}: gradient whose average with the "
                               "others overflows float32") for item in used]
        used, grad = [], None
    return used, grad, refusals


def _payloads(items: Sequence[Item[P]]) -> list[np.ndarray]:
    return [payload for _, payload, _, _ in items]


def _weights(items: Sequence[Item[P]]) -> list[float]:
    return [weight for _, _, weight, _ in items]
