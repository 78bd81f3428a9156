"""``Pipeline``: batches planned on the consumer, produced by Dask tasks, prefetched with a
bound, handed over as torch tensors."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import CancelledError
from typing import Any

import numpy as np
import torch
from dask.base import tokenize
from distributed import Client, Future, get_client, get_worker, wait
from distributed.client import FutureCancelledError

from dasktrain._cluster import embedded_client, worker_info
from dasktrain.datasets import Dataset, open_dataset
from dasktrain.pipeline.errors import PipelineError
from dasktrain.pipeline.plan import TASK_ROWS, EpochPlan, Unit
from dasktrain.pipeline.stats import PipelineStats
from dasktrain.pipeline.tasks import (
    ArraysRef,
    BlockFailed,
    EpochContext,
    Transform,
    assemble_batches,
    load_unit,
    load_window,
)

__all__ = ["Pipeline"]

logger = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor] | torch.Tensor | dict[str, torch.Tensor]
_PLACEMENTS = ("auto", "anywhere", "local", "consumer")
_STATE_KEYS = ("seed", "batch_size", "world_size", "rank", "num_samples", "shuffle",
               "shuffle_blocks", "block_rows", "drop_last")


class _Budget:
    """Rows of prefetch still free: a unit takes its window's rows until it is used up.

    Counted in rows rather than units so that the small windows that start an epoch (see
    :class:`~dasktrain.pipeline.plan.EpochPlan`) do not take a whole slot each."""

    def __init__(self, rows: int) -> None:
        self._free = rows
        self._cond = threading.Condition()

    def acquire(self, rows: int, timeout: float) -> bool:
        with self._cond:
            if self._free < rows:
                self._cond.wait(timeout)
            if self._free >= rows:
                self._free -= rows
                return True
            return False

    def release(self, rows: int) -> None:
        with self._cond:
            self._free += rows
            self._cond.notify_all()


def _release(future: Future | concurrent.futures.Future) -> None:
    """Let go of a unit's result: a Dask future is released, a local one cancelled."""
    if isinstance(future, Future):
        future.release()
    else:
        future.cancel()


def _unit_rows(plan: EpochPlan, unit: Unit) -> int:
    span = plan.window_spans[unit.window]
    return span.stop - span.start




@dataclasses.dataclass
class _Ahead:
    """Units of the next epoch submitted while the current one finished."""

    epoch: int
    rank: int
    world_size: int
    submitted: list[tuple[Unit, Any]] = dataclasses.field(default_factory=list)
    windows: dict[int, Future] = dataclasses.field(default_factory=dict)
    rows: int = 0  # of the prefetch budget, held by the submitted units

    def release(self) -> None:
        for _, future in self.submitted:
            _release(future)
        for future in self.windows.values():
            future.release()
        self.submitted.clear()
        self.windows.clear()


class Pipeline:
    """Batches of a dataset (or split), produced on a Dask cluster while you train.

    Use it like a DataLoader: ``for x, y in pipeline: ...`` runs one epoch and moves on to the
    next epoch the next time it is iterated.

    Parameters
    ----------
    data
        A :class:`~dasktrain.Dataset` (e.g. ``ds.split("train")``) or a dataset path.
    batch_size
        Samples per batch, per rank (as in DDP).
    shuffle
        Permute blocks each epoch and shuffle rows within windows of ``shuffle_blocks``
        blocks. With False, batches follow the stored order.
    seed
        Seeds every random choice together with the epoch: same seed, same batches.
    transform
        ``transform(arrays, rng) -> arrays``: a function of a dict of numpy arrays (a block of
        rows, keyed by array name) and a :class:`numpy.random.Generator` seeded from
        (seed, epoch, block). It runs in Dask tasks on the workers and must keep the number
        of rows. Pure functions only: it may run more than once for a block.
    prefetch
        Groups of blocks' worth of rows in flight for this consumer: memory held for it is
        at most about ``prefetch x shuffle_blocks x block_rows`` rows, however large the
        dataset.
    prefetch_next_epoch
        Once an epoch is all submitted, let the freed prefetch slots start on the next
        epoch, so that its first batches are ready when it begins (within the same
        ``prefetch`` bound). That work is dropped if the next iteration is another epoch
        or position (:meth:`set_epoch`, :meth:`load_state_dict`) or never comes.
    shuffle_blocks
        Blocks whose rows are shuffled together; larger mixes better and costs more memory.
    block_rows
        Rows of a block, the unit of the block permutation and of reading (default: the
        dataset's chunk rows). One task transforms at most ``task_rows`` of them; the first
        tasks of an epoch fewer (one piece of 256 rows or one batch, then doubling), so that
        the first batch is ready after one piece of transform work.
    task_rows
        Most rows one task transforms (whole pieces of 256 rows, or of one batch when
        larger). Neither the order nor the transformed values depend on it.
    drop_last
        Drop the last global batch if it is partial.
    rank, world_size
        This consumer's part of each epoch: global batches ``rank, rank + world_size, ...``.
    device
        Where batches land (``"cuda"``: pinned memory and non-blocking copies); default CPU.
    client
        The Dask client to use; default: the current one, else a LocalCluster owned by the
        pipeline (closed by :meth:`close`).
    placement
        Where blocks are read and transformed: ``"anywhere"`` on the cluster, ``"local"``
        in tasks on the consumer's own worker, ``"consumer"`` in threads of the consuming
        process (no Dask tasks, nothing to transfer). ``"auto"`` (default): ``"consumer"``
        without a transform (reading and shuffling cost less than moving the rows from a
        worker), ``"anywhere"`` with one.
    as_dict
        Yield dicts of tensors keyed by array name instead of ``(x, y)``.
    timeout
        Seconds to wait for one block before failing with a clear error.
    """

    def __init__(
        self,
        data: Dataset | str | os.PathLike,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        transform: Transform | None = None,
        prefetch: int = 4,
        prefetch_next_epoch: bool = True,
        shuffle_blocks: int = 1,
        block_rows: int | None = None,
        task_rows: int = TASK_ROWS,
        drop_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
        device: str | torch.device | None = None,
        client: Client | None = None,
        placement: str = "auto",
        as_dict: bool = False,
        timeout: float = 300.0,
    ) -> None:
        self.dataset = data if isinstance(data, Dataset) else open_dataset(data)
        n = len(self.dataset)
        checks = [
            (isinstance(batch_size, int) and batch_size > 0,
             f"batch_size must be a positive integer, got {batch_size!r}"),
            (isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0,
             f"seed must be a non-negative integer, got {seed!r}"),
            (isinstance(prefetch, int) and prefetch >= 1,
             f"prefetch must be >= 1, got {prefetch!r}"),
            (isinstance(shuffle_blocks, int) and shuffle_blocks >= 1,
             f"shuffle_blocks must be >= 1, got {shuffle_blocks!r}"),
            (block_rows is None or (isinstance(block_rows, int) and block_rows > 0),
             f"block_rows must be a positive integer, got {block_rows!r}"),
            (isinstance(task_rows, int) and task_rows > 0,
             f"task_rows must be a positive integer, got {task_rows!r}"),
            (isinstance(world_size, int) and world_size >= 1,
             f"world_size must be >= 1, got {world_size!r}"),
            (isinstance(rank, int) and 0 <= rank < max(world_size, 1),
             f"rank must lie in [0, world_size={world_size}), got {rank!r}"),
            (placement in _PLACEMENTS,
             f"placement must be one of {_PLACEMENTS}, got {placement!r}"),
            (timeout > 0, f"timeout must be positive, got {timeout!r}"),
            (transform is None or callable(transform), "transform must be callable"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if batch_size > n:
            raise ValueError(f"batch_size {batch_size} is larger than the {n} samples of "
                             f"{self.dataset!r}; use a smaller batch or more data")
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.transform = transform
        self.prefetch = prefetch
        self.prefetch_next_epoch = bool(prefetch_next_epoch)
        self.shuffle_blocks = shuffle_blocks
        self.block_rows = block_rows or self.dataset.chunk_rows
        self.task_rows = task_rows
        self.drop_last = drop_last
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.placement = placement if placement != "auto" else \
            ("consumer" if transform is None else "anywhere")
        self._here: concurrent.futures.ThreadPoolExecutor | None = None
        self.as_dict = as_dict
        self.timeout = float(timeout)
        self.stats = PipelineStats()
        self._client = client
        self._ahead: _Ahead | None = None  # the next epoch's head start
        self._ahead_pending: _Ahead | None = None  # the one the feeder is building
        self._epoch = 0
        self._position = 0  # batches of the current epoch already handed to the consumer
        # Looked up once: _deliver runs for every batch.
        self._features_name = self.dataset.features_name
        self._targets_name = self.dataset.targets_name
        names = tuple(self.dataset.array_names)
        self._ref = ArraysRef(names, tuple(self.dataset.zarr_array(n) for n in names))
        # Names this pipeline's tasks. Every rank must arrive at the same token (ranks share
        # window tasks), and no other data may: the dataset's identity tells a dataset
        # rewritten at the same URL from the build a client may still hold results of.
        self._token = tokenize(self.dataset.url, self.dataset.identity, self.dataset.start,
                               self.dataset.stop, names, self.block_rows, self.batch_size, seed,
                               shuffle, shuffle_blocks, drop_last, task_rows, transform)

    # -- the plan ----------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch the next iteration yields (or is yielding)."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Start the next iteration at the beginning of ``epoch``."""
        if epoch < 0:
            raise ValueError(f"epoch must be non-negative, got {epoch}")
        self._epoch, self._position = epoch, 0
        if self._ahead is not None and self._ahead.epoch != epoch:
            self._drop_ahead()

    def plan(self, epoch: int | None = None) -> EpochPlan:
        """The epoch's plan (pure: the same for every rank, worker count and run)."""
        # Without a transform a window costs a read, whose size barely matters to when the
        # first batch is ready: one window per group, no ramp (same order either way).
        cut = self.transform is not None
        return EpochPlan(self.dataset.start, self.dataset.stop, self.block_rows,
                         self.batch_size, self.seed, self._epoch if epoch is None else epoch,
                         self.shuffle, self.shuffle_blocks, self.drop_last,
                         self.task_rows if cut else self.shuffle_blocks * self.block_rows,
                         ramp=cut)

    def __len__(self) -> int:
        return len(self.plan().rank_batches(self.rank, self.world_size))

    # -- state -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where the consumer is: resume with :meth:`load_state_dict` for the same batches."""
        return {"epoch": self._epoch, "position": self._position, "seed": self.seed,
                "batch_size": self.batch_size, "world_size": self.world_size,
                "rank": self.rank, "num_samples": len(self.dataset), "shuffle": self.shuffle,
                "shuffle_blocks": self.shuffle_blocks, "block_rows": self.block_rows,
                "drop_last": self.drop_last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next batches are those an uninterrupted run yields.

        A different ``world_size``/``rank`` is accepted at an epoch boundary (position 0) —
        the next epoch is re-sharded — but not mid-epoch.
        """
        mine = self.state_dict()
        for key in _STATE_KEYS:
            if key in ("world_size", "rank") and state.get("position", 0) == 0:
                continue
            if state.get(key) != mine[key]:
                raise ValueError(f"cannot resume: the state has {key}={state.get(key)!r}, this "
                                 f"pipeline {key}={mine[key]!r}")
        self._epoch, self._position = int(state["epoch"]), int(state["position"])
        if self._position != 0 or (self._ahead is not None and self._ahead.epoch != self._epoch):
            self._drop_ahead()

    # -- the cluster -------------------------------------------------------------------
    @property
    def client(self) -> Client:
        if self._client is None:
            try:
                self._client = get_client()
            except ValueError:  # no client of the user's: the process's embedded cluster
                self._client = embedded_client()
        return self._client

    def close(self) -> None:
        """Drop work submitted ahead (the embedded cluster, if used, stays for later
        calls)."""
        self._drop_ahead()
        if self._here is not None:
            self._here.shutdown(wait=False, cancel_futures=True)
            self._here = None

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _submit_kwargs(self) -> dict[str, Any]:
        if self.placement == "consumer":
            return {}
        if self.placement == "local":
            try:
                return {"workers": [get_worker().address], "allow_other_workers": False}
            except ValueError:
                raise PipelineError("placement='local' needs the consumer to run on a Dask "
                                    "worker (e.g. inside a trainer task)") from None
        # Any worker, but named: the scheduler never holds restricted tasks in its queue of
        # root-ish tasks. Unrestricted, a burst of blocks is partly queued there and partly
        # sent to workers at once (Dask decides per task, by the size and dependencies of its
        # group), and the ones sent ahead run before earlier blocks still queued, so the
        # next batch waits. Sent at once, each worker runs its blocks in priority order; the
        # pipeline bounds what is in flight itself (``prefetch``).
        workers = sorted(self.client.scheduler_info(n_workers=-1)["workers"])
        return {"workers": workers, "allow_other_workers": True} if workers else {}

    def _submit(self, context: EpochContext, epoch: int, stride: int, unit: Unit,
                windows: dict[int, Future], kwargs: dict[str, Any]
                ) -> Future | concurrent.futures.Future:
        if self.placement == "consumer":
            if self._here is None:
                # Two threads: one decodes (zarr and its codecs release the GIL) while the
                # other shuffles and cuts; units still finish in order, near enough.
                self._here = concurrent.futures.ThreadPoolExecutor(
                    2, thread_name_prefix="dasktrain-read")
            return self._here.submit(self._compute_here, context, unit)
        client = self.client
        key = (f"dasktrain-batches-{self._token}-{epoch}-{self.rank}of{self.world_size}-"
               f"{unit.window}")
        # Submissions in a burst (or from inside a task) share one scheduler generation,
        # which would leave their order to chance: ask for consumption order explicitly.
        kwargs = {"priority": -(epoch * (stride + 1) + unit.batches[0]), **kwargs}
        if unit.exclusive:
            return client.submit(load_unit, context, unit.window, unit.pieces, key=key,
                                 **kwargs)
        # The window is shared (with other ranks, or with a neighbouring unit): one task
        # reads it, one per unit cuts the batches.
        for w in unit.windows:
            if w not in windows:
                # In the units' task group: one group for all of a pipeline's reads.
                windows[w] = client.submit(
                    load_window, context, w,
                    key=f"dasktrain-batches-{self._token}-{epoch}-window-{w}", **kwargs)
        return client.submit(assemble_batches, unit.pieces, unit.windows,
                             *[windows[w] for w in unit.windows], key=key, **kwargs)

    def _result(self, future: Future, unit: Unit, plan: EpochPlan
                ) -> list[dict[str, np.ndarray]]:
        """Wait for a unit with a deadline, checking that the cluster still has workers."""
        deadline = time.monotonic() + self.timeout
        blocks = [b for w in unit.windows for b in plan.windows[w]]
        where = f"block(s) {blocks} of epoch {plan.epoch}"
        while True:
            try:
                wait([future], timeout=min(2.0, max(deadline - time.monotonic(), 0.01)))
                # Straight from the worker that holds it: through the scheduler, every
                # batch would cost the scheduler's process (often this one) a copy and
                # a hand-off.
                return self.client.gather(future, direct=True)
            except BlockFailed as exc:
                raise PipelineError(exc.args[0]) from exc.original
            except (TimeoutError, OSError) as exc:
                if self.client.status not in ("running", "connecting"):
                    raise PipelineError(f"the Dask client closed while waiting for {where}") \
                        from exc
                if time.monotonic() >= deadline:
                    workers = len(worker_info(self.client))
                    raise PipelineError(f"no data for {where} after {self.timeout:.0f}s "
                                        f"({workers} worker(s) alive)") from exc
            except (CancelledError, FutureCancelledError) as exc:
                raise PipelineError(f"the task for {where} was cancelled") from exc
            except PipelineError:
                raise
            except Exception as exc:  # KilledWorker and anything the cluster raised
                raise PipelineError(f"{where} failed: {type(exc).__name__}: {exc}") from exc

    # -- iteration ---------------------------------------------------------------------
    def _host_tensors(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """CPU tensors sharing the arrays' memory (pinned when the batch goes to CUDA)."""
        tensors = {}
        for name, value in arrays.items():
            if not value.flags.writeable:  # torch wants writable memory; deserialised may not be
                value = value.copy()
            tensor = torch.from_numpy(value)
            tensors[name] = tensor.pin_memory() if self.device.type == "cuda" else tensor
        return tensors

    def _fetch(self, future: Future, unit: Unit, plan: EpochPlan
               ) -> list[dict[str, torch.Tensor]]:
        """Runs on a fetch thread: bring a unit's batches into this process as tensors, so
        that the consumer finds them ready instead of paying a round trip per unit."""
        return [self._host_tensors(arrays) for arrays in self._result(future, unit, plan)]

    def _compute_here(self, context: EpochContext, unit: Unit) -> list[dict[str, torch.Tensor]]:
        """A unit read, cut and turned into tensors on a read thread of this process
        (``placement="consumer"``): one thread hop from the read to the consumer."""
        try:
            batches = assemble_batches(unit.pieces, unit.windows,
                                       *[load_window(context, w) for w in unit.windows])
        except BlockFailed as exc:
            raise PipelineError(exc.args[0]) from exc.original
        return [self._host_tensors(arrays) for arrays in batches]

    def _deliver(self, tensors: dict[str, torch.Tensor]) -> Batch:
        if self.device.type != "cpu":
            tensors = {n: t.to(self.device, non_blocking=True) for n, t in tensors.items()}
        if self.as_dict:
            return tensors
        x = tensors[self._features_name]
        return x if self._targets_name is None else (x, tensors[self._targets_name])

    @staticmethod
    def _take_slot(slots: _Budget, rows: int, stop: threading.Event,
                   finishing: threading.Event | None = None) -> bool:
        """Wait for ``rows`` of free prefetch. False once the consumer has stopped, or (given
        ``finishing``: the epoch is consumed, nothing more will be freed) none is left."""
        while True:
            if slots.acquire(rows, timeout=0.1 if finishing is None else 0.01):
                if stop.is_set():
                    slots.release(rows)
                    return False
                return True
            if stop.is_set() or (finishing is not None and finishing.is_set()):
                return False

    @staticmethod
    def _forget_windows(windows: dict[int, Future], current: int) -> None:
        # Keep a window's future only while a later unit may still need it; the scheduler
        # keeps it for the submitted batch tasks that depend on it.
        for w in [w for w in windows if w < current]:
            del windows[w]

    def _feed(self, plan: EpochPlan, units: list[Unit], out: queue.Queue,
              slots: _Budget, stop: threading.Event,
              fetcher: concurrent.futures.ThreadPoolExecutor, kwargs: dict[str, Any],
              ahead: _Ahead | None, finishing: threading.Event) -> None:
        """Feeder thread: submit units as slots free up, and have each fetched in order.

        All data work (task submission, transfer, conversion) happens off the consumer's
        thread; the consumer only takes ready batches. ``slots`` holds ``prefetch`` permits:
        one is taken per submitted unit and given back when the consumer has used it up.
        Units submitted ahead, while the previous epoch finished, come first and already
        hold their permits. Once this epoch is all submitted, the freed permits go on into
        the next epoch, until the consumer is done with this one and none are left.
        """
        windows = ahead.windows if ahead is not None else {}
        carried = list(ahead.submitted) if ahead is not None else []
        finished = False
        try:
            context = self._context(plan)
            for i, unit in enumerate(units):
                if i < len(carried):
                    future = carried[i][1]
                else:
                    if not self._take_slot(slots, _unit_rows(plan, unit), stop):
                        return
                    future = self._submit(context, plan.epoch, plan.num_batches, unit,
                                          windows, kwargs)
                    self.stats.add_in_flight(1)
                self._forget_windows(windows, unit.window)
                # Read here, the unit's future gives tensors; from the cluster, a fetch
                # thread brings them in.
                out.put((future, future if self.placement == "consumer"
                         else fetcher.submit(self._fetch, future, unit, plan)))
            finished = True
        except BaseException as exc:  # handed to the consumer, which raises it
            out.put((None, exc))
        finally:
            out.put(None)
        if finished and self.prefetch_next_epoch:
            self._feed_ahead(plan.epoch + 1, slots, stop, finishing, kwargs)

    def _feed_ahead(self, epoch: int, slots: _Budget, stop: threading.Event,
                    finishing: threading.Event, kwargs: dict[str, Any]) -> None:
        """Submit ``epoch``'s first units while the consumer finishes the current one."""
        ahead = _Ahead(epoch, self.rank, self.world_size)
        self._ahead_pending = ahead
        try:
            plan = self.plan(epoch)
            context = self._context(plan)
            for unit in plan.units(self.rank, self.world_size):
                rows = _unit_rows(plan, unit)
                if not self._take_slot(slots, rows, stop, finishing):
                    return
                future = self._submit(context, epoch, plan.num_batches, unit, ahead.windows,
                                      kwargs)
                self._forget_windows(ahead.windows, unit.window)
                ahead.submitted.append((unit, future))
                ahead.rows += rows
                self.stats.add_in_flight(1)
        except Exception:  # only a head start: the next epoch submits the rest itself
            logger.debug("submitting epoch %d ahead failed", epoch, exc_info=True)

    def _context(self, plan: EpochPlan) -> EpochContext:
        if self.placement == "consumer":
            return EpochContext.here(f"{self._token}-{plan.epoch}", self._ref, plan,
                                     self.transform)
        return EpochContext.pack(self._ref, plan, self.transform)

    def _drop_ahead(self) -> None:
        """Forget work submitted for an epoch that will not come next."""
        if self._ahead is not None:
            self.stats.add_in_flight(-len(self._ahead.submitted))
            self._ahead.release()
            self._ahead = None

    def _take_ahead(self, epoch: int, units: list[Unit]) -> _Ahead | None:
        """The head start for this iteration if it is one; otherwise it is dropped."""
        ahead = self._ahead
        if ahead is not None and self._position == 0 \
                and (ahead.epoch, ahead.rank, ahead.world_size) == (epoch, self.rank,
                                                                    self.world_size) \
                and units[:len(ahead.submitted)] == [unit for unit, _ in ahead.submitted]:
            self._ahead = None
            return ahead
        self._drop_ahead()
        return None

    def __iter__(self) -> Iterator[Batch]:
        epoch, skip = self._epoch, self._position
        plan = self.plan(epoch)
        units = plan.units(self.rank, self.world_size)
        while units and skip >= len(units[0].batches):  # resume: whole units already consumed
            skip -= len(units[0].batches)
            units.pop(0)
        ahead = self._take_ahead(epoch, units)
        stats = self.stats
        stats.start_epoch()
        out: queue.Queue = queue.Queue()
        carried = ahead.rows if ahead is not None else 0
        slots = _Budget(max(self.prefetch * self.shuffle_blocks * self.block_rows - carried, 0))
        stop, finishing = threading.Event(), threading.Event()
        # Resolved here, on the consumer's thread: inside a Dask task the worker's client and
        # address are only visible from the task's own thread, not from the feeder.
        if self.placement != "consumer":
            _ = self.client
        kwargs = self._submit_kwargs()
        fetcher = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="dasktrain-fetch")
        feeder = threading.Thread(target=self._feed, args=(plan, units, out, slots, stop,
                                                          fetcher, kwargs, ahead, finishing),
                                  name="dasktrain-feeder", daemon=True)
        self._ahead_pending = None
        feeder.start()
        completed = False
        done = 0  # units used up
        try:
            while True:
                started = time.perf_counter()
                try:
                    # Submission is quick, so the feeder answers well within the timeout;
                    # _fetch itself waits with a deadline and a liveness check.
                    item = out.get(timeout=self.timeout)
                except queue.Empty:
                    raise PipelineError(f"the pipeline's feeder gave nothing for "
                                        f"{self.timeout:.0f}s in epoch {epoch}") from None
                if item is None:
                    break
                future, fetched = item
                if future is None:
                    raise PipelineError(f"submitting work for epoch {epoch} failed: "
                                        f"{fetched}") from fetched
                try:
                    # The fetch itself waits with a deadline; a read here has this one.
                    batches = fetched.result(timeout=self.timeout)
                except concurrent.futures.TimeoutError:
                    blocks = [b for w in units[done].windows for b in plan.windows[w]]
                    raise PipelineError(f"no data for block(s) {blocks} of epoch {epoch} "
                                        f"after {self.timeout:.0f}s") from None
                for tensors in batches[skip:]:
                    batch = self._deliver(tensors)
                    rows = len(next(iter(tensors.values())))
                    stats.record_batch(time.perf_counter() - started, rows,
                                       sum(t.nbytes for t in tensors.values()))
                    self._position += 1
                    yield batch
                    started = time.perf_counter()
                skip = 0
                stats.blocks_done += 1
                stats.add_in_flight(-1)
                slots.release(_unit_rows(plan, units[done]))
                done += 1
            completed = True
        finally:
            # A consumed epoch lets the feeder use the slots it freed for the next epoch
            # (a few quick submissions); an interrupted one stops it at once.
            (finishing if completed else stop).set()
            fetcher.shutdown(wait=False, cancel_futures=True)
            feeder.join(timeout=5)
            stop.set()
            while not out.empty():
                item = out.get_nowait()
                if item is not None and item[0] is not None:
                    _release(item[0])
            stats.clear_in_flight()
            pending, self._ahead_pending = self._ahead_pending, None
            if pending is not None:
                if completed and not feeder.is_alive():
                    self._ahead = pending
                    stats.add_in_flight(len(pending.submitted))
                else:  # an interrupted epoch resumes mid-way: the head start is moot
                    pending.release()
        stats.finished = time.perf_counter()
        self._epoch, self._position = epoch + 1, 0

    def __repr__(self) -> str:
        return (f"<dasktrain.Pipeline {self.dataset!r} batch_size={self.batch_size} "
                f"epoch={self._epoch} rank={self.rank}/{self.world_size}>")
