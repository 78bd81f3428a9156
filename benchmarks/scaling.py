"""W5, scaling with workers: ``sync`` step time for N trainer workers against gloo.

For N = 2, 4 and 8 workers and 10 MB of flat float32 parameters (2.5 M), measured side by
side in one run (medians of ``--repeats`` runs of ``--steps`` steps each, after warm-up),
with the exchange of ``benchmarks/holder.py`` (W2) run for N workers:

* dasktrain: N trainer tasks on an N-process LocalCluster (one single-threaded worker
  process each) push a gradient to the ParameterHolder actor in ``sync`` mode and load the
  parameters it sends back; the holder sits in the first process, so one worker calls it in
  place and the N - 1 others over the direct channel, sharing memory with it (the
  defaults); beside it, the holder in 2 shards (``holder_shards=2``, on the first two
  processes), what a cluster of several hosts would use, here with every byte on the
  channel's sockets;
* baseline: ``torch.distributed`` gloo ``all_reduce`` of the same buffer across N processes,
  divided by N, then the same SGD step in each process.

Both start N processes on the machine's cores, so both oversubscribe them the same way. The
holder receives N payloads and sends N replies per step; gloo's ring moves about twice the
buffer per process whatever N is: the ratio shows what a single holder costs as N grows.

Run: ``.venv/bin/python benchmarks/scaling.py`` (``--workers 2 4 8 --size 10 --steps 20
--repeats 3``; ``--quick``: 2 and 3 workers, 1 MB, 5 steps, once). ``dasktrain bench``
runs it among the others.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections import Counter

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch
from distributed import Client, LocalCluster

# W2's exchange and its gloo baseline, for N workers (this script's directory, that of
# benchmarks/holder.py, is on sys.path).
from holder import dasktrain_step, gloo_step

from dasktrain._cluster import NO_DASHBOARD
from dasktrain.cli.bench import Ratio, parse_with_quick, ratio_of, write_ratios

# shared/benchmarks.md, W5: the step time to reach, as a ratio to gloo's, at every N.
GOAL = "≤ 1x"
QUICK = {"workers": [2, 3], "size": 1.0, "steps": 5, "warmup": 2, "repeats": 1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8],
                        help="numbers of trainer workers (default 2 4 8)")
    parser.add_argument("--size", type=float, default=10.0,
                        help="parameter size in MB (default 10)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shards", type=int, default=2,
                        help="shards of the holder measured beside one holder (default 2; "
                             "1: none)")
    args = parse_with_quick(parser, argv, QUICK,
                            "seconds, not minutes: 2 and 3 workers, 1 MB, 5 steps, once")
    if min(args.workers) < 1:
        parser.error(f"--workers must be positive, got {args.workers}")
    return args


def ratios(mb: float, rows: list[tuple]) -> list[Ratio]:
    """The summary rows: per number of workers, our step time against gloo's."""
    return [Ratio(workload=f"W5 scaling, {mb:g} MB, sync, {n} workers (ms/step)",
                  ours=f"{a * 1e3:.1f}",
                  baseline=f"{b * 1e3:.1f} (gloo all_reduce + SGD, {n} processes)",
                  ratio=ratio_of(a, b), goal=GOAL)
            for n, a, b, *_ in rows]


def measure(workers: int, size: int, args: argparse.Namespace
            ) -> tuple[float, float, str, float | None]:
    """Medians of our step, gloo's and ours in shards for ``workers`` processes each,
    alternating."""
    ours, theirs, sharded = [], [], []
    placement = ""
    with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                      host="127.0.0.1", **NO_DASHBOARD) as cluster, \
            Client(cluster) as client:
        client.wait_for_workers(workers, timeout=120)
        for _ in range(args.repeats):
            seconds, placement = dasktrain_step(client, size, args.steps, args.warmup,
                                                workers=workers)
            ours.append(seconds)
            if 1 < args.shards <= workers:
                sharded.append(dasktrain_step(client, size, args.steps, args.warmup,
                                              workers=workers, shards=args.shards)[0])
            # Our cluster's processes idle meanwhile, as gloo's are gone while ours run.
            theirs.append(gloo_step(size, args.steps, args.warmup, workers=workers))
    # "local+direct+direct+direct" -> "local x1, direct x3"
    counts = Counter(placement.split("+"))
    return (statistics.median(ours), statistics.median(theirs),
            ", ".join(f"{where} x{count}" for where, count in counts.items()),
            statistics.median(sharded) if sharded else None)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    size = int(args.size * 1e6 / 4)
    rows = []
    for n in args.workers:
        a, b, placement, s = measure(n, size, args)
        rows.append((n, a, b, placement, s))
        shards = "" if s is None else f", {args.shards} shards {s * 1e3:.1f} ms"
        print(f"{n} workers: dasktrain {a * 1e3:.1f} ms{shards}, gloo {b * 1e3:.1f} ms, "
              f"ratio {a / b:.2f}x", flush=True)
    print(f"\n| workers ({args.size:g} MB) | dasktrain holder, sync (ms/step) "
          f"| gloo all_reduce + SGD (ms/step) | ratio | holder in {args.shards} shards "
          "(ms/step) | its ratio |")
    print("|---|---|---|---|---|---|")
    for n, a, b, _, s in rows:
        shards = "— | —" if s is None else f"{s * 1e3:.1f} | {s / b:.2f}x"
        print(f"| {n} | {a * 1e3:.1f} | {b * 1e3:.1f} | {a / b:.2f}x | {shards} |")
    placements = "; ".join(f"{n}: {p}" for n, _, _, p, _ in rows)
    print(f"\n(N processes for each; how workers reached the holder: {placements}; medians "
          f"of {args.repeats} x {args.steps} steps; {os.cpu_count()} cores; numpy "
          f"{np.__version__}, torch {torch.__version__})")
    if args.ratios_json:
        write_ratios(args.ratios_json, ratios(args.size, rows))


if __name__ == "__main__":
    main()
