"""The mode's half of the trainer worker's loop: what a worker does after each backward.

The worker loop (:mod:`.worker`) is the same for every mode: take a batch, forward,
backward, then ask its :class:`WorkerStep` what to push, push it, and hand the reply back
to the step. ``GradientStep`` pushes every gradient and loads the parameters it gets back;
``average`` mode's step takes local optimizer steps and pushes its parameters every K
steps (:mod:`.modes.average`). A mode names its step class in ``UpdateMode.worker_step``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from dasktrain.trainer.flat import FlatModel

__all__ = ["GradientStep", "Push", "StepContext", "WorkerStep"]


@dataclasses.dataclass(slots=True)
class Push:
    """What to send: ``payload`` (None: no batch this step), samples and mean loss."""

    payload: np.ndarray | None
    count: int
    loss: float


@dataclasses.dataclass(frozen=True, slots=True)
class StepContext:
    """What a worker's step may need besides the model."""

    optimizer: Any  # OptimizerConfig
    mode_options: dict[str, Any]
    step_offset: int  # lock-step steps of the fit before this epoch
    total_steps: int  # lock-step steps of the whole fit
    clip: tuple[float | None, float | None] = (None, None)  # gradient norm, value
    claimed: bool = False  # work claimed on demand: a push ends each claimed run


class WorkerStep:
    """Per batch: decide what to push (or nothing yet), and take the reply."""

    streams: bool = False
    """True if :meth:`after_backward` of a batch always pushes the model's gradient payload
    with the batch's size and loss, as it is: the worker may then send it during backward,
    bucket by bucket (see :mod:`.buckets`), instead of asking."""

    def __init__(self, flat: FlatModel, context: StepContext) -> None:
        self.flat = flat
        self.context = context
        self.lr_factor = 1.0  # the holder's factor on the schedule, given at join
        self.views = False  # see view_replies

    def receive_buffer(self) -> np.ndarray:
        """Where replies are received (its size is the mode's payload size)."""
        return self.flat.receive_buffer()

    def adopt(self, payload: np.ndarray, reply: np.ndarray) -> bool:
        """Push from ``payload`` and receive into ``reply`` from now on (memory shared with
        the holder, see :mod:`.shared`: a push then copies nothing); False where this step
        cannot."""
        return self.flat.adopt(payload, reply)

    def view_replies(self) -> bool:
        """Have the model view the replies it takes instead of copying them (see
        :meth:`FlatModel.view`), where it can and this step only reads the parameters
        between a reply and the next push; False where not."""
        self.views = self.streams and self.flat.can_view()
        return self.views

    def start(self, values: np.ndarray) -> None:
        """Take the join's reply (the parameters to start from)."""
        self.load(values)

    def after_backward(self, step: int, count: int, loss: float, last: bool) -> Push | None:
        """The batch of lock-step ``step`` (``count == 0``: none) has its gradients in the
        model; what to push now, or None to go on to the next batch. ``last``: the last
        step of this worker's epoch."""
        raise NotImplementedError

    def load(self, values: np.ndarray) -> None:
        """Take a push's reply."""
        if self.views and values.flags.writeable:
            self.flat.view(values)
        else:
            self.flat.load(values)


class GradientStep(WorkerStep):
    """Push every batch's gradient; continue from the parameters sent back."""

    streams = True

    def after_backward(self, step: int, count: int, loss: float, last: bool) -> Push | None:
        del step, last
        return Push(self.flat.payload() if count else None, count, loss)
