"""The versioned state an update mode sees: the parameters, their version, what each update
applied, and the bookkeeping that must move with it in the serial section.

This is the *host* of :mod:`dasktrain.trainer.modes.base`: a mode calls ``apply``,
``set_state``, ``hold``, ``drop_gradient`` and ``give_back`` and reads the version, the
epoch and the workers through it, and never touches the holder's wire, roster or epoch
machine. Every rule that ties an update to the work it took is kept here, once:

* a contribution is counted (its worker's clock and place, its batch done in the ledger)
  in the serial section, with the update that applies it or the mode's decision to keep or
  drop it: a checkpoint sees both or neither;
* a contribution of claimed work that a mode does not take (``average``: parameters that
  fell behind the rounds) goes back to the pool, never counted as done;
* non-finite gradients are refused (:mod:`.divergence`), and the version moves on only
  with an update (or a lock-step round that had nothing to apply).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import torch

from dasktrain.trainer.flat import FlatLayout, FlatModel
from dasktrain.trainer.holder.arithmetic import Arithmetic
from dasktrain.trainer.holder.balance import Balance
from dasktrain.trainer.holder.config import HolderConfig
from dasktrain.trainer.holder.divergence import NonFiniteGuard, all_finite, finite_mean
from dasktrain.trainer.holder.epochs import EpochMachine
from dasktrain.trainer.holder.records import Records
from dasktrain.trainer.holder.roster import Roster
from dasktrain.trainer.holder.shards import shard_layouts, shard_states
from dasktrain.trainer.modes import Contribution
from dasktrain.trainer.modes.base import Adjust, Adjusted, UpdateMode

__all__ = ["ModeHost", "initial_state"]

logger = logging.getLogger(__name__)


class ModeHost:
    """The holder as its update mode sees it (the ``Host`` of
    :mod:`dasktrain.trainer.modes.base`).

    ``work_changed()`` wakes the claims waiting for work (from any thread);
    ``after_update()`` runs on the event loop after each update (divergence, checkpoints
    awaited at a version).
    """

    def __init__(self, config: HolderConfig, layout: FlatLayout, arith: Arithmetic,
                 roster: Roster, epochs: EpochMachine, records: Records, balance: Balance, *,
                 work_changed: Callable[[], None],
                 after_update: Callable[[], Awaitable[None]]) -> None:
        self.config = config
        self.workers = config.workers
        self.batch_size = config.batch_size  # the modes' reference batch
        self.layout = layout
        self.optimizer = config.optimizer
        self.arith = arith
        self.roster = roster
        self.epochs = epochs
        self.records = records
        self.balance = balance
        self.guard = NonFiniteGuard(config.on_nonfinite, config.nonfinite_patience,
                                    config.workers)
        self.version = 0
        self.refused = 0
        self.diverged: str | None = None  # set by an update; the run is then aborted
        self.events: list[str] = []
        self.loop: asyncio.AbstractEventLoop | None = None  # the holder's, once it serves
        self.mode: UpdateMode | None = None  # told what each update took (see .taken)
        self._work_changed = work_changed
        self._after_update = after_update

    # -- what a mode reads ---------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self.epochs.epoch

    @property
    def epoch_start(self) -> int:
        """The version at which the current epoch began."""
        return self.epochs.start_version

    @property
    def updates(self) -> int:
        """Optimizer steps taken (the schedule's step)."""
        return self.arith.updates

    @property
    def clocks(self) -> Sequence[int]:
        """Contributions taken from each worker in the whole run."""
        return tuple(self.roster.clocks)

    @property
    def parameters(self) -> torch.Tensor:
        """The current parameters (a view; read it in the serial section)."""
        return self.arith.parameters

    @property
    def values(self) -> torch.Tensor:
        """The current parameters then buffers (a view; read it in the serial section)."""
        return self.arith.flat

    @property
    def claims_work(self) -> bool:
        """Whether workers claim their batches as they go (``assignment="dynamic"``)."""
        return self.roster.ledger is not None

    def batches_taken(self, worker: int) -> int:
        """Batches of the current epoch taken from ``worker`` so far."""
        ledger = self.roster.ledger
        if ledger is not None:  # positions are batch indices there, not counts
            return ledger.taken_by(worker)
        return self.roster.position_in(worker, self.epoch)

    def live_workers(self) -> set[int]:
        """Workers still to push this epoch: not finished, not lost, and, where work is
        claimed on demand, holding work or able to claim some (an update must not wait for
        a worker that has nothing left to push)."""
        live = self.roster.live()
        ledger = self.roster.ledger
        if ledger is None:
            return live
        return {w for w in live if not ledger.idle(w)}

    def record_event(self, text: str) -> None:
        logger.info("holder: %s", text)
        self.events.append(f"v{self.version}: {text}")

    async def serially(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` in order with every update, snapshot and restore."""
        return await self.arith.serially(fn, *args)

    # -- what a mode does ----------------------------------------------------------------
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
        if contribution.held:
            return
        contribution.held = True
        self.roster.counted(contribution.worker, contribution.position)
        ledger = self.roster.ledger
        if ledger is not None and contribution.grads is not None \
                and contribution.position[0] == ledger.epoch:
            ledger.taken(contribution.worker, contribution.position[1])
            if ledger.finished and self.loop is not None:
                # Maybe on the update thread: claims waiting learn the epoch is done.
                self.loop.call_soon_threadsafe(self._work_changed)

    def drop_gradient(self, contribution: Contribution, reason: str, **fields: Any) -> None:
        """Record ``contribution`` as received and not applied (``reason`` is logged)."""
        logger.debug("holder: worker %d's gradient dropped: %s", contribution.worker, reason)
        self.hold(contribution)
        self.records.gradient(staleness=self.version - contribution.version,
                              worker=contribution.worker, dropped=True, **fields)

    def give_back(self, contribution: Contribution, reason: str) -> None:
        """Take nothing of ``contribution`` (claimed work): its batches go back to the pool,
        to be trained again, and are not counted as done (``reason`` is an event)."""
        ledger = self.roster.ledger
        assert ledger is not None, "only claimed work goes back to the pool"
        back = ledger.refund(contribution.worker, contribution.position[1])
        self.record_event(f"worker {contribution.worker}'s push of {back} batch(es) went "
                          f"back to the pool: {reason}")
        self._work_changed()

    # -- updates (serial section) --------------------------------------------------------
    def _apply(self, contributions: list[Contribution], adjust: Adjust | None,
               advance: bool) -> None:
        for c in contributions:  # taken with the update: a checkpoint sees both or neither
            self.hold(c)
        if self.mode is not None:
            self.mode.taken(contributions)
        with_batch = [c for c in contributions if c.grads is not None and c.count > 0]
        adjusted = adjust(with_batch) if adjust is not None and with_batch else None
        lr_scale = adjusted.lr_scale if adjusted is not None else 1.0
        used, grad, refusals = finite_mean(_items(with_batch, adjusted), self.arith.average,
                                           self.arith.all_finite)
        for contribution, reason in refusals:
            self.refused += 1
            self.record_event(f"{reason}, refused")
            self.drop_gradient(contribution, reason)
            # Updates are counted from 1 in messages: this would have been the next one.
            stop = self.guard.refused(reason, self.arith.updates + 1, self.arith.lr(lr_scale))
            if stop is not None:
                self.diverged = stop  # nothing of this round is applied
                return
        if grad is not None:
            self.arith.step(grad, lr_scale,
                            adjusted.first_moment if adjusted is not None else None)
        for contribution, _, _, extra in used:
            self.records.gradient(staleness=self.version - contribution.version,
                                  worker=contribution.worker, **extra)
        if used or advance:
            self.version += 1
        if used:
            self._record_update([c for c, *_ in used])

    def _set_state(self, contributions: list[Contribution], values: torch.Tensor | None
                   ) -> None:
        for c in contributions:
            self.hold(c)
        if self.mode is not None:
            self.mode.taken(contributions)
        used = [c for c in contributions if c.count > 0]
        if values is None:
            self.version += 1
            return
        if not all_finite(values):
            reason = "the average of the workers' parameters is not finite"
            stop = self.guard.refused(reason, self.arith.updates + 1, self.arith.lr())
            self.diverged = stop or reason
            return
        self.arith.set_state(values)
        for c in used:
            self.records.gradient(staleness=self.version - c.version, worker=c.worker)
        self.version += 1
        if used:
            self._record_update(used)

    def _record_update(self, used: list[Contribution]) -> None:
        total = sum(c.count for c in used)
        loss = sum(c.loss * c.count for c in used) / total
        self.guard.applied(loss, self.arith.updates)
        self.epochs.applied_samples += total
        self.epochs.applied_loss += loss * total
        self.records.update(version=self.version, loss=loss, samples=total,
                            contributors=len(used))

    # -- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The versioned state (serial section): the arithmetic's, the version and epoch,
        the workers' clocks and places, the refusals, the mode's state and the work done."""
        assert self.mode is not None
        ledger = self.roster.ledger
        return {**self.arith.state_dict(), **self.roster.state_dict(),
                "version": self.version, "epoch": self.epochs.epoch,
                "epoch_start": self.epochs.start_version,
                "refused": self.refused, "nonfinite": self.guard.state_dict(),
                "total_steps": self.config.total_steps, "layout": self.layout.fingerprint,
                "mode": self.config.mode, "mode_state": self.mode.state_dict(),
                "work": None if ledger is None else ledger.state_dict(),
                "balance": self.balance.state_dict()}

    def progress(self, **extra: Any) -> dict[str, Any]:
        """Counters for the driver (serial section); ``records`` and ``events`` since the
        last call, and ``extra``."""
        roster, ledger, epochs = self.roster, self.roster.ledger, self.epochs
        assert self.mode is not None
        events, self.events = self.events, []
        return {"version": self.version, "updates": self.arith.updates,
                "early_means": self.arith.early_means, "epoch": epochs.epoch,
                "epoch_state": "short" if epochs.short_of_workers else epochs.state,
                "refused": self.refused, "fenced": roster.fenced,
                "clocks": list(roster.clocks), "diverged": self.diverged,
                "members": roster.states(), "addresses": roster.addresses(),
                "waiting_for": sorted(self.mode.waiting_for()),
                "shares": {} if ledger is None else ledger.shares(),
                "work_left": None if ledger is None else ledger.remaining(),
                "records": self.records.take(), "events": events, **extra}

    def boundary_values(self) -> dict[str, Any]:
        """The parameters and buffers now (serial section): an epoch's end, for the
        driver."""
        return {"params": self.arith.parameters.clone(), "buffers": self.arith.buffers.clone(),
                "version": self.version, "epoch": self.epochs.epoch}

    def check_state(self, state: dict[str, Any]) -> None:
        """Refuse a :meth:`state_dict` of another model or mode, or of another number of
        workers where that matters; the roster takes the workers' clocks and places."""
        if self.config.shard is None:  # a shard gets its own part, from the driver
            shard_states(state, 1)
        if state["layout"] != self.layout.fingerprint:
            raise ValueError("the checkpoint is of another model (its parameter layout "
                             "differs from this model's)")
        if state["mode"] != self.config.mode:
            raise ValueError(f"the checkpoint was made in mode {state['mode']!r}, not "
                             f"{self.config.mode!r}")
        # Any number of workers where work is claimed on demand, or the world follows the
        # cluster.
        self.roster.load_state_dict(state, any_count=self.roster.ledger is not None
                                    or self.config.elastic)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert self.mode is not None
        self.arith.load_state_dict(state)
        self.version = int(state["version"])
        self.epochs.epoch = int(state["epoch"])
        self.epochs.start_version = int(state["epoch_start"])
        self.refused = int(state["refused"])
        self.guard.load_state_dict(state.get("nonfinite", {}))
        self.mode.load_state_dict(state["mode_state"])
        ledger = self.roster.ledger
        if ledger is not None and state.get("work") is not None:
            ledger.load_state_dict(state["work"])
        self.balance.load_state_dict(state.get("balance"))


def initial_state(config: HolderConfig) -> tuple[FlatLayout, FlatLayout, np.ndarray]:
    """The model's layout, the layout of what a holder of ``config`` keeps (the whole
    model's, or a shard's slice of it) and its initial values: from one call of the model
    factory, on the holder's worker."""
    model = config.model()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"the model factory returned {type(model).__name__}, not a "
                        "torch.nn.Module")
    flat = FlatModel(model)
    state = flat.state()
    if config.shard is None:
        return flat.layout, flat.layout, state
    (start, stop), layout = shard_layouts(flat.layout, config.shard[1])[config.shard[0]]
    return flat.layout, layout, state[start:stop]


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
