"""``Trainer``: data-parallel training on a Dask cluster through a central parameter holder.

The public class composes the driver's modules: :mod:`.settings` (the checks of its
arguments, its settings as plain data), :mod:`.fitting` (the body of ``fit``, with
:mod:`.resume` and :mod:`.epoch_records`), :mod:`.inference` (``evaluate``, ``predict``)
and :mod:`.persistence` (``save``, ``load``). It stays one piece past 400 lines because
most of it is the class's documentation of its arguments.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from typing import Any

import dask.array as da
import numpy as np
import torch
from distributed import Client

from dasktrain._cluster import cluster_client
from dasktrain._durable import StorageOptions
from dasktrain.datasets import Dataset, open_dataset
from dasktrain.pipeline import Pipeline
from dasktrain.trainer.driver.fitting import fit_trainer
from dasktrain.trainer.driver.inference import (
    ForwardFunction,
    evaluate_on_cluster,
    evaluation_transform,
    predict_on_cluster,
)
from dasktrain.trainer.driver.persistence import read_trainer, save_trainer
from dasktrain.trainer.driver.run import FitRun
from dasktrain.trainer.driver.settings import (
    ModelSpec,
    check_arguments,
    check_loss_given,
    merge_mode_options,
    model_factory,
    resolve_assignment,
    run_settings,
    saved_settings,
    worker_range,
)
from dasktrain.trainer.exchange.buckets import BUCKET_BYTES
from dasktrain.trainer.flat import FlatModel
from dasktrain.trainer.optim import OptimizerConfig
from dasktrain.trainer.view.callbacks import Callback
from dasktrain.trainer.view.history import History
from dasktrain.trainer.worker.compute import BatchCompute, MetricFunction, StepFunction
from dasktrain.trainer.worker.loop import LossFunction

__all__ = ["Trainer"]


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
        Model replicas (Dask tasks): a number, or a range ``(least, most)`` for a run that
        follows the cluster's size (elastic training): it starts once ``least`` Dask
        workers are there, one replica on each, and in ``async``, ``ssp`` and ``soft``
        (work claimed on demand, see ``assignment``) takes up every worker the cluster
        adds mid-epoch up to ``most``, and lets one that is retired or dies go without
        stopping anyone; in ``sync`` and ``average`` the number of replicas follows the
        cluster at each epoch's start (a step then averages that many batches). See the
        docs' "Elastic training".
    batch_size
        Samples per batch **per worker**, as in DDP: a ``sync`` step averages ``workers``
        batches, so the global batch is ``workers x batch_size``.
    seed, shuffle, transform, prefetch, shuffle_blocks, block_rows, drop_last
        Passed to each worker's :class:`~dasktrain.Pipeline`.
    device
        Device of the workers' replicas; default CUDA where a worker sees a GPU, else CPU.
        When the cluster's workers declare a ``GPU`` resource, each trainer task asks for 1.
    holder_worker
        Address of the worker to hold the parameters; default: the one with most memory,
        then the fewest trainer tasks, one rather than none (its updates are serial, and
        share the process's GIL with the trainers there). With ``holder_shards``, the
        worker of the first shard.
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
    balance
        In ``sync``, cut each step's rows among the workers by their measured speeds: the
        holder times each worker's part of a step (its reply, forward and backward, its
        gradient's way back) and from the second epoch on a faster worker takes more of
        each step's ``workers x batch_size`` rows. The rows of a step, and so the update,
        stay the same (to float rounding). False: ``batch_size`` rows each, every step.
    bucket_bytes
        On the direct channel a gradient leaves in buckets of whole tensors of at least
        this many bytes, each as soon as backward has computed it (last layers first), so
        the transfer overlaps the rest of backward (as DDP's ``bucket_cap_mb``); replies come
        back in the same buckets, first layers first, into the next forward pass. Default
        1 MiB; a size over the model's makes one bucket each way.
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
    history_updates
        Keep the per-update and per-gradient records of the last this many updates in the
        :class:`History` (default None: every update's). A record costs the driver about
        0.3 KB, so a run of millions of updates may want a bound; the epoch records and
        the run's totals are kept whole, and the run's log beside a checkpoint keeps every
        update's record.
    progress
        Show a progress bar (notebook-aware).
    torch_threads, pause_dask_profiler
        Intra-op threads of torch in each worker process (1 keeps workers from
        oversubscribing the cores; 0 leaves torch's default); pause Dask's statistical
        profiler on workers while they train (default: it slowed a step by up to 9 %, see
        :mod:`dasktrain.trainer.worker.profiler`).
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
        Batches are dicts of tensors keyed by array name (:class:`~dasktrain.NamedBatch`):
        without a ``step`` the loss is ``loss(model(**batch.inputs), batch.target)`` (the
        features arrays by name), with metrics and accuracy as for ``(x, y)``.
    clip_grad_norm, clip_grad_value
        Clip the gradient the holder applies to this global norm, or each value to
        ``[-v, v]``: in ``sync`` the averaged gradient, exactly as
        ``torch.nn.utils.clip_grad_norm_`` on the union batch; in the other gradient
        modes each applied (averaged) gradient; in ``average`` each worker's local step.
    assignment
        How each epoch's batches reach the workers. ``"dynamic"``: a worker claims the
        next few batches of the epoch from the holder as its pipeline has room to
        prefetch, so a fast worker trains on more of the epoch than a slow one, and work
        a worker claimed goes back to the others if it dies or leaves; every batch is
        still applied once per epoch. ``"static"``: worker ``r`` of ``W`` takes global
        batches ``r, r + W, ...`` (the same stream per rank on every run). ``"auto"``
        (default): dynamic in ``async``, ``ssp`` and ``soft`` with one holder, static in
        ``sync`` and ``average``, whose steps take one batch of every worker.
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
        workers: int | tuple[int, int] = 2,
        batch_size: int = 32,
        *,
        seed: int = 0,
        shuffle: bool = True,
        transform: Callable | None = None,
        prefetch: int | None = None,
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
        balance: bool = True,
        bucket_bytes: int = BUCKET_BYTES,
        on_nonfinite: str = "raise",
        nonfinite_patience: int = 10,
        checkpoint_every: int | None = None,
        history_updates: int | None = None,
        progress: bool = True,
        torch_threads: int = 1,
        pause_dask_profiler: bool = True,
        step: StepFunction | None = None,
        metrics: dict[str, MetricFunction] | None = None,
        precision: str = "32",
        as_dict: bool = False,
        clip_grad_norm: float | None = None,
        clip_grad_value: float | None = None,
        assignment: str = "auto",
        mode_options: dict[str, Any] | None = None,
        **more_mode_options: Any,
    ) -> None:
        self._factory = model_factory(model)
        mode_options = merge_mode_options(mode_options, more_mode_options)
        metrics = dict(metrics or {})
        check_arguments(loss=loss, step=step, metrics=metrics, precision=precision,
                        optimizer=optimizer, mode=mode, mode_options=mode_options,
                        workers=workers, batch_size=batch_size, holder_shards=holder_shards,
                        clip_grad_norm=clip_grad_norm, clip_grad_value=clip_grad_value,
                        checkpoint_every=checkpoint_every, bucket_bytes=bucket_bytes,
                        timeout=timeout, barrier_timeout=barrier_timeout,
                        on_nonfinite=on_nonfinite, nonfinite_patience=nonfinite_patience,
                        history_updates=history_updates)
        self.loss = loss
        self.compute = BatchCompute(loss, step, metrics, precision)
        self.clip_grad_norm = clip_grad_norm
        self.clip_grad_value = clip_grad_value
        self.optimizer = optimizer
        self.mode = mode
        self.mode_options = mode_options
        self.min_workers, self.workers = worker_range(workers)
        """The least and most trainer workers (equal unless ``workers`` is a range)."""
        self.batch_size = batch_size
        self.pipeline_options = {"seed": seed, "shuffle": shuffle, "transform": transform,
                                 "prefetch": prefetch, "shuffle_blocks": shuffle_blocks,
                                 "block_rows": block_rows, "drop_last": drop_last,
                                 "as_dict": bool(as_dict)}
        self.device = device
        self.holder_worker = holder_worker
        self.holder_shards = holder_shards
        resolve_assignment(assignment, mode, holder_shards)  # refuses what cannot be
        self.assignment = assignment
        self.timeout, self.barrier_timeout = timeout, barrier_timeout
        self.direct_channel = direct_channel
        self.shared_memory, self.balance = bool(shared_memory), bool(balance)
        self.bucket_bytes = bucket_bytes
        self.on_nonfinite = on_nonfinite
        self.nonfinite_patience = nonfinite_patience
        self.checkpoint_every = checkpoint_every
        self.history_updates = history_updates
        self.show_progress = progress
        self.torch_threads, self.pause_dask_profiler = torch_threads, bool(pause_dask_profiler)
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

    def _config(self) -> dict[str, Any]:
        """The settings that define a run (plain values only, for loggers), the number of
        workers among them even where a resume may change it."""
        return {**run_settings(self), "workers": saved_settings(self)["workers"]}

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
        return fit_trainer(self, data, epochs, validation, client, checkpoint, resume,
                           callbacks, storage_options)

    def set_lr_factor(self, factor: float) -> float:
        """During a fit (from a callback): multiply the holder's learning-rate schedule by
        ``factor`` from the next update on (kept in checkpoints); returns it."""
        if self._current_run is None:
            raise ValueError("set_lr_factor works during fit (from a callback) only")
        if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
            raise ValueError(f"the learning-rate factor must be a positive number, got "
                             f"{factor!r}")
        return float(self._current_run.call("set_lr_factor", float(factor)))

    def _load(self, values: np.ndarray) -> None:
        if self._flat is None:
            self._flat = FlatModel(self.model)
        self._flat.load(values)

    # -- evaluation and persistence ----------------------------------------------------
    def evaluate(self, data: Dataset | str | os.PathLike, *, batch_size: int = 1024,
                 client: Client | None = None, transform: Callable | None = None
                 ) -> dict[str, float]:
        """Mean loss and metrics of :attr:`model` over ``data`` (and accuracy where the
        targets are class labels), computed by tasks on the cluster's workers, one per
        chunk of rows. A fit's ``validation`` is evaluated this way after every epoch.

        ``transform(arrays, rng) -> arrays`` is applied to the rows before the model; by
        default the deterministic part of the trainer's ``transform`` where it has one
        (``transform.evaluation()``: an ``ImageTransform``'s crops become a centred
        ``Resize``, its flips are left out), else none: the rows as stored."""
        check_loss_given(self.compute)
        dataset = data if isinstance(data, Dataset) else open_dataset(data)
        with cluster_client(client) as c:
            return evaluate_on_cluster(self.model, self.compute, dataset, c,
                                       batch_size=batch_size,
                                       as_dict=self.pipeline_options["as_dict"],
                                       threads=self.torch_threads,
                                       transform=self._evaluation_transform(transform),
                                       device=self.device)

    def predict(self, data: Dataset | str | os.PathLike, *, batch_size: int = 1024,
                forward: ForwardFunction | None = None, client: Client | None = None,
                transform: Callable | None = None) -> da.Array:
        """The outputs of :attr:`model` on every row of ``data``, as a lazy dask array (one
        task per chunk of rows, run on the cluster when computed).

        ``forward(model, batch) -> output`` replaces ``model(x)`` (with ``as_dict=True``,
        ``model(**batch.inputs)``: the features arrays by name) where a model needs more.
        ``transform`` is as for :meth:`evaluate`. ``client`` (default: as for :meth:`fit`)
        is the cluster the model is sent to now, once, and the tasks run on: compute the
        array with that client (``.compute()`` does, when it is the default).
        """
        dataset = data if isinstance(data, Dataset) else open_dataset(data)
        with cluster_client(client) as c:
            return predict_on_cluster(self.model, dataset, c,
                                      batch_size=batch_size, forward=forward,
                                      as_dict=self.pipeline_options["as_dict"],
                                      threads=self.torch_threads,
                                      transform=self._evaluation_transform(transform),
                                      device=self.device)

    def _evaluation_transform(self, given: Callable | None) -> Callable | None:
        return given if given is not None else \
            evaluation_transform(self.pipeline_options["transform"])

    def save(self, path: str | os.PathLike, *,
             storage_options: StorageOptions | None = None) -> str:
        """Save the model's parameters, every setting of the trainer that is plain data
        (functions by name) and the history (atomic); ``storage_options`` go to fsspec for
        a ``path`` at a URL."""
        return save_trainer(path, self.model, saved_settings(self), self.history,
                            storage_options=storage_options)

    @classmethod
    def load(cls, path: str | os.PathLike, model: ModelSpec,
             loss: LossFunction | None = None, *, step: StepFunction | None = None,
             metrics: dict[str, MetricFunction] | None = None,
             transform: Callable | None = None,
             storage_options: StorageOptions | None = None) -> Trainer:
        """A trainer with the parameters and settings saved by :meth:`save` (or the latest
        of a fit's checkpoint).

        ``model`` builds the architecture: code is never read from the file. Every setting
        that is plain data is restored; functions are not, so give ``loss`` (or ``step``),
        ``metrics`` and ``transform`` again. A ``torch.nn.functional`` loss is restored by
        its name. Without a loss the trainer predicts, and ``evaluate`` and ``fit`` say
        what to pass. ``storage_options`` go to fsspec for a ``path`` at a URL.
        """
        saved = read_trainer(path, loss=loss, step=step, metrics=metrics,
                             transform=transform, storage_options=storage_options)
        trainer = cls(model, **saved.arguments)
        if saved.model_state is not None:
            trainer.model.load_state_dict(saved.model_state)
        else:
            trainer._load(saved.flat_values)
        trainer.history = saved.history
        return trainer
