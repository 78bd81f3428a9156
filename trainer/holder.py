"""The central parameter holder: a Dask actor that owns the master parameters.

It keeps the parameters as one flat float32 buffer (plus the model's floating-point buffers),
the optimizer and its state, a version counter, a clock per worker and each worker's place
in the epoch. Workers ``push`` gradients and get fresh parameters back; *when* a push is
applied is the update mode's business (:mod:`dasktrain.trainer.modes`).

Threading: every public method is ``async`` and runs on the holder worker's event loop, so
barriers are plain asyncio futures. The arithmetic of models over 1M values (4 MB) runs on
one private thread, in order, so the event loop (heartbeats, transfers) never waits on it;
that of smaller ones runs on the loop itself, where it takes less time (under 1 ms at 1 MB)
than the hand-off to a thread would add. Either way updates, snapshots and checkpoints run in
one place and never interleave.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import dataclasses
import logging
import math
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from distributed import get_worker

from dasktrain.trainer.channel import ChannelServer, channel_host
from dasktrain.trainer.divergence import NonFiniteGuard, check_policy
from dasktrain.trainer.errors import TrainerError, TrainingDiverged
from dasktrain.trainer.flat import FlatLayout, FlatModel
from dasktrain.trainer.modes import Contribution, get_mode, mode_class
from dasktrain.trainer.optim import OptimizerConfig

__all__ = ["HolderConfig", "ParameterHolder"]

logger = logging.getLogger(__name__)

ModelFactory = Callable[[], torch.nn.Module]
_INLINE_SIZE = 1 << 20  # payload elements up to which updates run on the event loop
# References to a spare snapshot buffer held by the holder itself (the list, the loop
# variable, getrefcount's argument): more means it is still being sent somewhere.
_SPARE_REFS = 3


@dataclasses.dataclass(kw_only=True, slots=True)
class HolderConfig:
    """How to build a holder."""

    model: ModelFactory
    """Called once on the holder's worker: its parameters are everyone's starting point."""
    optimizer: OptimizerConfig
    """The optimizer the holder runs."""
    workers: int
    """Trainer workers that push to this holder."""
    mode: str = "sync"
    """Update mode (see :data:`dasktrain.trainer.modes.MODES`)."""
    mode_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Options of the mode."""
    total_steps: int | None = None
    """Updates in the whole fit (for learning-rate schedules)."""
    barrier_timeout: float = 120.0
    """Seconds an update waits for a live worker before going on without it."""
    check_interval: float = 1.0
    """Seconds between liveness checks of the workers an update waits for."""
    torch_threads: int = 1
    """Intra-op threads of torch in the holder's process."""
    direct_channel: bool = True
    """Pushes from workers in other processes go over a direct TCP connection to the
    holder (see :mod:`dasktrain.trainer.channel`); False keeps them on the actor's calls."""
    on_nonfinite: str = "raise"
    """A non-finite gradient or loss stops the run (``"raise"``) or is refused and skipped
    (``"skip"``); see :mod:`dasktrain.trainer.divergence`."""
    nonfinite_patience: int = 10
    """With ``"skip"``: rounds (one gradient per worker) all refused in a row that still
    stop the run, since no update is possible any more."""

    def __post_init__(self) -> None:
        if not callable(self.model):
            raise TypeError("model must be a callable returning a torch.nn.Module")
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"workers must be a positive integer, got {self.workers!r}")
        mode_class(self.mode)  # unknown names fail here, before any cluster work
        if self.barrier_timeout <= 0 or self.check_interval <= 0:
            raise ValueError("barrier_timeout and check_interval must be positive")
        check_policy(self.on_nonfinite, self.nonfinite_patience)


@dataclasses.dataclass(slots=True)
class _Member:
    state: str = "expected"
    address: str | None = None
    waiting_since: float | None = None


def _all_finite(values: torch.Tensor) -> bool:
    # One reduction instead of an elementwise mask; a sum that overflows is re-checked.
    if math.isfinite(float(values.sum())):
        return True
    return bool(torch.isfinite(values).all())


def _tensor(array: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():
        # Received buffers may be read-only; they are only ever read here.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


class ParameterHolder:
    """The master copy of the parameters, updated by the workers' gradients.

    Create it as a Dask actor: ``client.submit(ParameterHolder, config, actor=True)``. Every
    method returns (on the caller's side) a future.
    """

    def __init__(self, config: HolderConfig) -> None:
        self.config = config
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
        self.layout: FlatLayout = flat.layout
        n = self.layout.num_params
        # One flat master buffer, parameters then buffers: in lock-step modes it is itself
        # the snapshot sent to the workers (no copy per update).
        self._flat = torch.from_numpy(flat.state())
        self._param = torch.nn.Parameter(self._flat[:n])
        self._buffers = self._flat[n:]
        self._average_buffer = torch.empty(self.layout.size, dtype=torch.float32)
        self._spare: list[np.ndarray] = []  # snapshot buffers of the other modes
        self._optimizer = config.optimizer.build([self._param],
                                                 segments=self.layout.param_segments())
        self.version = 0
        self.updates = 0
        self.epoch = 0
        self._epoch_start = 0
        self._members = {w: _Member() for w in range(config.workers)}
        self._positions: dict[int, tuple[int, int]] = {}
        self._clocks = [0] * config.workers
        self.refused = 0
        self._guard = NonFiniteGuard(config.on_nonfinite, config.nonfinite_patience,
                                     config.workers)
        self._diverged: str | None = None  # set by an update; the run is then aborted
        self._records: dict[str, list] = _empty_records()
        self._events: list[str] = []
        self._notices: list[dict[str, Any]] = []  # workers' warnings, for the driver
        self._mode = get_mode(config.mode, self, **config.mode_options)
        self._snapshot = self._make_snapshot()
        self._executor = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="dasktrain-holder")
        self._error: BaseException | None = None
        self._state_waiters: list[tuple[int, asyncio.Future]] = []
        self._watchdog: asyncio.Task | None = None
        self._channel: ChannelServer | None = None
        self._channel_failed = False
        self._closed = False

    # -- membership --------------------------------------------------------------------
    def expected_workers(self) -> set[int]:
        """Workers an update of a lock-step mode waits for."""
        return {w for w, m in self._members.items() if m.state in ("expected", "active")}

    def record_event(self, text: str) -> None:
        logger.info("holder: %s", text)
        self._events.append(f"v{self.version}: {text}")

    def _check_usable(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise TrainerError("the parameter holder is closed")

    def _member(self, worker: int) -> _Member:
        if worker not in self._members:
            raise ValueError(f"unknown worker {worker!r}: this holder serves workers "
                             f"0..{self.config.workers - 1}")
        return self._members[worker]

    def _position_of(self, worker: int) -> int:
        if self._mode.lockstep:
            return self.version - self._epoch_start
        epoch, position = self._positions.get(worker, (self.epoch, 0))
        return position if epoch == self.epoch else 0

    async def begin_epoch(self, epoch: int, fresh: bool = True) -> None:
        """Expect every worker for ``epoch`` (``fresh=False``: continue a resumed epoch)."""
        self._check_usable()
        if fresh:
            self.epoch, self._epoch_start = epoch, self.version
        for member in self._members.values():
            member.state, member.address, member.waiting_since = "expected", None, None

    async def join(self, worker: int, address: str | None, layout: FlatLayout
                   ) -> dict[str, Any]:
        """A worker (re)starts: check its model, hand it the parameters and its position."""
        self._check_usable()
        member = self._member(worker)
        if layout != self.layout:
            raise ValueError(f"worker {worker}'s model does not match the holder's "
                             f"({self.layout.describe_difference(layout)}): every worker "
                             "must build the same model")
        if member.state in ("active", "lost"):
            self.record_event(f"worker {worker} rejoined on {address}")
        member.state, member.address, member.waiting_since = "active", address, None
        self._ensure_watchdog()
        params, version = self._snapshot
        local = self._worker is not None and address == self._worker.address
        return {"params": params, "version": version, "epoch": self.epoch,
                "position": self._position_of(worker),
                "channel": None if local else await self._channel_contact(worker)}

    async def _channel_contact(self, worker: int) -> dict[str, Any] | None:
        """Where ``worker`` connects for pushes, with its own token (None: use the actor);
        the listener opens on first use."""
        if not self.config.direct_channel or self._worker is None or self._channel_failed:
            return None
        if self._channel is None:
            host = channel_host(self._worker.address)
            if host is None:
                return None
            channel = ChannelServer(self.push, self.layout.size)
            try:
                await channel.start(host)
            except OSError as exc:
                logger.warning("holder: no direct channel on %s (%s); pushes go through "
                               "the actor", host, exc)
                self._channel_failed = True
                return None
            self._channel = channel
        return self._channel.contact(worker)

    async def leave(self, worker: int) -> None:
        """A worker finished its part of the epoch."""
        self._member(worker).state = "done"
        await self._mode.membership_changed()

    async def drop(self, worker: int, reason: str) -> None:
        """Stop waiting for ``worker`` (it rejoins with :meth:`join`)."""
        member = self._member(worker)
        if member.state in ("done", "lost"):
            return
        member.state = "lost"
        self.record_event(f"worker {worker} dropped: {reason}")
        await self._mode.membership_changed()

    async def notify(self, worker: int, notices: list[dict[str, str]]) -> None:
        """Warnings a worker saw (see :mod:`dasktrain.trainer.notices`), for the driver."""
        self._member(worker)
        self._notices.extend({**n, "worker": worker} for n in notices)

    # -- the exchange ------------------------------------------------------------------
    async def push(self, worker: int, version: int, grads: np.ndarray | None, count: int,
                   loss: float, position: tuple[int, int]) -> tuple[np.ndarray, int]:
        """Hand in the gradient of one batch; returns fresh parameters and their version.

        ``grads`` is the payload (gradients, then buffers) computed at ``version``; None
        says "no batch this step" in lock-step modes. ``count`` is the batch size, the
        gradient's weight in an average.
        """
        self._check_usable()
        member = self._member(worker)
        if grads is not None and (grads.dtype != np.float32
                                  or grads.shape != (self.layout.size,)):
            raise ValueError(
                f"worker {worker} pushed {grads.size} {grads.dtype} values; the holder's "
                f"model takes {self.layout.size} float32 ({self.layout.num_params} "
                f"parameters + {self.layout.num_buffers} buffer values): the worker's "
                "model differs from the holder's")
        if member.state != "active":
            self.record_event(f"worker {worker} came back (was {member.state})")
            member.state = "active"
        await self._mode.push(Contribution(worker, version, grads, count, loss,
                                           tuple(position)))
        return self._snapshot

    async def pull(self) -> tuple[np.ndarray, int]:
        """The current parameters (then buffers) and their version (a copy)."""
        params, version = self._snapshot
        return params.copy(), version

    async def apply(self, contributions: list[Contribution]) -> None:
        """Apply the (weighted) average of ``contributions`` as one optimizer step."""
        await self._serially(self._apply, contributions)
        if self._diverged is not None:
            error = TrainingDiverged(self._diverged)
            self.record_event(self._diverged)
            await self._fail(error)
            raise error
        if self._state_waiters and self.version >= min(v for v, _ in self._state_waiters):
            await self._serve_state_waiters()

    async def _serve_state_waiters(self) -> None:
        # Taken before the (possibly threaded) copy, so that an update finishing meanwhile
        # does not copy the state a second time for the same requests.
        waiting, self._state_waiters = self._state_waiters, []
        state = await self.state_dict()
        for version, future in waiting:
            if future.done():
                continue
            if state["version"] >= version:
                future.set_result(state)
            else:
                self._state_waiters.append((version, future))

    async def _serially(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn`` in order with every other update, snapshot and restore.

        Small models run on the event loop (the arithmetic takes less than a thread
        hand-off would), large ones on the one private thread; either way one place, so a
        state_dict never reads parameters half-way through a step."""
        if self.layout.size <= _INLINE_SIZE:
            return fn(*args)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, fn, *args)

    def _apply(self, contributions: list[Contribution]) -> None:
        # Worker order, not arrival order: the same sums on every run.
        contributions = sorted(contributions, key=lambda c: c.worker)
        used = [c for c in contributions if c.grads is not None and c.count > 0]
        refusals = [f"worker {c.worker}: non-finite batch loss ({c.loss})" for c in used
                    if not math.isfinite(c.loss)]
        used = [c for c in used if math.isfinite(c.loss)]
        grad = self._average(used)
        if grad is not None and not _all_finite(grad):
            # Rare: find the culprits (one check each) and average the rest.
            checked = [(c, _all_finite(_tensor(c.grads))) for c in used]
            refusals += [f"worker {c.worker}: non-finite gradient"
                         for c, finite in checked if not finite]
            used = [c for c, finite in checked if finite]
            grad = self._average(used, overflow_safe=True)
            if grad is not None and not _all_finite(grad):
                # Finite payloads whose mean is not (values at the float32 limit).
                refusals += [f"worker {c.worker}: gradient whose average with the "
                             "others overflows float32" for c in used]
                used, grad = [], None
        for reason in refusals:
            self.refused += 1
            self.record_event(f"{reason}, refused")
            # Updates are counted from 1 in messages: this would have been the next one.
            stop = self._guard.refused(reason, self.updates + 1,
                                       self.config.optimizer.lr_at(self.updates,
                                                                   self.config.total_steps))
            if stop is not None:
                self._diverged = stop  # nothing of this round is applied
                return
        total = sum(c.count for c in used)
        if grad is not None:
            self._step(grad)
        records = self._records
        for c in used:
            records["staleness"].append(self.version - c.version)
            records["staleness_worker"].append(c.worker)
        for c in contributions:
            self._clocks[c.worker] += 1
            self._positions[c.worker] = c.position
        if used or self._mode.lockstep:
            self.version += 1
            self._snapshot = self._make_snapshot()
        if used:
            loss = sum(c.loss * c.count for c in used) / total
            self._guard.applied(loss, self.updates)
            records["version"].append(self.version)
            records["time"].append(time.time())
            records["loss"].append(loss)
            records["samples"].append(total)
            records["contributors"].append(len(used))

    def _average(self, used: list[Contribution], overflow_safe: bool = False
                 ) -> torch.Tensor | None:
        """Batch-size-weighted mean of the payloads (gradients, then buffers).

        ``overflow_safe``: as a weighted sum, which stays finite for finite payloads (the
        running mean takes differences, which overflow near the float32 limit)."""
        if not used:
            return None
        if len(used) == 1:
            return _tensor(used[0].grads)
        if overflow_safe:
            total = sum(c.count for c in used)
            out = self._average_buffer
            torch.mul(_tensor(used[0].grads), used[0].count / total, out=out)
            for c in used[1:]:
                out.add_(_tensor(c.grads), alpha=c.count / total)
            return out
        # A running weighted mean, one pass per further payload: after each step ``out``
        # is the mean of the payloads so far (lerp: out + w * (g - out)).
        out = self._average_buffer
        first, second = used[0], used[1]
        seen = first.count + second.count
        torch.lerp(_tensor(first.grads), _tensor(second.grads), second.count / seen, out=out)
        for c in used[2:]:
            seen += c.count
            out.lerp_(_tensor(c.grads), c.count / seen)
        return out

    def _step(self, average: torch.Tensor) -> None:
        n = self.layout.num_params
        self._param.grad = average[:n]
        lr = self.config.optimizer.lr_at(self.updates, self.config.total_steps)
        for group in self._optimizer.param_groups:
            group["lr"] = lr
        self._optimizer.step()
        self._param.grad = None
        self.updates += 1
        if self.layout.num_buffers:
            # Buffers (batch-norm statistics...) are averaged like the gradients.
            self._buffers.copy_(average[n:])

    def _make_snapshot(self) -> tuple[np.ndarray, int]:
        if self._mode.lockstep:
            # Safe without a copy: every worker has loaded (or received) this snapshot
            # before it can push for the next version, and pull() copies.
            return self._flat.numpy(), self.version
        # Other modes update while earlier snapshots may still be on their way: take a
        # buffer no one else holds any more (fresh allocations cost page faults).
        for array in self._spare:
            if sys.getrefcount(array) <= _SPARE_REFS:
                break
        else:
            array = np.empty(self.layout.size, dtype=np.float32)
            self._spare = [array, *self._spare[:3]]
        np.copyto(array, self._flat.numpy())
        return array, self.version

    # -- liveness ----------------------------------------------------------------------
    def _ensure_watchdog(self) -> None:
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        """Drop workers an update waits for whose process died or that stay silent for
        ``barrier_timeout``: a barrier never waits on the dead."""
        while not self._closed and self._error is None:
            await asyncio.sleep(self.config.check_interval)
            waiting = self._mode.waiting_for()
            now = time.monotonic()
            for w, member in self._members.items():
                if w not in waiting:
                    member.waiting_since = None
                elif member.waiting_since is None:
                    member.waiting_since = now
            if not waiting:
                continue
            alive = await self._alive_addresses()
            for w in sorted(waiting):
                member = self._members[w]
                if alive is not None and member.address is not None \
                        and member.address not in alive:
                    await self.drop(w, f"its Dask worker {member.address} is gone")
                elif now - (member.waiting_since or now) > self.config.barrier_timeout:
                    await self.drop(w, f"nothing for {self.config.barrier_timeout:.0f}s")

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
        return await self._serially(self._progress)

    def _progress(self) -> dict[str, Any]:
        records, self._records = self._records, _empty_records()
        events, self._events = self._events, []
        notices, self._notices = self._notices, []
        return {"version": self.version, "updates": self.updates, "epoch": self.epoch,
                "refused": self.refused, "clocks": list(self._clocks),
                "diverged": self._diverged,
                "members": {w: m.state for w, m in self._members.items()},
                "waiting_for": sorted(self._mode.waiting_for()),
                "records": records, "events": events, "notices": notices}

    async def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue: parameters, optimizer state, version, clocks and
        every worker's position. Taken between two updates, so it is consistent."""
        return await self._serially(self._state_dict)

    def _state_dict(self) -> dict[str, Any]:
        return {
            "params": self._param.detach().clone(),
            "buffers": self._buffers.clone(),
            "optimizer": copy.deepcopy(self._optimizer.state_dict()),
            "version": self.version,
            "updates": self.updates,
            "epoch": self.epoch,
            "epoch_start": self._epoch_start,
            "clocks": list(self._clocks),
            "positions": {w: list(p) for w, p in self._positions.items()},
            "refused": self.refused,
            "nonfinite": self._guard.state_dict(),
            "layout": self.layout.fingerprint,
            "mode": self.config.mode,
            "mode_state": self._mode.state_dict(),
        }

    async def state_at(self, version: int) -> dict[str, Any]:
        """A :meth:`state_dict` taken as soon as an update brings the holder to ``version``
        (or now, if it is there already): checkpoints at exact update counts, however
        seldom the caller looks."""
        self._check_usable()
        if self.version >= version:
            return await self.state_dict()
        future = asyncio.get_running_loop().create_future()
        self._state_waiters.append((version, future))
        return await future

    def _fail_state_waiters(self, error: BaseException) -> None:
        waiting, self._state_waiters = self._state_waiters, []
        for _, future in waiting:
            if not future.done():
                future.set_exception(error)

    async def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict` of a holder of the same model and mode."""
        if state["layout"] != self.layout.fingerprint:
            raise ValueError("the checkpoint is of another model (its parameter layout "
                             "differs from this model's)")
        if state["mode"] != self.config.mode:
            raise ValueError(f"the checkpoint was made in mode {state['mode']!r}, not "
                             f"{self.config.mode!r}")
        if len(state["clocks"]) != self.config.workers:
            raise ValueError(f"the checkpoint has {len(state['clocks'])} workers, this run "
                             f"{self.config.workers}")
        await self._serially(self._load_state_dict, state)

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            self._flat[: self.layout.num_params].copy_(state["params"])
            self._buffers.copy_(state["buffers"])
        self._optimizer.load_state_dict(state["optimizer"])
        self.version, self.updates = int(state["version"]), int(state["updates"])
        self.epoch, self._epoch_start = int(state["epoch"]), int(state["epoch_start"])
        self._clocks = [int(c) for c in state["clocks"]]
        self._positions = {int(w): (int(p[0]), int(p[1]))
                           for w, p in state["positions"].items()}
        self.refused = int(state["refused"])
        self._guard.load_state_dict(state.get("nonfinite", {}))
        self._mode.load_state_dict(state["mode_state"])
        self._snapshot = self._make_snapshot()

    async def abort(self, reason: str) -> None:
        """Fail every waiting and future call with ``reason`` (the run is over)."""
        await self._fail(TrainerError(reason))

    async def _fail(self, error: TrainerError) -> None:
        if self._error is None:
            self._error = error
            self._mode.abort(error)
            self._fail_state_waiters(error)

    async def close(self) -> None:
        """Stop the watchdog and the arithmetic thread."""
        self._closed = True
        closed = TrainerError("the parameter holder is closed")
        self._mode.abort(closed)
        self._fail_state_waiters(closed)
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._channel is not None:
            await self._channel.close()
        self._executor.shutdown(wait=False)


def _empty_records() -> dict[str, list]:
    return {"version": [], "time": [], "loss": [], "samples": [], "contributors": [],
            "staleness": [], "staleness_worker": []}
