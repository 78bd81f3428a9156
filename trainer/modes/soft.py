"""``soft``: apply the average of the first ``wait_for`` (S) gradients to arrive.

Soft synchronisation: an update waits for S gradients, not all N, so one slow worker does
not hold every step back. A gradient computed on parameters that have changed since (its
worker was among the slow ones) is *late*: with ``late="next"`` (the default) it joins the
next update, with its staleness recorded; with ``late="drop"`` it is recorded as dropped
and its worker continues from the current parameters. Each push returns once the update
that took it is applied, with the parameters after it.

With fewer live workers than S (some finished their share of the epoch, or died) an
update waits for the live ones. S = N is ``sync``'s update in non-lock-step form: the same
averages, the same parameters. An update of S full batches is applied at S/N of the
learning rate (N/N: ``sync``'s rate), with the momentum compensated; the options of
:mod:`.adjust` apply too.

Restarts lose nothing. A gradient is counted as its worker's (``host.hold``) as it enters
the round, so a worker whose process died while its push waited there, Dask then running
its task again, resumes after that batch; so does one resumed from a checkpoint, whose
stored round holds the push. Its next push, of another batch, joins the round *beside* the
waiting one (see :mod:`.rounds`), counting as one more of the S, and both are applied:
every gradient held is applied or, with ``late="drop"``, recorded as dropped. What the
checkpoint stores as the round is what was held and not yet taken by an update, kept in
the serial section with the hold and the update themselves: a checkpoint taken between a
gradient's hold and its entry into the round still has it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dasktrain.trainer.modes.adjust import StaleGradientMode
from dasktrain.trainer.modes.base import Contribution, Host
from dasktrain.trainer.modes.rounds import RoundMode

__all__ = ["SoftMode"]

LATE = ("next", "drop")


class SoftMode(RoundMode, StaleGradientMode):
    name = "soft"

    def __init__(self, host: Host | None, *, wait_for: int | None = None,
                 late: str = "next", **options: Any) -> None:
        if wait_for is not None and (not isinstance(wait_for, int) or wait_for < 1):
            raise ValueError(f"wait_for must be a positive integer, got {wait_for!r}")
        if late not in LATE:
            raise ValueError(f"late must be one of {LATE}, got {late!r}")
        self.late = late
        self._wait_for = wait_for  # before the base's init, which asks expected_staleness
        super().__init__(host, **options)
        # Held and not yet taken by an update (serial section): the checkpoint's round.
        self._held: dict[tuple[int, tuple[int, int]], Contribution] = {}

    @classmethod
    def check(cls, workers: int, options: dict[str, Any]) -> None:
        wait_for = options.get("wait_for")
        if isinstance(wait_for, int) and wait_for > workers:
            raise ValueError(f"wait_for={wait_for} is more than the {workers} workers")
        super().check(workers, options)

    @property
    def wait_for(self) -> int:
        """S; by default all workers but one (at least one)."""
        if self._wait_for is not None:
            return self._wait_for
        return max(1, self.host.workers - 1)

    def expected_staleness(self) -> float:
        # Each update takes S of the N gradients; the N - S others are late by one.
        return (self.host.workers - min(self.wait_for, self.host.workers)) / self.wait_for

    @classmethod
    def planned_updates(cls, batches: int, workers: int, options: dict[str, Any]) -> int:
        wait_for = options.get("wait_for") or max(1, workers - 1)
        return -(-batches // wait_for)

    async def push(self, contribution: Contribution) -> None:
        if contribution.grads is None:
            return
        if self.late == "drop" and contribution.version < self.host.version:
            self.host.drop_gradient(contribution, "late")
            return
        # Counted now, in order with checkpoints, which store it with the round.
        await self.host.serially(self._hold, contribution)
        # No copy: the payload stays valid until this returns, after the round applies.
        await self.enter(contribution)

    def _needed(self) -> int:
        live = self.host.live_workers() | self.round_workers()
        return max(1, min(self.wait_for, len(live)))

    def complete(self) -> bool:
        return len(self.round) >= self._needed()

    async def close_round(self, contributions: list[Contribution]) -> None:
        await self.host.apply(contributions, adjust=self.adjuster)

    def _hold(self, contribution: Contribution) -> None:
        self.host.hold(contribution)
        self._held[(contribution.worker, tuple(contribution.position))] = contribution

    def taken(self, contributions: Sequence[Contribution]) -> None:
        for c in contributions:
            self._held.pop((c.worker, tuple(c.position)), None)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(),
                "round": [_stored(self._held[k]) for k in sorted(self._held)]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        # Pushes that were waiting in the checkpoint's round: their workers resume after
        # those batches, so the gradients are applied with the round they were in, beside
        # the pushes of the batches that follow.
        self.restore_round(map(_restored, state.get("round", [])))
        self._held = {(c.worker, tuple(c.position)): c for c in self.round}


def _stored(c: Contribution) -> dict[str, Any]:
    return {"worker": c.worker, "version": c.version, "grads": torch.from_numpy(c.grads.copy()),
            "count": c.count, "loss": c.loss, "position": list(c.position), "clock": c.clock}


def _restored(values: dict[str, Any]) -> Contribution:
    return Contribution(int(values["worker"]), int(values["version"]),
                        values["grads"].numpy(), int(values["count"]), float(values["loss"]),
                        (int(values["position"][0]), int(values["position"][1])),
                        int(values["clock"]), held=True)
