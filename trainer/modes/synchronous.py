"""``sync``: wait for the gradients of all live workers for a version, average, one step.

The average is weighted by each worker's batch size, so that with a mean-reduced loss the
update is exactly the gradient of the mean loss over the union of the batches: N workers
with batches of ``b`` equal one process with batches of ``N x b`` (same init, same order).

A worker that dies is dropped from the barrier (the holder's watchdog notices), and the
rounds go on without it. Its task, run again, joins the next round where the worker left
off: at the first of its batches the holder has not taken, not at the rounds' count, so no
batch of its share is skipped. It is then behind the others and finishes its share after
them, in rounds of its own: every batch of the epoch is applied once. Its first push comes
with the parameters of the round being gathered, so it is on time; only a gradient computed
before the round it belongs to closed without it (its worker was dropped meanwhile) arrives
late, and is recorded as dropped. What a worker restarted while its push waited does is in
:mod:`.rounds`.
"""

from __future__ import annotations

from dasktrain.trainer.modes.base import Contribution
from dasktrain.trainer.modes.rounds import RoundMode

__all__ = ["SyncMode"]


class SyncMode(RoundMode):
    name = "sync"
    lockstep = True
    may_claim_work = False
    balances = True
    early_mean = True

    async def push(self, contribution: Contribution) -> None:
        await self.enter_if_current(contribution, "gradient")

    def complete(self) -> bool:
        return not self.waiting_for()

    async def close_round(self, contributions: list[Contribution]) -> None:
        await self.host.apply(contributions, advance=True)
