"""How a run's numbers are shown to a person, in one place: the run report's tables, and
the metrics of the ``dasktrain train`` command's lines.

A metric keeps 4 significant digits (a loss of 0.0641, an accuracy of 0.983), a count or a
rate is whole and thousands separated (1,437 samples, 665 samples/s), seconds keep two
decimals, and a fraction of time (the data stall) is a percentage with one decimal.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

__all__ = ["Shown", "count", "metric", "rate", "seconds", "share", "shown"]

Shown = Callable[[Any], str]
"""Text of a value of one kind; None (not measured) is shown as an en dash."""

_NONE = "\N{EN DASH}"


def shown(fmt: str) -> Shown:
    """A :data:`Shown` of numbers by the format ``fmt``; other values (text, a non-finite
    float) as ``str`` gives them, None as an en dash."""
    def show(value: Any) -> str:
        if value is None:
            return _NONE
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return str(value)
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        return format(value, fmt)

    return show


count = shown(",.0f")
"""Whole and thousands separated: ``1,437``."""
rate = count
"""Per second, whole: ``665`` samples/s."""
seconds = shown(",.2f")
"""Two decimals: ``2.16``."""
metric = shown(".4g")
"""A loss or a metric, 4 significant digits: ``0.0641``."""
share = shown(".1%")
"""A fraction as a percentage: ``0.4%``."""
