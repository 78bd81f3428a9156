"""W4, whole training runs: samples/s of a steady ``sync`` epoch against PyTorch DDP, on one
host and across two.

What a user compares. MLPs 32 -> W -> W -> W -> 1 (ReLU) for W = 512 (542,721 parameters,
2.2 MB) and W = 1024 (2,134,017, 8.5 MB), the same initial weights on both sides, MSE loss,
SGD lr 0.01, on ``regression`` data (100,000 x 32 float32, prepared once with
``dt.prepare`` into a temporary directory), 2 worker processes x batches of 256 (global
512), one torch thread per process. Measured side by side in one run, the two alternating:

* dasktrain: ``dt.Trainer(model, mse_loss, dt.optim.sgd(0.01), mode="sync", workers=2,
  batch_size=256)`` fitting the dataset for ``--epochs`` epochs on the LocalCluster
  ``fit()`` starts when given no client (2 single-threaded worker processes on 127.0.0.1,
  each in a session of its own; ``--cluster own``: a LocalCluster made here, its workers in
  this process's session, as a script's own ``LocalCluster()``), started for the run and
  closed after it, the data read through the pipeline, every setting at its default;
  samples/s of an epoch as its History records it (``history.epochs[i]["samples_per_s"]``:
  the driver's wall time of the epoch);
* baseline: ``DistributedDataParallel`` over gloo on 127.0.0.1, 2 spawned processes, the
  whole dataset already in memory as tensors (DDP's best case); every epoch a permutation
  of the rows, shared by both ranks, cut into global batches of 512, of which each rank
  takes its half; an epoch is timed from a barrier to the slower rank's last step.

Across two hosts (``--hosts two``; by default both settings run, one after the other in
each repeat): the same two sides with the second process on another host. The hosts are two
Linux network namespaces of this machine (``dasktrain/_hosts.py``), each with its own
address from 192.0.2.0/24, hostname and loopback, joined by a bridge. dasktrain runs on a
Dask cluster of one single-threaded worker process per host (started for each run and
closed after it), the scheduler and the fit's driver on the first host: the trainer worker
in the holder's process calls it in place, as on one host, and the other reaches it over
TCP instead of memory shared with it. DDP runs rank 0 on the first host and rank 1 on the
second, gloo bound to each host's address (``GLOO_SOCKET_IFNAME``), in new processes each
run as on one host. Where namespaces cannot be made (not Linux, not root), this setting is
measured on one host with ``shared_memory=False`` (the worker's bytes then go over the
channel's local socket) against DDP on one host, and the report says so.

Each run has the machine to itself, as each side would for its user: no Dask cluster
runs while DDP or the ceiling (below) runs, nor the other setting's while dasktrain does.
Idle clusters are not free on 2 cores: with dasktrain's two clusters left running beside
them (as this benchmark did before 2026-11-28), the ceiling ran 7-19 % slower and DDP up
to 8 %.

The first epoch of each side warms up (process start, imports, first connections) and is
not counted: the figure of a repeat is the median samples/s of its later epochs, and the
table gives the median over ``--repeats``. Once, at the first size, both sides' models
after their first epoch are evaluated on the same 4,096 rows, to show that the two train
the same thing (the losses differ a little: the two draw their batches in different
orders).

A second table gives each side's use of the processors over its steady epochs (from
``/proc/stat``, so every process of the machine counts, the idle rest of the benchmark
included): the share of the processors' time that was busy, and the busy processor time per
sample trained. Where both sides are busy alike and spend the same time per sample, the
processors, not the exchange's waits, set the pace; what one side could still gain is its
idle share.

A third table gives the ceiling: DDP's loop in 2 spawned processes without DDP, each
training a replica of its own on its half of every global batch with nothing exchanged,
each epoch begun together (a barrier) and timed to the slower process (the same epochs,
once per repeat, before the two sides; the same figure for both settings, as moving no
bytes does not depend on where the processes are). No exchange can be faster, so
"no exchange / DDP" is the most any side could lead DDP by on this machine: where it is
below a goal, the goal cannot be met there.

Run: ``.venv/bin/python benchmarks/e2e.py`` (``--hidden 512 1024 --epochs 3 --repeats 3
--hosts one two``; ``--quick``: the small model, 20,000 rows, 2 epochs, once).
``--link-rate 3gbit`` limits the link between the two hosts (tc's token bucket, each way),
so that moving bytes takes time on a wire rather than the processors' time;
``--whole-gradient`` also runs dasktrain with the gradient and the reply each in one piece.
On Linux with scheduler autogroups (the default of most distributions), processes of one
session share one group's part of the processors: a script's own LocalCluster shares it with
the script, the scheduler and the DDP ranks' parent, and ran the small model's steps
4-5 % slower here than the default cluster, whose workers each start a session.
``dasktrain bench`` runs it among the others.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch
import torch.distributed as torch_dist
import torch.multiprocessing as mp
from distributed import Client, LocalCluster
from torch.nn.parallel import DistributedDataParallel

import dasktrain as dt
from dasktrain._cluster import NO_DASHBOARD, start_local_cluster
from dasktrain._host_cluster import HostCluster
from dasktrain._hosts import INTERFACE, Hosts, HostsUnavailable
from dasktrain._remote import Remote
from dasktrain.cli.bench import (
    Ratio,
    baseline_environment,
    parse_with_quick,
    ratio_of,
    write_ratios,
)

FEATURES, WORKERS, BATCH, LR = 32, 2, 256, 0.01
PROBE_ROWS = 4096
# shared/benchmarks.md, W4: samples/s of a steady epoch, as a ratio to DDP's.
GOALS = {"one": "≥ 1.25x", "two": "≥ 1.1x"}
WHOLE = 1 << 62  # bucket_bytes larger than any model: one bucket, ready when backward ends
QUICK = {"hidden": [512], "rows": 20_000, "epochs": 2, "repeats": 1}
RUN_TIMEOUT = 1800.0  # seconds one run of either side may take
GLOO_PORT = 29500  # the first run's across hosts: the first host's namespace is fresh

Rates = list[float]
State = dict[str, torch.Tensor]


# -- the processors' time ----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Processors:
    """How a side used the machine's processors over its steady epochs (every process on
    the machine counts: both hosts share one kernel)."""

    busy: float  # the share of all processors' time that was busy
    per_sample: float  # busy processor-seconds per sample trained


def processors_now() -> tuple[float, float] | None:
    """Seconds all processors have been busy, and seconds of processor time in all, since
    the machine started (``/proc/stat``); None where there is no ``/proc/stat``."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    if len(fields) < 5:
        return None
    # user nice system idle iowait irq softirq steal (guest time is within user's)
    total = sum(fields[:8])
    idle = fields[3] + fields[4]
    tick = os.sysconf("SC_CLK_TCK")
    return (total - idle) / tick, total / tick


def processor_use(start: tuple[float, float] | None, end: tuple[float, float] | None,
                  samples: int) -> Processors | None:
    """The processors' use between two :func:`processors_now` marks, over ``samples``."""
    if start is None or end is None or end[1] <= start[1] or samples <= 0:
        return None
    busy = end[0] - start[0]
    return Processors(busy / (end[1] - start[1]), busy / samples)


def mlp(width: int) -> torch.nn.Module:
    """32 -> width -> width -> width -> 1, the same initial weights at every call."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, width), torch.nn.ReLU(),
        torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, 1))


def _arrays(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole dataset at ``path`` in memory: features (N, 32) and targets (N, 1)."""
    ds = dt.open_dataset(path)
    x = ds.zarr_array(ds.features_name)[:]
    y = ds.zarr_array(ds.targets_name)[:]
    return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(y))


def _steady(rates: list[float]) -> float:
    """The figure of one run: the median samples/s of the epochs after the first."""
    return statistics.median(rates[1:])


# -- dasktrain ---------------------------------------------------------------------------
def dasktrain_run(client: Client, data: dt.Dataset | str, width: int, epochs: int,
                  **options: Any) -> tuple[Rates, dict[str, Any], State, Processors | None]:
    """Fit ``epochs`` epochs in ``sync`` mode: samples/s per epoch, the last epoch's record,
    the parameters after the first epoch and the processors' use after it."""
    after_first: dict[str, torch.Tensor] = {}
    marks: list[tuple[float, float] | None] = []

    class KeepFirst(dt.Callback):
        steers = False  # it only looks: the next epoch does not wait for it

        def on_epoch_end(self, trainer: dt.Trainer, record: dict[str, Any]) -> None:
            marks.append(processors_now())
            if record["epoch"] == 0:
                after_first.update({k: v.detach().clone()
                                    for k, v in trainer.model.state_dict().items()})

    trainer = dt.Trainer(functools.partial(mlp, width), torch.nn.functional.mse_loss,
                         dt.optim.sgd(LR), mode="sync", workers=WORKERS, batch_size=BATCH,
                         progress=False, **options)
    history = trainer.fit(data, epochs=epochs, client=client, callbacks=[KeepFirst()])
    use = processor_use(marks[0], marks[-1], sum(e["samples"] for e in history.epochs[1:]))
    return ([e["samples_per_s"] for e in history.epochs], history.epochs[-1], after_first,
            use)


def one_host_run(cluster: str, path: str, width: int, epochs: int, **options: Any
                 ) -> tuple[Rates, dict[str, Any], State, Processors | None]:
    """:func:`dasktrain_run` on one host, on a cluster started for this run and closed
    after it (``cluster``: "default", the one ``fit()`` starts when given no client, or
    "own", a script's own LocalCluster), so that none of it runs beside the other side."""
    with contextlib.ExitStack() as stack:
        local = stack.enter_context(
            start_local_cluster(n_workers=WORKERS) if cluster == "default" else
            LocalCluster(n_workers=WORKERS, threads_per_worker=1, processes=True,
                         host="127.0.0.1", **NO_DASHBOARD))
        client = stack.enter_context(Client(local))
        return dasktrain_run(client, path, width, epochs, **options)


def _dasktrain_on_hosts(address: str, path: str, width: int, epochs: int,
                        options: dict[str, Any]
                        ) -> tuple[Rates, dict[str, Any], State, Processors | None]:
    """:func:`dasktrain_run` on the cluster across hosts, run by the driver on its first
    host (the cluster's addresses are there); its client is closed with the run, as the
    cluster is."""
    with Client(address, timeout=120) as client:
        client.wait_for_workers(WORKERS, timeout=120)
        return dasktrain_run(client, path, width, epochs, **options)


# -- DDP ---------------------------------------------------------------------------------
# The DDP models of this process, kept until it ends, which frees nothing (os._exit, or
# SIGKILL): freeing a model frees its gloo process group, whose destructor waits for gloo's
# threads while holding the GIL, and a gloo thread still freeing the last collective's
# tensors waits for the GIL (a deadlock, met once in a dozen runs on a busy machine).
_KEPT: list[Any] = []


def _epoch(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
           y: torch.Tensor, rank: int, order: torch.Generator) -> None:
    """One epoch of one rank: a permutation of the rows, shared by both ranks (the same
    ``order``), cut into global batches, of which this rank trains on its half."""
    rows = len(x)
    permutation = torch.randperm(rows, generator=order)
    xs, ys = x[permutation], y[permutation]
    for start in range(0, rows, BATCH * WORKERS):
        stop = min(start + BATCH * WORKERS, rows)
        # This rank's half of the global batch (of a short last one too).
        half = -(-(stop - start) // WORKERS)
        lo, hi = start + rank * half, min(start + (rank + 1) * half, stop)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xs[lo:hi]), ys[lo:hi])
        loss.backward()
        optimizer.step()


def _ddp_train(rank: int, init_method: str, path: str, width: int, epochs: int
               ) -> tuple[Rates, dict[str, np.ndarray] | None, Processors | None]:
    """One DDP rank's run: samples/s per epoch and (rank 0) the parameters after the first
    epoch and the processors' use after it."""
    torch.set_num_threads(1)
    torch_dist.init_process_group("gloo", init_method=init_method, rank=rank,
                                  world_size=WORKERS,
                                  timeout=datetime.timedelta(seconds=RUN_TIMEOUT))
    x, y = _arrays(path)
    rows = len(x)
    model = DistributedDataParallel(mlp(width))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    order = torch.Generator().manual_seed(0)  # the same permutations on both ranks
    rates, after_first, marks = [], None, []
    for epoch in range(epochs):
        torch_dist.barrier()
        started = time.perf_counter()
        _epoch(model, optimizer, x, y, rank, order)
        wall = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
        torch_dist.all_reduce(wall, op=torch_dist.ReduceOp.MAX)  # the slower rank's
        rates.append(rows / wall.item())
        marks.append(processors_now())
        if epoch == 0 and rank == 0:
            # As numpy: a tensor would travel as shared memory this process frees at exit.
            after_first = {k: v.detach().numpy().copy()
                           for k, v in model.module.state_dict().items()}
    _KEPT.append(model)  # see _KEPT
    use = processor_use(marks[0], marks[-1], rows * (epochs - 1)) if rank == 0 else None
    return rates, after_first, use


def _ddp_process(rank: int, port: int, path: str, width: int, epochs: int, out) -> None:
    rates, after_first, use = _ddp_train(rank, f"tcp://127.0.0.1:{port}", path, width,
                                         epochs)
    if rank == 0:
        out.put((rates, after_first, use))
    out.close()
    out.join_thread()  # the result is in the pipe: now end, freeing nothing (see _KEPT)
    os._exit(0)


def _spawned(target: Callable[..., None], args: Callable[[int], tuple], results: int,
             what: str) -> list[Any]:
    """Run ``target(*args(rank), out)`` in a spawned process per rank, started as a user's
    own script would start them (see ``baseline_environment``), and return the first
    ``results`` items they put on ``out``; RuntimeError if one of them failed."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args(r), out)) for r in range(WORKERS)]
    with baseline_environment():
        for p in procs:
            p.start()
    try:
        found = [out.get(timeout=RUN_TIMEOUT) for _ in range(results)]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"a {what} process failed: exit codes "
                           f"{[p.exitcode for p in procs]}")
    return found


def ddp_run(path: str, width: int, epochs: int
            ) -> tuple[Rates, State, Processors | None]:
    """Train with DDP over gloo in 2 spawned processes on 127.0.0.1: samples/s per epoch,
    the parameters after the first epoch and the processors' use after it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    [(rates, after_first, use)] = _spawned(
        _ddp_process, lambda rank: (rank, port, path, width, epochs), 1, "DDP")
    return rates, {k: torch.from_numpy(v) for k, v in after_first.items()}, use


# -- no exchange: the ceiling ------------------------------------------------------------
def _alone_process(rank: int, path: str, width: int, epochs: int, start: Any, out: Any
                   ) -> None:
    """DDP's loop on one rank without DDP: its own replica, no exchange. ``start`` (a
    barrier of both ranks) begins each epoch together, so that neither runs alone."""
    torch.set_num_threads(1)
    x, y = _arrays(path)
    model = mlp(width)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    order = torch.Generator().manual_seed(0)
    rates = []
    for _ in range(epochs):
        start.wait(timeout=RUN_TIMEOUT)
        started = time.perf_counter()
        _epoch(model, optimizer, x, y, rank, order)
        rates.append(len(x) / (time.perf_counter() - started))
    out.put(rates)


def ceiling_run(path: str, width: int, epochs: int) -> Rates:
    """samples/s per epoch of 2 processes that each train a replica of their own on their
    half of every global batch, as DDP's ranks do, with nothing exchanged: what the
    forward and backward passes and the optimizer's step allow on this machine, which no
    exchange can beat (the epoch's wall is the slower process's)."""
    start = mp.get_context("spawn").Barrier(WORKERS)
    ranks = _spawned(_alone_process, lambda rank: (rank, path, width, epochs, start),
                     WORKERS, "ceiling")
    return [min(epoch) for epoch in zip(*ranks, strict=True)]


# -- across two hosts --------------------------------------------------------------------
_ONE_THREAD = {"OMP_NUM_THREADS": "1"}
# gloo binds to the host's address (by default to what the hostname resolves to, which a
# namespace's hostname does not); c10d's warnings that the peers' addresses have no names
# are left out.
_RANK_ENVIRONMENT = {**_ONE_THREAD, "GLOO_SOCKET_IFNAME": INTERFACE,
                     "TORCH_CPP_LOG_LEVEL": "ERROR"}


class TwoHosts:
    """Two hosts (network namespaces) and the fit's driver on the first. Each dasktrain run
    starts a Dask cluster of one worker process on each host and closes it after the run;
    DDP's ranks start on each for each run. All gone at :meth:`close`."""

    def __init__(self, directory: str, link_rate: str | None = None) -> None:
        self._stack = contextlib.ExitStack()
        self._runs = 0
        self._directory = directory
        try:
            self.hosts = self._stack.enter_context(Hosts(2))
            if link_rate is not None:
                self.hosts.limit_rate(link_rate)
            # Started as a user's own process would be (see baseline_environment): the
            # driver here is a plain process, as the benchmark's own is on one host.
            with baseline_environment():
                self.driver = self._stack.enter_context(
                    Remote(self.hosts, self.hosts[0], environment=_ONE_THREAD))
        except BaseException:
            self._stack.close()
            raise

    def dasktrain(self, path: str, width: int, epochs: int, **options: Any
                  ) -> tuple[Rates, dict[str, Any], State, Processors | None]:
        with HostCluster(self.hosts, [1, 1], directory=self._directory) as cluster:
            return self.driver.call(_dasktrain_on_hosts, cluster.scheduler_address, path,
                                    width, epochs, options, timeout=RUN_TIMEOUT)

    def ddp(self, path: str, width: int, epochs: int
            ) -> tuple[Rates, State, Processors | None]:
        """DDP with a rank on each host, in new processes (as on one host), which are
        killed once they answered (see _KEPT)."""
        # A port of its own per run: the last run's may still be closing.
        init = f"tcp://{self.hosts[0].address}:{GLOO_PORT + self._runs}"
        self._runs += 1
        ranks = []
        try:
            with baseline_environment():
                for host in self.hosts:
                    ranks.append(Remote(self.hosts, host, environment=_RANK_ENVIRONMENT))
            for rank, remote in enumerate(ranks):
                remote.submit(_ddp_train, rank, init, path, width, epochs)
            (rates, after_first, use), _ = (remote.result(RUN_TIMEOUT) for remote in ranks)
        finally:
            for remote in ranks:
                remote.close(kill=True)
        return rates, {k: torch.from_numpy(v) for k, v in after_first.items()}, use

    def close(self) -> None:
        self._stack.close()


@dataclasses.dataclass(frozen=True)
class Setting:
    """Where the two sides run."""

    key: str  # "one" or "two" (--hosts)
    name: str  # for the tables
    baseline: str  # what DDP's figure is
    # (width, **options)
    ours: Callable[..., tuple[Rates, dict[str, Any], State, Processors | None]]
    theirs: Callable[[int], tuple[Rates, State, Processors | None]]  # (width)


def settings(args: argparse.Namespace, path: str, stack: contextlib.ExitStack
             ) -> tuple[list[Setting], str | None]:
    """The settings ``--hosts`` asks for, and a note where across hosts runs on one."""
    found, note = [], None
    epochs = args.epochs
    if "one" in args.hosts:
        found.append(Setting(
            "one", "one host", "DDP over gloo, data in memory",
            lambda width, **options: one_host_run(args.cluster, path, width, epochs,
                                                  **options),
            lambda width: ddp_run(path, width, epochs)))
    if "two" in args.hosts:
        try:
            two = TwoHosts(str(Path(path).parent / "hosts"), args.link_rate)
        except HostsUnavailable as exc:
            note = (f"no second host here ({exc}): the cross-host setting ran on one host "
                    "with shared_memory=False, the path a worker on another host takes")
            found.append(Setting(
                "two", "one host, shared_memory=False", "DDP over gloo, data in memory",
                lambda width, **options: one_host_run(args.cluster, path, width, epochs,
                                                      shared_memory=False, **options),
                lambda width: ddp_run(path, width, epochs)))
        else:
            stack.callback(two.close)
            found.append(Setting(
                "two", "across 2 hosts" + (f", {args.link_rate} link" if args.link_rate else ""),
                "DDP over gloo across 2 hosts, data in memory",
                lambda width, **options: two.dasktrain(path, width, epochs, **options),
                lambda width: two.ddp(path, width, epochs)))
    return found, note


def probe_loss(width: int, state: dict[str, torch.Tensor] | None, x: torch.Tensor,
               y: torch.Tensor) -> float:
    """MSE on the probe rows of the model with parameters ``state`` (initial if None)."""
    model = mlp(width)
    if state is not None:
        model.load_state_dict(state)
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(x), y).item()


# -- the run -----------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[512, 1024],
                        help="hidden widths of the MLPs (default 512 1024)")
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--epochs", type=int, default=3,
                        help="epochs per run, the first one a warm-up (default 3)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hosts", nargs="+", choices=["one", "two"], default=["one", "two"],
                        help="on one host, across two (network namespaces of this machine; "
                             "where there are none, shared_memory=False on one host), or "
                             "both (default)")
    parser.add_argument("--cluster", choices=["default", "own"], default="default",
                        help="dasktrain's cluster on one host: the one fit() starts when "
                             "given no client (default), or a LocalCluster made by this "
                             "script, its workers in the script's session")
    parser.add_argument("--whole-gradient", action="store_true",
                        help="also run dasktrain with the gradient and the reply each in "
                             "one piece (bucket_bytes larger than the model): what sending "
                             "the gradient during backward and receiving the reply during "
                             "the next forward pass gain")
    parser.add_argument("--link-rate", metavar="RATE",
                        help="limit the link between the two hosts to RATE each way (tc's "
                             "units, e.g. 3gbit): a real network's bandwidth, where the "
                             "namespaces' own link costs CPU time as fast as memory copies "
                             "(default: unlimited)")
    args = parse_with_quick(parser, argv, QUICK,
                            "seconds, not minutes: the small model, 20,000 rows, 2 epochs, "
                            "once (rough figures)")
    if args.epochs < 2:
        parser.error(f"--epochs must be at least 2 (the first is a warm-up), got {args.epochs}")
    if args.rows < BATCH * WORKERS:
        parser.error(f"--rows must be at least one global batch ({BATCH * WORKERS}), "
                     f"got {args.rows}")
    if args.rows % (BATCH * WORKERS) == 1:
        parser.error("--rows leaves a last global batch of 1 row, which one of the DDP "
                     "ranks could not share")
    args.hosts = sorted(set(args.hosts), key=["one", "two"].index)
    if args.link_rate and "two" not in args.hosts:
        parser.error("--link-rate limits the link between two hosts: add --hosts two")
    return args


def _describe(width: int) -> tuple[str, int]:
    parameters = sum(p.numel() for p in mlp(width).parameters())
    return (f"32→{width}→{width}→{width}→1 ({parameters / 1e6:.2f} M parameters, "
            f"{parameters * 4 / 1e6:.1f} MB)"), parameters


@dataclasses.dataclass
class Row:
    """One model in one setting: the medians of its repeats."""

    label: str
    parameters: int
    setting: Setting
    ours: float
    theirs: float
    last: dict[str, Any]  # dasktrain's last epoch of the last repeat
    one_piece: float | None  # with --whole-gradient
    ours_use: Processors | None  # medians of the repeats
    theirs_use: Processors | None
    ceiling: float  # samples/s with nothing exchanged (the median of the repeats)


def median_use(uses: list[Processors | None]) -> Processors | None:
    """The median busy share and processor time per sample of ``uses`` (None if any is
    unknown)."""
    if not uses or any(u is None for u in uses):
        return None
    return Processors(statistics.median(u.busy for u in uses),
                      statistics.median(u.per_sample for u in uses))


def _use(use: Processors | None) -> tuple[str, str]:
    return ("?", "?") if use is None else (f"{use.busy:.0%}", f"{use.per_sample * 1e6:,.0f}")


def ratios(rows: list[Row]) -> list[Ratio]:
    """The summary rows: per model and setting, our steady samples/s against DDP's."""
    return [Ratio(workload=f"W4 whole run, MLP {row.parameters / 1e6:.2f} M parameters, sync, "
                           f"2 workers, {row.setting.name} (samples/s)",
                  ours=f"{row.ours:,.0f}", baseline=f"{row.theirs:,.0f} ({row.setting.baseline})",
                  ratio=ratio_of(row.ours, row.theirs), goal=GOALS[row.setting.key])
            for row in rows]


def _exchange(last: dict[str, Any]) -> str:
    """How dasktrain's workers reached the holder in an epoch, e.g. ``local x1, direct x1
    (tcp)``."""
    via = ", ".join(f"{k} x{v}" for k, v in sorted(last["exchange_via"].items()))
    transports = sorted({w["transport"] for w in last["per_worker"] if w["transport"]})
    return f"{via} ({', '.join(transports)})" if transports else via


def measure(width: int, setting: Setting, args: argparse.Namespace, repeat: int,
            results: dict[str, list]) -> tuple[dict[str, Any], State, State]:
    """One repeat of both sides in ``setting``: figures into ``results``; dasktrain's last
    epoch and both sides' parameters after the first epoch."""
    label, _ = _describe(width)
    rates, last, ours_first, ours_use = setting.ours(width)
    results["ours"].append(_steady(rates))
    results["ours_use"].append(ours_use)
    if args.whole_gradient:
        whole_rates, *_ = setting.ours(width, bucket_bytes=WHOLE)
        results["whole"].append(_steady(whole_rates))
        print(f"{label}, {setting.name}, repeat {repeat + 1}: gradient and reply in one piece "
              f"{', '.join(f'{r:,.0f}' for r in whole_rates)}", flush=True)
    ddp_rates, ddp_first, ddp_use = setting.theirs(width)
    results["theirs"].append(_steady(ddp_rates))
    results["theirs_use"].append(ddp_use)
    print(f"{label}, {setting.name}, repeat {repeat + 1}: dasktrain "
          f"{', '.join(f'{r:,.0f}' for r in rates)} samples/s by epoch; DDP "
          f"{', '.join(f'{r:,.0f}' for r in ddp_rates)}", flush=True)
    return last, ours_first, ddp_first


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    rows: list[Row] = []
    check = None
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="dasktrain-w4-"))
        path = str(Path(tmp) / "regression.zarr")
        with start_local_cluster(n_workers=WORKERS) as cluster, Client(cluster) as client:
            dt.prepare("regression", path, client=client, samples=args.rows, width=FEATURES,
                       progress=False)
        probe_x, probe_y = (a[:PROBE_ROWS] for a in _arrays(path))
        found, note = settings(args, path, stack)
        if note:
            print(note, flush=True)
        for width in args.hidden:
            label, parameters = _describe(width)
            results = {s.key: {"ours": [], "theirs": [], "whole": [], "ours_use": [],
                               "theirs_use": []} for s in found}
            last: dict[str, dict[str, Any]] = {}
            ceilings = []
            for repeat in range(args.repeats):
                alone = ceiling_run(path, width, args.epochs)
                ceilings.append(_steady(alone))
                print(f"{label}, repeat {repeat + 1}: no exchange "
                      f"{', '.join(f'{r:,.0f}' for r in alone)} samples/s by epoch", flush=True)
                for setting in found:  # alternating, so that drift hits every setting
                    last[setting.key], ours_first, ddp_first = measure(
                        width, setting, args, repeat, results[setting.key])
                    if check is None:
                        check = (width, setting.name, probe_loss(width, None, probe_x, probe_y),
                                 probe_loss(width, ours_first, probe_x, probe_y),
                                 probe_loss(width, ddp_first, probe_x, probe_y))
            for setting in found:
                figures = results[setting.key]
                rows.append(Row(label, parameters, setting, statistics.median(figures["ours"]),
                                statistics.median(figures["theirs"]), last[setting.key],
                                statistics.median(figures["whole"]) if figures["whole"]
                                else None, median_use(figures["ours_use"]),
                                median_use(figures["theirs_use"]),
                                statistics.median(ceilings)))
    print("\n| model | hosts | dasktrain `sync` (samples/s) | DDP, gloo, data in memory "
          "(samples/s) | ratio | goal |")
    print("|---|---|---:|---:|---:|---|")
    for row in rows:
        print(f"| {row.label} | {row.setting.name} | {row.ours:,.0f} | {row.theirs:,.0f} | "
              f"{row.ours / row.theirs:.2f}x | {GOALS[row.setting.key]} |")
    print("\n| model | hosts | processors busy: dasktrain / DDP | processor time per "
          "sample (µs): dasktrain / DDP |")
    print("|---|---|---:|---:|")
    for row in rows:
        (ours_busy, ours_time), (ddp_busy, ddp_time) = _use(row.ours_use), _use(row.theirs_use)
        print(f"| {row.label} | {row.setting.name} | {ours_busy} / {ddp_busy} | {ours_time} / "
              f"{ddp_time} |")
    print("\n| model | hosts | no exchange (samples/s) | dasktrain / no exchange | DDP / no "
          "exchange | the most any side could lead DDP by |")
    print("|---|---|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row.label} | {row.setting.name} | {row.ceiling:,.0f} | "
              f"{row.ours / row.ceiling:.0%} | {row.theirs / row.ceiling:.0%} | "
              f"{row.ceiling / row.theirs:.2f}x |")
    if args.whole_gradient:
        print("\n| model | hosts | in buckets: gradient during backward, reply during "
              "forward (default) | each in one piece | buckets gain |")
        print("|---|---|---:|---:|---:|")
        for row in rows:
            print(f"| {row.label} | {row.setting.name} | {row.ours:,.0f} | "
                  f"{row.one_piece:,.0f} | {row.ours / row.one_piece:.2f}x |")
    width, where, initial, ours_loss, ddp_loss = check
    print(f"\nSame training: MSE on the first {PROBE_ROWS:,} rows after one epoch, hidden "
          f"{width}, {where}: dasktrain {ours_loss:.4f}, DDP {ddp_loss:.4f} "
          f"(initial {initial:.4f}).")
    notes = "; ".join(f"{row.label.split(' ')[0]} {row.setting.name}: stall "
                      f"{row.last['stall']:.1%}, exchange {_exchange(row.last)}"
                      for row in rows)
    print(f"(2 workers x batch {BATCH}, {args.rows:,} rows; steady epoch = median of epochs "
          f"2..{args.epochs}, medians of {args.repeats} repeats; dasktrain's last epoch: "
          f"{notes}; dasktrain's cluster on one host: {args.cluster}; {os.cpu_count()} "
          f"cores; torch {torch.__version__})")
    if note:
        print(note)
    if args.ratios_json:
        write_ratios(args.ratios_json, ratios(rows))


if __name__ == "__main__":
    main()
