"""``Pipeline``: batches planned on the consumer, produced by Dask tasks, prefetched with a
bound, handed over as torch tensors.

This module is the façade and the consumer's side of an epoch; the feeder thread that
submits (:mod:`~dasktrain.pipeline.feeder`), the head start into the next epoch
(:mod:`~dasktrain.pipeline.ahead`), submission (:mod:`~dasktrain.pipeline.submit`) and the
hand-off of batches (:mod:`~dasktrain.pipeline.fetch`) live beside it.

:class:`Pipeline` stays one piece of some 410 lines: an iteration by rank and one of work
claimed on demand share the consumer's loop, and with the plan, the resume state and the
head start into the next epoch they read and move the same epoch position.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

import torch
from dask.base import tokenize
from distributed import Client, get_client

from dasktrain._cluster import embedded_client
from dasktrain.datasets import Dataset, open_dataset
from dasktrain.pipeline.ahead import HeadStart, start_now
from dasktrain.pipeline.budget import PrefetchBudget, prefetch_rows, unit_rows
from dasktrain.pipeline.errors import PipelineError
from dasktrain.pipeline.feeder import Feeder
from dasktrain.pipeline.fetch import Batch, Delivery, Tensors, unit_where
from dasktrain.pipeline.finish import split_transform
from dasktrain.pipeline.named import check_pair_batches
from dasktrain.pipeline.plan import TASK_ROWS, EpochPlan, Unit, check_shares
from dasktrain.pipeline.stats import PipelineStats
from dasktrain.pipeline.submit import (
    PLACEMENTS,
    LocalReaders,
    Submitter,
    inside_task,
    placement_kwargs,
    release,
)
from dasktrain.pipeline.tasks import ArraysRef, Transform, forget_groups

__all__ = ["Pipeline"]

logger = logging.getLogger(__name__)

#: Seconds :meth:`Pipeline.close` waits for each part of its work still running.
_CLOSE_WAIT = 10.0
_STATE_KEYS = ("seed", "batch_size", "world_size", "rank", "num_samples", "shuffle",
               "shuffle_blocks", "block_rows", "drop_last", "shares")
# May differ at an epoch boundary: the next epoch is cut anew.
_RECUT_KEYS = ("world_size", "rank", "shares")


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
        dataset. Default (None): 4 groups, or two batches for each process that reads
        this consumer's blocks if that is more (``2 x ceil(readers / world_size) x
        batch_size`` rows, as a DataLoader's two batches per worker process), so that
        every worker of a large cluster has work even where a batch spans many chunks
        (images: a 4 MiB chunk holds a few dozen of them).
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
    shares
        Rows of each rank's batch, one count per rank adding up to ``world_size x
        batch_size`` (default: ``batch_size`` each). Step ``k`` of all ranks together still
        covers the same rows, so a faster consumer can take more of them; see
        :meth:`set_shares`.
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
        Yield dicts of tensors keyed by array name instead of ``(x, y)``
        (:class:`NamedBatch`, which also knows each array's role). A dataset of several
        features (or targets) arrays needs them: ``(x, y)`` would leave some out.
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
        prefetch: int | None = None,
        prefetch_next_epoch: bool = True,
        shuffle_blocks: int = 1,
        block_rows: int | None = None,
        task_rows: int = TASK_ROWS,
        drop_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
        shares: Sequence[int] | None = None,
        device: str | torch.device | None = None,
        client: Client | None = None,
        placement: str = "auto",
        as_dict: bool = False,
        timeout: float = 300.0,
    ) -> None:
        self.dataset = data if isinstance(data, Dataset) else open_dataset(data)
        n = len(self.dataset)
        encoded = self.dataset.encoded_arrays
        checks = [
            (isinstance(batch_size, int) and batch_size > 0,
             f"batch_size must be a positive integer, got {batch_size!r}"),
            (isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0,
             f"seed must be a non-negative integer, got {seed!r}"),
            (prefetch is None or (isinstance(prefetch, int) and prefetch >= 1),
             f"prefetch must be None or >= 1, got {prefetch!r}"),
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
            (placement in PLACEMENTS,
             f"placement must be one of {PLACEMENTS}, got {placement!r}"),
            (timeout > 0, f"timeout must be positive, got {timeout!r}"),
            (transform is None or callable(transform), "transform must be callable"),
            # Bytes make no tensor: an encoded image dataset is read through its decoder.
            (transform is not None or not encoded,
             f"array(s) {encoded} of {self.dataset!r} hold encoded images (the files' "
             "bytes): give a transform that decodes them, e.g. "
             "transform=dasktrain.pipeline.images.ImageTransform()"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if shares is not None:
            check_shares(tuple(shares), world_size, batch_size, drop_last)
        if batch_size > n:
            raise ValueError(f"batch_size {batch_size} is larger than the {n} samples of "
                             f"{self.dataset!r}; use a smaller batch or more data")
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.transform = transform
        # The transform's element-wise tail (an image batch's floats) runs on this side
        self._worker_transform, finish = split_transform(transform)
        self.prefetch = prefetch
        self.prefetch_next_epoch = bool(prefetch_next_epoch)
        self.shuffle_blocks = shuffle_blocks
        self.block_rows = block_rows or self.dataset.chunk_rows
        self.task_rows = task_rows
        self.drop_last = drop_last
        self.rank = rank
        self.world_size = world_size
        self._shares = tuple(shares) if shares is not None else None
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.placement = placement if placement != "auto" else \
            ("consumer" if transform is None else "anywhere")
        # The read threads of placement="consumer"; made and shut down on the consumer's
        # thread, used by the feeder of each epoch.
        self._local: LocalReaders | None = None
        self.as_dict = as_dict
        self.timeout = float(timeout)
        self.stats = PipelineStats()
        self._client = client
        # The next epoch's head start, once a feeder handed it over: the consumer's alone.
        self._ahead: HeadStart | None = None
        self._late: list[Feeder] = []  # feeders that ended after their iteration did
        self._epoch = 0
        self._position = 0  # batches of the current epoch already handed to the consumer
        # Looked up once: it runs for every batch.
        if not as_dict:
            check_pair_batches(self.dataset)
        on_cpu = self.device.type == "cpu"
        self._finish_here = finish if on_cpu else None
        self._deliver = Delivery(self.device, as_dict, self.dataset.features_name,
                                 self.dataset.targets_name, self.dataset.roles,
                                 None if on_cpu else finish)
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

    @property
    def shares(self) -> tuple[int, ...] | None:
        """Rows of each rank's batch (None: ``batch_size`` each)."""
        return self._shares

    def set_shares(self, shares: Sequence[int] | None) -> None:
        """Cut the next epoch's steps into these rows per rank (every rank must be given
        the same); only between epochs."""
        shares = tuple(shares) if shares is not None else None
        if shares == self._shares:
            return
        if self._position != 0:
            raise ValueError("shares can only change between epochs, not at batch "
                             f"{self._position} of epoch {self._epoch}")
        if shares is not None:
            check_shares(shares, self.world_size, self.batch_size, self.drop_last)
        self._shares = shares

    def plan(self, epoch: int | None = None) -> EpochPlan:
        """The epoch's plan (pure: the same for every rank, worker count and run)."""
        # Without a transform a window costs a read, whose size barely matters to when the
        # first batch is ready: one window per group, no ramp (same order either way).
        cut = self.transform is not None
        return EpochPlan(self.dataset.start, self.dataset.stop, self.block_rows,
                         self.batch_size, self.seed, self._epoch if epoch is None else epoch,
                         self.shuffle, self.shuffle_blocks, self.drop_last,
                         self.task_rows if cut else self.shuffle_blocks * self.block_rows,
                         ramp=cut, shares=self._shares)

    def __len__(self) -> int:
        return len(self.plan().rank_batches(self.rank, self.world_size))

    # -- state -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where the consumer is: resume with :meth:`load_state_dict` for the same batches."""
        return {"epoch": self._epoch, "position": self._position, "seed": self.seed,
                "batch_size": self.batch_size, "world_size": self.world_size,
                "rank": self.rank, "num_samples": len(self.dataset), "shuffle": self.shuffle,
                "shuffle_blocks": self.shuffle_blocks, "block_rows": self.block_rows,
                "drop_last": self.drop_last,
                "shares": list(self._shares) if self._shares is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next batches are those an uninterrupted run yields.

        A different ``world_size``/``rank``/``shares`` is accepted at an epoch boundary
        (position 0) — the next epoch is re-sharded — but not mid-epoch.
        """
        mine = self.state_dict()
        for key in _STATE_KEYS:
            if key in _RECUT_KEYS and state.get("position", 0) == 0:
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
        """Drop work submitted ahead; outside a Dask task, let it and the feeders, fetches
        and reads end first (seconds at most): a script may close the cluster next."""
        wait = 0.0 if inside_task() else _CLOSE_WAIT
        for feeder in self._late:
            feeder.stop(wait)
        self._late.clear()
        self._drop_ahead(drain=wait)
        if self._local is not None:
            self._local.shutdown(wait=bool(wait))  # a read takes ms
            self._local = None
            forget_groups(self._token)

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- iteration ---------------------------------------------------------------------
    def _submitter(self) -> Submitter:
        """How this iteration's feeder submits. Made here, on the consumer's thread: inside a
        Dask task the worker's client and address are only visible from the task's own
        thread, not from the feeder."""
        client = None
        if self.placement == "consumer":
            if self._local is None:
                self._local = LocalReaders()
        else:
            client = self.client
        return Submitter(placement=self.placement, token=self._token, rank=self.rank,
                         world_size=self.world_size, ref=self._ref,
                         transform=self._worker_transform, device=self.device,
                         timeout=self.timeout, client=client,
                         kwargs=placement_kwargs(self.placement, client), local=self._local,
                         finish=self._finish_here)

    def _prefetch_rows(self, submitter: Submitter) -> int:
        return prefetch_rows(self.prefetch, self.shuffle_blocks * self.block_rows,
                             submitter.readers, self.world_size, self.batch_size)

    def start(self) -> None:
        """Begin reading the current epoch's first batches now, before the iteration asks
        for them: a consumer with setup of its own (a trainer building its model) then
        finds them in hand. As the head start into a next epoch, it takes as much of the
        prefetch as an iteration would, and is dropped unused if the iteration is another
        (other shares, a resumed position, another rank or epoch)."""
        if self._ahead is None and self._position == 0:
            submitter = self._submitter()
            self._ahead = start_now(self.plan, self._epoch, submitter,
                                    self._prefetch_rows(submitter), self.stats)

    def _drop_ahead(self, drain: float = 0.0) -> None:
        """Forget work submitted for an epoch that will not come next (letting it finish
        for up to ``drain`` seconds first: see :meth:`HeadStart.release`)."""
        if self._ahead is not None:
            self.stats.add_in_flight(-self._ahead.release(drain))
            self._ahead = None

    def _take_ahead(self, epoch: int, units: list[Unit]) -> HeadStart | None:
        """The head start for this iteration if it is one; otherwise it is dropped."""
        ahead = self._ahead
        if ahead is not None and self._position == 0 \
                and ahead.continues(epoch, self.rank, self.world_size, units):
            self._ahead = None
            return ahead
        self._drop_ahead()
        return None

    def _batches_of(self, fetched: concurrent.futures.Future[Sequence[Tensors]],
                    plan: EpochPlan, unit: Unit) -> Sequence[Tensors]:
        try:
            # The fetch itself waits with a deadline; a read here has this one.
            return fetched.result(timeout=self.timeout)
        except TimeoutError:
            raise PipelineError(f"no data for {unit_where(plan, unit)} after "
                                f"{self.timeout:.0f}s") from None

    def __iter__(self) -> Iterator[Batch]:
        epoch, skip = self._epoch, self._position
        plan = self.plan(epoch)
        units = plan.units(self.rank, self.world_size)
        while units and skip >= len(units[0].batches):  # resume: whole units already consumed
            skip -= len(units[0].batches)
            units.pop(0)
        ahead = self._take_ahead(epoch, units)
        carried = ahead.rows if ahead is not None else 0
        submitter = self._submitter()
        budget = PrefetchBudget(max(self._prefetch_rows(submitter) - carried, 0))
        # The head start, if any, is the feeder's from here on.
        for _, batch in self._run(plan, budget, lambda unit: unit_rows(plan, unit), skip,
                                  units=units, ahead=ahead, submitter=submitter):
            yield batch

    def claiming(self, claim: Callable[[threading.Event], range | None], *,
                 ahead: int = 2) -> Generator[tuple[int, Batch], None, None]:
        """One epoch of work claimed on demand: ``(global batch index, batch)`` pairs.

        ``claim(stop)`` is called on the pipeline's feeder thread for the next run of
        consecutive global batches of :meth:`plan` to read (a range), or None once there is
        no more for this consumer; it should return soon after ``stop`` is set (the consumer
        stopped reading). At most ``ahead`` claimed runs are in flight or waiting to be
        consumed, so a slow consumer holds little work that a faster one could have taken.
        Claiming ignores ``rank`` and the resume position: whoever hands out the runs keeps
        track of what is done (see :mod:`dasktrain.trainer.holder.ledger`).
        """
        if not isinstance(ahead, int) or ahead < 1:
            raise ValueError(f"ahead must be a positive integer, got {ahead!r}")
        plan = self.plan(self._epoch)
        self._drop_ahead()

        def unit_claim(stop: threading.Event) -> Unit | None:
            run = claim(stop)
            return None if run is None else plan.unit_of(run)

        yield from self._run(plan, PrefetchBudget(ahead), lambda unit: 1, 0,
                             claim=unit_claim)

    def _run(self, plan: EpochPlan, budget: PrefetchBudget, cost: Callable[[Unit], int],
             skip: int, *, units: list[Unit] | None = None, ahead: HeadStart | None = None,
             claim: Callable[[threading.Event], Unit | None] | None = None,
             submitter: Submitter | None = None) -> Iterator[tuple[int, Batch]]:
        """The consumer's side of one epoch: ``(global batch, batch)`` of the units the
        feeder queues (``units``, or those it claims), from batch ``skip`` of the first."""
        epoch = plan.epoch
        stats = self.stats
        stats.start_epoch()
        feeder = Feeder(plan, units or [], ahead, submitter or self._submitter(), budget, stats,
                        plan_for=self.plan if self.prefetch_next_epoch and claim is None
                        else None, claim=claim)
        feeder.start()
        completed = False
        held = None  # the unit being used up: the consumer's from the queue until it is
        done = 0  # units used up
        # Prefetch a used-up unit frees, handed back once the next batch is in hand: the
        # feeder then submits while the consumer is away with it, not while the consumer
        # waits for it (both want this process's GIL; ~1 ms of every unit's first batch).
        freed = 0
        try:
            while True:
                started = time.perf_counter()
                if freed and not feeder.has_next():  # the feeder needs the room to go on
                    budget.release(freed)
                    freed = 0
                held = feeder.next_unit(self.timeout)
                if held is None:
                    budget.release(freed)  # the head start into the next epoch uses it
                    break
                unit = feeder.handed[done]
                batches = self._batches_of(held[1], plan, unit)
                for i in range(len(batches) - skip):
                    tensors = batches[skip + i]  # waits while its floats are made
                    batch = self._deliver(tensors)
                    rows = len(next(iter(tensors.values())))
                    stats.record_batch(time.perf_counter() - started, rows,
                                       sum(t.nbytes for t in tensors.values()))
                    self._position += 1
                    if freed:
                        budget.release(freed)
                        freed = 0
                    yield unit.batches[skip + i], batch
                    started = time.perf_counter()
                held, skip = None, 0
                stats.blocks_done += 1
                stats.add_in_flight(-1)
                freed += cost(unit)
                done += 1
            completed = True
        finally:
            if held is not None:  # interrupted within a unit
                release(held[0])
                held[1].cancel()
                stats.add_in_flight(-1)
            head = feeder.finish(completed)
            self._late = [f for f in (*self._late, feeder) if f.running()]  # see close()
            if head is not None:
                if completed:
                    self._ahead = head
                else:  # an interrupted epoch resumes mid-way: the head start is moot
                    stats.add_in_flight(-head.release())
        stats.finished = time.perf_counter()
        self._epoch, self._position = epoch + 1, 0

    def __repr__(self) -> str:
        return (f"<dasktrain.Pipeline {self.dataset!r} batch_size={self.batch_size} "
                f"epoch={self._epoch} rank={self.rank}/{self.world_size}>")
