"""The momentum that asynchrony adds, and how much of the optimizer's own to keep.

A gradient computed on parameters some updates old acts, on average, like momentum
(Mitliagkas, Zhang, Hadjis and Ré, 2016, "Asynchrony begets momentum, with an application
to deep learning"): when the staleness τ of the applied gradients is geometric with mean
τ̄, the expected update is that of momentum SGD with coefficient

    μ = τ̄ / (1 + τ̄)

With W workers that are all computing, a gradient waits for about W - 1 others (the mean
staleness is W - 1 whatever their speeds), so μ ≈ 1 - 1/W: 2/3 with 3 workers. That comes
on top of the optimizer's own momentum m; with m = 0.9 the two add up past 1, and a rate at
which ``sync`` trains well diverges.

The holder knows the staleness of every gradient it applies, so it estimates μ from what it
sees (a running mean of the updates' staleness, starting from the mode's expectation).

**A heavy ball, per global batch.** A momentum coefficient is a decay per step, and the
steps differ: one ``sync`` step averages a global batch (W workers x ``batch_size``
samples), while an update of a stale mode holds n samples, the share ``s = n / (W x
batch_size)`` of one (``async``: 1/W). μ is the implicit momentum per update, so per global
batch it is ``μ^(1/s)``: with 3 workers ``async``'s μ = 2/3 a gradient is (2/3)^3 = 0.30 a
global batch, not 2/3. SGD's and LARS's momentum (``buffer = m x buffer + g``) is
compensated where m is meant, per global batch, and taken back to one update, never above
m:

    m' = min(m, max(0, m - μ^(1/s))^s)

0.85 for ``async`` with 3 workers and m = 0.9, 0.79 for ``soft`` taking 2 of 3. Subtracting
μ per update instead (``max(0, m - μ)``, 0.23 for ``async``) took most of the momentum that
crosses a plateau: on W3's ``committee`` task ``async``, ``soft`` and ``ssp`` then stayed
on it for the whole run.

**Backed off when the loss rises.** Near the largest rate ``sync`` takes, that much momentum
can be too much for gradients this stale (W3's ``wave`` under SGD diverges with it). The
holder watches the training loss of what it applies, as a "bold driver" watches it to set a
learning rate (Battiti 1989): two running means, over about 2 and 16 global batches; when
the short one rises more than 10 % above the long one, how far the compensation is relaxed
from per update to per global batch (the *level*, from 1) is halved, and it grows back by
0.002 an update while the loss does not rise. At level 0 the momentum is ``max(0, m -
μ)``, the most damped rule, stable wherever measured; between, it is interpolated
linearly.

**An average** (the first beta of Adam, AdamW and LAMB: ``(1 - β) x g`` per step, so the
step does not grow with β, and lowering β would only make the direction noisier) keeps its
betas, and the step is scaled by ``1 - μ``, per update. Counting μ per global batch there
too (a step of ``1 - μ^(1/s)``, 0.70 instead of 1/3 for ``async``) was measured and not
kept: on W3's ``teacher`` task ``async`` then needed 40 k samples to the target instead of
16 k, and on ``committee`` it still did not beat ``sync``'s time.

A run with fresh gradients only (``soft`` waiting for every worker, one worker left) sees
μ = 0, and an update of a whole global batch has s = 1: m and the step are kept exactly.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["DECAY", "ImplicitMomentum", "Relaxation", "compensated", "implicit_momentum",
           "per_global_batch", "step_factor"]

DECAY = 0.95
"""Weight of the past in the running mean of staleness, per update: it follows a change of
pace (workers finishing their share of the epoch) within some 20 updates."""
RISE = 0.1
"""How far (a share of the long mean) the short mean of the loss must rise above the long
one for the compensation to be tightened."""
RELAX = 0.002
"""How much of the way to the per-global-batch compensation is given back per update
while the loss does not rise (all of it within 500 updates)."""
SHORT, LONG = 2.0, 16.0
"""The spans of the loss's two running means, in global batches."""


def implicit_momentum(staleness: float) -> float:
    """The momentum that applying gradients of mean staleness ``staleness`` adds:
    τ̄ / (1 + τ̄)."""
    if not (math.isfinite(staleness) and staleness >= 0):
        raise ValueError(f"a mean staleness must be a finite number >= 0, got {staleness!r}")
    return staleness / (1.0 + staleness)


def per_global_batch(implicit: float, share: float) -> float:
    """Implicit momentum ``implicit`` per update of ``share`` of a global batch, per global
    batch: ``implicit^(1/share)`` (the same decay over the global batch's samples)."""
    if not share > 0:
        raise ValueError(f"a share of a global batch must be > 0, got {share!r}")
    return implicit ** (1.0 / share)


def compensated(momentum: float, implicit: float, share: float = 1.0) -> float:
    """The heavy-ball momentum per update of ``share`` of a global batch that, with
    ``implicit`` momentum per update from asynchrony, adds up to ``momentum`` per global
    batch, and is never more than ``momentum``: ``min(momentum, max(0, momentum -
    implicit^(1/share))^share)`` (share 1: ``max(0, momentum - implicit)``)."""
    return min(momentum, max(0.0, momentum - per_global_batch(implicit, share)) ** share)


def step_factor(implicit: float) -> float:
    """The factor on an averaging momentum's step that undoes the lengthening of momentum
    ``implicit``: ``1 - implicit``."""
    return 1.0 - implicit


class ImplicitMomentum:
    """A running estimate of the momentum that the staleness seen so far adds.

    Parameters
    ----------
    expected_staleness
        The mean staleness the mode expects before it has seen any (``async``: W - 1).
    decay
        Weight of the past per update in the running mean of staleness.
    """

    def __init__(self, expected_staleness: float, decay: float = DECAY) -> None:
        implicit_momentum(expected_staleness)  # refuses a bad value
        if not 0 <= decay < 1:
            raise ValueError(f"decay must lie in [0, 1), got {decay!r}")
        self.staleness = float(expected_staleness)
        self.decay = float(decay)

    def observe(self, staleness: float) -> None:
        """One more update, whose gradients had mean staleness ``staleness``."""
        self.staleness = self.decay * self.staleness + (1.0 - self.decay) * staleness

    @property
    def value(self) -> float:
        """The implicit momentum now: τ̄ / (1 + τ̄) of the running mean τ̄."""
        return implicit_momentum(self.staleness)

    def state_dict(self) -> dict[str, Any]:
        return {"staleness": self.staleness}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "staleness" in state:  # checkpoints of earlier versions have none
            self.staleness = float(state["staleness"])


class Relaxation:
    """How far the compensation is relaxed from per update (level 0) to per global batch
    (level 1), set from the training loss of the updates as a bold driver sets a rate: the
    level is halved when a short running mean of the loss rises more than :data:`RISE`
    above a long one, and grows back by :data:`RELAX` per update otherwise.

    Parameters
    ----------
    global_batch
        Samples in one global batch (the spans of the means are counted in them).
    """

    def __init__(self, global_batch: float) -> None:
        if not global_batch > 0:
            raise ValueError(f"global_batch must be > 0, got {global_batch!r}")
        self.short_span = SHORT * global_batch
        self.long_span = LONG * global_batch
        self.level = 1.0
        self.short: float | None = None
        self.long: float | None = None
        self.tightened = 0  # times the level was halved

    def observe(self, loss: float, samples: float) -> None:
        """One more update, of ``samples`` samples whose mean training loss is ``loss``."""
        if not (math.isfinite(loss) and samples > 0):
            return  # a refused update says nothing of the trend
        if self.short is None or self.long is None:
            self.short = self.long = float(loss)
            return
        self.short += (1.0 - math.exp(-samples / self.short_span)) * (loss - self.short)
        self.long += (1.0 - math.exp(-samples / self.long_span)) * (loss - self.long)
        if self.short - self.long > RISE * abs(self.long):
            self.level *= 0.5
            self.tightened += 1
            self.long = self.short  # measure the next rise from here
        else:
            self.level = min(1.0, self.level + RELAX)

    def between(self, damped: float, relaxed: float) -> float:
        """``damped`` at level 0, ``relaxed`` at level 1, linear between."""
        return damped + self.level * (relaxed - damped)

    def state_dict(self) -> dict[str, Any]:
        return {"level": self.level, "short": self.short, "long": self.long,
                "tightened": self.tightened}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.level = float(state["level"])
        self.short = None if state["short"] is None else float(state["short"])
        self.long = None if state["long"] is None else float(state["long"])
        self.tightened = int(state.get("tightened", 0))
