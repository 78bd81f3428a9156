"""A small TOML writer for flat configs: tables of scalars, arrays and inline tables.

``tomllib`` only reads. The resolved training config is one level of tables whose values
are booleans, numbers, strings, arrays and small inline tables, which this covers without
a dependency. TOML has no null: a top-level None is written as a comment naming the key,
so the file still says that the setting exists and was left unset.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["dumps", "format_value"]

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _key(name: str) -> str:
    return name if _BARE_KEY.fullmatch(name) else _string(name)


def _string(text: str) -> str:
    # JSON's escapes (\" \\ \n \t \uXXXX for control characters) are TOML's; DEL is a
    # control character to TOML but not to JSON.
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007F")


def format_value(value: Any) -> str:
    """``value`` as a TOML value (None has no TOML form and is refused)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        # None has no TOML form: an unset entry of an inline table is left out.
        items = [f"{_key(str(k))} = {format_value(v)}" for k, v in value.items() if v is not None]
        return "{" + ", ".join(items) + "}"
    raise TypeError(f"cannot write {type(value).__name__} {value!r} as TOML")


def dumps(tables: Mapping[str, Mapping[str, Any]], header: str = "") -> str:
    """``tables`` (table name -> key -> value) as TOML text, ``header`` as comment lines.

    A None value is written as ``# key = (not set)``.
    """
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    for name, table in tables.items():
        if lines:
            lines.append("")
        lines.append(f"[{_key(name)}]")
        for key, value in table.items():
            if value is None:
                lines.append(f"# {_key(key)} = (not set)")
            else:
                lines.append(f"{_key(key)} = {format_value(value)}")
    return "\n".join(lines) + "\n"
