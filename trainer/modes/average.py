"""``average``: periodic parameter averaging (local SGD).

Each worker runs the optimizer itself on its own batches and, every ``average_every`` (K)
steps and at the end of its epoch, pushes its parameters (and buffers). When every live
worker has pushed, the holder makes their sample-weighted average the parameters, and every
worker continues from it. One update is one averaging round.

``average_optimizer_state=True`` averages the workers' optimizer states (momentum, Adam's
moments) with the parameters; by default each worker keeps its own, which the holder stores
between rounds (so it survives epochs, restarts and checkpoints).

With K = 1, plain SGD and each worker on its own stride (``assignment="static"``) this is
``sync`` exactly: the average of one SGD step from the same parameters is one SGD step on
the average gradient. With momentum it is ``sync`` only when the optimizer state is averaged
too.

A worker whose process died starts again, as in ``sync``, after the last of its pushes the
holder took: the local steps it had taken since are taken again, so every batch of the
epoch is in exactly one average. Where work is claimed, a worker may sit out rounds (it had
no work, the rest of the epoch being in others' hands) and then claim work that came back
to the pool: its push is then of parameters the rounds left behind, which is not averaged
but goes back to the pool, batches and all, and the worker continues from the current
average that the reply brings it.

Where work is claimed on demand (``assignment="dynamic"``, the default with one holder), a
worker's local steps between two averages are a piece of the runs of batches it claimed,
and the holder sizes the pieces by the worker's pace: K batches for the fastest worker,
fewer in proportion for one under half its pace (at least one), paces measured from the
time between handing a worker the average and its next push. A round then lasts about K
steps of the fastest worker instead of K steps of a straggler, and a fast worker takes
more of the epoch. A piece is applied, or given back to the pool when its worker dies or
leaves, as a whole.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from dasktrain.trainer.flat import FlatLayout, FlatModel
from dasktrain.trainer.modes.base import Contribution, Host
from dasktrain.trainer.modes.rounds import RoundMode
from dasktrain.trainer.optim import OptimizerConfig
from dasktrain.trainer.optim.flat import FlatOptimizer, state_size
from dasktrain.trainer.worker.compute import clip_gradient
from dasktrain.trainer.worker.steps import Push, StepContext, WorkerStep

__all__ = ["AverageMode", "LocalSteps"]

DEFAULT_EVERY = 10


def _every(options: dict[str, Any]) -> int:
    every = options.get("average_every", DEFAULT_EVERY)
    if not isinstance(every, int) or every < 1:
        raise ValueError(f"average_every must be a positive integer, got {every!r}")
    return every


class LocalSteps(WorkerStep):
    """A worker's half of ``average``: local optimizer steps, parameters pushed every K."""

    def __init__(self, flat: FlatModel, context: StepContext) -> None:
        super().__init__(flat, context)
        self.every = _every(context.mode_options)
        # The optimizer works on views of the model's flat storage, whose gradients are
        # views of the flat gradient buffer: the model's own tensors move with it.
        self.optimizer = FlatOptimizer(context.optimizer, flat.params,
                                       flat.layout.param_segments())
        self.optimizer.attach_grad(flat.grads)
        size = flat.layout.size
        self._size = size
        total = size + self.optimizer.state_size()
        self._out = np.empty(total, dtype=np.float32)
        self._in = np.empty(total, dtype=np.float32)
        self._count = 0
        self._loss = 0.0

    def receive_buffer(self) -> np.ndarray:
        return self._in

    def adopt(self, payload: np.ndarray, reply: np.ndarray) -> bool:
        if payload.shape != self._out.shape or reply.shape != self._in.shape:
            return False
        self._out, self._in = payload, reply
        return True

    def start(self, values: np.ndarray) -> None:
        self.load(values)

    def load(self, values: np.ndarray) -> None:
        self.flat.load(values[: self._size])
        if len(values) > self._size:
            self.optimizer.load_state(values[self._size:])

    def after_backward(self, step: int, count: int, loss: float, last: bool) -> Push | None:
        if count:
            config = self.context.optimizer
            lr = config.lr_at(self.context.step_offset + step, self.context.total_steps)
            if self.context.clip != (None, None):
                clip_gradient(self.flat.grads, *self.context.clip)
            self.optimizer.step(lr=lr * self.lr_factor)
            self._count += count
            self._loss += loss * count
        # Claimed work: a push ends each claimed run, whose length the holder chose.
        if not last and (self.context.claimed or (step + 1) % self.every):
            return None
        np.copyto(self._out[: self._size], self.flat.state())
        self.optimizer.flatten_state(self._out[self._size:])
        push = Push(self._out, self._count, self._loss / self._count if self._count else 0.0)
        self._count, self._loss = 0, 0.0
        return push


#: Weight of a worker's latest measured pace in its running estimate.
PACE_WEIGHT = 0.5
#: Pushes in one claim of work: claims cost a call to the holder each, besides the pushes.
PUSHES_PER_CLAIM = 2
#: A worker at least this share of the fastest one's pace takes K batches per push too: on
#: W3 shorter pushes for workers within 20 % of the fastest (two sharing a process) added
#: rounds (88 instead of 64 in 4 epochs) and cost more than the wait they saved.
SAME_PACE = 0.5


class AverageMode(RoundMode):
    name = "average"
    lockstep = True
    pushes_runs = True
    worker_step = LocalSteps

    def __init__(self, host: Host | None, *, average_every: int = DEFAULT_EVERY,
                 average_optimizer_state: bool = False, **options: Any) -> None:
        super().__init__(host, **options)
        self.every = _every({"average_every": average_every})
        self.share_state = bool(average_optimizer_state)
        self._shared: torch.Tensor | None = None  # averaged optimizer state
        self._own: dict[int, torch.Tensor] = {}  # each worker's optimizer state
        self._extra = 0
        self._sent_at: dict[int, float] = {}  # when each worker was last handed parameters
        self._pace: dict[int, float] = {}  # each worker's samples per second of local steps
        if host is not None:
            self._extra = state_size(host.optimizer, host.layout.param_segments())

    @classmethod
    def planned_updates(cls, batches: int, workers: int, options: dict[str, Any]) -> int:
        steps = -(-batches // workers)
        return -(-steps // _every(options))

    @classmethod
    def schedule_length(cls, epoch_steps: Sequence[int], updates: int,
                        options: dict[str, Any]) -> int:
        # The workers' optimizers step every batch: the schedule counts local steps.
        return sum(epoch_steps)

    @classmethod
    def schedule_position(cls, holder_state: dict[str, Any], epoch_steps: Sequence[int],
                          options: dict[str, Any]) -> int:
        epoch = int(holder_state["epoch"])
        rounds = int(holder_state["version"]) - int(holder_state["epoch_start"])
        return sum(epoch_steps[:epoch]) + min(rounds * _every(options),
                                              epoch_steps[epoch] if epoch < len(epoch_steps)
                                              else 0)

    @classmethod
    def payload_size(cls, layout: FlatLayout, optimizer: OptimizerConfig,
                     options: dict[str, Any]) -> int:
        return layout.size + state_size(optimizer, layout.param_segments())

    async def push(self, contribution: Contribution) -> None:
        host = self.host
        if host.claims_work:
            self._measure(contribution)
            if contribution.version != host.version:
                # Local steps from parameters the rounds left behind (its worker had no
                # work while they went on): not averaged, and not lost either.
                host.give_back(contribution, f"its parameters of version "
                                             f"{contribution.version} fell behind the "
                                             f"rounds (version {host.version})")
                return
        await self.enter_if_current(contribution, "parameters")

    def sent(self, worker: int) -> None:
        self._sent_at[worker] = time.monotonic()

    def _measure(self, contribution: Contribution) -> None:
        """The pace of ``contribution``'s local steps: its samples over the time since its
        worker was handed the parameters they started from."""
        since = self._sent_at.pop(contribution.worker, None)
        if since is None or contribution.count <= 0:
            return  # its first run since it joined: the join's reply is not timed
        elapsed = time.monotonic() - since
        if elapsed <= 0:
            return
        pace = contribution.count / elapsed
        before = self._pace.get(contribution.worker)
        self._pace[contribution.worker] = pace if before is None else \
            PACE_WEIGHT * pace + (1 - PACE_WEIGHT) * before

    def claim_size(self, worker: int) -> tuple[int, int]:
        """Pushes of K batches for the fastest live worker, fewer for one under
        :data:`SAME_PACE` of its pace, in proportion, at least one (K until paces are
        known); a claim holds :data:`PUSHES_PER_CLAIM` of them."""
        pace = self._pace.get(worker)
        piece = self.every
        if pace is not None:
            fastest = max([pace, *(self._pace[w] for w in self.host.live_workers()
                                   if w in self._pace)])
            share = pace / fastest
            # Paces of equal workers differ by noise: shorter pushes would only add rounds.
            if share < SAME_PACE:
                piece = max(1, round(self.every * share))
        return PUSHES_PER_CLAIM * piece, piece

    def complete(self) -> bool:
        return not self.waiting_for()

    async def close_round(self, contributions: list[Contribution]) -> None:
        values = await self.host.serially(self._average, contributions)
        await self.host.set_state(contributions, values)

    def _average(self, contributions: list[Contribution]) -> torch.Tensor | None:
        size = self.host.layout.size
        for c in contributions:
            if self._extra and not self.share_state:
                self._own[c.worker] = torch.from_numpy(np.array(c.grads[size:]))
        used = [c for c in sorted(contributions, key=lambda c: c.worker) if c.count > 0]
        if not used:
            return None
        total = float(sum(c.count for c in used))
        mean = torch.zeros(len(used[0].grads), dtype=torch.float32)
        for c in used:
            mean.add_(torch.from_numpy(np.asarray(c.grads)), alpha=c.count / total)
        if self._extra and self.share_state:
            self._shared = mean[size:].clone()
        return mean[:size]

    def reply(self, worker: int) -> np.ndarray | None:
        if not self._extra:
            return None
        size = self.host.layout.size
        out = np.empty(size + self._extra, dtype=np.float32)
        out[:size] = self.host.values.numpy()
        state = self._shared if self.share_state else self._own.get(worker)
        out[size:] = 0.0 if state is None else state.numpy()
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"shared": None if self._shared is None else self._shared.clone(),
                "own": {w: t.clone() for w, t in self._own.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        shared = state.get("shared")
        self._shared = None if shared is None else shared.clone()
        self._own = {int(w): t.clone() for w, t in state.get("own", {}).items()}
