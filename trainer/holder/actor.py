"""The central parameter holder: a Dask actor that hosts an update mode.

A thin façade over the wire. Behind it: the :mod:`.roster` (who trains, under which
incarnation, holding what), the :mod:`.epochs` machine (when an epoch is complete and the
next begins), the versioned state the mode sees (:mod:`.host`: parameters, version,
records), pushes coming in (:mod:`.intake`), claims of work (:mod:`.claims`) and the mode
itself (:mod:`dasktrain.trainer.modes`), which decides *when* and *what* is applied. Each
worker call carries the incarnation its join handed out and is checked where it changes
something; however a worker goes, :meth:`ParameterHolder._deactivate` is the one way out.
The direct channel is :mod:`dasktrain.trainer.exchange.contact`'s.

Every public method is ``async`` and runs on the holder worker's event loop, so barriers are
plain asyncio futures; the arithmetic runs in the serial section of :mod:`.arithmetic`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np
import torch
from distributed import get_worker

from dasktrain._malloc import tune_allocator
from dasktrain.trainer.errors import Fenced, TrainerError, TrainingDiverged
from dasktrain.trainer.exchange.contact import HolderChannel
from dasktrain.trainer.flat import FlatLayout
from dasktrain.trainer.holder.arithmetic import Arithmetic, Lease
from dasktrain.trainer.holder.balance import Balance
from dasktrain.trainer.holder.claims import ClaimDesk
from dasktrain.trainer.holder.config import HolderConfig
from dasktrain.trainer.holder.doors import Doors
from dasktrain.trainer.holder.early import EARLY_VALUES
from dasktrain.trainer.holder.epochs import EpochMachine, Queued, world_changed
from dasktrain.trainer.holder.host import ModeHost, initial_state
from dasktrain.trainer.holder.intake import Intake
from dasktrain.trainer.holder.ledger import WorkLedger
from dasktrain.trainer.holder.records import Records
from dasktrain.trainer.holder.roster import Roster
from dasktrain.trainer.holder.waiters import StateWaiters
from dasktrain.trainer.holder.watchdog import Watchdog, scheduler_workers
from dasktrain.trainer.modes import get_mode, mode_class

__all__ = ["ParameterHolder"]

logger = logging.getLogger(__name__)


class ParameterHolder:
    """The master copy of the parameters, updated as its update mode says.

    Create it as a Dask actor: ``client.submit(ParameterHolder, config, actor=True)``. Every
    method returns (on the caller's side) a future. A worker's calls after its
    :meth:`join` name it by ``(worker, incarnation)``.
    """

    def __init__(self, config: HolderConfig) -> None:
        self.config = config
        self._closed = False
        tune_allocator()
        torch.set_num_threads(config.torch_threads)
        try:
            self._worker = get_worker()
        except ValueError:  # built outside a cluster (tests of the arithmetic)
            self._worker = None
        # The whole model's layout, which every worker's must be, and what this holder
        # keeps: the whole model's, or a shard's slice of it.
        self.model_layout, self.layout, state = initial_state(config)
        mode_type = mode_class(config.mode)
        arith = Arithmetic(self.layout, state, config.optimizer, config.total_steps,
                           clip=(config.clip_grad_norm, config.clip_grad_value),
                           names=[name for name, _ in self.model_layout.params])
        # Work claimed on demand (assignment="dynamic"): no ledger where ranks own a stride.
        self._roster = Roster(config.workers, WorkLedger(whole_runs=mode_type.pushes_runs)
                              if config.assignment == "dynamic" else None)
        self._epochs = EpochMachine(self._roster, elastic=config.elastic,
                                    least=config.min_workers or config.workers,
                                    snapshot=self._snapshot, began=self._began,
                                    version=lambda: self.version)
        # Uneven shares of a step, by the workers' speeds: a lock-step mode averaging
        # gradients by rows, over ranks that own their stride.
        self._balance = Balance(config.batch_size, config.balance and mode_type.balances
                                and self._roster.ledger is None)
        self._host = ModeHost(config, self.layout, arith, self._roster, self._epochs,
                              Records(mode_type.gradient_fields), self._balance,
                              work_changed=lambda: self._claims.changed(),
                              after_update=self._after_update)
        self._arith = arith
        self._mode = self._host.mode = get_mode(config.mode, self._host,
                                                **config.mode_options)
        self._claims = ClaimDesk(self._roster, self._mode, self._check,
                                 lambda: self.version, self._epochs.work_finished)
        self._watchdog = Watchdog(self._roster, self._waited_for, self.drop,
                                  scheduler_workers(self._worker),
                                  interval=config.check_interval,
                                  timeout=config.barrier_timeout)
        self._error: BaseException | None = None
        self._notices: list[dict[str, Any]] = []  # workers' warnings, for the driver
        self._state_waiters = StateWaiters()
        payload_size = mode_type.payload_size(self.layout, config.optimizer,
                                              config.mode_options)
        self._intake = Intake(self._roster, self._host, self._mode, arith, self._balance,
                              payload_size, lambda: not self._closed and self._error is None)
        self._direct = HolderChannel(
            self.exchange, self.layout, payload_size,
            worker_address=None if self._worker is None else self._worker.address,
            enabled=config.direct_channel, shared_memory=config.shared_memory,
            bucket_bytes=config.bucket_bytes, shared_reply=arith.region_shared,
            # Told of payloads arriving only where a round's mean may be begun early.
            arriving=self._intake.arriving_payload if mode_type.early_mean
            and payload_size >= EARLY_VALUES else None)
        self._doors = Doors(
            model_layout=self.model_layout, roster=self._roster, epochs=self._epochs,
            host=self._host, intake=self._intake, claims=self._claims, balance=self._balance,
            watchdog=self._watchdog, direct=self._direct,
            address=None if self._worker is None else self._worker.address,
            elastic=config.elastic, shards=None if config.shard is None else config.shard[1],
            fail=self._fail, advance=self._epochs.advance)

    @property
    def version(self) -> int:
        """Updates applied (the version of the current parameters)."""
        return self._host.version

    @property
    def clocks(self) -> tuple[int, ...]:
        return tuple(self._roster.clocks)

    @property
    def channel_address(self) -> tuple[str, int] | None:
        """Where the direct channel listens for TCP connections; None before the first
        worker from another process joined, or without a channel."""
        return self._direct.address

    @property
    def _channel(self) -> Any:
        """The direct channel's server once open (the channel's tests reach it here)."""
        return self._direct.server

    def _check_usable(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise TrainerError("the parameter holder is closed")

    def _check(self, worker: int, incarnation: int, what: str, active: bool = True) -> None:
        """Refuse ``what`` from a stale incarnation (:class:`Fenced`): an event, counted."""
        self._check_usable()
        try:
            self._roster.check(worker, incarnation, what, active=active)
        except Fenced as fenced:
            self._host.record_event(str(fenced))
            raise
        self._roster.heard(worker)

    # -- epochs (the driver's calls; the rules are the epoch machine's) -----------------
    async def begin_epoch(self, epoch: int, fresh: bool = True,
                          work: tuple[int, list[int]] | None = None,
                          present: int | None = None, keep: str | None = None) -> None:
        """Begin ``epoch`` with workers ``0..present-1`` (default: all) now (``fresh=False``:
        continue a resumed epoch); ``work``: its batches and claim bounds, where work is
        claimed on demand; ``keep``: what to snapshot at its end, for the driver."""
        self._check_usable()
        self._epochs.begin(Queued(epoch, fresh, work, present, keep))

    async def queue_epoch(self, epoch: int, work: tuple[int, list[int]] | None = None,
                          keep: str | None = None) -> None:
        """Begin ``epoch`` as soon as the one before is complete (now, if it is)."""
        self._check_usable()
        self._epochs.queue(Queued(epoch, True, work, None, keep))
        await self._epochs.advance()

    def _began(self, queued: Queued, members: list[int]) -> None:
        was, self._host.workers = self._host.workers, len(members)  # what the modes count
        self._host.loop = asyncio.get_running_loop()
        self._claims.changed()
        if self.config.elastic and queued.present is None and was != len(members):
            self._host.record_event(world_changed(queued.epoch, was, len(members),
                                                  self.config))

    async def _snapshot(self, keep: str) -> dict[str, Any]:
        return await self._host.serially(self._host.state_dict if keep == "state" else
                                         self._host.boundary_values)

    async def epoch_end(self, epoch: int, wait: float = 0.5) -> dict[str, Any] | None:
        """The workers' reports of ``epoch`` once it is complete, else None after ``wait``
        seconds (the driver's progress polls go on between two calls)."""
        if not await self._epochs.wait_complete(
                epoch, wait, lambda: self._error is not None or self._closed):
            return None
        return {"reports": self._epochs.take_reports(epoch),
                **self._epochs.outcomes.get(epoch, {"shares": {}, "samples": None,
                                                         "loss": None})}

    async def boundary(self, epoch: int) -> dict[str, Any]:
        """The snapshot taken when ``epoch`` was complete (given once)."""
        found = self._epochs.boundaries.pop(epoch, None)
        if found is None:
            raise TrainerError(f"no snapshot of the end of epoch {epoch} was kept")
        return found

    async def end_fit(self, reason: str) -> None:
        """Workers asking for another epoch are told the fit is over (``reason``)."""
        self._epochs.end(reason)

    async def next_epoch(self, worker: int, incarnation: int, after: int, address: str | None,
                         wait: float = 10.0, report: dict[str, Any] | None = None
                         ) -> dict[str, Any]:
        """For a worker that finished epoch ``after`` and trains on: :meth:`leave` with its
        ``report`` (if given), then what :meth:`join` answers once an epoch after it began;
        ``{"wait": what}`` if none did within ``wait`` seconds (``"driver"``: its boundary
        work; ``"workers"``: others still train; ``"cluster"``: too few workers): ask
        again, without the report; ``{"end": reason}`` once the fit is over for it."""
        self._check(worker, incarnation, f"a leave of epoch {after}", active=False)
        if report is not None and self._epochs.epoch == after \
                and self._roster.state(worker) in ("active", "expected"):
            await self.leave(worker, incarnation, False, report)
        machine = self._epochs
        waits_for = await machine.wait_begun(after, wait, self._check_usable)
        if waits_for is not None:
            return {"wait": waits_for}
        if machine.ended is not None:
            return {"end": machine.ended}
        if self._roster.state(worker) in ("left", "waiting") \
                and self._roster.incarnation(worker) == incarnation:
            # Beside another replica on its Dask worker (see Roster.begin_epoch).
            return {"end": f"worker {worker} has no place in epoch {machine.epoch}"}
        self._check(worker, incarnation, f"a start of epoch {machine.epoch}", active=False)
        return await self._doors.welcome(worker, self._roster.address(worker))

    async def epoch_shares(self, epoch: int, world: int) -> tuple[int, ...] | None:
        """The rows of each rank's batch in ``epoch`` (None: a batch each), for a worker
        about to compute ahead into it; every worker is told the same."""
        return self._balance.shares(epoch, world)

    # -- joining and leaving ---------------------------------------------------------------
    async def join(self, worker: int, address: str | None, layout: FlatLayout
                   ) -> dict[str, Any]:
        """A worker's task starts (or Dask ran it again): check its model, give it a new
        incarnation, the parameters and its place; ``{"surplus": True}`` where it has no
        place (an elastic run has a replica on its Dask worker already); ``{"wait":
        epoch}`` where it takes part from the next epoch on (ranks own a stride of this
        one)."""
        self._check_usable()
        return await self._doors.join(worker, address, layout)

    async def leave(self, worker: int, incarnation: int, retired: bool = False,
                    report: dict[str, Any] | None = None, error: str | None = None) -> None:
        """A worker finished its part of the epoch, with its ``report`` of it for the driver;
        ``retired`` (its Dask worker is being retired) or with an ``error``, its task ends."""
        self._check(worker, incarnation, "a leave", active=False)
        self._epochs.report(worker, report)
        ends = retired or error is not None
        why = (None if not ends else f"worker {worker} left: its Dask worker is retiring"
               if retired else f"worker {worker} left: {error}")
        await self._doors.deactivate(worker, "left" if ends else "done", why)

    async def drop(self, worker: int, reason: str) -> None:
        """Stop waiting for ``worker`` (its current incarnation is over; a task of it joins
        again with a new one); the watchdog and the driver call this."""
        if self._roster.state(worker) in ("lost", "left", "absent"):
            return
        await self._doors.deactivate(worker, "lost", f"worker {worker} dropped: {reason}")

    async def give_up(self, worker: int, reason: str) -> None:
        """Stop waiting for ``worker`` for the rest of the fit: Dask gave its task up."""
        if self._roster.state(worker) not in ("left", "absent"):
            await self._doors.deactivate(worker, "left", f"worker {worker} given up: {reason}")

    async def notify(self, worker: int, incarnation: int, notices: list[dict[str, str]]
                     ) -> None:
        """Warnings a worker saw (see :mod:`dasktrain.trainer.worker.notices`)."""
        self._check(worker, incarnation, "its warnings", active=False)
        self._notices.extend({**n, "worker": worker} for n in notices)

    async def exchange_changed(self, worker: int, incarnation: int, via: str,
                               reason: str = "") -> None:
        """``worker``'s pushes go ``via`` ``"actor"`` from now on (its direct channel could
        not be reached: ``reason``), or ``"direct"`` again: an event of the History."""
        self._check(worker, incarnation, "a move to the actor or back", active=False)
        if via not in ("actor", "direct"):
            raise ValueError(f"via must be 'actor' or 'direct', got {via!r}")
        self._host.record_event(f"worker {worker} pushes through the actor: {reason}"
                                if via == "actor" else
                                f"worker {worker} is back on the direct channel")

    # -- work claimed on demand ----------------------------------------------------------
    async def claim(self, worker: int, incarnation: int, epoch: int, wait: float = 2.0
                    ) -> list[int] | None:
        """The next run of the epoch's global batches for ``worker``: ``[start, stop]``
        (``[start, stop, piece]`` where a push covers ``piece`` batches of it); ``[]`` if
        none is free within ``wait`` seconds although the epoch is not done (what others
        claimed may come back: ask again); None once every batch of ``epoch`` is done. A
        claim that waited checks its incarnation again before it takes anything."""
        return await self._claims.claim(worker, incarnation, epoch, wait)

    def _waited_for(self) -> set[int]:
        """Workers something waits for, that the watchdog drops if they die or go silent:
        those a pending update waits for, and those that claims or the epoch's end wait
        on."""
        return self._mode.waiting_for() | self._claims.waited_for()

    # -- the exchange --------------------------------------------------------------------
    async def exchange(self, worker: int, incarnation: int, version: int,
                       grads: np.ndarray | None, count: int, loss: float,
                       position: tuple[int, int]) -> Lease:
        """Hand in one push of ``grads`` computed at ``version`` (gradients then buffers,
        or parameters in averaging modes; None: "no batch this step" in lock-step modes)
        of ``count`` samples; returns the reply under a lease the caller releases once it
        has sent (or copied) it."""
        self._check(worker, incarnation, "a push")
        return await self._intake.take(worker, incarnation, version, grads, count, loss,
                                       position)

    async def push(self, worker: int, incarnation: int, version: int,
                   grads: np.ndarray | None, count: int, loss: float,
                   position: tuple[int, int]) -> tuple[np.ndarray, int]:
        """:meth:`exchange` through the actor's calls: returns fresh parameters (a copy
        that the reply may send at leisure) and their version."""
        lease = await self.exchange(worker, incarnation, version, grads, count, loss,
                                    position)
        try:
            return lease.array.copy(), lease.version
        finally:
            lease.release()

    async def set_lr_factor(self, factor: float) -> float:
        """Multiply the learning-rate schedule by ``factor`` from the next update on."""
        self._check_usable()
        await self._host.serially(setattr, self._arith, "lr_factor", float(factor))
        self._host.record_event(f"learning rate factor set to {factor:.4g}")
        return self._arith.lr_factor

    async def pull(self) -> tuple[np.ndarray, int]:
        """The current parameters (then buffers) and their version (a copy)."""
        return await self._host.serially(lambda: (self._arith.flat.numpy().copy(),
                                                  self.version))

    async def _after_update(self) -> None:
        if self._host.diverged is not None:
            error = TrainingDiverged(self._host.diverged)
            self._host.record_event(self._host.diverged)
            await self._fail(error)
            raise error
        if self._state_waiters.due(self.version):
            await self._state_waiters.serve(self.state_dict)

    # -- reports, checkpoints, shutdown ------------------------------------------------
    async def progress(self) -> dict[str, Any]:
        """Counters for a progress display; ``records`` and ``events`` since the last call."""
        notices, self._notices = self._notices, []
        return await self._host.serially(lambda: self._host.progress(
            claims=self._claims.take(), notices=notices, error=self._error))

    async def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue: parameters, optimizer state, version, clocks,
        every worker's position and the mode's state. Taken between two updates, so it is
        consistent."""
        return await self._host.serially(self._host.state_dict)

    async def state_at(self, version: int) -> dict[str, Any]:
        """A :meth:`state_dict` taken as soon as an update brings the holder to ``version``
        (or now, if it is there already)."""
        self._check_usable()
        if self.version >= version:
            return await self.state_dict()
        return await self._state_waiters.wait(version)

    async def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict` of a holder of the same model and mode."""
        self._host.check_state(state)
        await self._host.serially(self._host.load_state_dict, state)

    async def abort(self, reason: str) -> None:
        """Fail every waiting and future call with ``reason`` (the run is over)."""
        await self._fail(TrainerError(reason))

    async def _fail(self, error: TrainerError) -> None:
        if self._error is None:
            self._error = error
            self._stop(error)

    def _stop(self, error: TrainerError) -> None:
        """Fail whatever waits (a round, a checkpoint, a worker asking for work or an
        epoch), and watch nobody any more."""
        self._watchdog.stop()
        self._mode.abort(error)
        self._state_waiters.fail(error)
        self._epochs.changed()
        self._claims.changed()

    async def close(self) -> None:
        """Stop the watchdog, the channel and the arithmetic thread."""
        self._closed = True
        self._stop(TrainerError("the parameter holder is closed"))
        await self._direct.close()
        self._arith.close()

