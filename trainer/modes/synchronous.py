"""``sync``: wait for the gradients of all live workers for a version, average, one step.

The average is weighted by each worker's batch size, so that with a mean-reduced loss the
update is exactly the gradient of the mean loss over the union of the batches: N workers
with batches of ``b`` equal one process with batches of ``N x b`` (same init, same order).
A worker that dies is dropped from the barrier (the holder's watchdog notices); a worker
that comes back joins the next round.
"""

from __future__ import annotations

from dasktrain.trainer.modes.base import Contribution
from dasktrain.trainer.modes.rounds import RoundMode

__all__ = ["SyncMode"]


class SyncMode(RoundMode):
    name = "sync"
    lockstep = True

    async def push(self, contribution: Contribution) -> None:
        await self.enter_if_current(contribution, "gradient")

    def complete(self) -> bool:
        return not self.waiting_for()

    async def close_round(self, contributions: list[Contribution]) -> None:
        await self.host.apply(contributions, advance=True)

    def start_position(self, worker: int, recorded: int) -> int:
        # Every worker is at the same step: the rounds of this epoch so far.
        return self.host.version - self.host.epoch_start
