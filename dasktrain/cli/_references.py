"""Functions named in a config file: ``"file.py:name"`` or ``"package.module:name"``.

A file (relative to the config's directory) is loaded as a module under a name that cannot
be imported. That is deliberate: Dask pickles task arguments with ``pickle`` first and falls
back to ``cloudpickle`` when that fails. A module registered under an importable name would
be pickled by reference, and workers (other processes, other machines) cannot import a file
that lies next to the user's config; under an unimportable name ``pickle`` fails and
``cloudpickle`` sends the functions and classes of the file by value. Such a file should
therefore import only packages the workers have. A ``package.module`` reference is pickled
by reference: the workers must be able to import it.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["is_reference", "load_function"]

_FILE_MODULE_PREFIX = "dasktrain-config-file:"
_loaded: dict[Path, ModuleType] = {}


def is_reference(text: str) -> bool:
    """Whether ``text`` names a function as ``module:name`` or ``file.py:name``."""
    module, sep, name = text.rpartition(":")
    return bool(sep and module and name)


def _load_file(path: Path) -> ModuleType:
    path = path.resolve()
    if path in _loaded:  # the model and the loss may come from one file: load it once
        return _loaded[path]
    name = f"{_FILE_MODULE_PREFIX}{path}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot load {path} as Python code")
    module = importlib.util.module_from_spec(spec)
    # Registered only while it runs (dataclasses and typing look their module up), then
    # removed so that its functions are pickled by value (see the module docstring).
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise ValueError(f"{path} failed to load: {type(exc).__name__}: {exc}") from exc
    finally:
        sys.modules.pop(name, None)
    _loaded[path] = module
    return module


def _import(module_name: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import module {module_name!r}: {exc}") from exc


def load_function(reference: str, base: Path) -> Callable[..., Any]:
    """The callable ``reference`` names.

    Parameters
    ----------
    reference
        ``"file.py:name"`` (a Python file, relative to ``base`` unless absolute) or
        ``"package.module:name"``; ``name`` may be dotted (``"Class.create"``).
    base
        Directory that relative file names start from (the config file's).
    """
    if not isinstance(reference, str) or not is_reference(reference):
        raise ValueError(f"{reference!r} is not 'file.py:function' or 'module:function'")
    where, _, name = reference.rpartition(":")
    if where.endswith(".py"):
        path = Path(where) if Path(where).is_absolute() else base / where
        if not path.is_file():
            raise ValueError(f"no file {path}")
        module = _load_file(path)
    else:
        module = _import(where)
    found: Any = module
    for part in name.split("."):
        if not hasattr(found, part):
            public = [n for n in dir(found) if not n.startswith("_")]
            close = difflib.get_close_matches(part, public, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"{where} has no {name!r}{hint}")
        found = getattr(found, part)
    if not callable(found):
        raise ValueError(f"{where}:{name} is a {type(found).__name__}, not a function")
    return found
