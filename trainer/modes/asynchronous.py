"""``async``: apply every gradient as it arrives (asynchronous SGD).

Each gradient was computed on the parameters of some version; by the time it is applied the
holder may have moved on. Its staleness, ``holder version at apply time - version it was
computed on``, is recorded for every gradient. ``staleness_lr`` and ``dc_lambda`` (see
:mod:`.adjust`) temper stale gradients.
"""

from __future__ import annotations

from dasktrain.trainer.modes.adjust import StaleGradientMode
from dasktrain.trainer.modes.base import Contribution

__all__ = ["AsyncMode"]


class AsyncMode(StaleGradientMode):
    name = "async"

    async def push(self, contribution: Contribution) -> None:
        if contribution.grads is None:
            return
        await self.host.apply([contribution], adjust=self.adjuster)
