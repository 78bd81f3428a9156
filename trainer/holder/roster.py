"""Who trains with the holder, under which incarnation, and what each one holds.

One object owns membership, incarnations, the work claimed on demand (the
:class:`~.ledger.WorkLedger`) and each worker's clock and place, so that one invariant holds
by construction:

    only the current, active incarnation of a worker holds claimed work, and a batch is
    done only when its gradient (or its whole push, in ``average``) is taken by the mode's
    rule: applied, kept for a later update, or recorded as dropped.

* **Incarnations.** Every join hands the worker a new incarnation (1, 2, ... per worker);
  from then on its earlier one is gone, whatever it was doing. Every call a worker makes
  after its join carries the incarnation, and :meth:`Roster.check` refuses one that is not
  current (:class:`~dasktrain.trainer.errors.Fenced`): a claim that waited while its worker
  was dropped, a frame still in the socket of a killed process, the predecessor of a task
  Dask ran again. The check is made where the state changes (taking work, admitting a
  gradient), not only where a call enters: a claim that waited checks again before it
  takes (torch elastic's rendezvous rounds and Kafka's producer epochs fence the same way).
* **One way out.** :meth:`Roster.deactivate` is the only path by which a worker stops
  holding work: it left the epoch, retired, died, went silent, was surplus, or a newer
  incarnation joined. It gives back what the incarnation claimed and did not push, and
  moves the worker to its new state; the holder tells the mode and the epoch machine.

States of a worker (one per worker number, for the whole fit):

``expected``
    part of the current epoch, not yet (re)joined it;
``active``
    training the current epoch;
``done``
    finished its part of the current epoch; it may go on into the next one;
``waiting``
    joined, and takes part from the next epoch on (a worker added mid-epoch where ranks
    own a stride of the epoch);
``lost``
    dropped: died or went silent; a task run again joins with a new incarnation;
``left``
    its task ended (retired, failed, surplus); a new task joins with a new incarnation;
``absent``
    no task for it (a free slot of an elastic run).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dasktrain.trainer.errors import Fenced
from dasktrain.trainer.holder.ledger import WorkLedger

__all__ = ["STATES", "Roster"]

STATES = ("expected", "active", "done", "waiting", "lost", "left", "absent")
#: States of a worker whose task lives on (it may take part in the next epoch).
ALIVE = ("expected", "active", "done", "waiting")


@dataclasses.dataclass(slots=True)
class _Member:
    state: str = "expected"  # a fixed world expects every worker from the start
    incarnation: int = 0  # 0: never joined
    address: str | None = None
    waiting_since: float | None = None  # since when something waits for it, silent


class Roster:
    """Membership, incarnations and claimed work of one holder's ``workers`` slots.

    ``clocks[w]`` counts the contributions of worker ``w`` the holder has taken in the whole
    fit; ``positions[w]`` is ``(epoch, batches consumed)`` after its latest one. ``ranks``
    lists, where each rank owns a stride of the epoch, the worker of each rank.
    """

    def __init__(self, workers: int, ledger: WorkLedger | None = None) -> None:
        self.workers = workers
        self.ledger = ledger
        self._members = {w: _Member() for w in range(workers)}
        self.clocks = [0] * workers
        self.positions: dict[int, tuple[int, int]] = {}
        self.ranks: list[int] = list(range(workers))
        self.fenced = 0  # calls refused because their incarnation was not current

    # -- identities ----------------------------------------------------------------------
    def known(self, worker: int) -> None:
        if worker not in self._members:
            raise ValueError(f"unknown worker {worker!r}: this holder serves workers "
                             f"0..{self.workers - 1}")

    def incarnation(self, worker: int) -> int:
        self.known(worker)
        return self._members[worker].incarnation

    def check(self, worker: int, incarnation: int, what: str, *, active: bool = True) -> None:
        """Refuse (:class:`Fenced`) ``what`` from ``worker``'s ``incarnation`` unless it is
        the worker's current one and, with ``active``, it trains the current epoch."""
        self.known(worker)
        member = self._members[worker]
        reason = None
        if incarnation != member.incarnation:
            reason = ("superseded" if incarnation < member.incarnation else "unknown")
        elif member.state in ("lost", "left", "absent") or (active and member.state != "active"):
            reason = member.state
        if reason is not None:
            self.fenced += 1
            raise Fenced(worker, incarnation, reason, what)

    def admit(self, worker: int, address: str | None, state: str) -> int:
        """A task of ``worker`` joined from ``address``: its new incarnation, in ``state``.
        The earlier incarnation must have been deactivated (:meth:`deactivate`)."""
        self.known(worker)
        member = self._members[worker]
        assert self.ledger is None or not self.ledger.holds(worker), \
            "a worker joined while an earlier incarnation held work"
        member.incarnation += 1
        member.state, member.address, member.waiting_since = state, address, None
        return member.incarnation

    def deactivate(self, worker: int, state: str) -> int:
        """The one way out (see the module docstring): ``worker`` moves to ``state`` and its
        incarnation's claimed work goes back to the pool; returns how many batches."""
        self.known(worker)
        member = self._members[worker]
        member.state, member.waiting_since = state, None
        return 0 if self.ledger is None else self.ledger.release(worker)

    def set(self, worker: int, state: str) -> str:
        """Move ``worker`` (which holds no work) to ``state``; returns the state it was in."""
        self.known(worker)
        member = self._members[worker]
        before, member.state, member.waiting_since = member.state, state, None
        return before

    # -- who is where --------------------------------------------------------------------
    def state(self, worker: int) -> str:
        self.known(worker)
        return self._members[worker].state

    def states(self) -> dict[int, str]:
        return {w: m.state for w, m in self._members.items()}

    def address(self, worker: int) -> str | None:
        return self._members[worker].address

    def addresses(self) -> dict[int, str | None]:
        """Where each worker's current task joined from (None: never)."""
        return {w: m.address for w, m in self._members.items()}

    def live(self) -> set[int]:
        """Workers still to push this epoch: expected or active."""
        return {w for w, m in self._members.items() if m.state in ("expected", "active")}

    def active(self) -> set[int]:
        return {w for w, m in self._members.items() if m.state == "active"}

    def alive(self) -> set[int]:
        """Workers whose task joined and lives on (it may take part in the next epoch)."""
        return {w for w, m in self._members.items()
                if m.state in ALIVE and m.incarnation > 0}

    def sharing(self, worker: int, address: str | None) -> int | None:
        """Another worker whose task lives on ``address``, if any."""
        return next((w for w, m in self._members.items() if w != worker and address
                     and m.state in ALIVE and m.address == address), None)

    def rank(self, worker: int) -> int | None:
        """``worker``'s rank in the current epoch, where ranks own a stride of it."""
        return self.ranks.index(worker) if worker in self.ranks else None

    # -- epochs --------------------------------------------------------------------------
    def begin_epoch(self, present: int | None, elastic: bool) -> list[int]:
        """Expect the epoch's workers; returns them (sorted, rank order).

        ``present``: workers ``0..present-1`` (a fit's first epoch, as the driver placed
        them). None: every worker whose task lives on in an elastic run (its world follows
        the cluster), every worker otherwise (a fixed world: Dask runs a dead one's task
        again)."""
        if present is not None:
            members = list(range(min(present, self.workers)))
        elif elastic:
            members = self._one_per_address(sorted(self.alive()))
        else:  # every worker but one whose task was given up
            members = [w for w, m in self._members.items() if m.state != "left"]
        for w, member in self._members.items():
            if w in members:
                member.state = "expected"
            elif member.incarnation == 0:  # no task of it ever joined
                member.state = "absent"
            elif member.state in ALIVE:  # its task lives, without a part in this epoch
                member.state = "waiting"
            member.waiting_since = None
        self.ranks = members
        return members

    def _one_per_address(self, workers: list[int]) -> list[int]:
        """``workers`` but the later of two whose tasks share a Dask worker (Dask ran one's
        task again beside the other, to finish its stride): one replica per Dask worker in
        an elastic run, the other's task ends."""
        seen: set[str] = set()
        kept = []
        for w in workers:
            address = self._members[w].address
            if address is not None and address in seen:
                self._members[w].state = "left"
                continue
            if address is not None:
                seen.add(address)
            kept.append(w)
        return kept

    # -- clocks and places ---------------------------------------------------------------
    def counted(self, worker: int, position: tuple[int, int]) -> None:
        """One more contribution of ``worker``, which has now consumed ``position``."""
        self.clocks[worker] += 1
        self.positions[worker] = position

    def position_in(self, worker: int, epoch: int) -> int:
        """Batches ``worker`` has consumed of ``epoch`` (0 if it has not started it)."""
        at_epoch, batches = self.positions.get(worker, (epoch, 0))
        return batches if at_epoch == epoch else 0

    # -- silence, for the watchdog -------------------------------------------------------
    def heard(self, worker: int) -> None:
        """``worker`` called: whatever it is waited for, it is not silent."""
        self._members[worker].waiting_since = None

    def mark_waiting(self, waiting: set[int], now: float) -> None:
        for w, member in self._members.items():
            if w not in waiting:
                member.waiting_since = None
            elif member.waiting_since is None:
                member.waiting_since = now

    def waited(self, worker: int, now: float) -> float:
        since = self._members[worker].waiting_since
        return 0.0 if since is None else now - since

    # -- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"clocks": list(self.clocks),
                "positions": {w: list(p) for w, p in self.positions.items()}}

    def load_state_dict(self, state: dict[str, Any], any_count: bool = False) -> None:
        """``any_count``: the checkpoint may have another number of workers (work claimed on
        demand, an elastic run): the workers in both keep their clocks, new ones start at
        0."""
        clocks = [int(c) for c in state["clocks"]]
        if len(clocks) != self.workers and not any_count:
            raise ValueError(f"the checkpoint has {len(clocks)} workers, this run "
                             f"{self.workers}")
        self.clocks = (clocks + [0] * self.workers)[:self.workers]
        self.positions = {int(w): (int(p[0]), int(p[1]))
                          for w, p in state["positions"].items() if int(w) < self.workers}
