"""One epoch of a trainer worker: from the holder's answer to a join to the worker's report.

Per batch: forward/backward, the mode's step (:mod:`.steps`: push the gradient, or take a
local step), the parameters the holder sends back. While a push is on its way the next
batch is already taken from the pipeline (whose prefetch runs on the cluster), so
communication overlaps data work. A worker with a stride of its own that pushes gradients
in a lock-step mode may start an epoch before the holder answered for it
(:func:`computes_ahead`): its first batch's gradient is computed meanwhile and pushed once
the answer came, if the answer is what it computed on (the epoch's start, the same
parameters, rank and world); else the epoch starts again from the answer
(:class:`AheadOfTheHolder`). Which task runs the epochs, and how it joins and leaves, is
:mod:`.loop`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading
import time
from collections.abc import Generator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from distributed import get_client

from dasktrain.pipeline import Pipeline
from dasktrain.trainer import faults
from dasktrain.trainer.exchange.buckets import GradientReadiness, reply_order
from dasktrain.trainer.exchange.handle import HolderHandle
from dasktrain.trainer.exchange.sharded import ShardedHandle
from dasktrain.trainer.exchange.streaming import OutgoingPush
from dasktrain.trainer.flat import FlatModel
from dasktrain.trainer.modes import mode_class, worker_step_class
from dasktrain.trainer.worker.batches import claim, next_item, stride
from dasktrain.trainer.worker.compute import LossScale, MetricTotals, batch_size_of
from dasktrain.trainer.worker.config import WorkerConfig
from dasktrain.trainer.worker.gate import ForwardGate
from dasktrain.trainer.worker.notices import (
    shape_notice,
    taken_warnings,
)
from dasktrain.trainer.worker.retire import retiring
from dasktrain.trainer.worker.steps import StepContext, WorkerStep

__all__ = ["CLAIMS_AHEAD", "PLACE", "AheadOfTheHolder", "Replica", "computes_ahead",
           "step_for", "train_epoch", "trainer_place"]

#: Runs of batches a worker holds claimed beyond the one it trains on (its prefetch).
CLAIMS_AHEAD = 2


PLACE = threading.local()  # the trainer task's (worker, epoch), in its thread


def trainer_place() -> tuple[int, int | None] | None:
    """``(worker, epoch)`` of the trainer task whose thread calls this (a loss, a model's
    forward; the epoch is None while the task builds its model, before the holder named
    it), else None: code that runs in the task can tell which replica and epoch it serves
    (one task trains every epoch of a fit)."""
    return getattr(PLACE, "place", None)


def step_for(config: WorkerConfig, flat: FlatModel, epoch: int) -> WorkerStep:
    """The mode's worker step (see :mod:`dasktrain.trainer.worker.steps`)."""
    context = StepContext(config.optimizer, dict(config.mode_options),
                          step_offset=sum(config.epoch_steps[:epoch]),
                          total_steps=sum(config.epoch_steps), clip=config.clip,
                          claimed=config.assignment == "dynamic")
    return worker_step_class(config.mode)(flat, context)


Handle = HolderHandle | ShardedHandle


@dataclasses.dataclass(slots=True)
class Replica:
    """What a worker task keeps from one epoch to the next."""

    config: WorkerConfig
    handle: Handle
    flat: FlatModel
    device: torch.device
    worker: int
    address: str | None
    strategy: WorkerStep | None = None
    pipe: Pipeline | None = None
    version: int = 0  # of the parameters the worker last received
    rank: int = 0  # its place among the epoch's ranks, where ranks own a stride
    world: int = 1  # the epoch's ranks
    asker: ThreadPoolExecutor | None = None  # asks for the next epoch while it computes
    gate: ForwardGate | None = None  # forward passes begun while a reply arrives
    gate_tried: bool = False
    # precision="fp16": kept from one epoch to the next, as torch's GradScaler is; a new
    # scale each epoch skipped the first steps of every epoch again.
    scale: LossScale | None = None


class AheadOfTheHolder(Exception):
    """The holder began the epoch a worker computed ahead into otherwise than the worker
    computed on (other parameters: the epoch before ended later than its last reply, or
    another rank or world): the gradient computed ahead is dropped, and the epoch starts
    again from the holder's ``answer``."""

    def __init__(self, answer: dict[str, Any]) -> None:
        super().__init__(answer)
        self.answer = answer


def computes_ahead(replica: Replica) -> bool:
    """Whether the worker takes the next epoch's first batch and computes its gradient
    while it waits for the holder to begin that epoch: it pushes gradients in a lock-step
    mode, on a stride of its own (it starts at the epoch's beginning, with no claim to wait
    for). Its parameters, those of the epoch's last step, are then exactly the next
    epoch's first ones; the gradient is pushed once the epoch began."""
    strategy, config = replica.strategy, replica.config
    return (config.assignment != "dynamic" and mode_class(config.mode).lockstep
            and strategy is not None and strategy.streams)


def worker_pipeline(config: WorkerConfig, rank: int, world: int,
                    device: torch.device) -> Pipeline:
    """The pipeline of rank ``rank`` of ``world`` over the fit's data, on this worker."""
    return Pipeline(config.data, config.batch_size, rank=rank, world_size=world,
                    device=device, client=get_client(), **config.pipeline_options)


def train_epoch(replica: Replica, info: dict[str, Any] | None, epoch: int,
                started: float, following: bool, asked: Future | None = None
                ) -> dict[str, Any] | None:
    """Train ``epoch`` from the parameters, rank and position in ``info`` (what the holder
    answered to a join); returns the worker's report of it.

    ``asked`` instead of ``info``: the holder's answer for the epoch is on its way (see
    :func:`computes_ahead`); the epoch starts at its beginning with the parameters, rank
    and world the worker has, and the answer is awaited before the first push (its own
    deadlines are those of :meth:`HolderHandle.next_epoch`). None if it says the fit is
    over; :class:`AheadOfTheHolder` if it began the epoch otherwise."""
    config, handle, flat = replica.config, replica.handle, replica.flat
    worker, device = replica.worker, replica.device
    strategy = replica.strategy
    assert strategy is not None
    PLACE.place = (worker, epoch)
    # Schedules of local steps count the fit's lock-step steps before this epoch.
    strategy.context = dataclasses.replace(
        strategy.context, step_offset=sum(config.epoch_steps[:epoch]))
    if info is not None:
        strategy.lr_factor = float(info.get("lr_factor", 1.0))
        strategy.start(info["params"])
        version, position = int(info["version"]), int(info["position"])
        replica.rank, replica.world = int(info["rank"]), int(info["world"])
    else:
        version, position = replica.version, 0
    rank, world = replica.rank, replica.world

    def settle() -> bool:
        """The holder's answer, once it is needed: False if the fit is over."""
        nonlocal asked
        if asked is None:
            return True
        answer, asked = asked.result(), None
        if answer is None:
            return False
        if (int(answer["epoch"]), int(answer["position"]), int(answer["version"]),
                int(answer["rank"]), int(answer["world"])) != (epoch, 0, version, rank, world):
            items.close()
            raise AheadOfTheHolder(answer)
        return True

    claimed = config.assignment == "dynamic"
    pipe = replica.pipe
    if pipe is not None and not claimed and (pipe.world_size, pipe.rank) != (world, rank):
        pipe.close()
        pipe = None
    if pipe is None:
        pipe = replica.pipe = worker_pipeline(config, rank, world, device)
    pipe.prefetch_next_epoch = following and not claimed
    pipe.set_epoch(epoch)
    if not claimed:
        pipe.set_shares(_shares(config, handle, info, epoch, world))
    run_ends: set[int] = set()  # the last batch of each run claimed
    if claimed:
        # Each batch's position is its index in the epoch plan: the holder's ledger knows
        # which are done (see dasktrain.trainer.holder.ledger).
        start, steps, last_batch = 0, None, pipe.plan().num_batches - 1
        items: Generator[tuple[int, Any], None, None] = pipe.claiming(
            functools.partial(claim, handle, worker, epoch, run_ends, config.timeout),
            ahead=CLAIMS_AHEAD)
    else:
        plan = pipe.plan()
        last_batch = None
        mine = len(plan.rank_batches(rank, world))
        lockstep = mode_class(config.mode).lockstep
        steps = math.ceil(plan.num_batches / world) if lockstep else mine
        start = min(position, steps)
        state = pipe.state_dict()
        state["position"] = min(start, mine)
        pipe.load_state_dict(state)
        items = stride(iter(pipe), start, mine, steps)
    compute = wait = 0.0
    samples = in_buckets = nonfinite = 0
    totals = MetricTotals()
    if replica.scale is None:
        replica.scale = LossScale(config.compute.precision == "fp16")
    scale = replica.scale
    overflowed_before = scale.skipped
    readiness = _readiness(strategy, handle, flat, scale)
    gate = _gate(replica)

    item = next_item(items)
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
            checking = gate is not None and gate.verified is None
            with gate.check() if checking else contextlib.nullcontext():
                loss, values, pair = config.compute(flat.model, batch, device)
            if checking and gate.verified:
                handle.stream_replies()
            if gate is not None:
                gate.settle()  # what follows may read the model outside a forward pass
            if step == start and pair is not None and pair[1] is not None:
                _tell(handle, worker, [shape_notice(*pair)])
            count, loss_value = batch_size_of(batch), float(loss.detach())
            if readiness is not None and asked is None:
                outgoing = handle.begin_push(version, count, loss_value, (epoch, mark),
                                             flat.payload())
                readiness.arm(outgoing.ready)
            try:
                scale.scaled(loss).backward()
                flat.gradients_done()
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
            item = next_item(items)
            continue
        elif asked is not None and not settle():  # the first push of an epoch computed ahead
            return None
        else:
            future = handle.push(version, push.payload, push.count, push.loss,
                                 (epoch, mark))
        faults.reached("push", worker=worker, epoch=epoch, batch=mark,
                       last=mark == last_batch if claimed else step == steps)
        item = next_item(items)  # overlaps the exchange
        params, version = handle.wait(future, f"worker {worker}'s update at step {step - 1}")
        strategy.load(params)
        _tell(handle, worker, taken_warnings())
        wait += time.perf_counter() - t1
    if gate is not None:
        gate.settle()
    if not settle():  # it had no batch this epoch
        return None
    replica.version = version
    retired = retired or (claimed and retiring())
    if retired:
        items.close()  # stops the pipeline: nothing more is claimed
    last_step_at = time.time()
    elapsed = time.perf_counter() - started
    report = {"worker": worker, "epoch": epoch, "address": replica.address,
            "steps": step - start,
            # The rows of its batches, where the holder cut the steps unevenly.
            "batch_rows": config.batch_size if claimed or pipe.shares is None
            else pipe.shares[rank],
            "samples": samples, "compute_s": compute, "exchange_s": wait,
            "elapsed_s": elapsed, "data_wait_s": pipe.stats.wait_total,
            # Of that wait, the epoch's first batch: the pipeline starting, not keeping up.
            "first_batch_s": pipe.stats.wait_per_batch[0] if pipe.stats.wait_per_batch else 0.0,
            "stall": pipe.stats.wait_total / elapsed if elapsed > 0 else 0.0,
            "metrics": totals.to_dict(), "skipped_overflow": scale.skipped - overflowed_before,
            "skipped_nonfinite": nonfinite,
            "exchange_via": handle.via, "transport": handle.transport, "retired": retired,
            "pushes_in_buckets": in_buckets, "replies_streamed": bool(gate and gate.verified),
            "replies_viewed": strategy.views,
            "first_step_at": first_step_at,
            "last_step_at": last_step_at if step > start else None}
    return report


def _shares(config: WorkerConfig, handle: Handle, info: dict[str, Any] | None, epoch: int,
            world: int) -> tuple[int, ...] | None:
    """The rows of each rank's batch in ``epoch`` (None: a batch each), as the holder cut
    its steps (see :mod:`dasktrain.trainer.holder.balance`): in its answer to the join, or
    asked for by a worker computing ahead into an epoch not yet begun."""
    if not mode_class(config.mode).balances:
        return None
    shares = info.get("shares") if info is not None else handle.request(
        "epoch_shares", epoch, world, what=f"the shares of epoch {epoch}")
    return tuple(shares) if shares is not None and len(shares) == world else None


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


def _gate(replica: Replica) -> ForwardGate | None:
    """The replica's :class:`~dasktrain.trainer.worker.gate.ForwardGate`, made on its first
    epoch where replies can stream: bytes over the direct channel (not memory shared with
    the holder) received straight into a CPU model, for a mode that loads them as they
    are."""
    if not replica.gate_tried:
        replica.gate_tried = True
        handle, flat, strategy = replica.handle, replica.flat, replica.strategy
        order = handle.order if isinstance(handle, HolderHandle) else None
        if (order is not None and strategy is not None and strategy.streams
                and flat.receives_in_place()
                and strategy.receive_buffer() is flat.receive_buffer()):
            try:
                replica.gate = ForwardGate(flat.model, flat.tensors, reply_order(order),
                                           lambda: handle.arrival)
            except RuntimeError:  # a model without module hooks gets its replies whole
                replica.gate = None
    return replica.gate


def _tell(handle: Handle, worker: int, notices: list) -> None:
    """Hand warnings to the holder, for the driver (rare: nothing is sent when none)."""
    notices = [n for n in notices if n is not None]
    if notices:
        handle.member_request("notify", notices, what=f"worker {worker}'s warnings")
