"""Reading a ``dasktrain train`` config file section by section, every error naming the file,
the section and the key (:mod:`.train_config` maps the sections onto the API's objects)."""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from dasktrain.cli._references import load_function
from dasktrain.cli.train_keys import type_name, type_ok
from dasktrain.errors import DasktrainError

__all__ = ["ConfigError", "Reader"]


class ConfigError(DasktrainError, ValueError):
    """A bad config file; the message names the file, the section and the key."""


class Reader:
    """Reads one config file, section by section, naming the key in every error."""

    def __init__(self, path: Path, document: dict[str, Any]) -> None:
        self.path = path
        self.name = str(path)
        self.base = path.parent.resolve()
        self.document = document

    def error(self, section: str, key: str | None, message: str) -> ConfigError:
        where = f"[{section}] {key}" if key else f"[{section}]"
        return ConfigError(f"{self.name}: {where}: {message}")

    def unknown(self, section: str, key: str, known: list[str], why: str | None = None
                ) -> ConfigError:
        if why is None:
            close = difflib.get_close_matches(key, known, n=1)
            why = f"did you mean {close[0]!r}?" if close else \
                f"known keys: {', '.join(known)}"
        return ConfigError(f"{self.name}: unknown key [{section}] {key} ({why})")

    def table(self, section: str) -> dict[str, Any]:
        value = self.document.get(section, {})
        if not isinstance(value, dict):
            raise self.error(section, None, "must be a table ([section] with key = value)")
        return value

    def check_keys(self, section: str, table: Mapping[str, Any], known: list[str]) -> None:
        for key in table:
            if key not in known:
                raise self.unknown(section, key, known)

    def require(self, section: str, table: Mapping[str, Any], key: str, hint: Any = str
                ) -> Any:
        if key not in table:
            raise self.error(section, key, "missing (required)")
        return self.typed(section, key, table[key], hint)

    def typed(self, section: str, key: str, value: Any, hint: Any) -> Any:
        if type_ok(value, hint) is False:
            raise self.error(section, key, f"expected {type_name(hint)}, got {value!r}")
        return value

    def path_value(self, text: str) -> str:
        """A local path relative to the config file made absolute; URLs unchanged."""
        if "://" in text:
            return text
        path = Path(text).expanduser()
        return str(path if path.is_absolute() else (self.base / path).resolve())

    def reference(self, section: str, key: str, text: str) -> tuple[Callable, str]:
        """The function ``text`` names, and ``text`` with a file made absolute."""
        try:
            fn = load_function(text, self.base)
        except ValueError as exc:
            raise self.error(section, key, str(exc)) from exc
        where, _, name = text.rpartition(":")
        if where.endswith(".py"):
            text = f"{self.path_value(where)}:{name}"
        return fn, text

    def bound(self, section: str, fn: Callable, kwargs: dict[str, Any]) -> Callable:
        """``fn`` with ``kwargs`` bound, once they are known to fit its signature."""
        if not kwargs:
            return fn
        try:
            inspect.signature(fn).bind_partial(**kwargs)
        except TypeError as exc:
            raise self.error(section, "kwargs", str(exc)) from exc
        except ValueError:  # no signature to check against (some builtins)
            pass
        return functools.partial(fn, **kwargs)
