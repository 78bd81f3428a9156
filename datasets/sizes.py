"""Byte counts as a person reads them, the same in ``dasktrain info`` and in what a
preparation says before it writes."""

from __future__ import annotations

__all__ = ["human_bytes"]


def human_bytes(size: float) -> str:
    """``512 B``, ``464.3 KiB``, ``1.2 GiB``: binary units, one decimal above bytes."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size}"
