"""The body of :meth:`Trainer.fit`: plan the run, start it on the cluster, run its epochs.

The Trainer hands itself over as a :class:`FitHost`, the interface this module reads and
sets, so that it never imports the Trainer's module (which imports this one).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import numpy as np
import torch
from distributed import Client, span

from dasktrain._cluster import cluster_client
from dasktrain._durable import StorageOptions, check_storage_options
from dasktrain.datasets import Dataset, open_dataset
from dasktrain.pipeline import EpochPlan, Pipeline
from dasktrain.pipeline.named import check_pair_batches
from dasktrain.trainer.driver.checkpoint import load_checkpoint
from dasktrain.trainer.driver.epoch_records import epoch_ends, epoch_record
from dasktrain.trainer.driver.resume import (
    check_resumable,
    checkpoint_history,
    dataset_key,
    load_callback_states,
)
from dasktrain.trainer.driver.run import FitRun
from dasktrain.trainer.driver.settings import (
    TrainerSettings,
    check_loss_given,
    resolve_assignment,
    saved_settings,
)
from dasktrain.trainer.driver.vocabulary import check_vocabulary, computing
from dasktrain.trainer.errors import TrainingDiverged
from dasktrain.trainer.holder.config import HolderConfig
from dasktrain.trainer.modes import mode_class
from dasktrain.trainer.view.callbacks import (
    Callback,
    RunningTrainer,
    as_callbacks,
    steers,
    tell_exception,
)
from dasktrain.trainer.view.history import History
from dasktrain.trainer.worker.loop import WorkerConfig

__all__ = ["FitHost", "fit_trainer"]

_PIPELINE_OPTIONS = ("shuffle", "seed", "transform", "prefetch", "shuffle_blocks",
                    "block_rows", "drop_last", "as_dict")
"""The Pipeline's settings that a fit on a :class:`Pipeline` takes from it."""


class FitHost(TrainerSettings, RunningTrainer, Protocol):
    """What a fit reads and sets of its Trainer, besides the settings and what callbacks
    see; the underscored members are the Trainer's own state, not its public API."""

    last_checkpoint: str | None
    _factory: Callable[[], torch.nn.Module]
    _current_run: FitRun | None

    def _load(self, values: np.ndarray) -> None: ...

    def evaluate(self, data: Dataset | str | os.PathLike, *, batch_size: int = 1024,
                 client: Client | None = None) -> dict[str, float]: ...


def _resolve(trainer: FitHost, data: Dataset | Pipeline | str | os.PathLike
             ) -> tuple[Dataset, dict[str, Any]]:
    """The dataset of ``data`` and the pipeline options of the workers."""
    options = dict(trainer.pipeline_options)
    if isinstance(data, Pipeline):
        if data.batch_size != trainer.batch_size:
            raise ValueError(f"the pipeline's batch_size {data.batch_size} differs from "
                             f"the trainer's {trainer.batch_size} (per worker)")
        options.update({k: getattr(data, k) for k in _PIPELINE_OPTIONS})
        return data.dataset, options
    return (data if isinstance(data, Dataset) else open_dataset(data)), options


def _plan(dataset: Dataset, options: dict[str, Any], batch_size: int, epoch: int
          ) -> EpochPlan:
    return EpochPlan(dataset.start, dataset.stop, options["block_rows"] or
                     dataset.chunk_rows, batch_size, options["seed"], epoch,
                     options["shuffle"], options["shuffle_blocks"], options["drop_last"])


def _progress_bar(trainer: FitHost, total: int, initial: int) -> Any:
    if not trainer.show_progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, unit="update",
                desc=f"{trainer.mode} x{trainer.workers}")


def fit_trainer(trainer: FitHost, data: Dataset | Pipeline | str | os.PathLike, epochs: int,
                validation: Dataset | str | os.PathLike | None, client: Client | None,
                checkpoint: str | os.PathLike | None, resume: str | os.PathLike | None,
                callbacks: Iterable[Callback | Callable], storage_options: StorageOptions | None
                ) -> History:
    """:meth:`Trainer.fit` (see there)."""
    if not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs must be a positive integer, got {epochs!r}")
    check_loss_given(trainer.compute)
    dataset, options = _resolve(trainer, data)
    # Token ids beyond the model's embedding: refused by name here, not by a worker's
    # bare IndexError.
    check_vocabulary(trainer.model, dataset, options["as_dict"], computing(trainer.compute),
                     "fit")
    if not options["as_dict"]:
        check_pair_batches(dataset)  # here, not in each worker's pipeline: before any task
    callbacks = as_callbacks(callbacks)
    storage_options = check_storage_options(storage_options)
    trainer.stop_training = False
    if trainer.batch_size > len(dataset):
        raise ValueError(f"batch_size {trainer.batch_size} is larger than the "
                         f"{len(dataset)} samples of {dataset!r}")
    state = (load_checkpoint(resume, storage_options=storage_options)
             if resume is not None else None)
    kind = mode_class(trainer.mode)
    assignment = resolve_assignment(trainer.assignment, trainer.mode, trainer.holder_shards)
    per_epoch = [_plan(dataset, options, trainer.batch_size, e).num_batches
                 for e in range(epochs)]
    total_steps = sum(kind.planned_updates(b, trainer.workers, trainer.mode_options)
                      for b in per_epoch)
    epoch_steps = tuple(math.ceil(b / trainer.workers) for b in per_epoch)
    schedule = kind.schedule_length(epoch_steps, total_steps, trainer.mode_options)
    if state is not None:
        check_resumable(trainer, state, dataset, epochs, schedule, epoch_steps)
    history = checkpoint_history(state, resume, storage_options) if state else \
        History(mode=trainer.mode, workers=trainer.workers)
    start = int(state["complete_epochs"]) if state else 0
    holder_config = HolderConfig(
        model=trainer._factory, optimizer=trainer.optimizer, workers=trainer.workers,
        batch_size=trainer.batch_size,
        mode=trainer.mode, mode_options=trainer.mode_options, total_steps=total_steps,
        barrier_timeout=trainer.barrier_timeout, torch_threads=trainer.torch_threads,
        direct_channel=trainer.direct_channel, shared_memory=trainer.shared_memory,
        balance=trainer.balance, bucket_bytes=trainer.bucket_bytes,
        on_nonfinite=trainer.on_nonfinite,
        nonfinite_patience=trainer.nonfinite_patience, clip_grad_norm=trainer.clip_grad_norm,
        clip_grad_value=trainer.clip_grad_value, assignment=assignment,
        elastic=trainer.min_workers < trainer.workers, min_workers=trainer.min_workers)
    worker_config = WorkerConfig(
        model=trainer._factory, compute=trainer.compute, data=dataset,
        workers=trainer.workers, batch_size=trainer.batch_size, pipeline_options=options,
        mode=trainer.mode, mode_options=trainer.mode_options, optimizer=trainer.optimizer,
        epoch_steps=epoch_steps, device=trainer.device, torch_threads=trainer.torch_threads,
        timeout=trainer.timeout, clip=(trainer.clip_grad_norm, trainer.clip_grad_value),
        assignment=assignment, pause_dask_profiler=trainer.pause_dask_profiler)
    trainer.history = history  # the run's own, growing: callbacks may read and add to it
    bar = _progress_bar(trainer, total_steps, initial=history.updates)
    started = time.perf_counter() - history.wall_time
    try:
        # One Dask span for the fit's tasks: without it each computation between idle
        # moments opens a span the scheduler keeps, and every submission outside a span
        # walks the default span's task groups, a walk that grows with the fit.
        with cluster_client(client) as c, span("dasktrain-fit"):
            run = FitRun(c, holder_config, worker_config,
                         holder_worker=trainer.holder_worker, timeout=trainer.timeout,
                         shards=trainer.holder_shards,
                         checkpoint=str(checkpoint) if checkpoint is not None else None,
                         checkpoint_every=trainer.checkpoint_every,
                         checkpoint_extra=lambda: {
                             "trainer": saved_settings(trainer),
                             "callbacks": [{"type": type(cb).__name__,
                                            "state": cb.state_dict()}
                                           for cb in callbacks],
                             "run": {"epochs": epochs, "total_steps": total_steps,
                                     "schedule_steps": schedule,
                                     "dataset": dataset_key(dataset)}},
                         history=history, progress=bar,
                         storage_options=storage_options, min_workers=trainer.min_workers,
                         on_records=lambda records: [cb.on_update(trainer, records)
                                                     for cb in callbacks])
            # Bounded only now: the run's log has been rewritten from every record.
            history.keep(trainer.history_updates)
            trainer._current_run = run
            try:
                _run_epochs(trainer, run, c, state, start, epochs, history, started,
                            validation, callbacks)
            except TrainingDiverged:
                # The holder refused the round that diverged: its parameters are the
                # last finite ones, worth having in trainer.model.
                with contextlib.suppress(Exception):
                    trainer._load(run.parameters())
                raise
            finally:
                trainer._current_run = None
                if run.last_checkpoint is not None:
                    trainer.last_checkpoint = str(run.last_checkpoint)
                run.close()
    except BaseException as exc:
        # What was recorded up to the failure stays available on the error too.
        with contextlib.suppress(AttributeError, TypeError):
            exc.history = history
        history.wall_time = time.perf_counter() - started
        trainer.history = history
        tell_exception(callbacks, trainer, exc)
        raise
    finally:
        history.wall_time = time.perf_counter() - started
        trainer.history = history
        if bar is not None:
            bar.close()
    return history


def _run_epochs(trainer: FitHost, run: FitRun, client: Client, state: dict[str, Any] | None,
                start: int, epochs: int, history: History, started: float,
                validation: Dataset | str | os.PathLike | None,
                callbacks: list[Callback]) -> None:
    """The epochs of a fit, from ``start``."""
    if state is not None:
        run.call("load_state_dict", state["holder"])
        run.version = int(state["holder"]["version"])
        load_callback_states(callbacks, state.get("callbacks") or [])
    for callback in callbacks:
        callback.on_fit_start(trainer)
    ends: dict[int, float] = {}  # each worker's last step of the epoch before
    # The next epoch begins as soon as this one is complete, while the driver validates,
    # calls back and checkpoints on the holder's snapshot of the boundary, unless a
    # callback may steer the run at the epoch's end (see Callback.steers).
    steered = run.steered = steers(callbacks)
    values = None
    epoch_started = time.perf_counter()
    for epoch in range(start, epochs):
        fresh = state is None or epoch != int(state["holder"]["epoch"])
        reports = run.run_epoch(epoch, fresh, epochs - 1, queue_next=not steered)
        # An epoch lasts from the end of the one before, as the driver learns of each.
        ended = time.perf_counter()
        values, holder_state = run.boundary(epoch)
        trainer._load(values)
        record = epoch_record(epoch, reports, ended - epoch_started, ends,
                              applied=run.applied_samples, applied_loss=run.applied_loss)
        epoch_started = ended
        ends = epoch_ends(reports)
        if run.worker_config.assignment == "dynamic":
            shares = run.shares  # a list by worker: a History's JSON keeps it as it is
            record["batches_per_worker"] = [shares.get(w, 0) for w in
                                            range(max(shares, default=-1) + 1)]
        if validation is not None:
            record["validation"] = trainer.evaluate(validation, client=client)
        run.records.record_epoch(record)
        run.records.show_epoch(record)
        history.wall_time = time.perf_counter() - started
        for callback in callbacks:  # before the save: their state goes in with it
            callback.on_epoch_end(trainer, record)
        # Where callbacks steer, the holder waited for them (they may have set its learning
        # rate factor): the state to keep is its own now, which save takes (None).
        run.save(complete_epochs=epoch + 1, holder_state=holder_state)
        if trainer.stop_training:
            run.records.add_events([f"training stopped after epoch {epoch} by a callback"])
            break
        if steered and epoch + 1 < epochs:
            run.queue(epoch + 1)
    run.finish(stopped=trainer.stop_training)
    # The last epoch's end (an epoch begun before a stop that no callback made is undone).
    trainer._load(values if values is not None else run.parameters())
    for callback in callbacks:
        callback.on_fit_end(trainer, history)

