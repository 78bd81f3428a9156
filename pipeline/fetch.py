"""Bringing a unit's batches to the consumer: wait for its task with a deadline and a
liveness check, turn its arrays into tensors (pinned when they go to CUDA), and hand each
batch over in the shape asked for."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import CancelledError

import numpy as np
import torch
from distributed import Client, Future, wait
from distributed.client import FutureCancelledError

from dasktrain._cluster import worker_info
from dasktrain._deadline import wait_until
from dasktrain.pipeline.errors import PipelineError
from dasktrain.pipeline.finish import Finish
from dasktrain.pipeline.named import NamedBatch
from dasktrain.pipeline.plan import EpochPlan, Unit
from dasktrain.pipeline.tasks import BlockFailed, EpochContext, assemble_batches, load_window

__all__ = ["Batch", "Delivery", "Finishing", "Tensors", "compute_here", "fetch_unit",
           "host_tensors", "unit_where", "wait_for_unit"]

Batch = tuple[torch.Tensor, torch.Tensor] | torch.Tensor | dict[str, torch.Tensor]
#: One batch on its way to the consumer: CPU tensors keyed by array name.
Tensors = dict[str, torch.Tensor]

_SLICE = 2.0  # seconds between liveness checks while waiting for a unit


def unit_where(plan: EpochPlan, unit: Unit) -> str:
    """The unit's blocks and epoch, as error messages name them."""
    blocks = [b for w in unit.windows for b in plan.windows[w]]
    return f"block(s) {blocks} of epoch {plan.epoch}"


def host_tensors(arrays: dict[str, np.ndarray], device: torch.device) -> Tensors:
    """CPU tensors sharing the arrays' memory (pinned when the batch goes to CUDA)."""
    tensors = {}
    for name, value in arrays.items():
        if not value.flags.writeable:  # torch wants writable memory; deserialised may not be
            value = value.copy()
        tensor = torch.from_numpy(value)
        tensors[name] = tensor.pin_memory() if device.type == "cuda" else tensor
    return tensors


def wait_for_unit(client: Client, future: Future, where: str, timeout: float
                  ) -> list[dict[str, np.ndarray]]:
    """A unit's batches, within ``timeout`` seconds, as long as the client stays open."""

    def get(seconds: float) -> list[dict[str, np.ndarray]]:
        try:
            wait([future], timeout=seconds)
            # Straight from the worker that holds it: through the scheduler, every batch
            # would cost the scheduler's process (often this one) a copy and a hand-off.
            return client.gather(future, direct=True)
        except OSError as exc:  # a connection that broke is retried like a slow answer
            raise TimeoutError(str(exc)) from exc

    def check() -> None:
        if client.status not in ("running", "connecting"):
            raise PipelineError(f"the Dask client closed while waiting for {where}")

    def expired() -> PipelineError:
        return PipelineError(f"no data for {where} after {timeout:.0f}s "
                             f"({len(worker_info(client))} worker(s) alive)")

    try:
        return wait_until(get, timeout=timeout, expired=expired, check=check,
                          slice_seconds=_SLICE)
    except BlockFailed as exc:
        raise PipelineError(exc.args[0]) from exc.original
    except (CancelledError, FutureCancelledError) as exc:
        raise PipelineError(f"the task for {where} was cancelled") from exc
    except PipelineError:
        raise
    except Exception as exc:  # KilledWorker and anything the cluster raised
        raise PipelineError(f"{where} failed: {type(exc).__name__}: {exc}") from exc


def _finished(batches: list[dict[str, np.ndarray]], device: torch.device,
              finish: Finish | None) -> list[Tensors]:
    tensors = [host_tensors(arrays, device) for arrays in batches]
    return tensors if finish is None else [finish(t) for t in tensors]


class Finishing(Sequence[Tensors]):
    """A unit's batches while a thread finishes them in order (a fetch thread makes their
    floats, a read thread cuts them): batch ``i`` is there once it is finished, so the
    consumer takes a unit's first batch while the thread still makes the next (at the start
    of an epoch, what the consumer waits for)."""

    def __init__(self, count: int, timeout: float) -> None:
        self._batches: list[Tensors | None] = [None] * count
        self._ready = [threading.Event() for _ in range(count)]
        self._failed: BaseException | None = None
        self._timeout = timeout

    def put(self, index: int, tensors: Tensors) -> None:
        self._batches[index] = tensors
        self._ready[index].set()

    def fail(self, exc: BaseException) -> None:
        """The finishing failed: every batch not yet finished raises ``exc``."""
        self._failed = exc
        for event in self._ready:
            event.set()

    def __len__(self) -> int:
        return len(self._batches)

    def __getitem__(self, index: int) -> Tensors:  # type: ignore[override]
        if not self._ready[index].wait(self._timeout):
            raise PipelineError(f"batch {index} of a unit was not finished within "
                                f"{self._timeout:.0f}s")
        found = self._batches[index]
        if found is None:
            assert self._failed is not None, "a batch is set, or the finishing failed"
            raise self._failed
        return found


def fetch_unit(client: Client, future: Future, plan: EpochPlan, unit: Unit, timeout: float,
               device: torch.device, finish: Finish | None,
               delivered: concurrent.futures.Future[Sequence[Tensors]]) -> None:
    """Runs on a fetch thread: bring a unit's batches into this process as tensors, so that
    the consumer finds them ready instead of paying a round trip per unit. ``delivered``
    gets them as soon as they are here; with ``finish``, as a :class:`Finishing` that this
    thread then finishes batch by batch."""
    if not delivered.set_running_or_notify_cancel():
        return  # the consumer let go of the unit before it was fetched
    try:
        tensors = [host_tensors(arrays, device) for arrays in
                   wait_for_unit(client, future, unit_where(plan, unit), timeout)]
    except BaseException as exc:  # handed to the consumer, which raises it
        delivered.set_exception(exc)
        return
    if finish is None:
        delivered.set_result(tensors)
        return
    batches = Finishing(len(tensors), timeout)
    delivered.set_result(batches)
    for index, batch in enumerate(tensors):
        try:
            batches.put(index, finish(batch))
        except BaseException as exc:
            batches.fail(exc)
            return


class WindowCell:
    """A window read once in this process for every unit that needs it
    (``placement="consumer"``): the first read thread to ask reads it, the others wait for
    that read rather than make their own, as the units of the Dask placements share one
    window task."""

    def __init__(self, context: EpochContext, window: int) -> None:
        self.context = context
        self._window = window
        self._lock = threading.Lock()
        self._arrays: dict[str, np.ndarray] | None = None

    def get(self) -> dict[str, np.ndarray]:
        with self._lock:  # held by a thread that is reading, never by a queued one
            if self._arrays is None:
                self._arrays = load_window(self.context, self._window)
            return self._arrays

    def serves(self, context: EpochContext) -> bool:
        """Whether this cell reads its window as ``context`` would (the same epoch's plan
        and data: a head start's cell serves the epoch it was made for, no other)."""
        mine, theirs = self.context, context
        return mine is theirs or (mine.digest == theirs.digest
                                  and mine.open()[1] == theirs.open()[1])

    def release(self) -> None:
        """Let go of the window's arrays (a unit that still asks reads it again)."""
        with self._lock:
            self._arrays = None


def compute_here(context: EpochContext, unit: Unit, device: torch.device,
                 finish: Finish | None, cells: Sequence[WindowCell] | None, timeout: float,
                 delivered: concurrent.futures.Future[Sequence[Tensors]]) -> None:
    """A unit read, cut and turned into tensors on a read thread of this process
    (``placement="consumer"``): one thread hop from the read to the consumer. ``cells``:
    the unit's windows, shared with the units next to it (one read for all).

    ``delivered`` gets the batches once the unit's first window is read, as a
    :class:`Finishing` that this thread fills batch by batch, each as soon as the windows
    it lies in are read: a unit's last batch may lie in the next group as well, and the
    batches before it do not wait for that group's read."""
    if not delivered.set_running_or_notify_cancel():
        return  # the consumer let go of the unit before it was read
    read: dict[int, dict[str, np.ndarray]] = {}

    def window(w: int) -> dict[str, np.ndarray]:
        if w not in read:
            k = unit.windows.index(w)
            read[w] = cells[k].get() if cells is not None else load_window(context, w)
        return read[w]

    batches: Finishing | None = None
    try:
        for index, pieces in enumerate(unit.pieces):
            within = tuple(dict.fromkeys(p.window for p in pieces))
            batch = _finished(assemble_batches((pieces,), within,
                                               *[window(w) for w in within]), device, finish)
            if batches is None:
                batches = Finishing(len(unit.pieces), timeout)
                delivered.set_result(batches)
            batches.put(index, batch[0])
    except BaseException as exc:  # handed to the consumer, which raises it
        failed = exc
        if isinstance(exc, BlockFailed):
            failed = PipelineError(exc.args[0])
            failed.__cause__ = exc.original
        if batches is None:
            delivered.set_exception(failed)
        else:
            batches.fail(failed)


@dataclasses.dataclass(frozen=True, slots=True)
class Delivery:
    """How a batch reaches the training loop: on which device, as a dict or as ``(x, y)``."""

    device: torch.device
    as_dict: bool
    features_name: str
    targets_name: str | None
    roles: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Each array's role, which dict batches carry (:class:`NamedBatch`)."""
    finish: Finish | None = None
    """The transform's last part, on the accelerator after the copy (on the CPU it runs on
    the fetch thread instead: see :mod:`~dasktrain.pipeline.finish`)."""

    def __call__(self, tensors: Tensors) -> Batch:
        if self.device.type != "cpu":
            tensors = {n: t.to(self.device, non_blocking=True) for n, t in tensors.items()}
            if self.finish is not None:
                tensors = self.finish(tensors)
        if self.as_dict:
            return NamedBatch(tensors, self.roles)
        x = tensors[self.features_name]
        return x if self.targets_name is None else (x, tensors[self.targets_name])
