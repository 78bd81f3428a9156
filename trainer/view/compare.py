"""Several runs on the same axes: loss by update and by wall time, a metric per epoch,
throughput per epoch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from dasktrain.trainer.driver.files import write_atomically
from dasktrain.trainer.view.history import History
from dasktrain.trainer.view.plots import (
    _empty,
    _figure,
    _log_scale_if_wide,
    _loss_line,
    _show_inline_in_notebooks,
    png_bytes,
)

__all__ = ["compare"]


def _labelled(histories: Mapping[str, History] | Sequence[History]
              ) -> list[tuple[str, History]]:
    if isinstance(histories, Mapping):
        runs = [(str(name), h) for name, h in histories.items()]
    elif isinstance(histories, Sequence) and not isinstance(histories, str | bytes):
        runs, seen = [], {}
        for i, h in enumerate(histories):
            base = getattr(h, "mode", "") or f"run {i}"
            seen[base] = seen.get(base, 0) + 1
            runs.append((base if seen[base] == 1 else f"{base} ({seen[base]})", h))
    else:
        raise TypeError(f"compare takes a dict name -> History or a list of Histories, got "
                        f"{type(histories).__name__}")
    if not runs:
        raise ValueError("compare needs at least one History")
    for name, h in runs:
        if not isinstance(h, History):
            raise TypeError(f"compare: {name!r} is a {type(h).__name__}, not a History "
                            "(History.load(path) reads a saved one)")
    return runs


def compare(histories: Mapping[str, History] | Sequence[History],
            path: str | Path | None = None, *, metric: str = "loss") -> Figure:
    """Several runs on the same axes: loss by update and by wall time, a validation
    metric per epoch and throughput per epoch.

    Parameters
    ----------
    histories
        ``{"name": history, ...}``, or a list of histories labelled by their mode (a
        repeated mode is numbered).
    path
        Also write the figure there as a PNG (atomically).
    metric
        The validation metric drawn per epoch; runs without validation show the training
        metric of that name (dashed).

    Returns
    -------
    matplotlib.figure.Figure
    """
    runs = _labelled(histories)
    fig, (by_update, by_time, per_epoch, throughput) = _figure(7.6, 2, 2)
    for i, (name, h) in enumerate(runs):
        color = f"C{i % 10}"
        if h.loss:
            loss = np.asarray(h.loss, dtype=float)
            _loss_line(by_update, np.asarray(h.version), loss, name, color, raw=False)
            _loss_line(by_time, np.asarray(h.time, dtype=float) - h.time[0], loss, name,
                       color, raw=False, by_time=True)
        _compare_metric(per_epoch, h, metric, name, color)
        points = [(r["epoch"], r["samples_per_s"]) for r in h.epochs
                  if r.get("samples_per_s") is not None]
        if points:
            xs, ys = zip(*points, strict=True)
            throughput.plot(xs, ys, marker="o", color=color, label=name)
    every_loss = [v for _, h in runs for v in h.loss]
    for ax, title, xlabel in (
            (by_update, "training loss by update", "update (holder version)"),
            (by_time, "training loss by wall time", "wall time since the first update (s)"),
            (per_epoch, f"{metric} per epoch (validation; dashed: training)", "epoch"),
            (throughput, "throughput per epoch", "epoch")):
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        if ax.lines:
            ax.legend(fontsize="small")
        else:
            _empty(ax, "nothing recorded")
    for ax in (by_update, by_time):
        if ax.lines:
            ax.set_ylabel("loss")
            _log_scale_if_wide(ax, every_loss)
    throughput.set_ylabel("samples/s")
    if throughput.lines:
        throughput.set_ylim(bottom=0)
    if per_epoch.lines:
        _log_scale_if_wide(per_epoch, [y for line in per_epoch.lines for y in line.get_ydata()])
    for ax in (per_epoch, throughput):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if path is not None:
        write_atomically(path, png_bytes(fig))
    _show_inline_in_notebooks()
    return fig


def _compare_metric(ax: Axes, history: History, metric: str, name: str, color: str) -> None:
    labelled = False
    for where, style in (("validation", "-"), ("train", "--")):
        points = [(r["epoch"], float(r[where][metric])) for r in history.epochs
                  if metric in (r.get(where) or {})]
        if points:
            xs, ys = zip(*points, strict=True)
            # One legend entry per run: the line style tells training from validation.
            ax.plot(xs, ys, linestyle=style, marker="o" if where == "validation" else None,
                    color=color, label=None if labelled else name)
            labelled = True
