"""Work handed out on demand: which global batches of the epoch are pending, claimed by a
worker, arriving (a gradient of it is in the holder's hands) or done.

With ``assignment="dynamic"`` no worker owns a fixed share of an epoch: each claims a run of
consecutive global batches of the epoch plan when its pipeline has room to prefetch, so a
fast worker takes more of the epoch than a slow one. Exactly once per epoch:

* a claim hands out the lowest pending batches, a run cut at the plan's window bounds (a
  claim reads as few windows as it can) and *guided* in size (Polychronopoulos & Kuck,
  1987): a share of what is left for each live worker, at most :data:`CLAIM_BATCHES` and at
  least one, so that claims shrink as the epoch ends and no worker ends up holding a long
  tail of work;
* a gradient for a batch is admitted once (:meth:`WorkLedger.arrive`): a second one (its
  first worker was given up and another took the batch, then both pushed) is refused (an
  event of the History; the batch counts once);
* where one push covers a whole claimed run (``whole_runs``: ``average``, whose worker
  takes local steps on the run and then pushes its parameters), the run is admitted, taken
  and refused as one, named by its last batch;
* a batch is done when the holder takes its gradient (:meth:`WorkLedger.taken`: applied,
  kept for a later update, or recorded as dropped by the mode's rule), in the holder's
  serial section, so that a checkpoint holds a batch as done exactly when its parameters
  hold its update;
* what a worker claimed and has not pushed goes back to the pool when it dies, leaves or
  is retired (:meth:`WorkLedger.release`); done work is never handed out again.

A checkpoint keeps the done batches only: on resume, with any number of workers, the rest
of the epoch is pending.
"""

from __future__ import annotations

import collections
import functools
import math
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from dasktrain.pipeline.plan import run_pieces

__all__ = ["CLAIM_BATCHES", "WorkLedger"]

#: Most batches in one claim.
CLAIM_BATCHES = 8

_PENDING, _DONE = -1, -2

_F = TypeVar("_F", bound=Callable[..., Any])


def _locked(method: _F) -> _F:
    """Under the ledger's lock: :meth:`WorkLedger.taken` may run on the holder's update
    thread while the event loop claims."""

    @functools.wraps(method)
    def run(self: WorkLedger, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return run  # type: ignore[return-value]


class WorkLedger:
    """The global batches of one epoch and who has them (see the module docstring)."""

    def __init__(self, claim_batches: int = CLAIM_BATCHES, whole_runs: bool = False) -> None:
        self.claim_batches = claim_batches
        self.whole_runs = whole_runs
        self._runs: dict[tuple[int, int], int] = {}  # (worker, last batch) -> first batch
        self._lock = threading.Lock()
        self.epoch = -1
        self._owner = np.zeros(0, dtype=np.int64)  # pending, done, or the claiming worker
        self._bounds = np.zeros(0, dtype=np.int64)  # first batch of each window's run
        self._arriving: set[int] = set()
        self._taken: dict[int, int] = {}  # batches done per worker this epoch
        self._cursor = 0  # no pending batch lies before it
        # Batches per owner value (pending, done, each worker): what the per-push questions
        # (finished, idle) read, instead of scanning the epoch.
        self._count: collections.Counter[int] = collections.Counter()

    def _move(self, batches: np.ndarray | slice | int, to: int) -> None:
        """Give ``batches`` to owner ``to`` (a worker, pending or done), keeping the
        counts."""
        before = np.atleast_1d(self._owner[batches])
        self._count.subtract(before.tolist())
        self._count[to] += len(before)
        self._owner[batches] = to

    def _recount(self) -> None:
        self._count = collections.Counter(self._owner.tolist())

    # -- the epoch ---------------------------------------------------------------------
    @_locked
    def begin(self, epoch: int, num_batches: int, bounds: list[int],
              keep_done: bool = False) -> None:
        """Start ``epoch`` of ``num_batches`` batches, claims cut at ``bounds``.
        ``keep_done``: the epoch is the one the ledger already holds (a resumed run),
        whose done batches stay done."""
        if keep_done and epoch == self.epoch and len(self._owner) == num_batches:
            self._owner[self._owner >= 0] = _PENDING
        else:
            self._owner = np.full(num_batches, _PENDING, dtype=np.int64)
            self._taken = {}
        self._recount()
        self.epoch = epoch
        self._bounds = np.asarray(sorted(set(bounds) | {0}), dtype=np.int64)
        self._arriving.clear()
        self._runs.clear()
        self._cursor = 0

    @property
    @_locked
    def finished(self) -> bool:
        """Every batch of the epoch is done."""
        return self._count[_DONE] == len(self._owner)

    @_locked
    def remaining(self) -> int:
        """Batches not done yet (pending, claimed or arriving)."""
        return len(self._owner) - self._count[_DONE]

    # -- claims ------------------------------------------------------------------------
    @_locked
    def claim(self, worker: int, live: int, size: int | None = None,
              piece: int | None = None) -> range | None:
        """The next run of pending batches for ``worker``, now claimed by it; None if none
        is pending now (some may come back: see :attr:`finished`). ``live`` is the number
        of workers taking work, for the guided size; ``size`` replaces that size (the
        mode's choice, see :meth:`~dasktrain.trainer.modes.base.UpdateMode.claim_size`).
        With ``whole_runs``, the run is pushed in pieces of ``piece`` batches (default: the
        whole run), each admitted and taken as one."""
        owner = self._owner
        pending = self._count[_PENDING]
        if not pending:
            self._cursor = len(owner)
            return None
        start = self._cursor + int(np.argmax(owner[self._cursor:] == _PENDING))
        self._cursor = start
        if size is None:
            size = min(self.claim_batches, max(1, math.ceil(pending / (2 * max(live, 1)))))
        size = max(1, int(size))
        bound = int(np.searchsorted(self._bounds, start, side="right"))
        stop = min(start + size, int(self._bounds[bound]) if bound < len(self._bounds)
                   else len(owner))
        run = owner[start:stop]
        taken = np.flatnonzero(run != _PENDING)
        if len(taken):  # a released batch's neighbour is still out: a shorter run
            stop = start + int(taken[0])
        self._move(slice(start, stop), worker)
        if self.whole_runs:
            for part in run_pieces(range(start, stop), piece):
                self._runs[(worker, part.stop - 1)] = part.start
        return range(start, stop)

    @_locked
    def arrive(self, worker: int, batch: int) -> str | None:
        """A gradient of ``batch`` from ``worker`` is in: None if it is admitted (it will be
        :meth:`taken`), else why it is refused."""
        if not 0 <= batch < len(self._owner):
            return f"batch {batch} is not one of the epoch's {len(self._owner)}"
        run = self._run(worker, batch)
        if run is None:
            return f"batch {batch} ends no run that worker {worker} claimed"
        if any(self._owner[b] == _DONE or b in self._arriving for b in run):
            return f"batch {batch} was already applied" if len(run) == 1 else \
                f"batches {run.start}-{run.stop - 1} were already applied, some or all"
        # Claimed by another worker after this one's claim was given back: the first
        # gradient in wins, the other's is refused when it comes.
        self._move(slice(run.start, run.stop), worker)
        self._arriving.update(run)
        return None

    def _run(self, worker: int, batch: int) -> range | None:
        """The batches a push of ``worker`` named by ``batch`` covers (None: no such run)."""
        if not self.whole_runs:
            return range(batch, batch + 1)
        start = self._runs.get((worker, batch))
        return None if start is None else range(start, batch + 1)

    @_locked
    def taken(self, worker: int, batch: int) -> None:
        """``worker``'s gradient of ``batch`` was taken (serial section)."""
        run = self._run(worker, batch) if 0 <= batch < len(self._owner) else None
        self._runs.pop((worker, batch), None)
        for b in run or ():
            if self._owner[b] != _DONE:
                self._move(b, _DONE)
                self._arriving.discard(b)
                self._taken[worker] = self._taken.get(worker, 0) + 1

    @_locked
    def release(self, worker: int) -> int:
        """Give back what ``worker`` claimed and did not push; returns how many batches."""
        back = np.flatnonzero(self._owner == worker)
        back = np.asarray([b for b in back.tolist() if b not in self._arriving], dtype=np.int64)
        self._runs = {(w, last): first for (w, last), first in self._runs.items()
                      if w != worker or last in self._arriving}
        if len(back):
            self._move(back, _PENDING)
            self._cursor = min(self._cursor, int(back[0]))
        return len(back)

    @_locked
    def refund(self, worker: int, batch: int) -> int:
        """Undo the admission (:meth:`arrive`) of ``worker``'s push named by ``batch``: its
        batches go back to the pool, not done (``average``: parameters that fell behind are
        not averaged, and their batches are trained again on the current ones); returns how
        many batches."""
        run = self._run(worker, batch) if 0 <= batch < len(self._owner) else None
        self._runs.pop((worker, batch), None)
        back = [b for b in run or () if b in self._arriving and self._owner[b] == worker]
        if back:
            self._arriving.difference_update(back)
            self._move(np.asarray(back, dtype=np.int64), _PENDING)
            self._cursor = min(self._cursor, back[0])
        return len(back)

    @_locked
    def holds(self, worker: int) -> bool:
        """Whether ``worker`` holds claimed work it has not pushed."""
        if not self._count[worker]:
            return False
        return any(b not in self._arriving
                   for b in np.flatnonzero(self._owner == worker).tolist())

    # -- reports and checkpoints -------------------------------------------------------
    def taken_by(self, worker: int) -> int:
        """Batches of this epoch done from ``worker``'s gradients."""
        return self._taken.get(worker, 0)

    @_locked
    def shares(self) -> dict[int, int]:
        """Batches done per worker this epoch."""
        return dict(self._taken)

    @_locked
    def idle(self, worker: int) -> bool:
        """``worker`` holds no work and none is pending: it has nothing to push (unless
        work comes back to the pool)."""
        return not self._count[_PENDING] and not self._count[worker]

    @_locked
    def holders(self) -> set[int]:
        """Workers holding claimed work they have not pushed."""
        owner = self._owner
        return {int(owner[b]) for b in np.flatnonzero(owner >= 0).tolist()
                if b not in self._arriving}

    @_locked
    def state_dict(self) -> dict[str, Any]:
        done = self._owner == _DONE
        return {"epoch": self.epoch, "num_batches": len(self._owner),
                "done": np.packbits(done).tobytes(), "taken": dict(self._taken),
                "pending": self._count[_PENDING],
                "claimed": len(self._owner) - self._count[_PENDING] - self._count[_DONE]}

    @_locked
    def load_state_dict(self, state: dict[str, Any]) -> None:
        n = int(state["num_batches"])
        done = np.unpackbits(np.frombuffer(state["done"], dtype=np.uint8), count=n)
        self.epoch = int(state["epoch"])
        self._owner = np.where(done.astype(bool), _DONE, _PENDING).astype(np.int64)
        self._recount()
        self._taken = {int(w): int(n) for w, n in state["taken"].items()}
        self._arriving.clear()
        self._runs.clear()
        self._cursor = 0
