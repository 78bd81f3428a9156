"""Figures of a run (a :class:`History`, read as a
:class:`~dasktrain.trainer.view.run_record.RunRecord`): loss, epoch metrics, staleness,
contributors, workers, events (:mod:`dasktrain.trainer.view.compare` puts several runs on the
same axes).

Figures are built as :class:`matplotlib.figure.Figure` objects, never through pyplot's
global state: no display or GUI toolkit is needed (PNGs are drawn by Agg), nothing
accumulates in pyplot's list of open figures, and a figure returned in a notebook shows
inline once.
"""

from __future__ import annotations

import io
import math
import re
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, MaxNLocator

from dasktrain.trainer.view.run_record import RunRecord

__all__ = ["FIGURES", "KINDS", "event_kind", "event_versions", "figure", "metric_names",
           "png_bytes"]

_WIDTH = 10.0  # inches; at 100 dpi a figure is 1,000 pixels wide, the report's column
_MAX_METRICS = 9
_EVENT_VERSION = re.compile(r"^v(\d+): (.*)$", re.DOTALL)
# Event kinds on the timeline, matched in this order against the event's text.
_EVENT_KINDS = (("refused", "gradient refused"), ("rejoined", "worker rejoined"),
                ("came back", "worker rejoined"), ("dropped", "worker lost"),
                ("given up", "worker lost"), ("learning rate", "learning rate"))


# -- panels: each draws one thing on one Axes ------------------------------------------
def _empty(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", color="0.45",
            transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def _integer_axis(axis: Any, top: int) -> None:
    """Ticks at whole numbers only (every one while few)."""
    if top <= 12:
        axis.set_major_locator(FixedLocator(range(max(top, 4) + 1)))
    else:
        axis.set_major_locator(MaxNLocator(integer=True))


def _moving_mean(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over ``window`` values (fewer at the start), same length."""
    sums = np.cumsum(np.concatenate([[0.0], values]))
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(ends - window, 0)
    return (sums[ends] - sums[starts]) / (ends - starts)


def _break_at_pauses(t: np.ndarray, *series: np.ndarray) -> tuple[np.ndarray, ...]:
    """Insert NaN (a break in the line) where the run paused (between epochs, for
    validation): a straight line across the pause would suggest losses never measured."""
    if len(t) < 3:
        return (t, *series)
    steps = np.diff(t)
    # A pause: far longer than a usual step, and long enough to see at this scale.
    gap = max(20 * float(np.median(steps)), 0.02 * float(t[-1] - t[0]))
    pauses = np.nonzero(steps > gap)[0] + 1
    return tuple(np.insert(np.asarray(a, dtype=float), pauses, np.nan) for a in (t, *series))


def _smoothing(n: int) -> int:
    return max(1, n // 50)


def _loss_line(ax: Axes, x: np.ndarray, loss: np.ndarray, label: str | None = None,
               color: Any = None, raw: bool = True, by_time: bool = False) -> None:
    """The per-update loss, faint, under its moving mean (noisy losses stay readable)."""
    window = _smoothing(len(loss))
    mean = _moving_mean(loss, window)
    if by_time:
        x, loss, mean = _break_at_pauses(x, loss, mean)
    if window > 1:
        if raw:
            ax.plot(x, loss, color=color or "C0", alpha=0.25, linewidth=0.8,
                    label="_per update", gid="loss")
        ax.plot(x, mean, color=color or "C0", linewidth=1.6,
                label=label or f"mean of {window} updates", gid="mean loss")
    else:
        ax.plot(x, loss, color=color or "C0", linewidth=1.4, marker="." if len(x) < 60
                else None, label=label or "per update", gid="loss")


def _log_scale_if_wide(ax: Axes, values: Sequence[float]) -> None:
    finite = [v for v in values if math.isfinite(v)]
    if finite and min(finite) > 0 and max(finite) / min(finite) > 30:
        ax.set_yscale("log")


def _loss_panel(ax: Axes, history: RunRecord, by: str) -> None:
    if not history.loss:
        _empty(ax, "no update recorded")
        return
    loss = np.asarray(history.loss, dtype=float)
    if by == "update":
        x = np.asarray(history.version)
        ax.set_xlabel("update (holder version)")
        ax.set_title("training loss by update")
        for i, (version, _) in enumerate(event_versions(history)[:200]):
            ax.axvline(version, color="C3", alpha=0.5, linewidth=0.9,
                       label="event" if i == 0 else "_event", gid="event")
    else:
        x = np.asarray(history.time, dtype=float) - history.time[0]
        ax.set_xlabel("wall time since the first update (s)")
        ax.set_title("training loss by wall time")
    _loss_line(ax, x, loss, by_time=by == "time")
    _log_scale_if_wide(ax, history.loss)
    ax.set_ylabel("loss")
    ax.legend(loc="upper right", fontsize="small")


def metric_names(history: RunRecord) -> list[str]:
    """Metrics recorded per epoch (training or validation), the loss first."""
    names: dict[str, None] = {}
    for record in history.epochs:
        for where in ("train", "validation"):
            names.update(dict.fromkeys(record.get(where) or {}))
    return sorted(names, key=lambda n: (n != "loss", n))


def _metric_panel(ax: Axes, history: RunRecord, name: str) -> None:
    drawn = False
    for where, marker in (("train", "o"), ("validation", "s")):
        points = [(r["epoch"], float(r[where][name])) for r in history.epochs
                  if name in (r.get(where) or {})]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker=marker, label="training" if where == "train" else where)
            drawn = True
    if not drawn:
        _empty(ax, f"no {name} recorded")
        return
    ax.set_title(f"{name} per epoch")
    ax.set_xlabel("epoch")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize="small")


def _staleness_panel(ax: Axes, history: RunRecord) -> None:
    if not history.staleness:
        _empty(ax, "no gradient recorded")
        return
    applied = history.applied_staleness
    dropped = [s for s, d in zip(history.staleness, history.dropped, strict=False) if d]
    top = max(history.staleness)
    positions = np.arange(top + 1)
    applied_counts = np.bincount(applied, minlength=top + 1) if applied else \
        np.zeros(top + 1, dtype=int)
    ax.bar(positions, applied_counts, width=0.8, label="applied", color="C0")
    if dropped:
        ax.bar(positions, np.bincount(dropped, minlength=top + 1), width=0.8,
               bottom=applied_counts, label="dropped", color="C3")
    mean = statistics.fmean(applied) if applied else 0.0
    ax.set_title(f"staleness of {len(history.staleness)} gradients: mean {mean:.2f}, "
                 f"max {max(applied, default=0)}")
    ax.set_xlabel("staleness (updates between computing and applying)")
    ax.set_ylabel("gradients")
    _integer_axis(ax.xaxis, top)
    ax.set_xlim(-0.6, max(top, 4) + 0.6)  # one bar alone stays a bar, not the whole width
    ax.legend(fontsize="small")


def _contributors_panel(ax: Axes, history: RunRecord) -> None:
    if not history.contributors:
        _empty(ax, "no update recorded")
        return
    ax.plot(history.version, history.contributors, drawstyle="steps-post", linewidth=1.0)
    ax.set_title("contributors per update")
    ax.set_xlabel("update (holder version)")
    ax.set_ylabel("gradients or replicas applied")
    ax.set_ylim(bottom=0, top=max(history.contributors) + 0.5)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))


def _contributor_counts_panel(ax: Axes, history: RunRecord) -> None:
    if not history.contributors:
        _empty(ax, "no update recorded")
        return
    counts = np.bincount(history.contributors)
    present = np.nonzero(counts)[0]
    ax.bar(present, counts[present], width=0.6, color="C2")
    ax.set_title("updates by number of contributors")
    ax.set_xlabel("contributors")
    ax.set_ylabel("updates")
    top = int(present[-1])
    _integer_axis(ax.xaxis, top)
    ax.set_xlim(-0.6, max(top, 4) + 0.6)


def _worker_panel(ax: Axes, history: RunRecord, field: str) -> None:
    """``field`` (``stall`` or ``samples_per_s``) per worker per epoch."""
    per_worker: dict[int, list[tuple[int, float]]] = {}
    for record in history.epochs:
        for entry in record.get("per_worker") or ():
            per_worker.setdefault(int(entry["worker"]), []).append(
                (record["epoch"], float(entry[field])))
    overall = [(r["epoch"], float(r[field])) for r in history.epochs
               if r.get(field) is not None]
    if not per_worker and not overall:
        _empty(ax, "no epoch recorded")
        return
    for worker, points in sorted(per_worker.items()):
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, marker="o", label=f"worker {worker}")
    if overall:
        xs, ys = zip(*overall, strict=True)
        what = "all workers (mean)" if field == "stall" else "all workers"
        ax.plot(xs, ys, color="k", linestyle="--", marker="x", label=what)
    if field == "stall":
        ax.set_title("data stall: share of time waiting for batches")
        ax.set_ylabel("fraction of the epoch")
        ax.set_ylim(bottom=0)
    else:
        ax.set_title("throughput per epoch")
        ax.set_ylabel("samples/s")
        ax.set_ylim(bottom=0)
    ax.set_xlabel("epoch")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize="small")


def event_versions(history: RunRecord) -> list[tuple[int, str]]:
    """The events the holder stamped with its version (``"v12: worker 1 dropped: ..."``)."""
    found = []
    for event in history.events:
        match = _EVENT_VERSION.match(event)
        if match:
            found.append((int(match.group(1)), match.group(2)))
    return found


def event_kind(text: str) -> str:
    """A short kind for an event's text (``worker lost``, ``gradient refused``, ...)."""
    lowered = text.lower()
    return next((kind for word, kind in _EVENT_KINDS if word in lowered), "other")


def _events_panel(ax: Axes, history: RunRecord) -> None:
    events = event_versions(history)
    if not events:
        _empty(ax, "no event recorded")
        return
    kinds = sorted({event_kind(text) for _, text in events})
    for row, kind in enumerate(kinds):
        xs = [v for v, text in events if event_kind(text) == kind]
        ax.scatter(xs, [row] * len(xs), marker="|", s=300, linewidths=2,
                   color=f"C{row}")
    ax.set_yticks(range(len(kinds)), kinds)
    ax.set_ylim(-0.7, len(kinds) - 0.3)
    last = max(history.version, default=0)
    ax.set_xlim(0, max(last, max(v for v, _ in events)) + 1)
    ax.set_xlabel("update (holder version)")
    ax.set_title(f"events by update ({len(events)})")


# -- figures ---------------------------------------------------------------------------
def _figure(height: float, rows: int = 1, cols: int = 1) -> tuple[Figure, np.ndarray]:
    fig = Figure(figsize=(_WIDTH, height), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    return fig, axes.ravel()


def loss_figure(history: RunRecord) -> Figure:
    fig, (by_update, by_time) = _figure(3.8, 1, 2)
    _loss_panel(by_update, history, "update")
    _loss_panel(by_time, history, "time")
    return fig


def metrics_figure(history: RunRecord) -> Figure:
    names = metric_names(history)[:_MAX_METRICS]
    if not names:
        fig, (ax,) = _figure(2.5)
        _empty(ax, "no epoch metrics recorded")
        return fig
    cols = min(len(names), 3)
    rows = math.ceil(len(names) / cols)
    fig, axes = _figure(3.4 * rows, rows, cols)
    for ax, name in zip(axes, names, strict=False):
        _metric_panel(ax, history, name)
    for ax in axes[len(names):]:
        ax.set_visible(False)
    return fig


def staleness_figure(history: RunRecord) -> Figure:
    fig, (ax,) = _figure(3.6)
    _staleness_panel(ax, history)
    return fig


def contributors_figure(history: RunRecord) -> Figure:
    fig, (over_time, counts) = _figure(3.6, 1, 2)
    _contributors_panel(over_time, history)
    _contributor_counts_panel(counts, history)
    return fig


def workers_figure(history: RunRecord) -> Figure:
    fig, (stall, throughput) = _figure(3.8, 1, 2)
    _worker_panel(stall, history, "stall")
    _worker_panel(throughput, history, "samples_per_s")
    return fig


def events_figure(history: RunRecord) -> Figure:
    kinds = {event_kind(text) for _, text in event_versions(history)}
    fig, (ax,) = _figure(1.2 + 0.45 * max(len(kinds), 1))
    _events_panel(ax, history)
    return fig


def overview_figure(history: RunRecord) -> Figure:
    """Loss by update and by time, the first epoch metric, and staleness: one glance."""
    fig, axes = _figure(7.2, 2, 2)
    _loss_panel(axes[0], history, "update")
    _loss_panel(axes[1], history, "time")
    names = metric_names(history)
    if names:
        _metric_panel(axes[2], history, names[0])
    else:
        _empty(axes[2], "no epoch metrics recorded")
    _staleness_panel(axes[3], history)
    fig.suptitle(f"{history.mode or 'run'}, {history.workers} worker(s)")
    return fig


FIGURES: dict[str, tuple[Callable[[RunRecord], Figure], str]] = {
    "loss": (loss_figure, "Training loss (per update, faint, and its moving mean) by update "
                          "and by wall time (gaps: pauses between epochs); red lines mark "
                          "the holder's events."),
    "metrics": (metrics_figure, "Training and validation metrics per epoch."),
    "staleness": (staleness_figure, "Staleness of every gradient received: applied, and "
                                    "dropped where the mode drops late ones."),
    "contributors": (contributors_figure, "Gradients (or replicas) each update applied."),
    "workers": (workers_figure, "Per worker and epoch: share of time waiting for data, and "
                                "samples per second."),
    "events": (events_figure, "Workers lost and rejoined, gradients refused, by update."),
}
"""The report's figures, in page order: name -> (builder, caption)."""

KINDS = ("overview", *FIGURES)


def figure(history: RunRecord, kind: str = "overview") -> Figure:
    """The figure ``kind`` (one of :data:`KINDS`) of ``history``."""
    if kind == "overview":
        fig = overview_figure(history)
    elif kind in FIGURES:
        fig = FIGURES[kind][0](history)
    else:
        raise ValueError(f"unknown plot {kind!r}; choose one of {', '.join(KINDS)}")
    _show_inline_in_notebooks()
    return fig


def png_bytes(fig: Figure, dpi: int = 100) -> bytes:
    """The figure as a PNG (drawn by Agg)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def _show_inline_in_notebooks() -> None:
    """In a Jupyter kernel, have figures display as PNG when none of the kernel's display
    formatters knows them yet (matplotlib's inline backend registers one only once pyplot
    has made a figure; ours are made without pyplot)."""
    if "ipykernel" not in sys.modules or "IPython" not in sys.modules:
        return
    shell = sys.modules["IPython"].get_ipython()
    if shell is None:
        return
    for formatter in shell.display_formatter.formatters.values():
        try:
            formatter.lookup_by_type(Figure)
            return  # the user's or the inline backend's choice stands
        except KeyError:
            continue
    from IPython.core.pylabtools import select_figure_formats

    select_figure_formats(shell, {"png"})
