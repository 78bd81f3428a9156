"""The body of :meth:`Evolver.fit`: set the run up, then one generation after another:
evaluate on the cluster, rank, advance the state, record, checkpoint.

The Evolver hands itself over as an :class:`EvolveHost`, so that this module never imports
the Evolver's (which imports this one).
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

import torch
from distributed import Client, span
from distributed.protocol import pickle

from dasktrain._cluster import cluster_client, worker_info
from dasktrain._durable import StorageOptions, check_storage_options
from dasktrain.datasets import Dataset, open_dataset
from dasktrain.evolve.algorithm import Algorithm, initial_state
from dasktrain.evolve.config import AlgorithmConfig
from dasktrain.evolve.driver.checkpoint import check_resumable, load_evolution, save_evolution
from dasktrain.evolve.driver.coordinator import Coordinator
from dasktrain.evolve.driver.generation import GenerationReport
from dasktrain.evolve.driver.settings import default_members_per_task, run_settings
from dasktrain.evolve.errors import EvolutionError, FitnessFailed, InvalidFitness
from dasktrain.evolve.model import load_parameters
from dasktrain.evolve.shaping import ranks_of
from dasktrain.evolve.spec import RunSpec
from dasktrain.evolve.view.history import EvolutionHistory
from dasktrain.evolve.worker.data import GenerationBatches
from dasktrain.evolve.worker.fitness import Fitness, LossFitness, RewardFitness
from dasktrain.pipeline import Pipeline
from dasktrain.trainer.worker.compute import BatchCompute

__all__ = ["EvolveHost", "fit_evolver"]


class EvolveHost(Protocol):
    """What a fit reads and sets of its Evolver."""

    algorithm: AlgorithmConfig
    reward: Callable | None
    reward_takes_seed: bool
    compute: BatchCompute | None
    population: int
    workers: int | None
    members_per_task: int | None
    seed: int
    noise: str
    noise_size: int | None
    data_options: dict[str, Any]
    timeout: float
    checkpoint_every: int
    show_progress: bool
    torch_threads: int
    model: torch.nn.Module
    parameters: int
    history: EvolutionHistory | None
    last_checkpoint: str | None
    stop_training: bool
    _factory: Callable[[], torch.nn.Module]


def _fitness(host: EvolveHost, data: Dataset | Pipeline | str | os.PathLike | None
             ) -> tuple[Fitness, dict[str, Any] | None]:
    """The run's fitness, and the data settings a resume must match (None: no data)."""
    if host.compute is None:
        if data is not None:
            raise ValueError("this evolver has a reward, which takes no data: call "
                             "fit(generations=...) without data")
        return RewardFitness(host.reward, host.reward_takes_seed), None
    if data is None:
        raise ValueError("this evolver has a loss: give fit the data to evaluate it on "
                         "(a dataset, its path or a Pipeline)")
    options = dict(host.data_options)
    seed = host.seed
    if isinstance(data, Pipeline):
        options.update(batch_size=data.batch_size, shuffle=data.shuffle,
                       transform=data.transform, drop_last=data.drop_last)
        seed, dataset = data.seed, data.dataset
    else:
        dataset = data if isinstance(data, Dataset) else open_dataset(data)
    if options["batch_size"] > len(dataset):
        raise ValueError(f"batch_size {options['batch_size']} is larger than the "
                         f"{len(dataset)} samples of {dataset!r}")
    batches = GenerationBatches(dataset, options["batch_size"], options["batches"], seed,
                                options["shuffle"], options["transform"],
                                options["drop_last"])
    plain = {k: options[k] for k in ("batch_size", "batches", "shuffle", "drop_last")}
    return LossFitness(host.compute, batches), {**plain, "seed": seed,
                                                "samples": len(dataset)}


def _resume_hint(host: EvolveHost) -> str:
    if host.last_checkpoint is None:
        return "no checkpoint was written (fit(..., checkpoint=DIR) keeps one)"
    return (f"the last checkpoint is {host.last_checkpoint}: continue with "
            f"fit(..., resume={host.last_checkpoint!r})")


def _progress_bar(host: EvolveHost, total: int, initial: int) -> Any:
    if not host.show_progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, unit="gen",
                desc=f"{host.algorithm.name} x{host.population}")


def fit_evolver(host: EvolveHost, data: Dataset | Pipeline | str | os.PathLike | None,
                generations: int, client: Client | None,
                checkpoint: str | os.PathLike | None, resume: str | os.PathLike | None,
                callbacks: list[Callable], storage_options: StorageOptions | None
                ) -> EvolutionHistory:
    """:meth:`Evolver.fit` (see there)."""
    if isinstance(generations, bool) or not isinstance(generations, int) or generations < 1:
        raise ValueError(f"generations must be a positive integer, got {generations!r}")
    for callback in callbacks:
        if not callable(callback):
            raise TypeError(f"callbacks must be functions fn(evolver, record), got "
                            f"{callback!r}")
    storage_options = check_storage_options(storage_options)
    fitness, data_settings = _fitness(host, data)
    settings = run_settings(algorithm=host.algorithm, population=host.population,
                            seed=host.seed, noise=host.noise, noise_size=host.noise_size,
                            parameters=host.parameters, fitness=fitness.label,
                            data=data_settings)
    saved = load_evolution(resume, storage_options) if resume is not None else None
    if saved is not None:
        check_resumable(saved["settings"], settings)
    spec = RunSpec(run_key=uuid.uuid4().hex[:16], algorithm=host.algorithm,
                   population=host.population, seed=host.seed, noise=host.noise,
                   noise_size=host.noise_size, num_params=host.parameters,
                   schedule_steps=generations, model=host._factory, fitness=fitness,
                   torch_threads=host.torch_threads, timeout=host.timeout)
    algorithm = spec.make_algorithm()
    if saved is not None:
        state = algorithm.load_state(saved["state"])
        start = int(saved["generation"])
        history = EvolutionHistory.from_dict(saved["history"])
        host.last_checkpoint = str(resume)
    else:
        state = initial_state(algorithm, host._factory, host.seed)
        start = 0
        host.last_checkpoint = None
        history = EvolutionHistory(algorithm=host.algorithm.name, fitness=fitness.label,
                                   population=host.population, parameters=host.parameters)
    host.history = history
    host.stop_training = False
    bar = _progress_bar(host, generations, start)
    started = time.perf_counter() - history.wall_time
    try:
        if start < generations:
            # One Dask span for the run's tasks (see dasktrain.trainer.driver.fitting).
            with cluster_client(client) as c, span("dasktrain-evolve"):
                state = _run(host, c, spec, algorithm, state, start, generations, history,
                             fitness, settings, checkpoint, storage_options, callbacks, bar,
                             started)
    except EvolutionError as exc:
        exc.history = history
        if isinstance(exc, (InvalidFitness, FitnessFailed)):
            raise  # the member's own failure: the fix is in the reward, not a resume
        # Where to go on from, said once, here: the coordinator does not know.
        wrapped = EvolutionError(f"{exc}; {_resume_hint(host)}")
        wrapped.history = history
        raise wrapped from exc.__cause__
    except BaseException as exc:  # the user's code failed, or Ctrl-C: the record stays
        with contextlib.suppress(AttributeError, TypeError):
            exc.history = history
        raise
    finally:
        history.wall_time = time.perf_counter() - started
        if bar is not None:
            bar.close()
    # (After a failure the model keeps the last finished generation's result, loaded by
    # the loop.)
    load_parameters(host.model, algorithm.best(state, host._factory))
    return history


def _run(host: EvolveHost, client: Client, spec: RunSpec, algorithm: Algorithm, state: Any,
         start: int, generations: int, history: EvolutionHistory, fitness: Fitness,
         settings: dict[str, Any], checkpoint: str | os.PathLike | None,
         storage_options: StorageOptions | None, callbacks: list[Callable], bar: Any,
         started: float) -> Any:
    """The generations ``start .. generations - 1``; returns the final state."""
    per_task = host.members_per_task or default_members_per_task(
        host.algorithm, host.population, host.workers or max(len(worker_info(client)), 1))
    coordinator = Coordinator(client, spec, pickle.dumps(spec), workers=host.workers,
                              members_per_task=per_task, timeout=host.timeout)
    try:
        coordinator.begin(start, state)
        for generation in range(start, generations):
            report = coordinator.run(generation, state, algorithm.digest(state))
            ranks = ranks_of(report.values, fitness.maximize)
            coordinator.record(generation, ranks)
            state = algorithm.advance(state, generation, ranks)
            # What callbacks (and a user after an error) see: the result so far.
            load_parameters(host.model, algorithm.best(state, host._factory))
            record = _record(generation, report, host)
            history.append(**record)
            history.events.extend(coordinator.events)
            coordinator.events.clear()
            history.wall_time = time.perf_counter() - started
            if bar is not None:
                bar.set_postfix(best=f"{record['best']:.4g}", mean=f"{record['mean']:.4g}",
                                evals_s=f"{record['evaluations_per_s']:.0f}", refresh=False)
                bar.update(1)
            for callback in callbacks:
                callback(host, record)
            last = generation + 1 == generations or host.stop_training
            if checkpoint is not None and ((generation + 1) % host.checkpoint_every == 0
                                           or last):
                written = save_evolution(checkpoint, settings=settings,
                                         generation=generation + 1,
                                         state=algorithm.state_dict(state), history=history,
                                         storage_options=storage_options)
                host.last_checkpoint = str(written)
            if host.stop_training and generation + 1 < generations:
                history.events.append(f"stopped after generation {generation} by a callback")
                break
    finally:
        coordinator.close()
    return state


def _record(generation: int, report: GenerationReport, host: EvolveHost) -> dict[str, Any]:
    values = report.values
    maximize = host.compute is None
    return {
        "generation": generation,
        "best": float(values.max() if maximize else values.min()),
        "mean": float(values.mean()),
        "worst": float(values.min() if maximize else values.max()),
        "seconds": report.seconds,
        "evaluations_per_s": len(values) / report.seconds if report.seconds else 0.0,
        "compute_seconds": report.compute_seconds,
        "tasks": report.tasks,
        "missed": report.missed,
        "workers": len(report.members_per_worker),
        "members_per_worker": dict(report.members_per_worker),
        "bytes_sent": report.bytes_sent,
        "record_bytes": report.record_bytes,
        "bytes_received": report.bytes_received,
        "snapshot_bytes": report.snapshot_bytes,
        "parameter_bytes": 4 * host.parameters * len(values),
    }
