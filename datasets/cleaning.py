"""What cleaning and normalisation did to a dataset: said as warnings, and by ``describe``.

A preparation drops rows holding NaN or infinite values (and tabular rows with a missing
cell), and ``normalize`` turns a feature that is constant on the split it is fitted on into
zeros. Both are legal and both change the data quietly, so :func:`warn_about_cleaning`
says so with the counts; the same counts sit in the dataset's attributes, where
:func:`cleaning_summary` and :func:`constant_summary` read them for ``dasktrain info``.
"""

from __future__ import annotations

import warnings
from typing import Any

__all__ = [
    "CleaningWarning",
    "cleaning_summary",
    "constant_columns",
    "constant_summary",
    "rows_dropped",
    "warn_about_cleaning",
]

#: Constant columns named in one message; more are counted.
_NAMED = 8


class CleaningWarning(UserWarning):
    """A preparation dropped rows or zeroed constant features (counts in the attributes)."""


def rows_dropped(attrs: dict[str, Any]) -> dict[str, int]:
    """Rows a preparation dropped, by cause: ``nonfinite`` (NaN or infinite values) and
    ``missing`` (tabular rows with an empty cell); also ``read``, the rows of the source."""
    details = attrs.get("provenance", {}).get("source_details", {})
    nonfinite = int(attrs.get("rows_dropped_nonfinite") or 0)
    missing = int(details.get("rows_dropped_missing") or 0)
    read = int(details.get("rows_read") or attrs["num_samples"] + nonfinite)
    return {"nonfinite": nonfinite, "missing": missing, "read": read}


def constant_columns(attrs: dict[str, Any]) -> dict[str, list[str]]:
    """Per normalised array, its features that were constant where normalisation was
    fitted (and are therefore zeros): column names where the source has them, else flat
    feature indices."""
    details = attrs.get("provenance", {}).get("source_details", {})
    found = {}
    for array, norm in (attrs.get("normalization") or {}).items():
        indices = norm.get("constant") or []
        # A table's columns per array; older datasets name only the features of "x".
        names = (details.get("columns") or {}).get(array, details.get("features"))
        if indices:
            found[array] = [repr(names[i]) if isinstance(names, list) and i < len(names)
                            else str(i) for i in indices]
    return found


def cleaning_summary(attrs: dict[str, Any]) -> str | None:
    """``dropped 3 of 1,000 rows: 2 with NaN or infinite values, 1 with a missing cell``,
    or None where no row was dropped."""
    counts = rows_dropped(attrs)
    causes = [f"{counts['nonfinite']:,} with NaN or infinite values"] * bool(counts["nonfinite"])
    causes += [f"{counts['missing']:,} with a missing cell"] * bool(counts["missing"])
    if not causes:
        return None
    total = counts["nonfinite"] + counts["missing"]
    return f"dropped {total:,} of {counts['read']:,} rows: {', '.join(causes)}"


def constant_summary(attrs: dict[str, Any], array: str) -> str | None:
    """``2 constant features set to 0: 'c', 'd'`` for a normalised array, or None."""
    columns = constant_columns(attrs).get(array)
    if not columns:
        return None
    shown = ", ".join(columns[:_NAMED]) + (", ..." if len(columns) > _NAMED else "")
    return (f"{len(columns)} constant feature{'s' if len(columns) > 1 else ''} "
            f"set to 0: {shown}")


def warn_about_cleaning(attrs: dict[str, Any]) -> None:
    """Warn (:class:`CleaningWarning`) about dropped rows and zeroed constant features."""
    dropped = cleaning_summary(attrs)
    if dropped is not None:
        warnings.warn(f"{dropped} (counted in the dataset's attributes)", CleaningWarning,
                      stacklevel=3)
    for array, norm in (attrs.get("normalization") or {}).items():
        constant = constant_summary(attrs, array)
        if constant is not None:
            fitted = norm["fitted_on"]
            where = "the whole dataset" if fitted == "all" else f"split {fitted!r}"
            warnings.warn(f"normalize: {constant} in {array!r} (constant on {where}, where "
                          "the mean and std were fitted)", CleaningWarning, stacklevel=3)
