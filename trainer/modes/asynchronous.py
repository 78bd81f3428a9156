"""``async``: apply every gradient as it arrives (asynchronous SGD).

Each gradient was computed on the parameters of some version; by the time it is applied the
holder may have moved on. Its staleness, ``holder version at apply time - version it was
computed on``, is recorded for every update.
"""

from __future__ import annotations

from dasktrain.trainer.modes.base import Contribution, UpdateMode

__all__ = ["AsyncMode"]


class AsyncMode(UpdateMode):
    name = "async"

    async def push(self, contribution: Contribution) -> None:
        if contribution.grads is None:
            return
        await self.holder.apply([contribution])
