"""What an update mode is: the rule the holder applies to arriving gradients."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

if TYPE_CHECKING:
    from dasktrain.trainer.holder import ParameterHolder

__all__ = ["Contribution", "UpdateMode"]


@dataclasses.dataclass(slots=True)
class Contribution:
    """One worker's push: the gradient of its batch at the parameters of ``version``.

    ``grads`` may be a buffer the sender reuses for its next push (the direct channel's
    receive buffer): it is valid until the mode's :meth:`UpdateMode.push` returns, so a mode
    that keeps a gradient for a later update must copy it.
    """

    worker: int
    version: int
    grads: np.ndarray | None  # payload (gradients then buffers); None: no batch this step
    count: int  # samples in the batch (the weight in an average)
    loss: float
    position: tuple[int, int]  # the worker's (epoch, batches consumed) after this batch


class UpdateMode:
    """Base of the update modes. A mode decides *when* and *what* to apply; the holder does
    the arithmetic (:meth:`ParameterHolder.apply`) and the bookkeeping.

    Mode methods run on the holder worker's event loop, never concurrently with each other
    except at ``await`` points.
    """

    name: ClassVar[str]
    lockstep: ClassVar[bool] = False
    """True when every worker pushes once per step (those without a batch push nothing but
    their presence), so the holder's version says where every worker is in the epoch."""

    def __init__(self, holder: ParameterHolder, **options: Any) -> None:
        if options:
            raise ValueError(f"mode {self.name!r} takes no option(s) {sorted(options)}")
        self.holder = holder

    async def push(self, contribution: Contribution) -> None:
        """Return once ``contribution`` is applied (or refused)."""
        raise NotImplementedError

    def waiting_for(self) -> set[int]:
        """Workers a pending update waits for (the holder's watchdog checks they live)."""
        return set()

    async def membership_changed(self) -> None:
        """A worker left, was lost or came back: a pending update may be complete now."""

    def abort(self, error: BaseException) -> None:
        """Fail every push still waiting."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state
