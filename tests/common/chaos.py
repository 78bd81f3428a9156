"""Faults for the chaos tests: a trainer worker's process killed at a point of its life
that the test names (see :mod:`dasktrain.trainer.faults`), once per test.

A kill is planned in every worker process (``client.run(plan_kill, ...)``); the worker that
reaches the point first with a planned worker number and epoch claims the test's marker
(an atomic link: only one ever does), writes the time and its number into it and kills its
own process. The marker then tells the test that, when and to whom the fault happened.

The process of the holder's Dask worker is never killed: which trainer worker runs beside
it is the placement's to decide (a worker process restarted by an earlier test can come
back with an address that sorts first), so a test plans the kill for several workers and
the one not beside the holder that gets there first dies.
"""

from __future__ import annotations

import collections
import functools
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from distributed import get_worker

from dasktrain.trainer import faults
from dasktrain.trainer.worker.epoch import trainer_place
from dasktrain.trainer.worker.retire import retiring
from tests.common.builders import claim_marker, wait_for
from tests.common.counting import Tally, spread

__all__ = ["gated_spread", "gated_tally", "killed_at", "killed_worker", "plan_kill", "unplan"]

_SEEN: collections.Counter[str] = collections.Counter()


def _kill(marker: str, victims: tuple[int, ...], first: int, nth: int, at_last: bool | None,
          **where: Any) -> None:
    if where["worker"] not in victims or where["epoch"] < first:
        return
    if at_last is not None and where.get("last") != at_last:
        return
    key = f"{marker}:{where['worker']}:{where['epoch']}"
    _SEEN[key] += 1
    if _SEEN[key] >= nth and claim_marker(Path(marker), f"{time.time()!r} {where['worker']}"):
        os.kill(os.getpid(), signal.SIGKILL)


def plan_kill(point: str, marker: str, victims: tuple[int, ...], epoch: int, nth: int = 1,
              last: bool | None = None, holder: str | None = None,
              dask_worker: Any = None) -> None:
    """In this process: kill it when one of the workers ``victims`` reaches ``point`` for
    the ``nth`` time in an epoch from ``epoch`` on (with ``last``: at a push that is, or is
    not, its last of the epoch), unless another process did first (``marker``) or this is
    the process of the holder's Dask worker ``holder`` (``dask_worker``: this process's,
    given by ``client.run``)."""
    faults.clear()
    if holder is None or dask_worker is None or dask_worker.address != holder:
        faults.install(point, functools.partial(_kill, marker, tuple(victims), epoch, nth,
                                                last))


def unplan() -> None:
    """Remove the planned kill of this process."""
    faults.clear()


def killed_at(marker: str | Path) -> float | None:
    """When the planned kill happened (the victim's clock), or None if it did not."""
    path = Path(marker)
    return float(path.read_text().split()[0]) if path.exists() else None


def killed_worker(marker: str | Path) -> int | None:
    """The trainer worker whose process the planned kill ended, or None if none."""
    path = Path(marker)
    return int(path.read_text().split()[1]) if path.exists() else None


def gated_spread(output: torch.Tensor, target: torch.Tensor, gate: str = "",
                 opener: int = -1, from_epoch: int = 2, holder: str = "") -> torch.Tensor:
    """:func:`~tests.common.counting.spread` with the trainer worker beside the holder's
    Dask worker ``holder`` slower (where work is claimed, the others take most of it, so a
    fault planned for them happens; without ``holder``: worker 0). With a ``gate``: worker
    ``opener`` opens it as it computes, and from epoch ``from_epoch`` on the others wait (at
    most 60 s) until it is open, so that a fault planned mid-fit surely happens before the
    fit ends."""
    task = trainer_place()
    if gate and task is not None and task[1] is not None:
        if task[0] == opener:
            Path(gate).touch()
        elif task[1] >= from_epoch:
            # A worker whose Dask worker is being retired stops waiting: it finishes the
            # batch in hand and leaves, as the retirement asks.
            wait_for(lambda: Path(gate).exists() or retiring(), 60, f"the gate {gate}")
    slow = 0
    if holder:
        slow = task[0] if task is not None and get_worker().address == holder else -1
    return spread(output, target, slow_rank=slow, delay=0.02, pace=0.004)


def gated_tally(rows: int, gate: str = "", opener: int = -1) -> Tally:
    """:class:`~tests.common.counting.Tally`; the task of trainer worker ``opener`` opens
    ``gate`` as it builds its model, just before it joins the holder."""
    task = trainer_place()
    if gate and task is not None and task[0] == opener:
        Path(gate).touch()
    return Tally(rows)
