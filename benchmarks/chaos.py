"""W9, chaos: a long randomized run of faults over several fits of every update mode, and
what each epoch applied.

Setup: a LocalCluster of 4 single-threaded worker processes on 127.0.0.1, the holder on
the first. Every fit is elastic (``workers=(2, 6)``: one trainer worker per Dask worker, the
cluster changing under it) and trains ``Tally``: one parameter per row of an indexed
dataset of 480 rows (batches of 8, 60 a epoch), the loss the mean output, and an optimizer
that adds one per application of a row's gradient. After each epoch, every parameter has
moved by exactly one, or some row was applied 0 or 2+ times. (In ``average`` a row's count
arrives divided by the round's average: there the samples the holder applied per epoch are
compared with the rows instead.) A trainer worker's batch costs 10 ms (20 ms beside the
holder, so that where work is claimed the others take most of it).

Faults: in each epoch from the second on, one, drawn at random (seeded) among the list
below; rounds of a fit per mode go on until ``--faults`` have happened (a planned kill may
find no worker at its point, a planned change no room on the cluster):

* a trainer worker's process (not the holder's) SIGKILLed with a claim of work on its way,
  with its n-th push of the epoch on its way, with the push of the epoch's last batch on
  its way, or after it left the epoch and asked for the next (the points of
  :mod:`dasktrain.trainer.faults`, planned in every worker process, the first worker to
  reach it dies). The nanny starts the process again; the fit starts a trainer worker on
  it.
* a Dask worker retired (``client.retire_workers``) as the epoch before ends, or one added
  (``cluster.scale``), keeping the cluster between 3 and 5 processes.

Reported: faults that happened and that the fits survived, fits completed (and failed,
with why), rows applied 0 / 1 / 2+ times per epoch (samples per epoch in ``average``), and
the longest time a fit waited on a dead worker: from the kill (the victim's clock) until
the driver saw the holder stop counting on it (the event that drops or supersedes it,
seen at the driver's next poll, so up to 0.5 s late). Goals: 0 rows applied 0 or 2+ times,
0 hangs, every wait on a dead worker <= 15 s.

Run: ``.venv/bin/python benchmarks/chaos.py`` (``--faults 200``, about 8 minutes on 2
cores; ``--quick``: 20 faults, about a minute and a half).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch
from distributed import Client, LocalCluster, get_worker
from distributed.diagnostics.plugin import WorkerPlugin

import dasktrain as dt
from dasktrain._cluster import NO_DASHBOARD, worker_info
from dasktrain.cli.bench import Ratio, parse_with_quick, write_ratios
from dasktrain.trainer import faults
from dasktrain.trainer.worker.loop import trainer_place

# The oracle is the test suite's (tests/common/counting.py); the worker processes, spawned
# with this process's sys.path, import it from there too.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.common.counting import Tally, register_tally

ROWS, BATCH = 480, 8
MODES = {"async": {}, "soft": {}, "ssp": {"staleness_bound": 2},
         "average": {"average_every": 2}, "sync": {}}
KILLS = ("claim", "push", "last", "boundary")
CLUSTER = (3, 5)  # the least and most worker processes the faults keep


# -- the oracle --------------------------------------------------------------------------
def tally() -> Tally:
    return Tally(ROWS)


def paced_mean(output: torch.Tensor, target: torch.Tensor, holder: str) -> torch.Tensor:
    """The mean output (its gradient marks the batch's rows), after 10 ms (20 ms in the
    holder's process)."""
    del target
    if trainer_place() is not None:
        time.sleep(0.02 if get_worker().address == holder else 0.01)
    return output.mean()


# -- the faults --------------------------------------------------------------------------
class Kills(WorkerPlugin):
    """Plans kills in every worker process, those the nanny starts again and those the
    cluster gains included: ``plans`` maps an epoch to (point, nth, marker); the first
    trainer worker outside the holder's process to reach the point the nth time in that
    epoch writes its number and the time into the marker (once) and dies."""

    name = "dasktrain-chaos-kills"

    def __init__(self, holder: str, plans: dict[int, tuple[str, int, str]]) -> None:
        self.holder, self.plans = holder, plans

    def setup(self, worker: Any) -> None:
        if worker.address == self.holder:
            return
        seen: Counter[tuple[int, str]] = Counter()
        for point in faults.POINTS:
            faults.install(point, lambda point=point, **where: self._reach(point, seen,
                                                                            where))

    def _reach(self, point: str, seen: Counter, where: dict[str, Any]) -> None:
        plan = self.plans.get(int(where["epoch"]))
        if plan is None:
            return
        kind, nth, marker = plan
        wanted = "push" if kind == "last" else kind
        if point != wanted or (kind == "last" and not where.get("last")):
            return
        seen[(where["epoch"], kind)] += 1
        if seen[(where["epoch"], kind)] < nth:
            return
        # A process's threads (its feeder's claims, its pushes) may reach points at once.
        draft = Path(f"{marker}.{os.getpid()}.{threading.get_ident()}")
        draft.write_text(f"{where['worker']} {time.time()!r}")
        try:
            os.link(draft, marker)
        except FileExistsError:
            return
        finally:
            draft.unlink(missing_ok=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def teardown(self, worker: Any) -> None:
        faults.clear()


class Changes(dt.Callback):
    """In the driver: the cluster changes planned for each epoch (retire or scale, started
    as the epoch before ends), and the time the driver first saw each event."""

    steers = False

    def __init__(self, cluster: LocalCluster, client: Client, holder: str,
                 plans: dict[int, str]) -> None:
        self.cluster, self.client, self.holder, self.plans = cluster, client, holder, plans
        self.seen: list[tuple[float, str]] = []
        self.done: list[str] = []
        self.threads: list[threading.Thread] = []
        self.ends: list[np.ndarray] = []

    def on_update(self, trainer: Any, records: dict[str, list]) -> None:
        now = time.time()
        self.seen += [(now, e) for e in trainer.history.events[len(self.seen):]]

    def on_epoch_end(self, trainer: Any, record: dict[str, Any]) -> None:
        self.on_update(trainer, {})
        self.ends.append(trainer.model.w.detach().numpy().copy())
        change = self.plans.get(record["epoch"] + 1)
        if change is not None:
            thread = threading.Thread(target=self._change, args=(change,), daemon=True)
            thread.start()
            self.threads.append(thread)

    def _change(self, change: str) -> None:
        running = sorted(worker_info(self.client))
        others = [a for a in running if a != self.holder]
        if change == "retire" and len(running) > CLUSTER[0] and others:
            self.client.retire_workers([others[-1]])
            self.done.append("retire")
        elif len(running) < CLUSTER[1]:
            self.cluster.scale(len(self.cluster.worker_spec) + 1)
            self.done.append("scale")


def _plan(rng: random.Random, mode: str, epochs: int, folder: Path
          ) -> tuple[dict[int, tuple[str, int, str]], dict[int, str]]:
    """One fault per epoch from the second on: a kill (point, nth, marker) or a change."""
    kills, changes = {}, {}
    for epoch in range(1, epochs):
        kind = rng.choice([k for k in (*KILLS, "retire", "scale")
                           if not (mode == "sync" and k == "claim")])
        if kind in KILLS:
            kills[epoch] = (kind, rng.randint(1, 4) if kind in ("claim", "push") else 1,
                            str(folder / f"killed-{epoch}"))
        else:
            changes[epoch] = kind
    return kills, changes


# -- one fit -----------------------------------------------------------------------------
def _keep_cluster(cluster: LocalCluster, client: Client) -> None:
    """Between 3 and 5 worker processes again, for the next fit."""
    running = sorted(worker_info(client))
    if len(running) < CLUSTER[0]:
        cluster.scale(len(cluster.worker_spec) + CLUSTER[0] - len(running))
        client.wait_for_workers(CLUSTER[0], timeout=120)


def one_fit(cluster: LocalCluster, client: Client, data: Any, mode: str, epochs: int,
            rng: random.Random, folder: Path) -> dict[str, Any]:
    _keep_cluster(cluster, client)
    holder = sorted(worker_info(client))[0]
    kills, changes = _plan(rng, mode, epochs, folder)
    client.register_plugin(Kills(holder, kills))
    watch = Changes(cluster, client, holder, changes)
    trainer = dt.Trainer(tally, functools.partial(paced_mean, holder=holder),
                         register_tally(), mode=mode,
                         workers=(2, 6), batch_size=BATCH, holder_worker=holder,
                         progress=False, timeout=60, barrier_timeout=20, **MODES[mode])
    started = time.monotonic()
    error = None
    try:
        history = trainer.fit(data, epochs=epochs, client=client, callbacks=[watch])
    except Exception as exc:  # a failed fit is reported, not hidden
        error = f"{type(exc).__name__}: {exc}"
        history = getattr(exc, "history", None)
    finally:
        for thread in watch.threads:
            thread.join(timeout=60)
        client.unregister_worker_plugin(Kills.name)
    wall = time.monotonic() - started
    killed = {e: Path(m).read_text().split() for e, (_, _, m) in kills.items()
              if Path(m).exists()}
    return {"mode": mode, "error": error, "wall": wall, "history": history,
            "tallies": watch.ends, "seen": watch.seen, "killed": killed,
            "kills": kills, "changes": watch.done}


def _applied(result: dict[str, Any]) -> Counter:
    """Rows applied 0 / 1 / 2+ times over the fit's epochs (in ``average``: epochs whose
    applied samples are short of, equal to or more than the rows)."""
    counts: Counter = Counter()
    history = result["history"]
    if result["mode"] == "average":
        for record in (history.epochs if history is not None else []):
            n = record["samples"]
            counts["0" if n < ROWS else "1" if n == ROWS else "2+"] += 1
        return counts
    before = np.zeros(ROWS, dtype=np.float32)
    for after in result["tallies"]:
        per_row = np.rint(after - before).astype(int)
        counts["0"] += int((per_row == 0).sum())
        counts["1"] += int((per_row == 1).sum())
        counts["2+"] += int((per_row >= 2).sum())
        before = after
    return counts


def _waits(result: dict[str, Any]) -> list[float]:
    """Seconds from each kill until the driver saw the holder stop counting on the worker."""
    waits = []
    for worker, at in result["killed"].values():
        gone = re.compile(rf"worker {worker} (dropped|left|given up)|worker {worker}'s "
                          r"earlier task is superseded")
        seen = [t for t, event in result["seen"] if gone.search(event) and t >= float(at)]
        waits.append(min(seen) - float(at) if seen else math.inf)
    return waits


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=200, help="faults in all, at least")
    parser.add_argument("--epochs", type=int, default=10, help="per fit (a fault per epoch "
                                                               "from the second on)")
    parser.add_argument("--seed", type=int, default=0)
    args = parse_with_quick(parser, argv, {"faults": 20, "epochs": 5},
                            "20 faults over a few short fits")
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    results: list[dict[str, Any]] = []
    try:
        _run_fits(args, rng, results)
    except KeyError as exc:
        # The cluster's close can trip over a worker it saw removed twice (SpecCluster's
        # status watch); the fits and their report are done by then.
        print(f"(closing the cluster: KeyError {exc})", file=sys.stderr)


def _run_fits(args: argparse.Namespace, rng: random.Random,
              results: list[dict[str, Any]]) -> None:
    """Rounds of a fit per mode until ``args.faults`` faults happened (a planned kill may
    find no worker at its point, a planned change no room on the cluster)."""
    planned_rounds = max(1, math.ceil(args.faults / ((args.epochs - 1) * len(MODES))))
    with tempfile.TemporaryDirectory() as scratch, \
            LocalCluster(n_workers=4, threads_per_worker=1, processes=True,
                         host="127.0.0.1", **NO_DASHBOARD) as cluster, \
            Client(cluster) as client:
        folder = Path(scratch)
        data = _indexed(client, folder)
        n = 0
        while _faults(results) < args.faults and n < 2 * planned_rounds:
            for mode in MODES:
                run = folder / f"{mode}-{n}"
                run.mkdir()
                result = one_fit(cluster, client, data, mode, args.epochs, rng, run)
                results.append(result)
                print(f"{mode:8s} fit {n}: {len(result['killed'])} kills, "
                      f"{len(result['changes'])} changes, {result['wall']:.1f} s"
                      + (f", FAILED: {result['error'][:160]}" if result["error"] else ""),
                      file=sys.stderr, flush=True)
                if result["error"] and result["history"] is not None:  # what happened
                    for event in result["history"].events[-40:]:
                        print(f"    {event}", file=sys.stderr, flush=True)
            n += 1
        _report(results, args)  # before the cluster closes: its close may raise


def _faults(results: list[dict[str, Any]]) -> int:
    return sum(len(r["killed"]) + len(r["changes"]) for r in results)


def _indexed(client: Client, folder: Path) -> dt.Dataset:
    """Feature 0 of each row is its index (what Tally counts by)."""
    x = np.zeros((ROWS, 2), dtype=np.float32)
    x[:, 0] = np.arange(ROWS)
    np.save(folder / "x.npy", x)
    np.save(folder / "y.npy", np.zeros(ROWS, dtype=np.float32))
    return dt.prepare(folder / "x.npy", folder / "rows.zarr", client=client,
                      target=str(folder / "y.npy"), chunk_rows=60, progress=False)


def _report(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    completed = [r for r in results if r["error"] is None]
    survived = sum(len(r["killed"]) + len(r["changes"]) for r in completed)
    happened = _faults(results)
    applied: Counter = Counter()
    for r in completed:
        if r["mode"] != "average":
            applied.update(_applied(r))
    epochs_off = sum(_applied(r)["0"] + _applied(r)["2+"] for r in completed
                     if r["mode"] == "average")
    waits = [w for r in results for w in _waits(r)]
    longest = max(waits, default=0.0)
    print(f"\nW9 chaos: {len(results)} fits ({', '.join(MODES)}), {happened} faults "
          f"({sum(len(r['killed']) for r in results)} kills, "
          f"{sum(len(r['changes']) for r in results)} cluster changes)")
    print(f"fits completed: {len(completed)} of {len(results)}")
    for r in results:
        if r["error"]:
            print(f"  failed ({r['mode']}): {r['error'][:300]}")
    print(f"faults survived (in completed fits): {survived}")
    print(f"rows applied per epoch (async, soft, ssp, sync): 0 times {applied['0']}, "
          f"once {applied['1']}, 2+ times {applied['2+']}")
    print(f"average: epochs whose applied samples were not the rows: {epochs_off}")
    print(f"longest wait on a dead worker: {longest:.1f} s (median "
          f"{statistics.median(waits) if waits else 0.0:.1f} s over {len(waits)} kills)")
    goals = (applied["0"] == 0 and applied["2+"] == 0 and epochs_off == 0
             and len(completed) == len(results) and longest <= 15.0)
    print(f"goals (0 rows 0 or 2+ times, every fit completed, waits <= 15 s): "
          f"{'met' if goals else 'NOT met'}")
    if args.ratios_json:
        write_ratios(args.ratios_json, [Ratio(
            workload=f"W9 chaos: fits completed of {len(results)}, {happened} faults",
            ours=str(len(completed)), baseline=f"{len(results)} fits", goal="all",
            ratio=len(completed) / len(results) if results else None)])


if __name__ == "__main__":
    main()
