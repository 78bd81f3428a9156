"""``Trainer``: data-parallel training on a Dask cluster through a central parameter holder."""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import os
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import dask.array as da
import numpy as np
import torch
from distributed import Client

from dasktrain._cluster import cluster_client
from dasktrain._durable import StorageOptions, check_storage_options
from dasktrain.datasets import Dataset, open_dataset
from dasktrain.pipeline import EpochPlan, Pipeline
from dasktrain.trainer.driver.checkpoint import load_checkpoint, save_checkpoint
from dasktrain.trainer.driver.inference import (
    ForwardFunction,
    evaluate_on_cluster,
    predict_on_cluster,
)
from dasktrain.trainer.driver.run import FitRun
from dasktrain.trainer.driver.update_log import UpdateLog, records_of
from dasktrain.trainer.errors import TrainingDiverged
from dasktrain.trainer.exchange.buckets import BUCKET_BYTES
from dasktrain.trainer.flat import FlatModel
from dasktrain.trainer.holder.actor import HolderConfig
from dasktrain.trainer.holder.divergence import check_policy
from dasktrain.trainer.holder.shards import check_shards
from dasktrain.trainer.modes import mode_class
from dasktrain.trainer.optim import OptimizerConfig
from dasktrain.trainer.view.callbacks import Callback, as_callbacks, tell_exception
from dasktrain.trainer.view.history import History
from dasktrain.trainer.worker.compute import (
    BatchCompute,
    MetricFunction,
    MetricTotals,
    StepFunction,
    check_compute_options,
)
from dasktrain.trainer.worker.loop import LossFunction, WorkerConfig

__all__ = ["Trainer"]

ModelSpec = Callable[[], torch.nn.Module] | torch.nn.Module
_PIPELINE_OPTIONS = ("shuffle", "seed", "transform", "prefetch", "shuffle_blocks",
                     "block_rows", "drop_last", "as_dict")


def _copy_of(module: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(module)


def _merge_mode_options(given: dict[str, Any] | None, keywords: dict[str, Any]
                        ) -> dict[str, Any]:
    if given is None:
        return keywords
    if not isinstance(given, dict):
        raise TypeError(f"mode_options must be a dict, got {type(given).__name__}")
    both = sorted(set(given) & set(keywords))
    if both:
        raise TypeError(f"mode option(s) {both} given both in mode_options and as keywords")
    return {**given, **keywords}


def _checkpoint_history(state: dict[str, Any], path: str | os.PathLike,
                        storage_options: StorageOptions | None = None) -> History:
    """The History of a checkpoint: its summary, and the per-update records from the update
    log beside it up to the checkpoint's version (a fit checkpoint) or from the file itself
    (a :meth:`Trainer.save`)."""
    history = History.from_dict(state["history"])
    if not history.version and "holder" in state:
        log = UpdateLog(path, storage_options=storage_options)
        rows = log.read(up_to_version=int(state["holder"]["version"]))
        history.extend(records_of(rows))
    return history


_FUNCTION = "function:"


def _name_of(value: Any) -> Any:
    """A function as a comparable name (``function:module.qualname``); None stays None."""
    if value is None:
        return None
    module = getattr(value, "__module__", None) or "?"
    name = getattr(value, "__qualname__", None) or type(value).__qualname__
    return f"{_FUNCTION}{module}.{name}"


def _dataset_key(dataset: Dataset) -> str:
    """Which data a run trains on: the dataset's identity and its rows."""
    return f"{dataset.identity}[{dataset.start}:{dataset.stop}]"


def _merged_metrics(reports: list[dict[str, Any]]) -> dict[str, float]:
    """The epoch's training metrics over every worker's batches (sample-weighted means)."""
    totals = MetricTotals()
    for report in reports:
        totals.merge(report.get("metrics") or {})
    return totals.means()


def _load_callback_states(callbacks: list[Callback], states: list[dict[str, Any]]) -> None:
    """Give each callback its state from the checkpoint (matched by position and type)."""
    for callback, saved in zip(callbacks, states, strict=False):
        if saved.get("type") == type(callback).__name__:
            callback.load_state_dict(saved.get("state") or {})


def _check_clip(norm: float | None, value: float | None) -> None:
    for name, limit in (("clip_grad_norm", norm), ("clip_grad_value", value)):
        if limit is not None and not (isinstance(limit, (int, float)) and
                                      math.isfinite(limit) and limit > 0):
            raise ValueError(f"{name} must be a positive number, got {limit!r}")


def _factory(model: ModelSpec) -> Callable[[], torch.nn.Module]:
    if isinstance(model, torch.nn.Module):
        return functools.partial(_copy_of, model)
    if callable(model):
        return model
    raise TypeError(f"model must be a torch.nn.Module or a function returning one, got "
                    f"{type(model).__name__}")


class Trainer:
    """Train one model with ``workers`` replicas on a Dask cluster.

    Each worker is a long-running Dask task with its own model replica and its own shard
    of every epoch (a :class:`~dasktrain.Pipeline` with ``rank=worker``). It pushes each
    batch's gradient to the parameter holder, an actor on one worker that runs the
    optimizer, and continues from the parameters the holder sends back.

    Parameters
    ----------
    model
        A function returning a fresh ``torch.nn.Module`` (called once on the holder, whose
        parameters every worker then starts from, and once per worker) or a module (copied).
    loss
        ``loss(output, target) -> scalar tensor``, a mean over the batch (e.g.
        ``torch.nn.functional.cross_entropy``). May be None when ``step`` is given.
    optimizer
        ``dt.optim.sgd(...)``, ``adam``, ``adamw``, or the large-batch ``lars`` and ``lamb``.
    mode
        ``"sync"`` (all workers' gradients averaged per step: the same as one process
        training on the union of their batches), ``"average"`` (local steps, parameters
        averaged every ``average_every``), ``"soft"`` (the first ``wait_for`` gradients
        per update), ``"ssp"`` (on arrival, within ``staleness_bound`` clocks) or
        ``"async"`` (each gradient applied on arrival); see the README's mode guide.
    workers
        Model replicas (Dask tasks).
    batch_size
        Samples per batch **per worker**, as in DDP: a ``sync`` step averages ``workers``
        batches, so the global batch is ``workers x batch_size``.
    seed, shuffle, transform, prefetch, shuffle_blocks, block_rows, drop_last
        Passed to each worker's :class:`~dasktrain.Pipeline`.
    device
        Device of the workers' replicas; default CUDA where a worker sees a GPU, else CPU.
        When the cluster's workers declare a ``GPU`` resource, each trainer task asks for 1.
    holder_worker
        Address of the worker to hold the parameters; default: the one with most memory.
        With ``holder_shards``, the worker of the first shard.
    holder_shards
        Split the holder into this many actors, each keeping a slice of whole parameter
        tensors and its optimizer state, on workers spread over the cluster's hosts (see
        :mod:`dasktrain.trainer.holder.shards`): each host then carries its share of the exchange
        instead of one holder's interface carrying every worker's. For clusters of several
        machines; on one host, memory shared with a single holder costs less. ``sync``
        mode only, without ``clip_grad_norm``. Default 1.
    timeout
        Seconds any single wait (a batch, an exchange) may take before failing.
    barrier_timeout
        Seconds a ``sync`` step waits for a silent (but alive) worker before going on
        without it.
    direct_channel
        Workers in other processes than the holder push gradients and receive parameters
        over a direct TCP connection to the holder's worker (on ``tcp://`` clusters; a
        worker that cannot connect falls back by itself). False: every exchange goes
        through the holder actor's Dask calls, several milliseconds slower per step.
    shared_memory
        A worker on the holder's host (a LocalCluster, the GPUs of one machine) shares
        memory with the holder over the direct channel. On the CPU the holder reads its
        gradients where backward wrote them and writes fresh parameters into its model (on
        CUDA the host copies go into and out of that memory instead), so no payload
        byte goes through a socket. False: payloads travel on the channel's local socket.
    bucket_bytes
        On the direct channel a gradient leaves in buckets of whole tensors of at least
        this many bytes, each as soon as backward has computed it (last layers first), so
        the transfer overlaps the rest of backward (as DDP's ``bucket_cap_mb``). Default
        1 MiB; a size over the model's puts the whole gradient in one bucket.
    on_nonfinite
        ``"raise"`` (default): a non-finite loss or gradient stops the run with
        :class:`~dasktrain.TrainingDiverged`. ``"skip"``: the gradient is refused (counted in
        ``History.refused_gradients``) and the run goes on, unless every gradient is refused
        for ``nonfinite_patience`` rounds in a row, which also stops it. A batch whose loss
        is not finite counts in no epoch mean, and in the epoch's ``"skipped_steps"``.
    nonfinite_patience
        See ``on_nonfinite``; a round is one gradient per worker.
    checkpoint_every
        Also checkpoint every this many updates (taken by the holder at exactly those
        update counts), not only at epoch ends.
    progress
        Show a progress bar (notebook-aware).
    torch_threads
        Intra-op threads of torch in each worker process (1 keeps workers from
        oversubscribing the cores; 0 leaves torch's default).
    step
        ``step(model, batch) -> loss`` or ``-> {"loss": loss, "metric": value, ...}``, in
        place of ``loss(model(x), y)``: for models of several inputs, dict batches
        (``as_dict=True``) and auxiliary losses. The other entries are training metrics.
    metrics
        Named ``fn(output, target)`` measured on training batches (default step) and on
        validation; their epoch means go in the History (``epochs[i]["train"]`` and
        ``["validation"]``).
    precision
        ``"32"`` (default), ``"bf16"`` (autocast to bfloat16; CPU and GPU) or ``"fp16"``
        (autocast to float16 with dynamic loss scaling; for GPUs). The holder keeps
        float32 master parameters and receives float32 gradients.
    as_dict
        Batches are dicts of tensors keyed by array name (for a custom ``step``).
    clip_grad_norm, clip_grad_value
        Clip the gradient the holder applies to this global norm, or each value to
        ``[-v, v]``: in ``sync`` the averaged gradient, exactly as
        ``torch.nn.utils.clip_grad_norm_`` on the union batch; in the other gradient
        modes each applied (averaged) gradient; in ``average`` each worker's local step.
    mode_options, **more_mode_options
        Options of the mode, as a dict or as keywords (not both for the same option).
        Unknown options are refused by the mode.
    """

    def __init__(
        self,
        model: ModelSpec,
        loss: LossFunction,
        optimizer: OptimizerConfig,
        mode: str = "sync",
        workers: int = 2,
        batch_size: int = 32,
        *,
        seed: int = 0,
        shuffle: bool = True,
        transform: Callable | None = None,
        prefetch: int = 4,
        shuffle_blocks: int = 1,
        block_rows: int | None = None,
        drop_last: bool = False,
        device: str | None = None,
        holder_worker: str | None = None,
        holder_shards: int = 1,
        timeout: float = 300.0,
        barrier_timeout: float = 120.0,
        direct_channel: bool = True,
        shared_memory: bool = True,
        bucket_bytes: int = BUCKET_BYTES,
        on_nonfinite: str = "raise",
        nonfinite_patience: int = 10,
        checkpoint_every: int | None = None,
        progress: bool = True,
        torch_threads: int = 1,
        step: StepFunction | None = None,
        metrics: dict[str, MetricFunction] | None = None,
        precision: str = "32",
        as_dict: bool = False,
        clip_grad_norm: float | None = None,
        clip_grad_value: float | None = None,
        mode_options: dict[str, Any] | None = None,
        **more_mode_options: Any,
    ) -> None:
        self._factory = _factory(model)
        mode_options = _merge_mode_options(mode_options, more_mode_options)
        metrics = dict(metrics or {})
        check_compute_options(loss, step, metrics, precision)
        _check_clip(clip_grad_norm, clip_grad_value)
        if not isinstance(optimizer, OptimizerConfig):
            raise TypeError("optimizer must come from dt.optim (e.g. dt.optim.sgd(lr=0.1))")
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be a positive integer, got {workers!r}")
        mode_class(mode).check(workers, mode_options)  # unknown modes and options fail here
        check_shards(holder_shards, mode, clip_grad_norm)
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if checkpoint_every is not None and checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every!r}")
        if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be a positive integer, got {bucket_bytes!r}")
        if timeout <= 0 or barrier_timeout <= 0:
            raise ValueError("timeout and barrier_timeout must be positive")
        check_policy(on_nonfinite, nonfinite_patience)
        self.loss = loss
        self.compute = BatchCompute(loss, step, metrics, precision)
        self.clip_grad_norm = clip_grad_norm
        self.clip_grad_value = clip_grad_value
        self.optimizer = optimizer
        self.mode = mode
        self.mode_options = mode_options
        self.workers = workers
        self.batch_size = batch_size
        self.pipeline_options = {"seed": seed, "shuffle": shuffle, "transform": transform,
                                 "prefetch": prefetch, "shuffle_blocks": shuffle_blocks,
                                 "block_rows": block_rows, "drop_last": drop_last,
                                 "as_dict": bool(as_dict)}
        self.device = device
        self.holder_worker = holder_worker
        self.holder_shards = holder_shards
        self.timeout = timeout
        self.barrier_timeout = barrier_timeout
        self.direct_channel = direct_channel
        self.shared_memory = bool(shared_memory)
        self.bucket_bytes = bucket_bytes
        self.on_nonfinite = on_nonfinite
        self.nonfinite_patience = nonfinite_patience
        self.checkpoint_every = checkpoint_every
        self.show_progress = progress
        self.torch_threads = torch_threads
        self.model: torch.nn.Module = self._factory()
        """A plain module holding the latest parameters (after :meth:`fit`)."""
        # A parameter group naming no tensor of this model is a typo: say so before a fit.
        optimizer.check_names([n for n, p in self.model.named_parameters() if p.requires_grad])
        self._flat: FlatModel | None = None
        self.history: History | None = None
        self.last_checkpoint: str | None = None
        self.stop_training = False
        """Set by a callback (e.g. :class:`~dasktrain.EarlyStopping`) to end the fit after
        the current epoch, as in Keras."""
        self._current_run: FitRun | None = None

    # -- data --------------------------------------------------------------------------
    def _resolve(self, data: Dataset | Pipeline | str | os.PathLike
                 ) -> tuple[Dataset, dict[str, Any]]:
        options = dict(self.pipeline_options)
        if isinstance(data, Pipeline):
            if data.batch_size != self.batch_size:
                raise ValueError(f"the pipeline's batch_size {data.batch_size} differs from "
                                 f"the trainer's {self.batch_size} (per worker)")
            options.update({k: getattr(data, k) for k in _PIPELINE_OPTIONS})
            return data.dataset, options
        return (data if isinstance(data, Dataset) else open_dataset(data)), options

    def _plan(self, dataset: Dataset, options: dict[str, Any], epoch: int) -> EpochPlan:
        return EpochPlan(dataset.start, dataset.stop, options["block_rows"] or
                         dataset.chunk_rows, self.batch_size, options["seed"], epoch,
                         options["shuffle"], options["shuffle_blocks"], options["drop_last"])

    def _config(self) -> dict[str, Any]:
        """The settings that define a run (stored in checkpoints; plain values only)."""
        options = self.pipeline_options
        return {"mode": self.mode, "workers": self.workers, "batch_size": self.batch_size,
                "seed": options["seed"], "shuffle": options["shuffle"],
                "shuffle_blocks": options["shuffle_blocks"],
                "block_rows": options["block_rows"], "drop_last": options["drop_last"],
                "transform": _name_of(options["transform"]),
                "as_dict": options["as_dict"], "step": _name_of(self.compute.step),
                "precision": self.compute.precision,
                "clip_grad_norm": self.clip_grad_norm,
                "clip_grad_value": self.clip_grad_value,
                "optimizer": self.optimizer.to_dict(),
                "mode_options": {k: _name_of(v) if callable(v) else v
                                 for k, v in self.mode_options.items()}}

    # -- training ----------------------------------------------------------------------
    def fit(
        self,
        data: Dataset | Pipeline | str | os.PathLike,
        epochs: int,
        validation: Dataset | str | os.PathLike | None = None,
        client: Client | None = None,
        checkpoint: str | os.PathLike | None = None,
        resume: str | os.PathLike | None = None,
        callbacks: Iterable[Callback | Callable[[Trainer, dict[str, Any]], Any]] = (),
        storage_options: StorageOptions | None = None,
    ) -> History:
        """Train for ``epochs`` epochs (counted from 0, so a resumed fit runs the rest).

        Parameters
        ----------
        data
            Training data: a dataset (or split), its path, or a :class:`Pipeline` whose
            settings are used by every worker.
        epochs
            Total epochs.
        validation
            Evaluated (mean loss, and accuracy for class labels) after every epoch.
        client
            Dask client; default: the client made in this process, else the process's
            embedded LocalCluster (started on first use, reused, closed at exit).
        checkpoint
            Directory for the run's checkpoint, rewritten atomically at every epoch end
            (and every ``checkpoint_every`` updates).
        resume
            A checkpoint (directory or file) to continue from.
        callbacks
            :class:`~dasktrain.Callback` objects (per update and per epoch hooks, such as
            :class:`~dasktrain.EarlyStopping`) or functions ``fn(trainer, epoch_record)``
            called after every epoch. Setting ``trainer.stop_training = True`` ends the fit
            after the current epoch, with its checkpoint written. If the fit fails, each
            callback's ``on_exception(trainer, error)`` runs before the error propagates.
        storage_options
            Passed to fsspec for a ``checkpoint`` or ``resume`` at a URL (``s3://...``):
            credentials, endpoint. Without them, fsspec's configuration and the
            environment apply.
        """
        if not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs must be a positive integer, got {epochs!r}")
        dataset, options = self._resolve(data)
        callbacks = as_callbacks(callbacks)
        storage_options = check_storage_options(storage_options)
        self.stop_training = False
        if self.batch_size > len(dataset):
            raise ValueError(f"batch_size {self.batch_size} is larger than the "
                             f"{len(dataset)} samples of {dataset!r}")
        state = (load_checkpoint(resume, storage_options=storage_options)
                 if resume is not None else None)
        kind = mode_class(self.mode)
        per_epoch = [self._plan(dataset, options, e).num_batches for e in range(epochs)]
        total_steps = sum(kind.planned_updates(b, self.workers, self.mode_options)
                          for b in per_epoch)
        epoch_steps = tuple(math.ceil(b / self.workers) for b in per_epoch)
        schedule = kind.schedule_length(epoch_steps, total_steps, self.mode_options)
        if state is not None:
            self._check_resumable(state, dataset, epochs, schedule, epoch_steps)
        history = _checkpoint_history(state, resume, storage_options) if state else \
            History(mode=self.mode, workers=self.workers)
        start = int(state["complete_epochs"]) if state else 0
        holder_config = HolderConfig(
            model=self._factory, optimizer=self.optimizer, workers=self.workers,
            mode=self.mode, mode_options=self.mode_options, total_steps=total_steps,
            barrier_timeout=self.barrier_timeout, torch_threads=self.torch_threads,
            direct_channel=self.direct_channel, shared_memory=self.shared_memory,
            bucket_bytes=self.bucket_bytes,
            on_nonfinite=self.on_nonfinite,
            nonfinite_patience=self.nonfinite_patience, clip_grad_norm=self.clip_grad_norm,
            clip_grad_value=self.clip_grad_value)
        worker_config = WorkerConfig(
            model=self._factory, compute=self.compute, data=dataset, workers=self.workers,
            batch_size=self.batch_size, pipeline_options=options,
            mode=self.mode, mode_options=self.mode_options, optimizer=self.optimizer,
            epoch_steps=epoch_steps, device=self.device, torch_threads=self.torch_threads,
            timeout=self.timeout, clip=(self.clip_grad_norm, self.clip_grad_value))
        self.history = history  # the run's own, growing: callbacks may read and add to it
        bar = self._progress_bar(total_steps, initial=len(history.loss))
        started = time.perf_counter() - history.wall_time
        try:
            with cluster_client(client) as c:
                run = FitRun(c, holder_config, worker_config,
                             holder_worker=self.holder_worker, timeout=self.timeout,
                             shards=self.holder_shards,
                             checkpoint=str(checkpoint) if checkpoint is not None else None,
                             checkpoint_every=self.checkpoint_every,
                             checkpoint_extra=lambda: {
                                 "trainer": self._config(),
                                 "callbacks": [{"type": type(cb).__name__,
                                                "state": cb.state_dict()}
                                               for cb in callbacks],
                                 "run": {"epochs": epochs, "total_steps": total_steps,
                                         "schedule_steps": schedule,
                                         "dataset": _dataset_key(dataset)}},
                             history=history, progress=bar,
                             storage_options=storage_options,
                             on_records=lambda records: [cb.on_update(self, records)
                                                         for cb in callbacks])
                self._current_run = run
                try:
                    self._run(run, c, state, start, epochs, history, started, validation,
                              callbacks)
                except TrainingDiverged:
                    # The holder refused the round that diverged: its parameters are the
                    # last finite ones, worth having in trainer.model.
                    with contextlib.suppress(Exception):
                        self._load(run.parameters())
                    raise
                finally:
                    self._current_run = None
                    if run.last_checkpoint is not None:
                        self.last_checkpoint = str(run.last_checkpoint)
                    run.close()
        except BaseException as exc:
            # What was recorded up to the failure stays available on the error too.
            with contextlib.suppress(AttributeError, TypeError):
                exc.history = history
            history.wall_time = time.perf_counter() - started
            self.history = history
            tell_exception(callbacks, self, exc)
            raise
        finally:
            history.wall_time = time.perf_counter() - started
            self.history = history
            if bar is not None:
                bar.close()
        return history

    def _run(self, run: FitRun, client: Client, state: dict[str, Any] | None, start: int,
             epochs: int, history: History, started: float,
             validation: Dataset | str | os.PathLike | None,
             callbacks: list[Callback]) -> None:
        """The epochs of a fit, from ``start``."""
        if state is not None:
            run.call("load_state_dict", state["holder"])
            run.version = int(state["holder"]["version"])
            _load_callback_states(callbacks, state.get("callbacks") or [])
        for callback in callbacks:
            callback.on_fit_start(self)
        for epoch in range(start, epochs):
            fresh = state is None or epoch != int(state["holder"]["epoch"])
            epoch_started = time.perf_counter()
            reports = run.run_epoch(epoch, fresh)
            self._load(run.parameters())
            record = self._epoch_record(epoch, reports, time.perf_counter() - epoch_started)
            if validation is not None:
                record["validation"] = self.evaluate(validation, client=client)
            history.epochs.append(record)
            run.show_epoch(record)
            history.wall_time = time.perf_counter() - started
            for callback in callbacks:  # before the save: their state goes in with it
                callback.on_epoch_end(self, record)
            run.save(complete_epochs=epoch + 1)
            if self.stop_training:
                history.events.append(f"training stopped after epoch {epoch} by a callback")
                break
        self._load(run.parameters())
        for callback in callbacks:
            callback.on_fit_end(self, history)

    def set_lr_factor(self, factor: float) -> float:
        """During a fit (from a callback): multiply the holder's learning-rate schedule by
        ``factor`` from the next update on (kept in checkpoints); returns it."""
        if self._current_run is None:
            raise ValueError("set_lr_factor works during fit (from a callback) only")
        if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
            raise ValueError(f"the learning-rate factor must be a positive number, got "
                             f"{factor!r}")
        return float(self._current_run.call("set_lr_factor", float(factor)))

    def _check_resumable(self, state: dict[str, Any], dataset: Dataset, epochs: int,
                         schedule: int, epoch_steps: tuple[int, ...]) -> None:
        """Refuse a resume that would change the run.

        Every setting that decides which batches are drawn or how they are applied must
        match the checkpoint's, named in the error if not. More (or fewer) epochs are
        allowed: the learning-rate schedule is then stretched to the new length, and a
        warning says what that does to the learning rate."""
        mine, theirs = self._config(), state.get("trainer", {})
        for key, value in mine.items():
            if key in theirs and theirs[key] != value:
                raise ValueError(f"cannot resume: the checkpoint was made with {key}="
                                 f"{theirs[key]!r}, this trainer has {key}={value!r}; "
                                 "resuming would change the run (use the checkpoint's "
                                 "setting, or start afresh)")
        run = state.get("run", {})
        if run.get("dataset") not in (None, _dataset_key(dataset)):
            raise ValueError(f"cannot resume: the checkpoint was made on dataset "
                             f"{run['dataset']!r}, this fit is on {_dataset_key(dataset)!r}")
        before = run.get("schedule_steps", run.get("total_steps",
                                                    state["holder"].get("total_steps")))
        if before is not None and before != schedule:
            kind = mode_class(self.mode)
            step = kind.schedule_position(state["holder"], epoch_steps, self.mode_options)
            old = self.optimizer.lr_at(step, before)
            new = self.optimizer.lr_at(step, schedule)
            note = (f"resuming with epochs={epochs} (the checkpoint's run had "
                    f"{run.get('epochs', '?')}): the schedule now spans {schedule} "
                    f"steps instead of {before}")
            if old != new:
                warnings.warn(f"{note}, so the learning rate at step {step} changes from "
                              f"{old:.4g} to {new:.4g}", stacklevel=3)

    def _progress_bar(self, total: int, initial: int) -> Any:
        if not self.show_progress:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=total, initial=initial, unit="update",
                    desc=f"{self.mode} x{self.workers}")

    def _epoch_record(self, epoch: int, reports: list[dict[str, Any]], wall: float
                      ) -> dict[str, Any]:
        samples = sum(r["samples"] for r in reports)
        return {
            "epoch": epoch,
            "wall_s": wall,
            "samples": samples,
            "samples_per_s": samples / wall if wall > 0 else 0.0,
            "stall": float(np.mean([r["stall"] for r in reports])) if reports else None,
            "exchange_s": float(np.mean([r["exchange_s"] for r in reports]))
            if reports else None,
            "workers_finished": len(reports),
            # How each worker reached the holder: in its process, direct channel, actor.
            "exchange_via": dict(Counter(r["exchange_via"] for r in reports)),
            "train": _merged_metrics(reports),
            # Batches whose loss was not finite (on_nonfinite="skip"): refused by the
            # holder, and left out of "train" so that one bad batch cannot make it NaN.
            "skipped_steps": sum(int(r.get("skipped_nonfinite", 0)) for r in reports),
            # Per worker, so a report can show which replica waited on data or lagged.
            "per_worker": [
                {"worker": int(r["worker"]), "samples": int(r["samples"]),
                 "stall": float(r["stall"]),
                 "samples_per_s": r["samples"] / r["elapsed_s"] if r["elapsed_s"] > 0 else 0.0,
                 # Of the stall, the wait for the epoch's first batch (the pipeline starting).
                 "first_batch_s": float(r.get("first_batch_s", 0.0)),
                 # "shared", "local" or "tcp" over the direct channel; None without one.
                 "transport": r.get("transport"),
                 # Pushes sent bucket by bucket during backward (direct channel only).
                 "pushes_in_buckets": int(r.get("pushes_in_buckets", 0))}
                for r in sorted(reports, key=lambda r: r["worker"])],
        }

    def _load(self, values: np.ndarray) -> None:
        if self._flat is None:
            self._flat = FlatModel(self.model)
        self._flat.load(values)

    # -- evaluation and persistence ----------------------------------------------------
    def evaluate(self, data: Dataset | str | os.PathLike, *, batch_size: int = 1024,
                 client: Client | None = None) -> dict[str, float]:
        """Mean loss and metrics of :attr:`model` over ``data`` (and accuracy where the
        targets are class labels), computed by tasks on the cluster's workers, one per
        chunk of rows."""
        dataset = data if isinstance(data, Dataset) else open_dataset(data)
        with cluster_client(client) as c:
            return evaluate_on_cluster(self.model, self.compute, dataset, c,
                                       batch_size=batch_size,
                                       as_dict=self.pipeline_options["as_dict"],
                                       threads=self.torch_threads)

    def predict(self, data: Dataset | str | os.PathLike, *, batch_size: int = 1024,
                forward: ForwardFunction | None = None) -> da.Array:
        """The outputs of :attr:`model` on every row of ``data``, as a lazy dask array (one
        task per chunk of rows, run on the cluster when computed).

        ``forward(model, batch) -> output`` replaces ``model(x)`` for models of several
        inputs (batches are dicts with ``as_dict=True``).
        """
        dataset = data if isinstance(data, Dataset) else open_dataset(data)
        return predict_on_cluster(copy.deepcopy(self.model), dataset, batch_size=batch_size,
                                  forward=forward, as_dict=self.pipeline_options["as_dict"],
                                  threads=self.torch_threads)

    def save(self, path: str | os.PathLike, *,
             storage_options: StorageOptions | None = None) -> str:
        """Save the model's parameters, the trainer's settings and the history (atomic);
        ``storage_options`` go to fsspec for a ``path`` at a URL."""
        written = save_checkpoint(path, {
            "model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
            "trainer": self._config(),
            "history": self.history.to_dict() if self.history else None},
            storage_options=check_storage_options(storage_options))
        return str(written)

    @classmethod
    def load(cls, path: str | os.PathLike, model: ModelSpec,
             loss: LossFunction = torch.nn.functional.mse_loss, *,
             storage_options: StorageOptions | None = None) -> Trainer:
        """A trainer with the parameters saved by :meth:`save` (or the latest of a fit's
        checkpoint). ``model`` builds the architecture: code is never read from the file.
        ``storage_options`` go to fsspec for a ``path`` at a URL."""
        storage_options = check_storage_options(storage_options)
        state = load_checkpoint(path, storage_options=storage_options)
        config = state.get("trainer")
        if config is None:
            raise ValueError(f"{path} holds no trainer settings")
        mode_options = config.get("mode_options") or {}
        if not isinstance(mode_options, dict):
            raise ValueError(f"{path}: the stored mode options are not a mapping")
        # A function given as an option is stored by name only (a file never names code
        # to import): such options are left out here and must be given again to fit.
        mode_options = {k: v for k, v in mode_options.items()
                        if not (isinstance(v, str) and v.startswith(_FUNCTION))}
        # One dict, checked by the mode: a file never sets other constructor arguments.
        trainer = cls(model, loss, OptimizerConfig.from_dict(config["optimizer"]),
                      config["mode"], config["workers"], config["batch_size"],
                      seed=config["seed"], mode_options=mode_options)
        if "model" in state:
            trainer.model.load_state_dict(state["model"])
        else:  # a fit checkpoint: the holder's flat parameters then buffers
            holder = state["holder"]
            trainer._load(torch.cat([holder["params"], holder["buffers"]]).numpy())
        if state.get("history"):
            trainer.history = _checkpoint_history(state, path, storage_options)
        return trainer
