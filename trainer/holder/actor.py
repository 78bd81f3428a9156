"""The central parameter holder: a Dask actor that hosts an update mode.

It owns the master parameters (:mod:`.arithmetic`), knows its workers
(:mod:`.membership`), records what it applies (:mod:`.records`), refuses what is not finite
(:mod:`.divergence`) and serves the wire (the actor's calls, and the direct channel through
:mod:`dasktrain.trainer.exchange.contact`). *When* and *what* it applies is the update mode's
business (:mod:`dasktrain.trainer.modes`), which sees it through the small host interface
documented in :mod:`dasktrain.trainer.modes.base`. How it is built is
:mod:`.config`; checkpoints awaited at a version are :mod:`.waiters`.

Every public method is ``async`` and runs on the holder worker's event loop, so barriers are
plain asyncio futures; the arithmetic runs in the serial section of :mod:`.arithmetic`.

The actor stays one piece of some 880 lines because every method left reads or moves the
same version, epoch and membership state under that one serial section (the wire's calls, the
modes' host interface, the checkpoint of that state, the epoch boundaries that the workers
and membership decide): split further, the parts would share
that state through attributes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from distributed import get_worker

from dasktrain._malloc import tune_allocator
from dasktrain.trainer.errors import TrainerError, TrainingDiverged
from dasktrain.trainer.exchange.contact import HolderChannel
from dasktrain.trainer.exchange.landing import Landing
from dasktrain.trainer.flat import FlatLayout, FlatModel
from dasktrain.trainer.holder.arithmetic import Arithmetic, Lease
from dasktrain.trainer.holder.balance import Balance
from dasktrain.trainer.holder.config import HolderConfig
from dasktrain.trainer.holder.divergence import NonFiniteGuard, all_finite, finite_mean
from dasktrain.trainer.holder.early import EARLY_VALUES, Arrival, early_round
from dasktrain.trainer.holder.ledger import WorkLedger
from dasktrain.trainer.holder.membership import Membership, Watchdog
from dasktrain.trainer.holder.records import Records
from dasktrain.trainer.holder.shards import shard_layouts, shard_states
from dasktrain.trainer.holder.turns import Turns
from dasktrain.trainer.holder.waiters import StateWaiters
from dasktrain.trainer.modes import Contribution, get_mode, mode_class
from dasktrain.trainer.modes.base import Adjust, Adjusted

__all__ = ["ParameterHolder"]

logger = logging.getLogger(__name__)


class ParameterHolder:
    """The master copy of the parameters, updated as its update mode says.

    Create it as a Dask actor: ``client.submit(ParameterHolder, config, actor=True)``. Every
    method returns (on the caller's side) a future.
    """

    def __init__(self, config: HolderConfig) -> None:
        self.config = config
        tune_allocator()
        torch.set_num_threads(config.torch_threads)
        try:
            self._worker = get_worker()
        except ValueError:  # built outside a cluster (tests of the arithmetic)
            self._worker = None
        model = config.model()
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"the model factory returned {type(model).__name__}, not a "
                            "torch.nn.Module")
        flat = FlatModel(model)
        self.model_layout: FlatLayout = flat.layout
        """The whole model's, which every worker's must be."""
        state = flat.state()
        self.layout: FlatLayout = flat.layout
        """What this holder keeps: the whole model's, or a shard's slice of it."""
        if config.shard is not None:
            (start, stop), self.layout = shard_layouts(flat.layout, config.shard[1])[
                config.shard[0]]
            state = state[start:stop]
        self.workers = config.workers
        self.batch_size = config.batch_size  # the modes' reference batch (host interface)
        self.optimizer = config.optimizer
        self._arith = Arithmetic(self.layout, state, config.optimizer,
                                 config.total_steps,
                                 clip=(config.clip_grad_norm, config.clip_grad_value),
                                 names=[name for name, _ in self.model_layout.params])
        self._version = 0
        self._epoch = 0
        self._epoch_start = 0
        self.refused = 0
        self._members = Membership(config.workers)
        # Work claimed on demand (assignment="dynamic"): None when ranks own their stride.
        self._ledger = (WorkLedger(whole_runs=mode_class(config.mode).pushes_runs)
                        if config.assignment == "dynamic" else None)
        self._work_waiters: list[asyncio.Future] = []  # claims waiting for work to free
        self._loop: asyncio.AbstractEventLoop | None = None  # the actor's, once an epoch began
        self._claims: list[tuple[int, int, int, int]] = []  # (version, worker, start, stop)
        self._guard = NonFiniteGuard(config.on_nonfinite, config.nonfinite_patience,
                                     config.workers)
        self._diverged: str | None = None  # set by an update; the run is then aborted
        self._events: list[str] = []
        self._notices: list[dict[str, Any]] = []  # workers' warnings, for the driver
        mode_type = mode_class(config.mode)
        self._payload_size = mode_type.payload_size(self.layout, config.optimizer,
                                                    config.mode_options)
        self._records = Records(mode_type.gradient_fields)
        self._mode = get_mode(config.mode, self, **config.mode_options)
        self._claims_waiting = 0  # claims waiting for work that others hold
        self._watchdog = Watchdog(self._members, self._waited_for, self.drop,
                                  self._alive_addresses, interval=config.check_interval,
                                  timeout=config.barrier_timeout)
        self._error: BaseException | None = None
        self._state_waiters = StateWaiters()
        self._turns = Turns()  # epoch boundaries of tasks that last the fit
        # Uneven shares of a step, by the workers' speeds: a lock-step mode averaging
        # gradients by rows, over ranks that own their stride.
        self._balance = Balance(config.batch_size, config.balance and mode_type.balances
                                and self._ledger is None)
        self._direct = HolderChannel(
            self.exchange, self.layout, self._payload_size,
            worker_address=None if self._worker is None else self._worker.address,
            enabled=config.direct_channel, shared_memory=config.shared_memory,
            bucket_bytes=config.bucket_bytes, shared_reply=self._arith.region_shared,
            # Told of payloads arriving only where a round's mean may be begun early.
            arriving=self._arriving_payload if mode_type.early_mean
            and self._payload_size >= EARLY_VALUES else None)
        # Payloads on their way over the channel, by worker (see .early).
        self._arriving: dict[int, Arrival] = {}
        self._closed = False

    # -- the host interface (see dasktrain.trainer.modes.base) --------------------------
    @property
    def version(self) -> int:
        """Updates applied (the version of the current parameters)."""
        return self._version

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def epoch_start(self) -> int:
        """The version at which the current epoch began."""
        return self._epoch_start

    @property
    def updates(self) -> int:
        """Optimizer steps taken (the schedule's step)."""
        return self._arith.updates

    @property
    def clocks(self) -> Sequence[int]:
        """Contributions taken from each worker in the whole run."""
        return tuple(self._members.clocks)

    @property
    def parameters(self) -> torch.Tensor:
        """The current parameters (a view; read it in the serial section)."""
        return self._arith.parameters

    @property
    def values(self) -> torch.Tensor:
        """The current parameters then buffers (a view; read it in the serial section)."""
        return self._arith.flat

    def batches_taken(self, worker: int) -> int:
        """Batches of the current epoch taken from ``worker`` so far."""
        if self._ledger is not None:  # positions are batch indices there, not counts
            return self._ledger.taken_by(worker)
        return self._members.position_in(worker, self._epoch)

    @property
    def claims_work(self) -> bool:
        """Whether workers claim their batches as they go (``assignment="dynamic"``)."""
        return self._ledger is not None

    def live_workers(self) -> set[int]:
        """Workers still to push this epoch: not finished, not lost, and, where work is
        claimed on demand, holding work or able to claim some (an update must not wait for
        a worker that has nothing left to push)."""
        live = self._members.live()
        if self._ledger is None:
            return live
        return {w for w in live if not self._ledger.idle(w)}

    def record_event(self, text: str) -> None:
        logger.info("holder: %s", text)
        self._events.append(f"v{self._version}: {text}")

    async def serially(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` in order with every update, snapshot and restore."""
        return await self._arith.serially(fn, *args)

    async def apply(self, contributions: Sequence[Contribution], *,
                    adjust: Adjust | None = None, advance: bool = False) -> None:
        """Apply the batch-size-weighted mean of ``contributions`` as one optimizer step.

        ``adjust(contributions)`` runs in the serial section just before the step (so
        ``version`` and ``parameters`` are those the step starts from) and may return
        other payloads (delay-compensated gradients), weights, a learning-rate scale and
        each gradient's record fields: see :class:`Adjusted`. Contributions without a
        batch count for nothing; non-finite ones are refused. ``advance``: the version
        moves on even if nothing was applied (lock-step rounds).
        """
        # Worker order, not arrival order: the same sums on every run.
        ordered = sorted(contributions, key=lambda c: c.worker)
        await self.serially(self._apply, ordered, adjust, advance)
        await self._after_update()

    async def set_state(self, contributions: Sequence[Contribution],
                        values: torch.Tensor | None) -> None:
        """Make ``values`` (parameters then buffers) the current state: one update made of
        ``contributions`` (parameter averaging); None keeps the state and only moves the
        version on (a round in which no worker had a batch)."""
        await self.serially(self._set_state, list(contributions), values)
        await self._after_update()

    def hold(self, contribution: Contribution) -> None:
        """Count ``contribution`` as taken although a mode keeps it for a later update (in
        the serial section, and in the mode's checkpointed state): a resumed worker goes
        on after its batch."""
        if not contribution.held:
            contribution.held = True
            self._members.counted(contribution.worker, contribution.position)
            if self._ledger is not None and contribution.grads is not None \
                    and contribution.position[0] == self._ledger.epoch:
                self._ledger.taken(contribution.worker, contribution.position[1])
                if self._ledger.finished and self._loop is not None:
                    # Maybe on the update thread: claims waiting learn the epoch is done.
                    self._loop.call_soon_threadsafe(self._work_changed)

    def drop_gradient(self, contribution: Contribution, reason: str, **fields: Any) -> None:
        """Record ``contribution`` as received and not applied (``reason`` is logged)."""
        logger.debug("holder: worker %d's gradient dropped: %s", contribution.worker, reason)
        self.hold(contribution)
        self._records.gradient(staleness=self._version - contribution.version,
                               worker=contribution.worker, dropped=True, **fields)

    # -- membership --------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise TrainerError("the parameter holder is closed")

    async def begin_epoch(self, epoch: int, fresh: bool = True,
                          work: tuple[int, list[int]] | None = None,
                          present: int | None = None, after: int | None = None,
                          keep: str | None = None) -> None:
        """Expect workers ``0..present-1`` (default: all) for ``epoch`` (``fresh=False``:
        continue a resumed epoch). ``work``: the epoch's number of batches and claim
        bounds, where work is claimed on demand.

        ``after``: begin it as soon as epoch ``after`` is complete (now, if it is), for
        workers whose task lasts the fit (see :mod:`.turns`); ``keep``: what to snapshot
        when ``epoch`` is complete, for the driver (``"params"``, ``"state"``, None)."""
        self._check_usable()
        if after is not None and self._turns.complete < after:
            self._turns.queued = (epoch, (epoch, fresh, work, present, keep))
            return
        self._begin(epoch, fresh, work, present, keep)

    def _begin(self, epoch: int, fresh: bool, work: tuple[int, list[int]] | None,
               present: int | None, keep: str | None) -> None:
        self._turns.begin(epoch, keep)
        if fresh:
            self._epoch, self._epoch_start = epoch, self._version
        self._members.begin_epoch(present)
        if present is not None:  # an elastic run's epoch: the modes count these workers
            self.workers = present
        self._loop = asyncio.get_running_loop()
        if self._ledger is not None:
            if work is None:
                raise ValueError("a holder with dynamic assignment needs the epoch's work")
            self._ledger.begin(epoch, work[0], work[1], keep_done=not fresh)
            self._work_changed()
        self._turns.changed()  # workers waiting for this epoch go on

    async def _check_epoch_end(self) -> None:
        """If the current epoch is complete: keep its boundary, begin the queued epoch."""
        epoch = self._epoch
        if self._turns.complete >= epoch or not self._epoch_complete():
            return
        keep = self._turns.keep
        boundary = (None if keep is None else
                    await self.serially(self._state_dict if keep == "state" else
                                        self._boundary_values))
        if self._turns.complete >= epoch or self._epoch != epoch:
            return  # settled by another call while the snapshot was taken
        self._turns.finish(epoch, boundary,
                           {} if self._ledger is None else self._ledger.shares())
        queued = self._turns.take_queued(epoch + 1)
        if queued is not None:
            self._begin(*queued)

    def _epoch_complete(self) -> bool:
        """Every stride is done (a lost worker's task comes back to finish its own), or,
        where work is claimed, every batch is applied and nobody trains on."""
        states = self._members.states().values()
        if self._ledger is not None:
            return self._ledger.finished and "active" not in states
        return all(state in ("done", "absent") for state in states)

    def _boundary_values(self) -> dict[str, Any]:
        return {"params": self._arith.parameters.clone(),
                "buffers": self._arith.buffers.clone(), "version": self._version,
                "epoch": self._epoch}

    async def next_epoch(self, worker: int, after: int, address: str | None,
                         wait: float = 10.0, report: dict[str, Any] | None = None
                         ) -> dict[str, Any]:
        """For a worker that finished epoch ``after`` and trains on: :meth:`leave` with
        its ``report`` (if given), then what :meth:`join` answers once an epoch after it
        began; ``{"wait": True}`` if none did within ``wait`` seconds (the driver's
        boundary work goes on: ask again, without the report); ``{"end": reason}`` once
        the fit is over for it."""
        self._check_usable()
        self._members.check(worker)
        if report is not None:
            await self.leave(worker, False, report)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while self._epoch <= after and self._turns.ended is None:
            left = deadline - loop.time()
            if left <= 0:
                return {"wait": True}
            await self._turns.wait(left)
            self._check_usable()
        if self._turns.ended is not None:
            return {"end": self._turns.ended}
        if self._members.state(worker) == "absent":
            return {"end": f"worker {worker} has no place in epoch {self._epoch}"}
        return await self._welcome(worker, address)

    async def epoch_end(self, epoch: int, wait: float = 0.5) -> dict[str, Any] | None:
        """The workers' reports of ``epoch`` once it is complete, else None after ``wait``
        seconds (the driver's progress polls go on between two calls)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while self._turns.complete < epoch:
            left = deadline - loop.time()
            if left <= 0 or self._error is not None or self._closed:
                return None
            await self._turns.wait(left)
        return {"reports": self._turns.take_reports(epoch),
                "shares": self._turns.shares.get(epoch, {})}

    async def boundary(self, epoch: int) -> dict[str, Any]:
        """The snapshot taken when ``epoch`` was complete (given once): the parameters
        and buffers, or the whole :meth:`state_dict` where the run checkpoints."""
        found = self._turns.boundaries.pop(epoch, None)
        if found is None:
            raise TrainerError(f"no snapshot of the end of epoch {epoch} was kept")
        return found

    async def end_fit(self, reason: str) -> None:
        """Workers asking for another epoch are told the fit is over (``reason``)."""
        self._turns.end(reason)

    async def give_up(self, worker: int, reason: str) -> None:
        """Stop waiting for ``worker`` for the rest of the fit: its task will not come back
        (Dask gave it up), so the epoch's end does not wait for its stride."""
        await self.drop(worker, reason)
        self._members.set(worker, "absent")
        await self._check_epoch_end()

    async def claim(self, worker: int, epoch: int, wait: float = 2.0) -> list[int] | None:
        """The next run of the epoch's global batches for ``worker`` to train on, as
        ``[start, stop]`` (``[start, stop, piece]`` where a push covers ``piece`` batches of
        it: see :meth:`~dasktrain.trainer.modes.base.UpdateMode.claim_size`); ``[]`` if none
        is free within ``wait`` seconds although the epoch is not done (what others claimed
        may come back: ask again); None once every batch of ``epoch`` is done (or ``epoch``
        is over). See :mod:`.ledger`."""
        self._check_usable()
        self._members.check(worker)
        ledger = self._ledger
        if ledger is None:
            raise TrainerError("this holder assigns work statically: nothing to claim")
        self._members.heard(worker)  # waiting for work is not silence
        deadline = asyncio.get_running_loop().time() + wait
        while True:
            if epoch != ledger.epoch or ledger.finished:
                return None
            live = len(self._members.live())
            size, piece = self._mode.claim_size(worker)
            run = ledger.claim(worker, live, size, piece)
            if run is not None:
                self._claims.append((self._version, worker, run.start, run.stop))
                return [run.start, run.stop] if piece is None else \
                    [run.start, run.stop, piece]
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return []
            # No await since the claim above: a change cannot slip in before this waits.
            changed = asyncio.get_running_loop().create_future()
            self._work_waiters.append(changed)
            # This worker has nothing to push now: an update waiting for it need not.
            await self._mode.membership_changed()
            self._claims_waiting += 1
            try:
                await asyncio.wait([changed], timeout=left)
            finally:
                self._claims_waiting -= 1
            self._check_usable()
            self._members.heard(worker)

    async def join(self, worker: int, address: str | None, layout: FlatLayout,
                   epoch: int | None = None) -> dict[str, Any]:
        """A worker (re)starts: check its model, hand it the parameters and its position.
        A task of another ``epoch`` than the holder's steps aside (``{"surplus": True}``):
        the driver cancelled it, but a running task cannot be stopped from outside."""
        self._check_usable()
        self._members.check(worker)
        if epoch is not None and epoch != self._epoch:
            logger.info("holder: a task of worker %d for epoch %d joined in epoch %d: it "
                        "steps aside", worker, epoch, self._epoch)
            return {"surplus": True}
        if layout != self.model_layout:
            raise ValueError(f"worker {worker}'s model does not match the holder's "
                             f"({self.model_layout.describe_difference(layout)}): every "
                             "worker must build the same model")
        if self.config.elastic and self._ledger is not None:
            surplus = await self._surplus(worker, address)
            if surplus is not None:
                logger.info("holder: worker %d's task on %s is surplus: %s", worker, address,
                            surplus)
                return {"surplus": True}
        # A task that lasts the fit joins once: joining again, it is Dask's rerun of it.
        rerun = epoch is None and worker in self._turns.joined
        if epoch is None:
            self._turns.joined.add(worker)
        return {**await self._welcome(worker, address, rerun),
                "channel": None if self._worker is not None and address ==
                self._worker.address else await self._direct.contact(worker)}

    async def _welcome(self, worker: int, address: str | None, rerun: bool = False
                       ) -> dict[str, Any]:
        """Make ``worker`` active; its parameters, version and place in the epoch
        (``rerun``: it is a task of a worker that joined before, run again)."""
        before = self._members.set(worker, "active", address)
        if before == "absent" and not rerun:
            self.record_event(f"worker {worker} joined on {address}")
        if before in ("active", "lost") or rerun:
            self.record_event(f"worker {worker} rejoined on {address}")
            self._give_back(worker)  # its earlier task's claims: a rerun claims anew
        self._watchdog.ensure_running()
        self._mode.joined(worker)
        lease = await self.serially(self._reply, worker)
        try:
            params = lease.array.copy()  # goes out through the actor: its own copy
        finally:
            lease.release()
        recorded = self._members.position_in(worker, self._epoch)
        return {"params": params, "version": lease.version, "epoch": self._epoch,
                "lr_factor": self._arith.lr_factor, "world": self.workers,
                "position": self._mode.start_position(worker, recorded),
                "shares": self._balance.shares(self._epoch, self.workers)}

    async def epoch_shares(self, epoch: int, world: int) -> tuple[int, ...] | None:
        """The rows of each worker's batch in ``epoch`` (None: a batch each), for a worker
        about to compute ahead into it before it began; every worker is told the same.
        (Answered also once the fit ended: the answer to the worker's question for that
        epoch says so, and it stops there.)"""
        return self._balance.shares(epoch, world)

    async def _surplus(self, worker: int, address: str | None) -> str | None:
        """Why a task of ``worker`` joining from ``address`` has no place in an elastic run
        (Dask reran it after its worker left, or put it beside another replica), or None.
        """
        state = self._members.state(worker)
        if state == "done":
            return "this worker already finished or left this epoch"
        if state == "active" and self._members.address(worker) != address:
            return "another task of this worker is at work"
        other = self._members.sharing(worker, address)
        if other is None:
            return None
        # Its earlier task died or never came: the slot empties, its claims go back.
        self._members.set(worker, "absent")
        self._give_back(worker)
        self.record_event(f"worker {worker} left: its task was rerun on {address}, which "
                          f"worker {other} trains on already")
        await self._mode.membership_changed()
        return f"worker {other} trains on {address}"

    @property
    def channel_address(self) -> tuple[str, int] | None:
        """Where the direct channel listens for TCP connections; None before the first
        worker from another process joined, or without a channel."""
        return self._direct.address

    @property
    def _channel(self) -> Any:
        """The direct channel's server once open, else None (the channel's tests reach it
        here; the actor itself only asks :attr:`_direct` for contacts)."""
        return self._direct.server

    async def exchange_changed(self, worker: int, via: str, reason: str = "") -> None:
        """``worker``'s pushes go ``via`` ``"actor"`` from now on (its direct channel could
        not be reached: ``reason``), or ``"direct"`` again: an event of the History."""
        self._members.check(worker)
        if via == "actor":
            self.record_event(f"worker {worker} pushes through the actor: {reason}")
        elif via == "direct":
            self.record_event(f"worker {worker} is back on the direct channel")
        else:
            raise ValueError(f"via must be 'actor' or 'direct', got {via!r}")

    async def leave(self, worker: int, retired: bool = False,
                    report: dict[str, Any] | None = None) -> None:
        """A worker finished its part of the epoch (``retired``: its Dask worker is being
        retired, so it stopped early), with its ``report`` of it for the driver."""
        if report is not None:
            self._turns.report(worker, report)
        self._members.set(worker, "done")
        self._balance.forget(worker)
        if retired:
            self.record_event(f"worker {worker} left: its Dask worker is retiring")
        self._give_back(worker)
        await self._mode.left(worker)
        await self._check_epoch_end()

    def _waited_for(self) -> set[int]:
        """Workers something waits for, that the watchdog drops if they die or go silent:
        those a pending update waits for, and those holding claimed work while another
        waits for work (a dead one's claims then go back to the pool)."""
        waiting = self._mode.waiting_for()
        if self._claims_waiting and self._ledger is not None:
            waiting = waiting | (self._ledger.holders() & self._members.live())
        return waiting

    def _work_changed(self) -> None:
        """Wake the claims waiting for work: some came back, or the epoch is done."""
        waiters, self._work_waiters = self._work_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _give_back(self, worker: int) -> None:
        """Put what ``worker`` claimed and did not push back in the pool."""
        if self._ledger is None:
            return
        back = self._ledger.release(worker)
        if back:
            self.record_event(f"worker {worker}'s {back} claimed batch(es) went back to "
                              "the pool")
            self._work_changed()

    async def drop(self, worker: int, reason: str) -> None:
        """Stop waiting for ``worker`` (it rejoins with :meth:`join`); the watchdog and the
        driver call this."""
        if self._members.state(worker) in ("done", "lost"):
            return
        self._members.set(worker, "lost")
        self._balance.forget(worker)
        self.record_event(f"worker {worker} dropped: {reason}")
        self._give_back(worker)
        await self._mode.lost(worker)
        await self._check_epoch_end()

    async def notify(self, worker: int, notices: list[dict[str, str]]) -> None:
        """Warnings a worker saw (see :mod:`dasktrain.trainer.worker.notices`), for the driver."""
        self._members.check(worker)
        self._notices.extend({**n, "worker": worker} for n in notices)

    # -- the exchange ------------------------------------------------------------------
    async def exchange(self, worker: int, version: int, grads: np.ndarray | None,
                       count: int, loss: float, position: tuple[int, int]) -> Lease:
        """Hand in one push; returns the reply under a lease the caller releases once it
        has sent (or copied) it.

        ``grads`` is the payload computed at ``version`` (gradients then buffers, or
        parameters in averaging modes); None says "no batch this step" in lock-step
        modes. ``count`` is the batch size, the weight in an average.
        """
        self._check_usable()
        self._arriving.pop(worker, None)  # in, if it came over the channel
        self._members.check(worker)
        if grads is not None and (grads.dtype != np.float32
                                  or grads.shape != (self._payload_size,)):
            raise ValueError(
                f"worker {worker} pushed {grads.size} {grads.dtype} values; the holder "
                f"takes {self._payload_size} float32 ({self.layout.num_params} parameters "
                f"+ {self.layout.num_buffers} buffer values"
                f"{' + optimizer state' if self._payload_size > self.layout.size else ''})"
                ": the worker's model differs from the holder's")
        self._members.heard(worker)
        state = self._members.state(worker)
        if state != "active":
            self.record_event(f"worker {worker} came back (was {state})")
            self._members.set(worker, "active")
            self._mode.joined(worker)
        if self._arith.threaded:
            # Let an update in flight finish first: its version bump decides whether this
            # push is on time, and no push may slip in between its check and the bump.
            await self._arith.promptly(_nothing)
        contribution = Contribution(worker, version, grads, count, loss, tuple(position),
                                    clock=self._members.clocks[worker])
        loop = asyncio.get_running_loop()
        self._balance.pushed(worker, count if grads is not None else 0, loop.time())
        refusal = self._admit(contribution)
        if refusal is None:
            if self._arriving:
                # Once this push is in the round, which may then wait only for payloads
                # still arriving.
                loop.call_soon(self._begin_mean)
            await self._mode.push(contribution)
        else:
            # An event, not a dropped gradient: its batch counts once, by its first one.
            self.record_event(f"worker {worker}'s gradient refused: {refusal}")
        lease = await self._arith.promptly(self._reply, worker, True)
        self._balance.replied(worker, loop.time())
        return lease

    def _arriving_payload(self, worker: int, version: int, count: int, loss: float,
                          payload: np.ndarray, landing: Landing) -> None:
        """The channel's news that ``worker``'s push for ``version`` is arriving into
        ``payload`` (its push follows once it is in)."""
        self._arriving[worker] = Arrival(version, count, loss, payload, landing)
        self._begin_mean()

    def _begin_mean(self) -> None:
        """Begin the round's mean while its last payloads arrive, if it waits for nothing
        else (see :mod:`.early`)."""
        if self._closed or self._error is not None:
            return
        found = early_round(self._mode.round, self._mode.waiting_for(), self._arriving,
                            self._version)
        if found is not None:
            self._arith.begin_mean(*found)

    def _admit(self, contribution: Contribution) -> str | None:
        """Why a gradient of work claimed on demand is not taken (its batch was applied
        already, or is not the epoch's), or None."""
        ledger = self._ledger
        if ledger is None or contribution.grads is None:
            return None
        epoch, batch = contribution.position
        if epoch != ledger.epoch:
            return f"it is of epoch {epoch}, not {ledger.epoch}"
        return ledger.arrive(contribution.worker, batch)

    async def push(self, worker: int, version: int, grads: np.ndarray | None, count: int,
                   loss: float, position: tuple[int, int]) -> tuple[np.ndarray, int]:
        """:meth:`exchange` through the actor's calls: returns fresh parameters (a copy
        that the reply may send at leisure) and their version."""
        lease = await self.exchange(worker, version, grads, count, loss, position)
        try:
            return lease.array.copy(), lease.version
        finally:
            lease.release()

    def _reply(self, worker: int, pushed: bool = False) -> Lease:
        """The reply to ``worker``, leased; ``pushed``: to its push, which it waits for
        without reading its model."""
        custom = self._mode.reply(worker)
        self._mode.sent(worker)
        if custom is not None:
            return Lease(custom, self._version, None)
        if pushed:  # the worker waits for this reply: its model's region is free
            self._arith.adopt_for(worker)
        return self._arith.lease(self._version)

    async def set_lr_factor(self, factor: float) -> float:
        """Multiply the learning-rate schedule by ``factor`` from the next update on."""
        self._check_usable()
        await self.serially(setattr, self._arith, "lr_factor", float(factor))
        self.record_event(f"learning rate factor set to {factor:.4g}")
        return self._arith.lr_factor

    async def pull(self) -> tuple[np.ndarray, int]:
        """The current parameters (then buffers) and their version (a copy)."""
        return await self.serially(self._pull)

    def _pull(self) -> tuple[np.ndarray, int]:
        return self._arith.flat.numpy().copy(), self._version

    # -- updates (serial section) ------------------------------------------------------
    def _apply(self, contributions: list[Contribution], adjust: Adjust | None,
               advance: bool) -> None:
        for c in contributions:  # taken with the update: a checkpoint sees both or neither
            self.hold(c)
        with_batch = [c for c in contributions if c.grads is not None and c.count > 0]
        adjusted = adjust(with_batch) if adjust is not None and with_batch else None
        lr_scale = adjusted.lr_scale if adjusted is not None else 1.0
        used, grad, refusals = finite_mean(_items(with_batch, adjusted), self._arith.average,
                                           self._arith.all_finite)
        for contribution, reason in refusals:
            self.refused += 1
            self.record_event(f"{reason}, refused")
            self.drop_gradient(contribution, reason)
            # Updates are counted from 1 in messages: this would have been the next one.
            stop = self._guard.refused(reason, self._arith.updates + 1,
                                       self._arith.lr(lr_scale))
            if stop is not None:
                self._diverged = stop  # nothing of this round is applied
                return
        if grad is not None:
            self._arith.step(grad, lr_scale,
                             adjusted.first_moment if adjusted is not None else None)
        for contribution, _, _, extra in used:
            self._records.gradient(staleness=self._version - contribution.version,
                                   worker=contribution.worker, **extra)
        if used or advance:
            self._version += 1
        if used:
            self._record_update([c for c, *_ in used])

    def _set_state(self, contributions: list[Contribution], values: torch.Tensor | None
                   ) -> None:
        for c in contributions:
            self.hold(c)
        used = [c for c in contributions if c.count > 0]
        if values is None:
            self._version += 1
            return
        if not all_finite(values):
            reason = "the average of the workers' parameters is not finite"
            stop = self._guard.refused(reason, self._arith.updates + 1, self._arith.lr())
            self._diverged = stop or reason
            return
        self._arith.set_state(values)
        for c in used:
            self._records.gradient(staleness=self._version - c.version, worker=c.worker)
        self._version += 1
        if used:
            self._record_update(used)

    def _record_update(self, used: list[Contribution]) -> None:
        total = sum(c.count for c in used)
        loss = sum(c.loss * c.count for c in used) / total
        self._guard.applied(loss, self._arith.updates)
        self._records.update(version=self._version, loss=loss, samples=total,
                             contributors=len(used))

    async def _after_update(self) -> None:
        if self._diverged is not None:
            error = TrainingDiverged(self._diverged)
            self.record_event(self._diverged)
            await self._fail(error)
            raise error
        if self._state_waiters.due(self._version):
            await self._state_waiters.serve(self.state_dict)

    # -- liveness ----------------------------------------------------------------------
    async def _alive_addresses(self) -> set[str] | None:
        if self._worker is None:
            return None
        try:
            info = await asyncio.wait_for(self._worker.scheduler.identity(n_workers=-1), 10)
        except Exception:  # the scheduler is slow or away: check again next time
            return None
        return set(info.get("workers", {}))

    # -- reports, checkpoints, shutdown ------------------------------------------------
    async def progress(self) -> dict[str, Any]:
        """Counters for a progress display; ``records`` and ``events`` since the last call."""
        return await self.serially(self._progress)

    def _progress(self) -> dict[str, Any]:
        events, self._events = self._events, []
        notices, self._notices = self._notices, []
        return {"version": self._version, "updates": self._arith.updates,
                "early_means": self._arith.early_means,
                "epoch": self._epoch, "refused": self.refused,
                "clocks": list(self._members.clocks), "diverged": self._diverged,
                "members": self._members.states(),
                "addresses": self._members.addresses(),
                "waiting_for": sorted(self._mode.waiting_for()),
                "claims": self._take_claims(),
                "shares": {} if self._ledger is None else self._ledger.shares(),
                "work_left": None if self._ledger is None else self._ledger.remaining(),
                "records": self._records.take(), "events": events, "notices": notices}

    def _take_claims(self) -> list[tuple[int, int, int, int]]:
        claims, self._claims = self._claims, []
        return claims

    async def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue: parameters, optimizer state, version, clocks,
        every worker's position and the mode's state. Taken between two updates, so it is
        consistent."""
        return await self.serially(self._state_dict)

    def _state_dict(self) -> dict[str, Any]:
        return {
            **self._arith.state_dict(),
            **self._members.state_dict(),
            "version": self._version,
            "epoch": self._epoch,
            "epoch_start": self._epoch_start,
            "total_steps": self.config.total_steps,
            "refused": self.refused,
            "nonfinite": self._guard.state_dict(),
            "layout": self.layout.fingerprint,
            "mode": self.config.mode,
            "mode_state": self._mode.state_dict(),
            "work": None if self._ledger is None else self._ledger.state_dict(),
            "balance": self._balance.state_dict(),
        }

    async def state_at(self, version: int) -> dict[str, Any]:
        """A :meth:`state_dict` taken as soon as an update brings the holder to ``version``
        (or now, if it is there already): checkpoints at exact update counts, however
        seldom the caller looks."""
        self._check_usable()
        if self._version >= version:
            return await self.state_dict()
        return await self._state_waiters.wait(version)

    async def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict` of a holder of the same model and mode."""
        if self.config.shard is None:  # a shard gets its own part, from the driver
            shard_states(state, 1)
        if state["layout"] != self.layout.fingerprint:
            raise ValueError("the checkpoint is of another model (its parameter layout "
                             "differs from this model's)")
        if state["mode"] != self.config.mode:
            raise ValueError(f"the checkpoint was made in mode {state['mode']!r}, not "
                             f"{self.config.mode!r}")
        # Checks the number of workers first (any, where work is claimed on demand).
        self._members.load_state_dict(state, any_count=self._ledger is not None)
        await self.serially(self._load_state_dict, state)

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        self._arith.load_state_dict(state)
        self._version = int(state["version"])
        self._epoch, self._epoch_start = int(state["epoch"]), int(state["epoch_start"])
        self.refused = int(state["refused"])
        self._guard.load_state_dict(state.get("nonfinite", {}))
        self._mode.load_state_dict(state["mode_state"])
        self._balance.load_state_dict(state.get("balance"))
        if self._ledger is not None and state.get("work") is not None:
            self._ledger.load_state_dict(state["work"])

    async def abort(self, reason: str) -> None:
        """Fail every waiting and future call with ``reason`` (the run is over)."""
        await self._fail(TrainerError(reason))

    async def _fail(self, error: TrainerError) -> None:
        if self._error is None:
            self._error = error
            self._watchdog.stop()
            self._mode.abort(error)
            self._state_waiters.fail(error)
            self._turns.changed()

    async def close(self) -> None:
        """Stop the watchdog, the channel and the arithmetic thread."""
        self._closed = True
        closed = TrainerError("the parameter holder is closed")
        self._mode.abort(closed)
        self._state_waiters.fail(closed)
        self._turns.changed()
        self._watchdog.stop()
        await self._direct.close()
        self._arith.close()


def _items(contributions: list[Contribution], adjusted: Adjusted | None
           ) -> list[tuple[Contribution, np.ndarray, float, dict[str, Any]]]:
    """(contribution, payload, weight, record fields) of each contribution."""
    n = len(contributions)
    if adjusted is None:
        return [(c, c.grads, float(c.count), {}) for c in contributions]
    payloads = adjusted.payloads or [c.grads for c in contributions]
    weights = adjusted.weights or [float(c.count) for c in contributions]
    fields = adjusted.fields or [{} for _ in contributions]
    if not len(payloads) == len(weights) == len(fields) == n:
        raise ValueError("adjust must return one payload, weight and record per "
                         "contribution")
    return list(zip(contributions, payloads, weights, fields, strict=True))


def _nothing() -> None:
    """A no-op for the serial section: awaiting it waits for the work queued before."""
