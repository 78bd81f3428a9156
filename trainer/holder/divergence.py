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
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["NONFINITE_POLICIES", "NonFiniteGuard", "all_finite", "check_policy"]

NONFINITE_POLICIES = ("raise", "skip")


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


def all_finite(values: torch.Tensor) -> bool:
    """Whether every value is finite: one reduction instead of an elementwise mask; a sum
    that overflows is re-checked."""
    if math.isfinite(float(values.sum())):
        return True
    return bool(torch.isfinite(values).all())
