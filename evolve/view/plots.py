"""Figures of an evolution run, drawn without pyplot (no display needed; see
:mod:`dasktrain.trainer.view.plots`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

__all__ = ["KINDS", "figure"]

_WIDTH = 10.0


class EvolutionHistory(Protocol):
    """What the figures read of an :class:`~dasktrain.evolve.EvolutionHistory` (named
    here, not imported: the history imports this module to draw itself)."""

    algorithm: str
    fitness: str
    population: int
    generation: list[int]
    best: list[float]
    mean: list[float]
    worst: list[float]
    evaluations_per_s: list[float]
    bytes_sent: list[int]
    bytes_received: list[int]
    snapshot_bytes: list[int]
    parameter_bytes: list[int]

    @property
    def maximize(self) -> bool: ...

    def best_so_far(self) -> list[float]: ...

    def exchange_ratio(self, skip_first: bool = True) -> float | None: ...


def _fitness(ax: Axes, history: EvolutionHistory) -> None:
    x = history.generation
    ax.fill_between(x, history.worst, history.best, color="C0", alpha=0.15,
                    label="worst to best")
    ax.plot(x, history.mean, color="C0", label="mean")
    ax.plot(x, history.best, color="C1", lw=1, label="best")
    ax.plot(x, history.best_so_far(), color="C3", ls="--", lw=1, label="best so far")
    ax.set_xlabel("generation")
    ax.set_ylabel(f"{history.fitness} ({'higher' if history.maximize else 'lower'} is "
                  "better)")
    ax.set_title(f"{history.algorithm.upper()} fitness, population {history.population}")
    ax.legend(fontsize="small")


def _throughput(ax: Axes, history: EvolutionHistory) -> None:
    ax.plot(history.generation, history.evaluations_per_s, color="C2")
    ax.set_xlabel("generation")
    ax.set_ylabel("evaluations / s")
    ax.set_ylim(bottom=0)
    ax.set_title("evaluations per second")


def _bytes(ax: Axes, history: EvolutionHistory) -> None:
    x = history.generation
    exchanged = history.exchanged_bytes()
    ax.plot(x, history.parameter_bytes, color="0.4", ls="--",
            label="sending every member's parameters")
    ax.plot(x, exchanged, color="C0", label="tasks, record and results")
    snapshots = [(g, b) for g, b in zip(x, history.snapshot_bytes, strict=True) if b]
    if snapshots:
        ax.scatter(*zip(*snapshots, strict=True), color="C3", s=12, zorder=3,
                   label="snapshots of the state")
    ax.set_yscale("log")
    ax.set_xlabel("generation")
    ax.set_ylabel("bytes per generation")
    ratio = history.exchange_ratio()
    ax.set_title("bytes exchanged" + (f" ({ratio:,.0f}x fewer)" if ratio else ""))
    ax.legend(fontsize="small")


_PANELS: dict[str, Callable[[Axes, EvolutionHistory], None]] = {
    "fitness": _fitness, "throughput": _throughput, "bytes": _bytes}
KINDS = ("overview", *_PANELS)


def figure(history: EvolutionHistory, kind: str = "overview") -> Figure:
    """The figure ``kind`` (one of :data:`KINDS`) of ``history``."""
    if kind not in KINDS:
        raise ValueError(f"unknown plot {kind!r}; choose one of {', '.join(KINDS)}")
    panels = list(_PANELS) if kind == "overview" else [kind]
    fig = Figure(figsize=(_WIDTH if len(panels) > 1 else 6.0, 3.6), layout="constrained")
    for i, name in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        if not history.generation:
            ax.text(0.5, 0.5, "no generation yet", ha="center", va="center")
            continue
        _PANELS[name](ax, history)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig
