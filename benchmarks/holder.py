"""W2, parameter exchange: time per step of push + fresh parameters back, against gloo.

For flat float32 parameters of 1, 10 and 100 MB and 2 trainer workers, measured side by side
in one run (medians of ``--repeats`` runs of ``--steps`` steps each, after warm-up):

* dasktrain: two trainer tasks on a 2-process LocalCluster push gradients to the
  ParameterHolder actor in ``sync`` mode (batch-size-weighted average + one SGD step on the
  holder) and load the parameters it sends back into their model: the worker in the
  holder's process in place, the other over the holder's direct channel, through memory
  shared with the holder (the default on one host); for comparison, once more with the
  bytes on the channel's local socket (``shared_memory=False``, as between hosts) and once
  through the actor's Dask calls alone (``direct_channel=False``);
* baseline: ``torch.distributed`` gloo ``all_reduce`` of the same buffer across 2 processes,
  divided by 2, then the same SGD step in each process (what DDP does per step).

Run: ``.venv/bin/python benchmarks/holder.py`` (``--sizes 1 10 100 --steps 20 --repeats 3``;
``--quick``: 1 MB, 5 steps, once). ``dasktrain bench`` runs it among the others.
``benchmarks/scaling.py`` (W5) runs the same exchange and baseline for N workers.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import os
import socket
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch
import torch.distributed as torch_dist
import torch.multiprocessing as mp
from distributed import Client, LocalCluster, get_worker, secede

import dasktrain as dt
from dasktrain._cluster import NO_DASHBOARD, worker_info
from dasktrain.cli.bench import (
    Ratio,
    baseline_environment,
    parse_with_quick,
    ratio_of,
    write_ratios,
)
from dasktrain.trainer.exchange.sharded import open_handle
from dasktrain.trainer.flat import FlatModel
from dasktrain.trainer.holder import HolderConfig, ParameterHolder
from dasktrain.trainer.holder.shards import shard_workers

WORKERS = 2
LR = 1e-3
# shared/benchmarks.md, W2: the step time to reach, as a ratio to gloo's, per size in MB.
GOALS = {1.0: "≤ 0.8x", 10.0: "≤ 0.8x", 100.0: "≤ 0.6x"}
QUICK = {"sizes": [1.0], "steps": 5, "warmup": 2, "repeats": 1}


class FlatParameters(torch.nn.Module):
    """A model that is nothing but ``size`` float32 parameters, in ``pieces`` tensors of
    about equal size (a holder in shards keeps whole tensors)."""

    def __init__(self, size: int, pieces: int = 1) -> None:
        super().__init__()
        cuts = np.linspace(0, size, pieces + 1).astype(int)
        self.pieces = torch.nn.ParameterList(
            torch.nn.Parameter(torch.zeros(int(b - a))) for a, b in itertools.pairwise(cuts))


def _model(size: int, pieces: int = 1) -> torch.nn.Module:
    return FlatParameters(size, pieces)


def _exchange_task(holder, worker: int, size: int, steps: int, warmup: int,
                   pieces: int = 1) -> dict:
    secede()
    torch.set_num_threads(1)
    flat = FlatModel(_model(size, pieces))
    handle = open_handle(holder, timeout=120)  # one holder, or a list of shards
    info = handle.join(worker, get_worker().address, flat.layout, into=flat.receive_buffer())
    handle.share(flat.adopt)  # as the trainer's workers do
    flat.load(info["params"])
    version = info["version"]
    flat.grads.copy_(torch.rand(size))  # a fixed, finite "gradient"
    times = []
    for step in range(warmup + steps):
        t0 = time.perf_counter()
        future = handle.push(version, flat.payload(), 1, 0.0, (0, step + 1))
        params, version = handle.wait(future, "push")
        flat.load(params)
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    handle.member_request("leave")
    via = handle.via if handle.transport is None else f"{handle.via}/{handle.transport}"
    handle.close()
    return {"median_s": statistics.median(times), "where": via}


def dasktrain_step(client: Client, size: int, steps: int, warmup: int, direct: bool = True,
                   workers: int = WORKERS, shared: bool = True, shards: int = 1
                   ) -> tuple[float, str]:
    """Median seconds per ``sync`` step of ``workers`` trainer tasks exchanging ``size``
    float32 parameters through a holder on the cluster's first worker, or ``shards``
    shards on its first workers, as ``fit`` places them (trainer ``w`` on worker ``w``
    modulo their number), and how each reached the holder."""
    addresses = sorted(worker_info(client))
    pieces = 1 if shards == 1 else 8 * shards  # whole tensors to cut the shards from
    config = HolderConfig(model=functools.partial(_model, size, pieces),
                          optimizer=dt.optim.sgd(LR), workers=workers, mode="sync",
                          direct_channel=direct, shared_memory=shared)
    configs = [config] if shards == 1 else [
        dataclasses.replace(config, shard=(k, shards)) for k in range(shards)]
    targets = [addresses[0]] if shards == 1 else shard_workers(addresses, shards)
    holder_futures = [client.submit(ParameterHolder, c, actor=True, workers=[target],
                                    pure=False) for c, target in zip(configs, targets,
                                                                     strict=True)]
    actors = [f.result() for f in holder_futures]
    for actor in actors:
        actor.begin_epoch(0).result()
    holder = actors[0] if shards == 1 else actors
    futures = [client.submit(_exchange_task, holder, w, size, steps, warmup, pieces,
                             pure=False, workers=[addresses[w % len(addresses)]])
               for w in range(workers)]
    results = client.gather(futures)
    for actor in actors:
        actor.close().result()
    for future in holder_futures:
        future.release()
    # A step is over when the slowest worker has its parameters back.
    placement = "+".join(r["where"] for r in results)
    return max(r["median_s"] for r in results), placement


def _gloo_process(rank: int, port: int, size: int, steps: int, warmup: int, workers: int,
                  out) -> None:
    torch.set_num_threads(1)
    torch_dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                  world_size=workers)
    param = torch.zeros(size)
    grad = torch.rand(size)
    buffer = torch.empty(size)
    times = []
    for step in range(warmup + steps):
        buffer.copy_(grad)  # all_reduce works in place: keep the gradient for the next step
        t0 = time.perf_counter()
        torch_dist.all_reduce(buffer)
        buffer.div_(workers)
        param.add_(buffer, alpha=-LR)
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    torch_dist.destroy_process_group()
    out.put((rank, statistics.median(times)))


def gloo_step(size: int, steps: int, warmup: int, workers: int = WORKERS) -> float:
    """Median seconds per step of gloo ``all_reduce`` + average + SGD of ``size`` float32
    across ``workers`` processes on 127.0.0.1 (the slowest rank's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_gloo_process,
                         args=(r, port, size, steps, warmup, workers, out))
             for r in range(workers)]
    with baseline_environment():
        for p in procs:
            p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    return max(t for _, t in results)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[1, 10, 100],
                        help="parameter sizes in MB (default 1 10 100)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parse_with_quick(parser, argv, QUICK,
                            "seconds, not minutes: 1 MB, 5 steps, once (rough figures)")
    return args


def ratios(rows: list[tuple]) -> list[Ratio]:
    """The summary rows: per size, our step time against gloo's."""
    return [Ratio(workload=f"W2 exchange, {mb:g} MB, sync, 2 workers (ms/step)",
                  ours=f"{a * 1e3:.1f}", baseline=f"{b * 1e3:.1f} (gloo all_reduce + SGD)",
                  ratio=ratio_of(a, b), goal=GOALS.get(mb, "—"))
            for mb, a, _, b, *_ in rows]


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    rows = []
    with LocalCluster(n_workers=WORKERS, threads_per_worker=1, processes=True,
                      host="127.0.0.1", **NO_DASHBOARD) as cluster, \
            Client(cluster) as client:
        for mb in args.sizes:
            size = int(mb * 1e6 / 4)
            ours, socket_only, actor, theirs = [], [], [], []
            placement = ""
            for _ in range(args.repeats):
                seconds, placement = dasktrain_step(client, size, args.steps, args.warmup)
                ours.append(seconds)
                socket_only.append(dasktrain_step(client, size, args.steps, args.warmup,
                                                  shared=False)[0])
                actor.append(dasktrain_step(client, size, args.steps, args.warmup,
                                            direct=False)[0])
                theirs.append(gloo_step(size, args.steps, args.warmup))
            a, s, c, b = (statistics.median(x) for x in (ours, socket_only, actor, theirs))
            rows.append((mb, a, c, b, placement, s))
            print(f"{mb:g} MB: dasktrain {a * 1e3:.1f} ms (bytes on the local socket "
                  f"{s * 1e3:.1f} ms, actor calls only {c * 1e3:.1f} ms), gloo "
                  f"{b * 1e3:.1f} ms, ratio {a / b:.2f}x", flush=True)
    print("\n| parameters | dasktrain holder, sync (ms/step) | gloo all_reduce + SGD (ms/step) "
          "| ratio | `shared_memory=False` (ms/step) | its ratio "
          "| actor calls only (ms/step) | its ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for mb, a, c, b, _, s in rows:
        print(f"| {mb:g} MB | {a * 1e3:.1f} | {b * 1e3:.1f} | {a / b:.2f}x | {s * 1e3:.1f} "
              f"| {s / b:.2f}x | {c * 1e3:.1f} | {c / b:.2f}x |")
    print(f"\n(2 trainer workers, holder placement: {rows[0][4]}; medians of "
          f"{args.repeats} x {args.steps} steps; numpy {np.__version__}, torch "
          f"{torch.__version__})")
    if args.ratios_json:
        write_ratios(args.ratios_json, ratios(rows))


if __name__ == "__main__":
    main()
