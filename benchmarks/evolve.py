"""W8, evolution strategies: bytes exchanged per generation against sending parameters,
evaluations/s on 1 and 2 workers, and the same task in a plain single-process NumPy ES.

What it measures
----------------
The task: CartPole (the numpy environment of ``examples/evolve.py``, vectorised over
episodes), a policy MLP 4 -> 64 -> 64 -> 2 (tanh; 4,610 parameters), a member's reward the
mean return over ``--episodes`` episodes, each run for exactly ``--steps`` steps (a fallen
pole stops scoring, not the episode), so that every evaluation costs the same whatever the
policy does. OpenAI-ES with antithetic pairs, centred ranks and Adam (lr 0.05, sigma 0.1),
population ``--population``, ``--generations`` generations, three ways:

* **dasktrain, 1 worker** and **2 workers**: ``dt.Evolver(..., workers=W)`` on a LocalCluster
  of 2 single-threaded worker processes on 127.0.0.1 (the default noise table, the default
  of about four tasks per worker and generation).
* **NumPy ES**, the reference: the same algorithm written plainly in one process (a
  generator draws each pair's perturbation, members evaluated one after the other with the
  same reward function, the same centred ranks and the same Adam arithmetic in numpy).

Evaluations/s: members evaluated over the wall time of the generations, the first left out
(it carries the start-up: the workers' snapshot and imports); for NumPy over its whole
loop (update included). Beside them: how busy the workers were (their evaluation time over
workers x wall time) and the time of one evaluation (for NumPy: its whole loop per
member): on 2 cores shared with the driver and anything else running, two workers make
each evaluation slower, which the busy fraction tells apart from time lost waiting. Each
cell is the median of ``--repeats`` runs, interleaved, after one unmeasured warm-up run of
each. Bytes (from dasktrain's own count, ``EvolutionHistory``, see
``dasktrain.evolve.wire``): per generation, the tasks' pickled arguments (each its chunk's
index), the update record (the previous generation's ranks, 6 bits a member, and a 20-byte
header) once per worker that held it, and the results (fitness as float32, the seconds
the evaluation took, the worker's 8-byte id, and its 4-byte checksum once per worker and
generation), against ``population x 4 x parameters``, what sending every member's float32
parameters would take; the state's snapshot travels once per worker at the start
(reported apart). The ideal ratio, a 4-byte seed and a 4-byte fitness per member and
nothing else, is parameters / 2. Not counted, and said apart: Dask's own description of
each task (its key, the function's name, the record's key), the same whatever the model
and the population.

Also measured, in this process: the cost of one perturbation from the noise table (a
slice, then ``theta + sigma * eps``) against drawing it from a seeded generator, for 4,610,
100,000 and 1,000,000 parameters: the figure behind the default ``noise="table"``.

How to run
----------
From the repository root::

    .venv/bin/python benchmarks/evolve.py                 # ~2 minutes on 2 cores
    .venv/bin/python benchmarks/evolve.py --repeats 5 --generations 20
    .venv/bin/python benchmarks/evolve.py --quick         # seconds: rough figures
"""

from __future__ import annotations

import os

# Before numpy is imported here and before the worker processes start (they inherit it).
os.environ["OMP_NUM_THREADS"] = "1"

import argparse
import functools
import importlib.util
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import cloudpickle
import numpy as np
import torch
from distributed import Client

import dasktrain as dt
from dasktrain._cluster import start_local_cluster
from dasktrain.cli.bench import Ratio, parse_with_quick, ratio_of, write_ratios
from dasktrain.evolve.noise import noise_source

QUICK = {"generations": 4, "repeats": 1, "population": 16, "steps": 50}
SIGMA, LR = 0.1, 0.05


def _example() -> object:
    """``examples/evolve.py`` as a module (its CartPole), pickled by value to the workers."""
    path = Path(__file__).resolve().parent.parent / "examples" / "evolve.py"
    spec = importlib.util.spec_from_file_location("evolve_example", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)
    return module


EXAMPLE = _example()


def policy() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                               torch.nn.Tanh(), torch.nn.Linear(64, 2))


def fixed_length_reward(model: torch.nn.Module, seed: int, episodes: int, steps: int
                        ) -> float:
    """Mean return over ``episodes`` episodes of exactly ``steps`` steps each."""
    env = EXAMPLE.CartPole(episodes, seed)
    total = np.zeros(episodes)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.from_numpy(env.state.astype(np.float32)))
            total += env.step((logits[:, 1] > logits[:, 0]).numpy())
    return float(total.mean())


# -- the reference: a plain single-process NumPy ES ---------------------------------------
def numpy_es(reward, population: int, generations: int, seed: int) -> tuple[float, float]:
    """OpenAI-ES in one process; returns (evaluations/s, best reward of the last
    generation)."""
    torch.manual_seed(seed)
    model = policy()
    params = [p for p in model.parameters()]
    theta = torch.nn.utils.parameters_to_vector(params).detach().numpy().copy()
    m, v = np.zeros_like(theta), np.zeros_like(theta)
    rng = np.random.default_rng(seed)
    pairs = population // 2
    started = time.perf_counter()
    for generation in range(generations):
        eps = rng.standard_normal((pairs, theta.size), dtype=np.float32)
        fitness = np.empty(population)
        for i in range(population):
            member = theta + (SIGMA if i % 2 == 0 else -SIGMA) * eps[i // 2]
            torch.nn.utils.vector_to_parameters(torch.from_numpy(member), params)
            fitness[i] = reward(model, generation)
        ranks = np.argsort(np.argsort(fitness, kind="stable"), kind="stable")
        shaped = (ranks / (population - 1) - 0.5).astype(np.float32)
        grad = -((shaped[0::2] - shaped[1::2]) @ eps) / (population * SIGMA)
        m = 0.9 * m + 0.1 * grad
        v = 0.999 * v + 0.001 * grad * grad
        t = generation + 1
        theta -= LR / (1 - 0.9**t) * m / (np.sqrt(v) / np.sqrt(1 - 0.999**t) + 1e-8)
    seconds = time.perf_counter() - started
    return population * generations / seconds, float(fitness.max())


# -- dasktrain -----------------------------------------------------------------------------
def dasktrain_es(client: Client, reward, population: int, generations: int, workers: int,
                 seed: int) -> dt.EvolutionHistory:
    evolver = dt.Evolver(policy, reward=reward, population=population, workers=workers,
                         seed=seed, algorithm=dt.evolve.es(SIGMA, dt.optim.adam(LR)),
                         progress=False)
    return evolver.fit(generations=generations, client=client)


def steady(history: dt.EvolutionHistory, workers: int) -> tuple[float, float, float]:
    """Over the generations after the first: evaluations/s, the workers' busy fraction
    (their evaluation time over workers x wall time) and ms per evaluation."""
    rows = range(1, history.generations) if history.generations > 1 else range(1)
    wall = sum(history.seconds[i] for i in rows)
    busy = sum(history.compute_seconds[i] for i in rows)
    evaluations = history.population * len(rows)
    return evaluations / wall, busy / (workers * wall), 1e3 * busy / evaluations


def dask_envelope_bytes() -> int | None:
    """Bytes of Dask's own description of one evaluation task as the client sends it (its
    key, the function's name, the record's key and the task's argument): what carries the
    counted bytes, the same for any model and population. None where this version of
    Dask describes tasks otherwise."""
    try:
        from dask._task_spec import Task, TaskRef
    except ImportError:
        return None
    from distributed.protocol import pickle

    from dasktrain.evolve.worker.tasks import evaluate_members

    run = "0123456789abcdef"
    task = Task(f"dasktrain-evolve-{run}-12-3-57", evaluate_members,
                TaskRef(f"dasktrain-evolve-record-{run}-12-40"), 3)
    return len(pickle.dumps(task))


def noise_costs(sizes: list[int], repeats: int = 20) -> list[tuple[int, float, float]]:
    """(parameters, ms per member from the table, ms per member from a generator)."""
    out = []
    for size in sizes:
        theta = np.zeros(size, np.float32)
        member = np.empty_like(theta)
        costs = []
        for kind in ("table", "generator"):
            source = noise_source(kind, 0, size)
            seeds = source.seeds(np.random.default_rng(1), repeats)
            started = time.perf_counter()
            for seed in seeds:
                np.multiply(source.vector(int(seed)), np.float32(SIGMA), out=member)
                member += theta
            costs.append((time.perf_counter() - started) / repeats * 1e3)
        out.append((size, *costs))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--population", type=int, default=48)
    parser.add_argument("--generations", type=int, default=10)
    parser.add_argument("--episodes", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200, help="steps of every episode")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    args = parse_with_quick(parser, argv, QUICK, "seconds: population 16, 4 generations of "
                            "50-step episodes, one timed run")
    for flag in ("population", "generations", "episodes", "steps", "repeats"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1")
    if args.population % 2 or args.generations < 2:
        parser.error("--population must be even and --generations at least 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    wall = time.perf_counter()
    report = sys.stderr if args.ratios_json else sys.stdout
    torch.set_num_threads(1)
    reward = functools.partial(fixed_length_reward, episodes=args.episodes, steps=args.steps)
    parameters = sum(p.numel() for p in policy().parameters())
    rates: dict[str, list[float]] = {"1 worker": [], "2 workers": [], "numpy": []}
    best: dict[str, list[float]] = {name: [] for name in rates}
    busy: dict[str, list[float]] = {name: [] for name in rates}
    per_evaluation: dict[str, list[float]] = {name: [] for name in rates}
    histories: list[dt.EvolutionHistory] = []
    with start_local_cluster(2) as cluster, Client(cluster) as client:
        client.wait_for_workers(2)
        for repeat in range(args.repeats + 1):  # the first: an unmeasured warm-up
            for name in rates:
                if name == "numpy":
                    rate, top = numpy_es(reward, args.population, args.generations,
                                         args.seed)
                    fraction, each = 1.0, 1e3 / rate
                else:
                    history = dasktrain_es(client, reward, args.population,
                                           args.generations, int(name[0]), args.seed)
                    (rate, fraction, each), top = steady(history, int(name[0])), \
                        history.best[-1]
                    if name == "2 workers" and repeat:
                        histories.append(history)
                if repeat:
                    rates[name].append(rate)
                    best[name].append(top)
                    busy[name].append(fraction)
                    per_evaluation[name].append(each)
    noise = noise_costs([parameters, 100_000, 1_000_000])
    median = {name: statistics.median(values) for name, values in rates.items()}
    history = histories[-1]
    rows = range(1, history.generations)
    sent = statistics.median(history.bytes_sent[i] for i in rows)
    records = statistics.median(history.record_bytes[i] for i in rows)
    received = statistics.median(history.bytes_received[i] for i in rows)
    exchanged = statistics.median(history.exchanged_bytes()[i] for i in rows)
    by_parameters = history.parameter_bytes[-1]
    start = history.snapshot_bytes[0]

    print(f"W8 evolution strategies: CartPole, policy MLP 4-64-64-2 ({parameters:,} "
          f"parameters), population {args.population}, {args.generations} generations, "
          f"{args.episodes} episodes x {args.steps} steps per evaluation; median of "
          f"{args.repeats} run(s)", file=report)
    print(f"LocalCluster of 2 worker processes x 1 thread on 127.0.0.1; {os.cpu_count()} "
          f"CPU(s), load average {os.getloadavg()[0]:.1f} at the end, Python "
          f"{platform.python_version()}, numpy {np.__version__}, torch {torch.__version__}",
          file=report)
    print(file=report)
    print("| ES on CartPole | evaluations/s | / NumPy ES | workers busy | ms per evaluation "
          "| best reward, last generation |", file=report)
    print("|---|---:|---:|---:|---:|---:|", file=report)
    labels = {"numpy": "NumPy ES, one process (reference)", "1 worker": "dasktrain, 1 worker",
              "2 workers": "dasktrain, 2 workers"}
    for name in ("numpy", "1 worker", "2 workers"):
        ratio = ratio_of(median[name], median["numpy"])
        print(f"| {labels[name]} | {median[name]:,.0f} | {ratio:.2f}x | "
              f"{statistics.median(busy[name]):.0%} | "
              f"{statistics.median(per_evaluation[name]):.1f} | "
              f"{statistics.median(best[name]):.1f} |", file=report)
    print(file=report)
    print("| bytes per generation (2 workers, median after the first) | bytes |", file=report)
    print("|---|---:|", file=report)
    print(f"| tasks: pickled arguments (a chunk's index), {history.tasks[-1]} tasks | "
          f"{sent:,.0f} |", file=report)
    print(f"| update record: the last generation's ranks, one copy per worker | "
          f"{records:,.0f} |", file=report)
    print(f"| results: fitness, seconds, worker id; a checksum per worker | {received:,.0f} |",
          file=report)
    print(f"| **exchanged** ({exchanged / args.population:.0f} bytes per member) | "
          f"**{exchanged:,.0f}** |", file=report)
    print(f"| sending every member's parameters instead | {by_parameters:,} |", file=report)
    print(f"| **ratio** (ideal: parameters / 2 = {parameters / 2:,.0f}) | "
          f"**{by_parameters / exchanged:,.0f}x** |", file=report)
    print(f"| once at the start: the state's snapshot, to each of 2 workers | {start:,} |",
          file=report)
    envelope = dask_envelope_bytes()
    if envelope is not None:
        print(f"| not counted: Dask's own description of each task (key, function, the "
              f"record's key), pickled | {envelope:,} |", file=report)
    print(file=report)
    print("| perturbation of | noise table (slice + axpy) | seeded generator | table / "
          "generator |", file=report)
    print("|---|---:|---:|---:|", file=report)
    for size, table, generator in noise:
        print(f"| {size:,} parameters | {table:.3f} ms | {generator:.3f} ms | "
              f"{table / generator:.2f}x |", file=report)
    print(file=report)
    print(f"command: {shlex.join(sys.orig_argv)}", file=report)
    print(f"total wall time: {time.perf_counter() - wall:.1f} s (incl. cluster start-up and "
          "warm-up)", file=report)
    if args.ratios_json:
        write_ratios(args.ratios_json, [
            Ratio(workload=f"W8 ES bytes per generation, {parameters:,} parameters, "
                           f"population {args.population}",
                  ours=f"{exchanged:,.0f} B", baseline=f"{by_parameters:,} B (every "
                  "member's parameters)", ratio=ratio_of(exchanged, by_parameters),
                  goal=f"≈ {2 / parameters:.5f}x (parameters / 2 fewer)"),
            Ratio(workload="W8 ES evaluations/s, CartPole, 1 worker",
                  ours=f"{median['1 worker']:,.0f}", baseline=f"{median['numpy']:,.0f} "
                  "(NumPy ES, one process)", ratio=ratio_of(median["1 worker"],
                                                            median["numpy"])),
            Ratio(workload="W8 ES evaluations/s, CartPole, 2 workers",
                  ours=f"{median['2 workers']:,.0f}", baseline=f"{median['numpy']:,.0f} "
                  "(NumPy ES, one process)", ratio=ratio_of(median["2 workers"],
                                                            median["numpy"])),
        ])
    return 0


if __name__ == "__main__":
    sys.exit(main())
