"""What the figures and the report read of a run: a :class:`RunRecord` is any object with
these fields, :class:`~dasktrain.trainer.view.history.History` first among them.

Figures and the report are typed with this protocol, not with ``History``, so that they do
not depend on the class whose ``plot()`` and ``report()`` call them (the dependency goes one
way: History to its figures).
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["RunRecord"]


class RunRecord(Protocol):
    """The fields of a fit's record that are drawn and tabulated (see ``History``)."""

    mode: str
    workers: int
    version: list[int]
    loss: list[float]
    time: list[float]
    contributors: list[int]
    staleness: list[int]
    dropped: list[bool]
    epochs: list[dict[str, Any]]
    events: list[str]
    refused_gradients: int

    @property
    def applied_staleness(self) -> list[int]: ...

    def summary(self) -> dict[str, Any]: ...
