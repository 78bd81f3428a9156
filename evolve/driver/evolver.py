"""``Evolver``: gradient-free training on a Dask cluster, by evolution strategies or a
genetic algorithm.

The public class keeps the settings and composes the driver's modules: :mod:`.settings`
(checks), :mod:`.fitting` (the body of ``fit``) and, for ``evaluate``, the trainer's
evaluation on the cluster.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
from distributed import Client

from dasktrain._cluster import cluster_client
from dasktrain._durable import StorageOptions
from dasktrain.datasets import Dataset, open_dataset
from dasktrain.evolve.config import AlgorithmConfig, get_algorithm
from dasktrain.evolve.driver.fitting import fit_evolver
from dasktrain.evolve.driver.settings import check_arguments
from dasktrain.evolve.model import flat_parameters, made_with_seed
from dasktrain.evolve.view.history import EvolutionHistory
from dasktrain.evolve.worker.fitness import RewardFunction, takes_seed
from dasktrain.pipeline import Pipeline
from dasktrain.trainer.driver.inference import evaluate_on_cluster
from dasktrain.trainer.driver.settings import ModelSpec, model_factory
from dasktrain.trainer.worker.compute import BatchCompute, MetricFunction
from dasktrain.trainer.worker.loop import LossFunction

__all__ = ["Evolver", "GenerationCallback"]

GenerationCallback = Callable[["Evolver", dict[str, Any]], Any]
"""``fn(evolver, record)`` after every generation; ``record`` holds its figures."""


class Evolver:
    """Train a model without gradients: a population of perturbed copies of it is
    evaluated on the cluster every generation, and the fitness decides the next.

    A member travels as seeds, never as parameters: every worker process holds the run's
    noise source and its own copy of the state, and advances that copy from each
    generation's ranks, the same update the driver computes (bit-identical: see the docs'
    "Gradient-free training"). A generation exchanges a few bytes per member.

    Parameters
    ----------
    model
        A function returning a fresh ``torch.nn.Module`` (made under ``torch.manual_seed``
        of the run's seed: ES starts from it; each of the GA's first individuals is made
        under its own seed) or a module (copied).
    reward
        ``reward(model, seed) -> float`` (or ``reward(model)``), higher is better: a
        control task, no data. ``seed`` is the same for every member of a generation
        (compare members on the same episodes) and new each generation.
    loss
        ``loss(output, target) -> scalar tensor``, lower is better: a member's fitness is
        its mean loss over the generation's ``batches`` batches of ``batch_size`` of the
        data given to :meth:`fit`, read through a :class:`~dasktrain.Pipeline`. Give
        ``reward`` or ``loss``.
    algorithm
        ``"es"`` (OpenAI-ES, :func:`dasktrain.evolve.es`), ``"ga"`` (Deep GA,
        :func:`dasktrain.evolve.ga`), or either's config with its settings.
    population
        Members per generation (even for ES: antithetic pairs).
    workers
        Evaluate on at most this many Dask workers (the same ones while they live);
        default every worker of the cluster.
    members_per_task
        Members one Dask task evaluates; default about four tasks per worker and
        generation, so that a slow worker takes fewer.
    seed
        Seeds the initial model, the noise and every random choice of every generation.
    noise, noise_size
        Where perturbations come from: ``"table"`` (a table of ``noise_size`` standard
        normal values made once per process; default ``max(2**22, 4 x parameters)``) or
        ``"generator"`` (each drawn from its own seeded generator: no table memory, about
        fifteen times slower per perturbation). See :mod:`dasktrain.evolve.noise`.
    batch_size, batches, shuffle, transform, drop_last
        With ``loss``: the generation's batches (through a Pipeline with ``seed``).
    metrics
        Named ``fn(output, target)`` measured by :meth:`evaluate` beside the loss.
    timeout
        Seconds a generation may go without any of its tasks finishing before the fit
        fails.
    checkpoint_every
        With ``checkpoint=`` in :meth:`fit`: write it every this many generations (and
        at the end of the fit).
    progress
        Show a progress bar (notebook-aware).
    torch_threads
        Intra-op threads of torch in each worker process while it evaluates (0 leaves
        torch's default).
    """

    def __init__(
        self,
        model: ModelSpec,
        *,
        reward: RewardFunction | None = None,
        loss: LossFunction | None = None,
        algorithm: str | AlgorithmConfig = "es",
        population: int = 64,
        workers: int | None = None,
        members_per_task: int | None = None,
        seed: int = 0,
        noise: str = "table",
        noise_size: int | None = None,
        batch_size: int = 256,
        batches: int = 1,
        shuffle: bool = True,
        transform: Callable | None = None,
        drop_last: bool = False,
        metrics: dict[str, MetricFunction] | None = None,
        timeout: float = 300.0,
        checkpoint_every: int = 10,
        progress: bool = True,
        torch_threads: int = 1,
    ) -> None:
        self.algorithm = get_algorithm(algorithm)
        check_arguments(reward=reward, loss=loss, population=population, workers=workers,
                        members_per_task=members_per_task, seed=seed, noise=noise,
                        noise_size=noise_size, batch_size=batch_size, batches=batches,
                        timeout=timeout, checkpoint_every=checkpoint_every,
                        torch_threads=torch_threads, algorithm=self.algorithm)
        self._factory = model_factory(model)
        self.reward = reward
        self.reward_takes_seed = takes_seed(reward) if reward is not None else False
        self.compute = BatchCompute(loss, None, dict(metrics or {})) if loss else None
        self.population = population
        self.workers = workers
        self.members_per_task = members_per_task
        self.seed = seed
        self.noise = noise
        self.noise_size = noise_size
        self.data_options = {"batch_size": batch_size, "batches": batches,
                             "shuffle": bool(shuffle), "transform": transform,
                             "drop_last": bool(drop_last)}
        self.timeout = float(timeout)
        self.checkpoint_every = checkpoint_every
        self.show_progress = progress
        self.torch_threads = torch_threads
        self.model: torch.nn.Module = made_with_seed(self._factory, seed)
        """A plain module holding the run's result, updated after every generation of
        :meth:`fit` (callbacks see it): ES's parameters θ, or the GA's best individual of
        the last generation."""
        self.parameters = flat_parameters(self.model).size
        """Trainable parameters of the model (the length of every perturbation)."""
        self.history: EvolutionHistory | None = None
        self.last_checkpoint: str | None = None
        self.stop_training = False
        """Set by a callback to end the fit after the current generation (its checkpoint
        written)."""

    def fit(self, data: Dataset | Pipeline | str | os.PathLike | None = None,
            generations: int = 100, *, client: Client | None = None,
            checkpoint: str | os.PathLike | None = None,
            resume: str | os.PathLike | None = None,
            callbacks: Iterable[GenerationCallback] = (),
            storage_options: StorageOptions | None = None) -> EvolutionHistory:
        """Evolve for ``generations`` generations (counted from 0, so a resumed fit runs the
        rest).

        Parameters
        ----------
        data
            With ``loss``: a dataset (or split), its path, or a :class:`Pipeline` (its
            ``batch_size``, ``seed``, ``shuffle``, ``transform`` and ``drop_last`` are
            used). None with ``reward``.
        generations
            Total generations.
        client
            Dask client; default: the client made in this process, else the process's
            embedded LocalCluster (started on first use, reused, closed at exit).
        checkpoint
            Directory (or ``.pt`` file, or URL) of the run's checkpoint, rewritten
            atomically every ``checkpoint_every`` generations and at the end.
        resume
            A checkpoint to continue from: the same run, as if never stopped.
        callbacks
            Functions ``fn(evolver, record)`` called after every generation.
        storage_options
            Passed to fsspec for a ``checkpoint`` or ``resume`` at a URL.

        Raises
        ------
        InvalidFitness
            A reward or loss returned anything but one finite number within float32's
            range; the message names the member and the generation.
        FitnessFailed
            A reward or loss raised; the message names the member, the generation and the
            error, which is its ``error`` and ``__cause__``.
        EvolutionError
            The run cannot go on (workers lost again and again, the cluster gone); the
            message names the last checkpoint. Every error ``fit`` raises carries the
            generations done as ``history``.
        """
        return fit_evolver(self, data, generations, client, checkpoint, resume,
                           list(callbacks), storage_options)

    def evaluate(self, data: Dataset | str | os.PathLike, *, batch_size: int = 1024,
                 client: Client | None = None) -> dict[str, float]:
        """Mean loss and metrics of :attr:`model` over ``data`` (and accuracy where the
        targets are class labels), computed by tasks on the cluster's workers."""
        if self.compute is None:
            raise ValueError("evaluate needs a loss: this evolver has a reward (call it on "
                             "evolver.model yourself)")
        dataset = data if isinstance(data, Dataset) else open_dataset(data)
        with cluster_client(client) as c:
            return evaluate_on_cluster(self.model, self.compute, dataset, c,
                                       batch_size=batch_size, as_dict=False,
                                       threads=self.torch_threads)
