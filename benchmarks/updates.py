"""Holder throughput, end to end: updates per second in ``async`` for a small model.

Two trainer tasks on a 2-process LocalCluster each compute the gradient of a 10,513-parameter
MLP on a fixed batch of 32, push it to the ParameterHolder actor in ``async`` mode (Adam on
the holder) and load the parameters it sends back, for ``--seconds`` seconds: one worker
in the holder's process (in-process calls), the other over the holder's direct channel.
Measured side by side in the same run:

* dasktrain: holder updates per second (its version over the wall time), default settings;
* baseline: the same forward/backward + Adam step in one plain process (what a user would
  run without a cluster), steps per second;
* and the holder alone: the same two workers pushing a fixed gradient without computing
  one, which is the exchange's own ceiling.

Run: ``.venv/bin/python benchmarks/updates.py`` (``--seconds 5 --repeats 3``; ``--quick``:
0.5 s, once). ``dasktrain bench`` runs it among the others.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from distributed import Client, LocalCluster, get_worker, secede

import dasktrain as dt
from dasktrain._cluster import NO_DASHBOARD, worker_info
from dasktrain.cli.bench import Ratio, parse_with_quick, ratio_of, write_ratios
from dasktrain.trainer.exchange.handle import HolderHandle
from dasktrain.trainer.flat import FlatModel
from dasktrain.trainer.holder import HolderConfig, ParameterHolder

WORKERS = 2
BATCH = 32
# The holder's own ceiling to reach: updates per second from two workers (README).
GOAL_EXCHANGE = "≥ 3,000/s"
QUICK = {"seconds": 0.5, "repeats": 1}


def model() -> torch.nn.Module:
    """32 -> 256 -> 8 -> 1: 10,513 parameters."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(),
                               torch.nn.Linear(256, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 32, generator=generator)
    return x, x.sum(dim=1, keepdim=True).sin()


def _push_task(holder, worker: int, seconds: float, compute: bool) -> dict:
    secede()
    torch.set_num_threads(1)
    flat = FlatModel(model())
    handle = HolderHandle(holder, timeout=120)
    info = handle.join(worker, get_worker().address, flat.layout, into=flat.receive_buffer())
    flat.load(info["params"])
    version = info["version"]
    x, y = _batch()
    flat.zero_grad()
    torch.nn.functional.mse_loss(flat.model(x), y).backward()
    pushes = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        if compute:
            flat.zero_grad()
            torch.nn.functional.mse_loss(flat.model(x), y).backward()
        future = handle.push(version, flat.payload(), BATCH, 0.0, (0, pushes + 1))
        params, version = handle.wait(future, "push")
        flat.load(params)
        pushes += 1
    elapsed = time.perf_counter() - start
    handle.member_request("leave")
    via = handle.via
    handle.close()
    return {"pushes": pushes, "elapsed": elapsed, "via": via}


def holder_updates_per_second(client: Client, seconds: float, compute: bool
                              ) -> tuple[float, str]:
    addresses = sorted(worker_info(client))
    config = HolderConfig(model=model, optimizer=dt.optim.adam(1e-4), workers=WORKERS,
                          mode="async")
    holder_future = client.submit(ParameterHolder, config, actor=True, workers=[addresses[0]],
                                  pure=False)
    holder = holder_future.result()
    holder.begin_epoch(0).result()
    futures = [client.submit(_push_task, holder, w, seconds, compute, pure=False,
                             workers=[addresses[w % len(addresses)]])
               for w in range(WORKERS)]
    results = client.gather(futures)
    holder.close().result()
    holder_future.release()
    # Both ran for the same wall time, side by side: their updates add up.
    rate = sum(r["pushes"] / r["elapsed"] for r in results)
    return rate, "+".join(r["via"] for r in results)


def one_process_steps_per_second(seconds: float) -> float:
    net = model()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-4)
    x, y = _batch()
    steps = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        optimizer.step()
        steps += 1
    return steps / (time.perf_counter() - start)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parse_with_quick(parser, argv, QUICK,
                            "seconds, not minutes: 0.5 s, once (rough figures)")
    return args


def ratios(parameters: int, ours: float, bare: float, single: float) -> list[Ratio]:
    """The summary rows: updates per second against one plain process's steps."""
    baseline = f"{single:,.0f} (one process)"
    return [Ratio(workload=f"holder updates/s, {parameters:,}-parameter MLP, async, "
                           f"{WORKERS} workers", ours=f"{ours:,.0f}", baseline=baseline,
                  ratio=ratio_of(ours, single)),
            Ratio(workload="holder updates/s, exchange only (a fixed gradient)",
                  ours=f"{bare:,.0f}", baseline=baseline, ratio=ratio_of(bare, single),
                  goal=GOAL_EXCHANGE)]


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    parameters = sum(p.numel() for p in model().parameters())
    ours, bare, single = [], [], []
    placement = ""
    with LocalCluster(n_workers=WORKERS, threads_per_worker=1, processes=True,
                      host="127.0.0.1", **NO_DASHBOARD) as cluster, \
            Client(cluster) as client:
        # Warm-up: imports, first connections.
        holder_updates_per_second(client, min(1.0, args.seconds), True)
        for _ in range(args.repeats):
            rate, placement = holder_updates_per_second(client, args.seconds, True)
            ours.append(rate)
            bare.append(holder_updates_per_second(client, args.seconds, False)[0])
            single.append(one_process_steps_per_second(args.seconds))
    a, b, c = (statistics.median(v) for v in (ours, bare, single))
    print(f"\n| {parameters:,}-parameter MLP, batch {BATCH}, Adam | updates/s |")
    print("|---|---|")
    print(f"| dasktrain async, {WORKERS} workers ({placement}) | {a:,.0f} |")
    print(f"| the same, pushing a fixed gradient (exchange only) | {b:,.0f} |")
    print(f"| one process, forward/backward + Adam step | {c:,.0f} |")
    print(f"\nratio async / one process: {a / c:.2f}x; medians of {args.repeats} runs of "
          f"{args.seconds:g} s (torch {torch.__version__})")
    if args.ratios_json:
        write_ratios(args.ratios_json, ratios(parameters, a, b, c))


if __name__ == "__main__":
    main()
