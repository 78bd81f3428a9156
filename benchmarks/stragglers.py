"""W3, stragglers: every update mode with one trainer worker 3x slower, and without, under
SGD with momentum 0.9 and under Adam, each at a learning rate where ``sync`` trains well.

Tasks (non-convex, where staleness hurts; ``--task``):

* ``teacher`` (default): teacher-student classification. 24,576 rows of 32 standard normal
  features; the label is the argmax over 10 classes of a fixed random teacher network
  (32 -> 64 tanh -> 10). The student is an MLP 32 -> 128 tanh -> 128 tanh -> 10 (22k
  parameters) trained with cross-entropy. ``--model linear`` trains softmax regression on
  the same data instead, the convex contrast.
* ``wave``: regression of a smooth non-linear function of 8 standard normal features,
  ``sin(2 a.x) cos(b.x) + 0.5 tanh(2 c.x)`` for fixed random directions, by a ReLU MLP
  8 -> 64 -> 64 -> 1 (4.8k parameters) with mean squared error.
* ``committee``: a task with a long plateau, the soft committee machine of Saad and Solla
  (1995, "On-line learning in soft committee machines"). The target is a sum of K = 4
  ``erf`` units along orthonormal directions of 16 standard normal features; the student
  is a tanh MLP 16 -> 4 -> 1 (73 parameters) whose first layer starts 100 times smaller than
  PyTorch's default, with mean squared error. Why it has a plateau: from a small start the
  four hidden units are nearly interchangeable, and the gradient first moves them together
  towards the mean of the teacher's directions (the symmetric phase, a saddle whose loss is
  about 0.03 under SGD, 0.07 under Adam); the loss falls again only when the units break
  their symmetry and each takes one direction, which is slow to begin because it grows
  from the small differences between them. Sustained momentum is what crosses the saddle
  fast, which is what a mode that damps momentum for staleness loses. Its target is fixed,
  not read off ``sync``: a smoothed loss of 0.002, past the plateau by a factor of 15 to
  35 (``sync`` goes on to 0.0001-0.0004, a floor a noisier update need not reach to have
  crossed it), and its fits run 8 epochs (``sync`` crosses in its sixth under SGD, its
  third under Adam).

Optimizers (``--optimizer``, default both, one after the other on the same cluster): SGD
with momentum 0.9, and Adam (betas 0.9, 0.999); the learning rate of each task and
optimizer is in ``LR`` (``--lr`` sets one for all): SGD 0.2 (the rate W3 always used on
``teacher``; the best ``sync`` loss of 0.05-0.4 on ``wave``), Adam 0.02 (the best ``sync``
loss of 0.005-0.04 on both).

Setup: a LocalCluster of 2 processes on 127.0.0.1 (the machine has 2 cores, 2 threads per
process), 3 trainer workers (long-running tasks, ``torch_threads=1``), batches of 128 per
worker. The straggler is the trainer worker of rank ``--slow-rank`` (default 2): its loss
function, after computing the loss, sleeps (``--slowdown`` - 1) = 2 x the measured time of
one step of an unhindered worker, so that its steps take 3x as long. A step is forward,
backward and the exchange with the parameter holder (here the exchange costs more than the
compute); the step time is the median, over three untimed ``sync`` fits of one epoch
without a straggler (``--calibration-fits``; one with ``--quick``), of the median time
between updates, measured once the cluster is warm: after an untimed ``sync`` fit and an
untimed ``average`` fit (the first torch optimizer a worker process builds imports
``torch._dynamo``, about 1 s, which would otherwise land in the first timed ``average``
fit). A change that shortens the step shortens the straggler's sleep with it; ``--sleep-ms``
fixes the sleep instead, to compare runs whose steps differ. The loss knows it runs
in the straggler from the trainer task it is called in (``trainer_place()``, the worker and
epoch of the trainer task whose thread calls it): no global state, and the same loss object
serves every worker; ``Trainer.evaluate`` runs in no trainer task and never sleeps.
Sleeping releases the CPU, as a slow GPU or a slow node would. The run reports the
straggler's share of the last quarter of each epoch's gradients in ``async``, to show it
took effect.

For every mode (defaults first, ``average`` at its K = 10 and then at K = 4, then the
options of :mod:`dasktrain.trainer.modes.adjust`:
staleness-scaled learning rate, delay compensation DC-ASGD with constant and adaptive λ;
then ``async`` without its momentum compensation, and "as before": without it and at W
times the rate, one full step per gradient, which is what ``async`` did before the rate
became per global batch; last ``average`` with each rank's own stride and rounds in
lock-step, ``assignment="static"``, as it ran before it claimed work), without and with the
straggler, one configuration after the
other (so both see the same load on the machine): wall time from the call to ``fit`` and
updates (and samples) until the smoothed training loss (sample-weighted mean of the update
losses over the last ``--window`` samples, so that 1-gradient and N-gradient updates are
smoothed alike) first reaches the target, the final loss (the loss of the final model on
the whole training set; "diverged" when the fit stopped on a non-finite loss), mean / max
staleness of the applied gradients, and the wall time of the whole fit. The target is
``--target-factor`` (1.1) x the smoothed loss ``sync`` without a straggler ends with (median
over repeats); the same target for every run of one optimizer. ``--only LABEL...`` runs
some configurations (``sync`` always runs, for the target), among them more than the
default ones (``EXTRA``).

Run: ``.venv/bin/python benchmarks/stragglers.py [--task wave|committee]`` (``--repeats
2``, the task's epochs; medians of the repeats; about 6 minutes on 2 cores for both
optimizers on ``teacher``; ``--quick``: sync, average K=4 and async, 2 epochs of 6,144
rows, once). ``dasktrain bench`` runs it among the others (``teacher``).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch
from distributed import Client, LocalCluster

import dasktrain as dt
from dasktrain._cluster import NO_DASHBOARD
from dasktrain.cli.bench import Ratio, parse_with_quick, ratio_of, write_ratios
from dasktrain.trainer.worker.loop import trainer_place

ROWS, FEATURES, CLASSES, HIDDEN, BATCH = 24_576, 32, 10, 128, 128
WAVE_FEATURES, WAVE_HIDDEN = 8, 64
WORKERS = 3
MOMENTUM = 0.9
OPTIMIZERS = ("sgd", "adam")
TASKS = ("teacher", "wave", "committee")
COMMITTEE_FEATURES, COMMITTEE_UNITS, COMMITTEE_INIT = 16, 4, 0.01
# Per task: epochs by default, and a fixed target (None: target-factor x sync's end).
EPOCHS = {"teacher": 4, "wave": 4, "committee": 8}
REGRESSION = ("wave", "committee")  # mean squared error; teacher is classification
FEATURES_OF = {"teacher": FEATURES, "wave": WAVE_FEATURES, "committee": COMMITTEE_FEATURES}
TARGET = {"teacher": None, "wave": None, "committee": 0.002}
# The learning rate of each task and optimizer, where ``sync`` trains well (one step per
# global batch of 3 x 128): see the module's docstring.
LR = {("teacher", "sgd"): 0.2, ("teacher", "adam"): 0.02,
      ("wave", "sgd"): 0.2, ("wave", "adam"): 0.02,
      ("committee", "sgd"): 0.05, ("committee", "adam"): 0.02}
LR_FACTOR = "lr_factor"  # a key of a configuration's options: run at lr x this
ASSIGNMENT = "assignment"  # a key of a configuration's options: the Trainer's assignment

# (label, mode, options): every mode at its default settings, then the stale-gradient
# options (staleness-scaled learning rate, delay compensation) on the modes that take them,
# then the momentum compensation off, and off with the step per gradient of before.
CONFIGS: list[tuple[str, str, dict[str, Any]]] = [
    ("sync", "sync", {}),
    ("average", "average", {}),  # K = 10, its default
    ("average K=4", "average", {"average_every": 4}),
    ("soft S=2", "soft", {"wait_for": WORKERS - 1}),
    ("ssp s=2", "ssp", {"staleness_bound": 2}),
    ("async", "async", {}),
    ("async lr/(1+τ)", "async", {"staleness_lr": "inverse"}),
    ("async DC λ=0.04", "async", {"dc_lambda": 0.04}),
    ("async DC-a λ=2", "async", {"dc_lambda": 2.0, "dc_adaptive": True}),
    ("async DC-a λ=32", "async", {"dc_lambda": 32.0, "dc_adaptive": True}),
    ("soft S=2 lr/(1+τ)", "soft", {"wait_for": WORKERS - 1, "staleness_lr": "inverse"}),
    ("ssp s=2 DC-a λ=32", "ssp", {"staleness_bound": 2, "dc_lambda": 32.0,
                                  "dc_adaptive": True}),
    ("async, no compensation", "async", {"momentum_compensation": False}),
    ("async, as before", "async", {"momentum_compensation": False, LR_FACTOR: WORKERS}),
    ("average K=4, static", "average", {"average_every": 4, ASSIGNMENT: "static"}),
]
# More, run only when named in --only (to keep the default run short).
EXTRA: list[tuple[str, str, dict[str, Any]]] = [
    ("async lr/√(1+τ)", "async", {"staleness_lr": "sqrt"}),
    ("async DC λ=1", "async", {"dc_lambda": 1.0}),
    ("async DC-a λ=8", "async", {"dc_lambda": 8.0, "dc_adaptive": True}),
    ("ssp s=2 lr/(1+τ)", "ssp", {"staleness_bound": 2, "staleness_lr": "inverse"}),
    ("soft S=2 DC-a λ=32", "soft", {"wait_for": WORKERS - 1, "dc_lambda": 32.0,
                                    "dc_adaptive": True}),
    ("soft S=2 drop late", "soft", {"wait_for": WORKERS - 1, "late": "drop"}),
    ("average K=1", "average", {"average_every": 1}),
    ("average K=16", "average", {"average_every": 16}),
    ("soft S=2, no compensation", "soft", {"wait_for": WORKERS - 1,
                                           "momentum_compensation": False}),
    ("ssp s=2, no compensation", "ssp", {"staleness_bound": 2,
                                         "momentum_compensation": False}),
    ("soft S=2, as before", "soft", {"wait_for": WORKERS - 1, "momentum_compensation": False,
                                     LR_FACTOR: WORKERS / (WORKERS - 1)}),
    ("ssp s=2, as before", "ssp", {"staleness_bound": 2, "momentum_compensation": False,
                                   LR_FACTOR: WORKERS}),
]
CALIBRATION_FITS = 3  # sync fits of one epoch whose median step sets the straggler's delay
QUICK = {"epochs": 2, "repeats": 1, "rows": 6_144, "only": ["average K=4", "async"],
         "calibration_fits": 1}


def student(task: str = "teacher", kind: str = "mlp") -> torch.nn.Module:
    """The network trained: for ``teacher`` an MLP (``kind="linear"``: softmax regression, a
    convex contrast), for ``wave`` a ReLU MLP with one output."""
    torch.manual_seed(0)  # the holder builds it once: every run starts from the same weights
    if task == "committee":
        model = torch.nn.Sequential(torch.nn.Linear(COMMITTEE_FEATURES, COMMITTEE_UNITS),
                                    torch.nn.Tanh(), torch.nn.Linear(COMMITTEE_UNITS, 1))
        with torch.no_grad():  # the small start that makes the symmetric plateau
            model[0].weight.mul_(COMMITTEE_INIT)
            model[0].bias.zero_()
        return model
    if task == "wave":
        return torch.nn.Sequential(torch.nn.Linear(WAVE_FEATURES, WAVE_HIDDEN), torch.nn.ReLU(),
                                   torch.nn.Linear(WAVE_HIDDEN, WAVE_HIDDEN), torch.nn.ReLU(),
                                   torch.nn.Linear(WAVE_HIDDEN, 1))
    if kind == "linear":
        return torch.nn.Linear(FEATURES, CLASSES)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, CLASSES))


def make_data(directory: Path, client: Client, rows: int = ROWS, task: str = "teacher"
              ) -> dt.Dataset:
    rng = np.random.default_rng(0)
    if task == "committee":
        n = COMMITTEE_FEATURES
        x = rng.standard_normal((rows, n)).astype(np.float32)
        # Orthonormal teacher directions, of length sqrt(n) so that v.x / sqrt(n) ~ N(0, 1).
        v = np.linalg.qr(rng.standard_normal((n, n)))[0][:, :COMMITTEE_UNITS] * np.sqrt(n)
        y = torch.erf(torch.from_numpy(x @ v / np.sqrt(2 * n))).sum(1, keepdim=True)
        y = y.numpy().astype(np.float32)
    elif task == "wave":
        # A smooth non-linear target: two products of waves along random directions.
        x = rng.standard_normal((rows, WAVE_FEATURES), dtype=np.float32)
        a, b, c = rng.standard_normal((3, WAVE_FEATURES)) / np.sqrt(WAVE_FEATURES)
        y = (np.sin(2 * x @ a) * np.cos(x @ b) + 0.5 * np.tanh(2 * x @ c))[:, None]
        y = y.astype(np.float32)
    else:
        x = rng.standard_normal((rows, FEATURES), dtype=np.float32)
        w1 = rng.standard_normal((FEATURES, 64)) * 2 / np.sqrt(FEATURES)
        w2 = rng.standard_normal((64, CLASSES)) / np.sqrt(64)
        y = np.argmax(np.tanh(x @ w1) @ w2, axis=1).astype(np.int64)
    np.save(directory / "x.npy", x)
    np.save(directory / "y.npy", y)
    return dt.prepare(directory / "x.npy", directory / "w3.zarr", client=client,
                      target=str(directory / "y.npy"), chunk_rows=4096, progress=False)


class StragglerLoss:
    """Cross-entropy (``wave`` and ``committee``: mean squared error); in the trainer worker of rank
    ``slow_rank`` it then sleeps ``delay_s``.

    Defined at module level so that it pickles to the workers. The rank comes from the key of
    the Dask task the loss is called in (a trainer worker's task; anywhere else, e.g. in
    ``Trainer.evaluate`` on the driver, there is no task and no sleep)."""

    def __init__(self, slow_rank: int | None = None, delay_s: float = 0.0,
                 task: str = "teacher") -> None:
        self.slow_rank, self.delay_s, self.task = slow_rank, delay_s, task

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.task in REGRESSION:
            loss = torch.nn.functional.mse_loss(output, target.reshape(output.shape))
        else:
            loss = torch.nn.functional.cross_entropy(output, target)
        if self.slow_rank is not None and self.delay_s > 0 and _rank() == self.slow_rank:
            time.sleep(self.delay_s)
        return loss


def _rank() -> int | None:
    place = trainer_place()
    return None if place is None else place[0]


def smoothed(history: dt.History, window: int) -> np.ndarray:
    """Per update: the sample-weighted mean loss of the updates covering the last ``window``
    samples (so that modes with 1-gradient and N-gradient updates are smoothed alike)."""
    loss = np.asarray(history.loss, dtype=float)
    samples = np.asarray(history.samples, dtype=float)
    weighted = np.concatenate([[0.0], np.cumsum(loss * samples)])
    counted = np.concatenate([[0.0], np.cumsum(samples)])
    ends = np.arange(1, len(loss) + 1)
    # The latest start whose updates still cover ``window`` samples (0 early on).
    starts = np.maximum(np.searchsorted(counted, counted[ends] - window, side="right") - 1, 0)
    return (weighted[ends] - weighted[starts]) / (counted[ends] - counted[starts])


def optimizer_config(name: str, lr: float) -> dt.optim.OptimizerConfig:
    """SGD with momentum 0.9, or Adam (its first beta is 0.9 too)."""
    return dt.optim.sgd(lr, momentum=MOMENTUM) if name == "sgd" else dt.optim.adam(lr)


def fit(client: Client, data: dt.Dataset, mode: str, options: dict[str, Any], lr: float,
        epochs: int, loss: StragglerLoss, model: str = "mlp", optimizer: str = "sgd"
        ) -> tuple[dt.History, float, float]:
    """One fit; returns its History, its start (wall clock) and the final model's loss."""
    options = dict(options)
    lr *= options.pop(LR_FACTOR, 1)
    assignment = options.pop(ASSIGNMENT, "auto")
    trainer = dt.Trainer(functools.partial(student, loss.task, model), loss,
                         optimizer_config(optimizer, lr), mode=mode, workers=WORKERS,
                         batch_size=BATCH, progress=False, torch_threads=1,
                         assignment=assignment, mode_options=options)
    started = time.time()
    try:
        history = trainer.fit(data, epochs=epochs, client=client)
    except dt.TrainingDiverged as exc:  # a result too: the final loss reads "diverged"
        return exc.history, started, math.inf
    final = trainer.evaluate(data, batch_size=4096, client=client)["loss"]
    return history, started, final


def measure(history: dt.History, started: float, final: float, target: float | None,
            window: int) -> dict[str, float]:
    curve = smoothed(history, window)
    reached = np.flatnonzero(curve <= target) if target is not None else np.array([])
    applied = history.applied_staleness
    return {
        "to_target_s": float(history.time[reached[0]] - started) if reached.size else np.nan,
        "updates_to_target": float(reached[0] + 1) if reached.size else np.nan,
        "samples_to_target": float(np.sum(history.samples[:reached[0] + 1]))
        if reached.size else np.nan,
        "final_smoothed": float(curve[-1]),
        "final_loss": final,
        "mean_staleness": float(np.mean(applied)) if applied else 0.0,
        "max_staleness": float(max(applied, default=0)),
        "updates": float(history.updates),
        "wall_s": history.wall_time,
    }


def step_time(history: dt.History) -> float:
    """Median time between consecutive updates of an unhindered ``sync`` fit: one step of
    every worker (the median leaves out the odd slow one, e.g. the first)."""
    gaps = np.diff(np.asarray(history.time))
    return float(np.median(gaps))


def per_batch_compute(task: str, kind: str) -> float:
    """Forward + backward of one batch on this process, 1 thread (for the record)."""
    model = student(task, kind)
    x = torch.randn(BATCH, FEATURES_OF[task])
    y = torch.randn(BATCH, 1) if task in REGRESSION else torch.randint(0, CLASSES, (BATCH,))
    loss = StragglerLoss(task=task)
    times = []
    for _ in range(50):
        t0 = time.perf_counter()
        model.zero_grad()
        loss(model(x), y).backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[10:])


def summarise(rows: list[dict[str, float]]) -> dict[str, Any]:
    """Medians over repeats; times and updates to target over the repeats that reached it."""
    out: dict[str, Any] = {name: float(np.median([r[name] for r in rows])) for name in rows[0]}
    hits = [r for r in rows if not np.isnan(r["to_target_s"])]
    for name in ("to_target_s", "updates_to_target", "samples_to_target"):
        out[name] = float(np.median([r[name] for r in hits])) if hits else np.nan
    out["reached"] = "" if len(hits) in (0, len(rows)) else f" ({len(hits)}/{len(rows)})"
    return out


def tail_share(history: dt.History, epochs: int, rank: int) -> float:
    """Share of ``rank``'s gradients among the last quarter of each epoch's gradients."""
    workers = np.asarray(history.staleness_worker)
    per_epoch = len(workers) // epochs
    tails = [workers[e * per_epoch + per_epoch * 3 // 4:(e + 1) * per_epoch]
             for e in range(epochs)]
    return float(np.mean(np.concatenate(tails) == rank))


def reading(table: dict[tuple[str, bool], dict[str, Any]],
            configs: list[tuple[str, str, dict[str, Any]]]) -> str:
    """A few sentences read off the table."""
    labels = [label for label, _, _ in configs]
    lines = ["Reading:"]
    for straggler, name in ((False, "without"), (True, "with")):
        reached = sorted((table[(lab, straggler)]["to_target_s"], lab) for lab in labels
                         if not np.isnan(table[(lab, straggler)]["to_target_s"]))
        missed = [lab for lab in labels if np.isnan(table[(lab, straggler)]["to_target_s"])]
        ranked = ", ".join(f"{lab} {t:.2f} s" for t, lab in reached)
        lines.append(f"* {name} the straggler, to target: {ranked or 'none reached it'}"
                     + (f"; never reached: {', '.join(missed)}" if missed else "") + ".")
    diverged = [f"{lab}{' (with the straggler)' if straggler else ''}"
                for lab in labels for straggler in (False, True)
                if math.isinf(table[(lab, straggler)]["final_loss"])]
    lines.append(f"* diverged: {', '.join(diverged) if diverged else 'none'}.")
    walls = {lab: table[(lab, True)]["wall_s"] for lab in labels
             if math.isfinite(table[(lab, True)]["final_loss"]) or lab == "sync"}
    lines.append(f"* fit wall time with the straggler: {min(walls.values()):.2f} to "
                 f"{max(walls.values()):.2f} s across the runs that did not diverge (sync "
                 f"{walls['sync']:.2f} s, "
                 f"{walls['sync'] / table[('sync', False)]['wall_s']:.2f}x its time "
                 "without).")
    better = [lab for lab in labels
              if table[(lab, True)]["final_loss"] < 0.95 * table[(lab, False)]["final_loss"]]
    if better:
        lines.append(f"* final loss clearly lower with the straggler than without: "
                     f"{', '.join(better)} (compare the staleness columns).")
    best = min(labels, key=lambda lab: table[(lab, True)]["final_loss"])
    lines.append(f"* lowest final loss with the straggler: {best} "
                 f"({_loss(table[(best, True)]['final_loss'])}; sync "
                 f"{_loss(table[('sync', True)]['final_loss'])}).")
    if "async" in labels:
        plain = table[("async", False)]["final_loss"], table[("async", True)]["final_loss"]
        for lab in labels:
            if lab.startswith("async") and lab != "async":
                mine = table[(lab, False)]["final_loss"], table[(lab, True)]["final_loss"]
                pairs = list(zip(mine, plain, strict=True))
                better = [m < 0.98 * p for m, p in pairs]
                worse = [m > 1.02 * p for m, p in pairs]
                verdict = ("helps" if all(better) else "hurts" if any(worse) and not any(better)
                           else "mixed" if any(better) and any(worse)
                           else "no clear effect (within 2%)" if not any(better)
                           else "helps in one of the two")
                lines.append(f"* {lab} against plain async, final loss without / with the "
                             f"straggler: {_loss(mine[0])} / {_loss(mine[1])} against "
                             f"{_loss(plain[0])} / {_loss(plain[1])}: {verdict}.")
    return "\n".join(lines)


def _loss(value: float) -> str:
    return "diverged" if math.isinf(value) else f"{value:.4f}"


def _fmt(value: float, spec: str) -> str:
    return "—" if value is None or np.isnan(value) else format(value, spec)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser,
                                                       argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=None,
                        help="epochs of each fit (default: the task's, "
                        f"{', '.join(f'{t} {e}' for t, e in EPOCHS.items())})")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rows", type=int, default=ROWS,
                        help=f"rows of the training set (default {ROWS:,})")
    parser.add_argument("--task", choices=TASKS, default="teacher",
                        help="teacher (default: teacher-student classification) or wave (a "
                        "ReLU MLP regressing a non-linear function)")
    parser.add_argument("--optimizer", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS),
                        help="SGD with momentum 0.9 and/or Adam (default: both, one after "
                        "the other)")
    parser.add_argument("--lr", type=float, default=None,
                        help="learning rate of every optimizer run (default: the task's and "
                        f"optimizer's, {', '.join(f'{t} {o} {v:g}' for (t, o), v in LR.items())})")
    parser.add_argument("--slow-rank", type=int, default=WORKERS - 1)
    parser.add_argument("--calibration-fits", type=int, default=CALIBRATION_FITS,
                        help="sync fits of one epoch, on the warm cluster, whose median step "
                        f"sets the straggler's sleep (default {CALIBRATION_FITS})")
    parser.add_argument("--sleep-ms", type=float, default=None,
                        help="the straggler's sleep per batch in milliseconds, instead of "
                        "(--slowdown - 1) x the measured step: the same straggler across "
                        "runs whose steps differ (another placement, another machine)")
    parser.add_argument("--slowdown", type=float, default=3.0,
                        help="how many times slower the straggler's steps are (default 3)")
    parser.add_argument("--window", type=int, default=3072,
                        help="samples in the training-loss smoothing window (default 3072)")
    parser.add_argument("--target-factor", type=float, default=1.1,
                        help="the target is this x the smoothed loss sync ends with, no "
                        "straggler (default 1.1; not for a task with a fixed target)")
    parser.add_argument("--target", type=float, default=None,
                        help="a fixed target loss instead (default: the task's, "
                        f"{', '.join(f'{t} {v:g}' for t, v in TARGET.items() if v)})")
    parser.add_argument("--model", choices=("mlp", "linear"), default="mlp",
                        help="teacher task: mlp (default, non-convex) or linear (softmax "
                        "regression, convex)")
    parser.add_argument("--only", nargs="*", default=None,
                        help="labels of the configurations to run (default: all but the "
                        "extra ones)")
    args = parse_with_quick(parser, argv, QUICK,
                            "seconds, not minutes: sync, average K=4, async, async lr/(1+τ) "
                            "and async as before, 2 epochs of 6,144 rows, once (rough "
                            "figures)")
    return parser, args


def ratios(table: dict[tuple[str, bool], dict[str, Any]],
           configs: list[tuple[str, str, dict[str, Any]]], slowdown: float, name: str
           ) -> list[Ratio]:
    """The summary rows: what the straggler costs ``sync``, then each other mode's time to
    the target with the straggler against ``sync``'s (W3 sets no goal: it reports)."""
    sync, calm = table[("sync", True)], table[("sync", False)]
    rows = [Ratio(workload=f"W3 {name} sync, one worker {slowdown:g}x slower: fit wall time "
                  "(s)", ours=f"{sync['wall_s']:.2f}",
                  baseline=f"{calm['wall_s']:.2f} (no straggler)",
                  ratio=ratio_of(sync["wall_s"], calm["wall_s"]))]
    for label, _, _ in configs:
        if label == "sync":
            continue
        mine = table[(label, True)]
        rows.append(Ratio(
            workload=f"W3 {name} {label}, one worker {slowdown:g}x slower: time to target (s)",
            ours=_fmt(mine["to_target_s"], ".2f") + mine["reached"],
            baseline=f"{_fmt(sync['to_target_s'], '.2f')} (sync)",
            ratio=ratio_of(mine["to_target_s"], sync["to_target_s"])))
    return rows


Runs = dict[tuple[str, bool], list[tuple[dt.History, float, float]]]


def run_configs(client: Client, data: dt.Dataset, args: argparse.Namespace, optimizer: str,
                lr: float, configs: list[tuple[str, str, dict[str, Any]]], delay_s: float
                ) -> Runs:
    """Every configuration without, then with the straggler, next to each other (both see
    the same load on the machine), ``args.repeats`` times."""
    results: Runs = {}
    for _ in range(args.repeats):
        for label, mode, options in configs:
            for straggler in (False, True):
                loss = StragglerLoss(args.slow_rank if straggler else None, delay_s, args.task)
                run = fit(client, data, mode, options, lr, args.epochs, loss, args.model,
                          optimizer)
                results.setdefault((label, straggler), []).append(run)
                h = run[0]
                print(f"  {label:26s} straggler={straggler!s:5s} {h.wall_time:6.2f} s, "
                      f"{h.updates} updates, final loss {run[2]:.4f}", flush=True)
    return results


def report(results: Runs, args: argparse.Namespace, optimizer: str, lr: float,
           configs: list[tuple[str, str, dict[str, Any]]]) -> dict[tuple[str, bool],
                                                                   dict[str, Any]]:
    """Print the table of one optimizer's runs and what it reads; returns the table."""
    sync_end = statistics.median(smoothed(h, args.window)[-1]
                                 for h, _, _ in results[("sync", False)])
    fixed = args.target if args.target is not None else TARGET[args.task]
    target = fixed if fixed is not None else args.target_factor * sync_end
    table = {key: summarise([measure(h, s, f, target, args.window) for h, s, f in runs])
             for key, runs in results.items()}
    described = (f"SGD lr {lr:g} momentum {MOMENTUM:g}" if optimizer == "sgd"
                 else f"Adam lr {lr:g} betas (0.9, 0.999)")
    how = (f"fixed; sync ends with {sync_end:.4f} without the straggler" if fixed is not None
           else f"{args.target_factor:g} x the {sync_end:.4f} sync ends with, no straggler")
    print(f"\nTarget: smoothed training loss <= {target:.4g} ({how}). {WORKERS} workers, "
          f"batch {BATCH} each, {args.epochs} epochs of {args.rows} rows, {args.task}"
          f"{f' {args.model}' if args.task == 'teacher' else ''}, {described}; straggler: "
          f"rank {args.slow_rank}, {args.slowdown:g}x slower.\n")
    print("| mode | straggler | time to target (s) | updates (k samples) to target | final loss "
          "| mean / max staleness | fit wall (s) | x slower with it: to target, fit |")
    print("|---|---|---|---|---|---|---|---|")
    for label, _, _ in configs:
        for straggler in (False, True):
            r, none = table[(label, straggler)], table[(label, False)]
            ratio = (f"{_fmt(r['to_target_s'] / none['to_target_s'], '.2f')}, "
                     f"{r['wall_s'] / none['wall_s']:.2f}") if straggler else ""
            print(f"| {'' if straggler else label} | {'3x slow' if straggler else 'none'} "
                  f"| {_fmt(r['to_target_s'], '.2f')}{r['reached']} "
                  f"| {_fmt(r['updates_to_target'], '.0f')} "
                  f"({_fmt(r['samples_to_target'] / 1e3, '.1f')}) | {_loss(r['final_loss'])} "
                  f"| {r['mean_staleness']:.2f} / {r['max_staleness']:.0f} | {r['wall_s']:.2f} "
                  f"| {ratio} |")
    print(f"\n(medians of {args.repeats} repeat(s), over the repeats that reached the target "
          f"where not all did, marked k/n; — : never reached; time to target is from the call "
          f"to fit; final loss: the final model on the whole training set; torch "
          f"{torch.__version__})")
    if ("async", True) in results:
        share = statistics.median(tail_share(h, args.epochs, args.slow_rank)
                                  for h, _, _ in results[("async", True)])
        print(f"\nStraggler check: in async with the straggler, {share:.0%} of the last quarter "
              f"of each epoch's gradients came from rank {args.slow_rank} (1/{WORKERS} if all "
              "ran at the same speed).")
    print("\n" + reading(table, configs))
    return table


def main() -> None:
    parser, args = parse_args()
    if not 0 <= args.slow_rank < WORKERS:
        parser.error(f"--slow-rank must be in [0, {WORKERS})")
    if args.calibration_fits < 1:
        parser.error("--calibration-fits must be at least 1")
    if args.sleep_ms is not None and not (math.isfinite(args.sleep_ms) and args.sleep_ms >= 0):
        parser.error("--sleep-ms must be a finite number >= 0")
    if args.epochs is None:
        args.epochs = EPOCHS[args.task]
    if args.task != "teacher" and args.model != "mlp":
        parser.error("--model linear is a variant of the teacher task")
    torch.set_num_threads(1)
    configs = [c for c in CONFIGS + EXTRA if c[0] in args.only] if args.only else CONFIGS
    unknown = set(args.only or ()) - {c[0] for c in CONFIGS + EXTRA}
    if unknown:
        parser.error(f"unknown configuration(s) {sorted(unknown)}; known: "
                     f"{[c[0] for c in CONFIGS + EXTRA]}")
    if not configs or configs[0][0] != "sync":
        configs = [CONFIGS[0], *[c for c in configs if c[0] != "sync"]]
    compute_s = per_batch_compute(args.task, args.model)
    rows: list[Ratio] = []
    with tempfile.TemporaryDirectory() as tmp, \
            LocalCluster(n_workers=2, threads_per_worker=2, processes=True, host="127.0.0.1",
                         **NO_DASHBOARD) as cluster, \
            Client(cluster) as client:
        data = make_data(Path(tmp), client, args.rows, args.task)
        t0 = time.perf_counter()
        first = args.optimizer[0]
        first_lr = args.lr or LR[(args.task, first)]
        fit(client, data, "sync", {}, first_lr, 1, StragglerLoss(task=args.task),
            args.model, first)
        # The first torch optimizer a process builds imports torch._dynamo (about 1 s): in
        # ``average`` the workers build one, so warm that up too, untimed.
        fit(client, data, "average", {}, first_lr, 1, StragglerLoss(task=args.task),
            args.model, first)
        # The step measured on the warm cluster: the first fit's steps can be longer (3.3
        # ms against 1.6-2.2 ms in one check), which made the straggler slower than
        # --slowdown says.
        step_s = statistics.median(
            step_time(fit(client, data, "sync", {}, first_lr, 1,
                          StragglerLoss(task=args.task), args.model, first)[0])
            for _ in range(args.calibration_fits))
        delay_s = (args.slowdown - 1) * step_s if args.sleep_ms is None \
            else args.sleep_ms / 1e3
        print(f"per-batch forward+backward {compute_s * 1e3:.2f} ms; unhindered sync step "
              f"{step_s * 1e3:.2f} ms (warm-up fits {time.perf_counter() - t0:.1f} s); the "
              f"straggler (rank {args.slow_rank}) sleeps {delay_s * 1e3:.2f} ms per batch",
              flush=True)
        for optimizer in args.optimizer:
            lr = args.lr or LR[(args.task, optimizer)]
            print(f"\n## {optimizer}, lr {lr:g}", flush=True)
            results = run_configs(client, data, args, optimizer, lr, configs, delay_s)
            table = report(results, args, optimizer, lr, configs)
            name = {"sgd": "SGD", "adam": "Adam"}[optimizer]
            if args.task != "teacher":
                name = f"{args.task} {name}"
            rows.extend(ratios(table, configs, args.slowdown, name))
    if args.ratios_json:
        write_ratios(args.ratios_json, rows)


if __name__ == "__main__":
    main()
