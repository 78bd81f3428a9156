"""A model whose parameters count how often each sample's gradient was applied.

``Tally`` has one parameter per row of an indexed dataset (feature 0 is the row index, see
:mod:`tests.common.data`) and outputs the parameter of each row of the batch; with
``spread`` as the loss, a gradient is positive exactly at the rows of its batch(es), and the
``tally`` optimizer adds the gradient's sign, ignoring the learning rate (and whatever a
mode does to it). After a fit, parameter ``i`` is the number of times a gradient of row
``i`` was applied: exactly once per epoch means every entry equals the epochs.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch

import dasktrain as dt
from tests.common.builders import claim_marker

__all__ = ["ROWS", "Tally", "TallyOptimizer", "paced_mse", "register_tally", "spread",
           "tally"]

ROWS = 900


class Tally(torch.nn.Module):
    def __init__(self, rows: int = ROWS) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(rows))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w[x[:, 0].long()]


def tally() -> Tally:
    return Tally()


def _task() -> tuple[int, int] | None:
    """(rank, epoch) of the trainer task this runs in (see trainer_place), else None."""
    from dasktrain.trainer.worker.loop import trainer_place

    return trainer_place()


_CALLS: dict[str, int] = {}


def spread(output: torch.Tensor, target: torch.Tensor, slow_rank: int = -1,
           delay: float = 0.0, pace: float = 0.0, kill_rank: int = -1, kill_after: int = 0,
           marker: str = "", fail_after: int = 0, fail_epoch: int = 0) -> torch.Tensor:
    """The mean output (its gradient marks the batch's rows). Every rank sleeps ``pace``
    seconds per batch and rank ``slow_rank`` ``delay`` instead (a slow worker); the
    process of rank ``kill_rank`` is killed (SIGKILL) at its ``kill_after``-th batch, and
    the batch that is the ``fail_after``-th of epoch ``fail_epoch`` across every process
    raises, each once per test (``marker`` file)."""
    del target
    rank, epoch = _task() or (None, None)
    if rank is not None:
        time.sleep(delay if rank == slow_rank else pace)
    if not marker or Path(marker).exists():
        return output.mean()
    if fail_after:
        # Counted across processes: one process's count says nothing of the epoch's
        # progress when the processes run at different paces.
        if epoch == fail_epoch and _count_across_processes(marker) >= fail_after \
                and claim_marker(Path(marker), "failed"):
            raise RuntimeError("the loss fails once, on purpose")
        return output.mean()
    _CALLS[marker] = _CALLS.get(marker, 0) + 1
    if rank == kill_rank and _CALLS[marker] >= kill_after:
        Path(marker).touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return output.mean()


def _count_across_processes(marker: str) -> int:
    """One more call, counted in a file beside ``marker`` that every process appends a
    byte to: how many calls there were, this one included."""
    fd = os.open(f"{marker}.calls", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, b".")  # one small append: whole, whichever process writes at once
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def paced_mse(output: torch.Tensor, target: torch.Tensor, pace: float) -> torch.Tensor:
    """Mean squared error, after ``pace`` seconds of sleep in a trainer task."""
    spread(output, target, pace=pace)
    return torch.nn.functional.mse_loss(output, target)


class TallyOptimizer(torch.optim.Optimizer):
    """``w += sign(g)``: one count per row in the applied gradient."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(torch.sign(p.grad))


def _build(config, params, segments):
    return TallyOptimizer(params, lr=config.lr)


def register_tally() -> dt.optim.OptimizerConfig:
    """The ``tally`` optimizer's config (registered on first use)."""
    dt.optim.register_optimizer("tally", _build)
    return dt.optim.get_optimizer("tally", lr=1.0)
