"""Uneven shares of a lock-step step, so that no worker waits for a slower one.

In ``sync`` every worker waits, each step, for the slowest. Workers differ: one beside the
holder gets its replies for free while one on another host spends part of its step
receiving them and sending its gradient; GPUs of two generations differ by more. The
holder sees it: the time from its reply to a worker until that worker's next push is the
worker's own part of a step (receiving, computing, sending), not counting its wait for the
others. Rows per second of that time are each worker's speed, and the next epoch's step is
cut in proportion (see ``shares`` in :mod:`dasktrain.pipeline.plan`): every step still
covers the same rows, so the average, weighted by each batch's rows, is the same update.

Each epoch's shares are decided once, when first asked for (a worker's join, or one
computing ahead asking before the epoch began), from what was measured since the last
decision, and kept in the holder's state so that a resumed epoch is cut as it was. The
speeds' fixed part per step (a reply's bytes on the wire) makes proportional shares fall
short of even finish times; the next decision corrects further, so shares settle over a few
epochs. Small changes (under :data:`MIN_CHANGE` of a batch) are not made, nor changes that
would not pay for themselves within an epoch (:data:`RECUT_COST`): a new cut makes the
pipeline read the next epoch's first batches again, prepared ahead for the old one. Without
that rule short epochs of a small model (steps of a few milliseconds, mostly fixed costs)
were cut anew every epoch, each time waiting for their first batches.
"""

from __future__ import annotations

import collections
import statistics
from typing import Any

__all__ = ["Balance"]

#: Change shares only where one moves by more than this part of a batch: measurement
#: noise between equal workers stays below it.
MIN_CHANGE = 0.02
#: The least share of a worker, as a part of a batch: a slow worker still computes
#: something each step, and its speed can still be measured.
MIN_SHARE = 0.25
#: Seconds a new cut must save over one epoch (by the measured speeds): what it costs once,
#: the next epoch's first batches, prepared ahead for the old cut, read again (5-15 ms a
#: worker on 2 cores), with a margin for the speeds' fixed part, which proportional shares
#: do not see.
RECUT_COST = 0.05
#: Measurements kept per worker (the latest): a few hundred steps tell a speed.
KEEP = 512


class Balance:
    """Measures each worker's part of a step and cuts the next epoch's steps by speed.

    Lives on the holder's event loop (no locks); ``now`` is the loop's clock."""

    def __init__(self, batch_size: int | None, enabled: bool) -> None:
        self.batch_size = batch_size
        self.enabled = enabled and batch_size is not None
        self._replied: dict[int, float] = {}  # when each worker's last reply went out
        # Rows per second of each worker's part of a step, the latest KEEP.
        self._speeds: dict[int, collections.deque[float]] = {}
        self._steps: collections.Counter[int] = collections.Counter()  # since a decision
        self.decided: dict[int, tuple[int, ...] | None] = {}  # shares by epoch

    def replied(self, worker: int, now: float) -> None:
        if self.enabled:
            self._replied[worker] = now

    def pushed(self, worker: int, count: int, now: float) -> None:
        """``worker`` pushed the gradient of ``count`` rows at ``now``."""
        if not self.enabled:
            return
        sent = self._replied.pop(worker, None)
        if sent is None or count <= 0 or now <= sent:
            return
        self._speeds.setdefault(worker, collections.deque(maxlen=KEEP)).append(
            count / (now - sent))
        self._steps[worker] += 1

    def forget(self, worker: int) -> None:
        """``worker`` left or was lost: its next push follows no reply of ours."""
        self._replied.pop(worker, None)

    def shares(self, epoch: int, world: int) -> tuple[int, ...] | None:
        """The rows of each of ``world`` workers' batches in ``epoch`` (None: a batch each),
        decided now if not before."""
        if epoch not in self.decided:
            self.decided[epoch] = self._decide(epoch, world)
            for old in [e for e in self.decided if e < epoch - 1]:
                del self.decided[old]
        shares = self.decided[epoch]
        return shares if shares is not None and len(shares) == world else None

    def _decide(self, epoch: int, world: int) -> tuple[int, ...] | None:
        before = self.decided.get(epoch - 1)
        current = before if before is not None and len(before) == world else None
        if not self.enabled or world < 2:
            return None
        speeds = [self._speeds.get(w) for w in range(world)]
        if not all(speeds):
            return current  # somebody has not been measured: nothing new to go by
        steps = min(self._steps[w] for w in range(world))
        self._speeds.clear()
        self._steps.clear()
        batch = self.batch_size
        assert batch is not None  # enabled
        rates = [statistics.median(s) for s in speeds]
        total = world * batch
        least = max(1, round(MIN_SHARE * batch))
        wanted = [max(least, rate / sum(rates) * total) for rate in rates]
        shares = [round(w * total / sum(wanted)) for w in wanted]
        shares[shares.index(max(shares))] += total - sum(shares)
        if min(shares) < 1:  # rounding left a worker nothing (tiny batches): keep the cut
            return current
        was = current or (batch,) * world
        if max(abs(a - b) for a, b in zip(shares, was, strict=True)) <= MIN_CHANGE * batch:
            return current
        # A step lasts as long as its slowest worker's part; the measured speeds were those
        # of the cut in force (``was``).
        now_s = max(rows / rate for rows, rate in zip(was, rates, strict=True))
        then_s = max(rows / rate for rows, rate in zip(shares, rates, strict=True))
        if (now_s - then_s) * steps < RECUT_COST:
            return current
        return None if all(s == batch for s in shares) else tuple(shares)

    def state_dict(self) -> dict[str, Any]:
        return {"decided": {str(e): list(s) if s is not None else None
                            for e, s in self.decided.items()}}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.decided = {int(e): tuple(s) if s is not None else None
                        for e, s in (state or {}).get("decided", {}).items()}
