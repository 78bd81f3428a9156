"""The trainer worker: one model replica running as a long-lived Dask task.

Per epoch, each worker task secedes from its worker's thread pool (so the pipeline's tasks
can use that thread), builds the model, takes its starting parameters and position from the
holder, then loops: batch -> forward/backward -> the mode's step (:mod:`.steps`: push the
gradient, or take a local step) -> load the parameters the holder sends back. While a push
is on its way the next batch is already taken from the pipeline (whose prefetch runs on the
cluster), so communication overlaps data work.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pickle
import threading
import time
import traceback
from collections.abc import Callable, Generator, Hashable, Iterator
from typing import Any

import torch
from distributed import get_client, get_worker, secede

from dasktrain._malloc import tune_allocator
from dasktrain.datasets import Dataset
from dasktrain.pipeline import Pipeline
from dasktrain.pipeline.plan import run_pieces
from dasktrain.trainer.exchange.buckets import GradientReadiness
from dasktrain.trainer.exchange.client import OutgoingPush
from dasktrain.trainer.exchange.handle import HolderHandle
from dasktrain.trainer.exchange.sharded import ShardedHandle, open_handle
from dasktrain.trainer.flat import FlatModel
from dasktrain.trainer.modes import mode_class, worker_step_class
from dasktrain.trainer.worker import kept
from dasktrain.trainer.worker.compute import BatchCompute, LossScale, MetricTotals, batch_size_of
from dasktrain.trainer.worker.notices import (
    capture_warnings,
    shape_notice,
    taken_warnings,
    watch_this_thread,
)
from dasktrain.trainer.worker.retire import retiring, training
from dasktrain.trainer.worker.steps import StepContext, WorkerStep

__all__ = ["WorkerConfig", "WorkerFailure", "pick_device", "run_worker"]

LossFunction = Callable[[Any, Any], torch.Tensor]

#: Runs of batches a worker holds claimed beyond the one it trains on (its prefetch).
CLAIMS_AHEAD = 2


@dataclasses.dataclass(kw_only=True, slots=True)
class WorkerConfig:
    """What every trainer worker needs; sent once per worker task."""

    model: Callable[[], torch.nn.Module]
    compute: BatchCompute  # forward, loss and metrics of a batch, and its precision
    data: Dataset
    workers: int
    batch_size: int
    pipeline_options: dict[str, Any]
    mode: str = "sync"
    mode_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    optimizer: Any = None  # OptimizerConfig, for modes whose workers step locally
    epoch_steps: tuple[int, ...] = ()  # lock-step steps of each epoch of the fit
    device: str | None = None
    torch_threads: int = 1
    timeout: float = 300.0
    clip: tuple[float | None, float | None] = (None, None)  # for modes stepping locally
    assignment: str = "static"  # or "dynamic": batches claimed from the holder on demand


def pick_device(requested: str | None) -> torch.device:
    """``requested``, else CUDA when this process sees a GPU, else CPU."""
    if requested is not None:
        return torch.device(requested)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerFailure:
    """Why a trainer worker's task stopped: what it raised, and where (the worker's
    traceback, as text)."""

    error: BaseException
    traceback: str

    @classmethod
    def of(cls, error: BaseException) -> WorkerFailure:
        where = "".join(traceback.format_exception(error))
        try:
            pickle.dumps(error)
        except Exception:  # it must travel to the driver: its type and message do
            error = RuntimeError(f"{type(error).__name__}: {error}")
        return cls(error, where)


def run_worker(config: WorkerConfig, holder: Any, worker: int, epoch: int,
               world: int | None = None) -> dict[str, Any]:
    """Train ``worker``'s share of ``epoch`` (of ``world`` workers' strides, by default
    ``config.workers``, where work is not claimed); returns its counters, or
    ``{"worker": worker, "failed": WorkerFailure}`` if it could not, or
    ``{"worker": worker, "surplus": True}`` if the holder had no place for it.

    A failure is returned, not raised: Dask logs every task that raises on its worker
    ("Compute Failed" and the task's traceback, on the user's terminal for a local
    cluster), while the one error to read is the driver's, which raises it
    (:meth:`FitRun._collect`).
    """
    try:
        return _run_worker(config, holder, worker, epoch, world or config.workers)
    except Exception as exc:
        return {"worker": worker, "failed": WorkerFailure.of(exc)}


def _run_worker(config: WorkerConfig, holder: Any, worker: int, epoch: int, world: int
                ) -> dict[str, Any]:
    secede()  # free the thread for pipeline tasks; this task is not stolen once running
    tune_allocator()
    started = time.perf_counter()
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    device = pick_device(config.device)
    flat = FlatModel(config.model(), device)
    handle = open_handle(holder, config.timeout)  # one actor, or a list of shards
    try:
        address = get_worker().address
    except ValueError:
        address = None
    capture_warnings()
    watch_this_thread()
    try:
        with training():  # a closing worker waits for this to leave (see .retire)
            return _train(config, handle, flat, device, worker, address, epoch, world,
                          started, kept.fit_key(holder))
    finally:
        taken_warnings(stop=True)
        handle.close()


def _step_for(config: WorkerConfig, flat: FlatModel, epoch: int) -> WorkerStep:
    """The mode's worker step (see :mod:`dasktrain.trainer.worker.steps`)."""
    context = StepContext(config.optimizer, dict(config.mode_options),
                          step_offset=sum(config.epoch_steps[:epoch]),
                          total_steps=sum(config.epoch_steps), clip=config.clip,
                          claimed=config.assignment == "dynamic")
    return worker_step_class(config.mode)(flat, context)


Handle = HolderHandle | ShardedHandle


def _train(config: WorkerConfig, handle: Handle, flat: FlatModel, device: torch.device,
           worker: int, address: str | None, epoch: int, world: int, started: float,
           fit: Hashable) -> dict[str, Any]:
    strategy = _step_for(config, flat, epoch)
    info = handle.join(worker, address, flat.layout, into=strategy.receive_buffer(),
                       epoch=epoch)
    if info.get("surplus"):
        return {"worker": worker, "epoch": epoch, "surplus": True}
    handle.share(strategy.adopt)  # on the holder's host: pushes then copy nothing
    strategy.lr_factor = float(info.get("lr_factor", 1.0))
    strategy.start(info["params"])
    version = int(info["version"])
    claimed = config.assignment == "dynamic"
    rank = min(worker, world - 1)
    # A static rank's pipeline lives on in this process between the fit's epoch tasks
    # (see .kept), with a head start into the next epoch unless this is the last one.
    following = not claimed and epoch + 1 < len(config.epoch_steps)
    pipe = None if claimed else kept.take(fit, rank, world)
    if pipe is None:
        pipe = Pipeline(config.data, config.batch_size, rank=rank, world_size=world,
                        device=device, client=get_client(), **config.pipeline_options)
    pipe.prefetch_next_epoch = following
    pipe.set_epoch(epoch)
    run_ends: set[int] = set()  # the last batch of each run claimed
    if claimed:
        # Each batch's position is its index in the epoch plan: the holder's ledger knows
        # which are done (see dasktrain.trainer.holder.ledger).
        start, steps = 0, None
        items: Generator[tuple[int, Any], None, None] = pipe.claiming(
            functools.partial(_claim, handle, worker, epoch, run_ends), ahead=CLAIMS_AHEAD)
    else:
        plan = pipe.plan()
        mine = len(plan.rank_batches(worker, world))
        lockstep = mode_class(config.mode).lockstep
        steps = math.ceil(plan.num_batches / world) if lockstep else mine
        start = min(int(info["position"]), steps)
        state = pipe.state_dict()
        state["position"] = min(start, mine)
        pipe.load_state_dict(state)
        items = _stride(iter(pipe), start, mine, steps)
    compute = wait = 0.0
    samples = in_buckets = nonfinite = 0
    totals = MetricTotals()
    scale = LossScale(config.compute.precision == "fp16")
    readiness = _readiness(strategy, handle, flat, scale)

    item = next(items, None)
    step = start
    retired = False
    first_step_at = time.time() if item is not None else None  # wall clock: see epoch_records
    while item is not None:
        if claimed and retiring():
            retired = True  # hand back what is claimed, while the worker still lives
            break
        mark, batch = item
        t0 = time.perf_counter()
        count, loss_value = 0, 0.0
        outgoing = None
        if batch is not None:
            flat.zero_grad()
            loss, values, pair = config.compute(flat.model, batch, device)
            if step == start and pair is not None and pair[1] is not None:
                _tell(handle, worker, [shape_notice(*pair)])
            count, loss_value = batch_size_of(batch), float(loss.detach())
            if readiness is not None:
                outgoing = handle.begin_push(version, count, loss_value, (epoch, mark),
                                             flat.payload())
                readiness.arm(outgoing.ready)
            try:
                scale.scaled(loss).backward()
            finally:
                if readiness is not None:
                    readiness.disarm()
            if not scale.unscale(flat.grads):  # float16 overflow: skipped, scale lowered
                count = 0
            else:
                samples += count
                if math.isfinite(loss_value):
                    totals.add({"loss": loss_value, **values}, count)
                else:  # the holder refuses its gradient: it counts in no epoch mean
                    nonfinite += 1
        # A gradient on its way since backward began needs no asking what to push.
        # Claimed work: the schedule's step is the batch's place among the epoch's lock-step
        # steps, and a run ends where its claim did.
        push = None if outgoing is not None else strategy.after_backward(
            mark // world if claimed else step, count, loss_value,
            last=mark in run_ends if claimed else step + 1 == steps)
        step += 1
        t1 = time.perf_counter()
        compute += t1 - t0
        if outgoing is not None:  # send the rest
            future = outgoing.finish()
            # A push begun after a fall back to the actor goes whole (see begin_push).
            in_buckets += isinstance(outgoing, OutgoingPush)
        elif push is None:  # a local step: nothing to exchange yet
            item = next(items, None)
            continue
        else:
            future = handle.push(worker, version, push.payload, push.count, push.loss,
                                 (epoch, mark))
        item = next(items, None)  # overlaps the exchange
        params, version = handle.wait(future, f"worker {worker}'s update at step {step - 1}")
        strategy.load(params)
        _tell(handle, worker, taken_warnings())
        wait += time.perf_counter() - t1
    retired = retired or (claimed and retiring())
    if retired:
        items.close()  # stops the pipeline: nothing more is claimed
    elif following:
        kept.keep(fit, rank, world, pipe)
    last_step_at = time.time()
    handle.request("leave", worker, retired, what=f"worker {worker} to leave")
    elapsed = time.perf_counter() - started
    return {"worker": worker, "epoch": epoch, "address": address, "steps": step - start,
            "samples": samples, "compute_s": compute, "exchange_s": wait,
            "elapsed_s": elapsed, "data_wait_s": pipe.stats.wait_total,
            # Of that wait, the epoch's first batch: the pipeline starting, not keeping up.
            "first_batch_s": pipe.stats.wait_per_batch[0] if pipe.stats.wait_per_batch else 0.0,
            "stall": pipe.stats.wait_total / elapsed if elapsed > 0 else 0.0,
            "metrics": totals.to_dict(), "skipped_overflow": scale.skipped,
            "skipped_nonfinite": nonfinite,
            "exchange_via": handle.via, "transport": handle.transport, "retired": retired,
            "pushes_in_buckets": in_buckets, "first_step_at": first_step_at,
            "last_step_at": last_step_at if step > start else None}


def _stride(batches: Iterator[Any], start: int, mine: int, steps: int
            ) -> Generator[tuple[int, Any], None, None]:
    """A static rank's steps ``start..steps``: ``(position after it, batch)``, the batch
    None for the steps of a lock-step epoch in which this rank has none left."""
    for step in range(start, steps):
        yield step + 1, (next(batches) if step < mine else None)
    for _ in batches:  # let the pipeline finish its epoch bookkeeping (nothing is left)
        pass


def _claim(handle: Handle, worker: int, epoch: int, run_ends: set[int],
           stop: threading.Event) -> range | None:
    """The next run of global batches ``worker`` claims from the holder (on the pipeline's
    feeder thread), its last batch added to ``run_ends``; None once the epoch has no more
    work for it."""
    while not stop.is_set() and not retiring():  # a retiring worker claims no more
        run = handle.request("claim", worker, epoch, what=f"work for worker {worker}")
        if run is None:
            return None
        if run:
            claimed = range(run[0], run[1])
            pieces = run_pieces(claimed, run[2] if len(run) > 2 else None)
            run_ends.update(part.stop - 1 for part in pieces)
            return claimed
        # []: nothing free now, but what others hold may come back (a worker dies): ask again
    return None


def _readiness(strategy: WorkerStep, handle: Handle, flat: FlatModel,
               scale: LossScale) -> GradientReadiness | None:
    """Hooks that send a gradient bucket by bucket during backward, where that is exact:
    the mode pushes plain gradients, over the direct channel, from CPU memory (on CUDA the
    gradients still need a copy to the host after backward), without a loss scale (a scaled
    gradient may yet be found to overflow and be skipped)."""
    order = handle.order
    if not strategy.streams or order is None or flat.device.type != "cpu" or scale.enabled:
        return None
    params = [p for _, p in flat.model.named_parameters() if p.requires_grad]
    return GradientReadiness(params, flat.layout, order)


def _tell(handle: Handle, worker: int, notices: list) -> None:
    """Hand warnings to the holder, for the driver (rare: nothing is sent when none)."""
    notices = [n for n in notices if n is not None]
    if notices:
        handle.request("notify", worker, notices, what=f"worker {worker}'s warnings")
