"""Refusing, before any task, a fit whose model or functions the workers cannot load.

A class or function is pickled by reference to its module, unless it lives in ``__main__``:
a model defined in ``mymodels.py`` that the driver imports reaches each worker as "import
``mymodels``, take ``Net``". Where a worker cannot import it, Dask's worker fails to read
the task, its process dies and the nanny starts another, so that a task pinned to that
worker (the parameter holder) waits for a worker that never comes, and the fit would end
only at its ``timeout`` with no word of the cause. The driver therefore pickles what its
tasks carry and has the workers load it first, each in a ``try``, and stops with the
loading error and what to do.
"""

from __future__ import annotations

from typing import Any

from distributed import Client
from distributed.protocol.pickle import dumps, loads

from dasktrain.trainer.errors import TrainerError

__all__ = ["check_loadable"]

#: Up to this many bytes in all, every worker loads the payloads; past it one worker per
#: host does (a large model's weights travel once per host, not once per worker).
_EVERY_WORKER_BYTES = 8 * 2**20

_FIX = ("a class or function from a module the driver imports is sent by name, so every "
        "worker must be able to import that module too: install it on the workers, send "
        "it with client.upload_file(path) before the fit, or define it in the script run "
        "as __main__ (sent whole)")


def _load(payloads: dict[str, bytes]) -> dict[str, str]:
    """On a worker: the error of each payload that does not load."""
    failed = {}
    for what, payload in payloads.items():
        try:
            loads(payload)
        except Exception as exc:  # reported to the driver, which stops the fit
            failed[what] = f"{type(exc).__name__}: {exc}"
    return failed


def check_loadable(client: Client, parts: dict[str, Any],
                   workers: dict[str, dict[str, Any]]) -> None:
    """Raise :class:`TrainerError` if a worker of ``workers`` (address -> scheduler info)
    cannot load one of ``parts`` (what it is, for the message -> the object)."""
    payloads = {}
    for what, obj in parts.items():
        try:
            payloads[what] = dumps(obj)  # as Dask sends a task: pickle, else cloudpickle
        except Exception:  # not picklable here: submitting the task says so, as it did
            continue
    if not payloads:
        return
    size = sum(map(len, payloads.values()))
    targets = sorted(workers)
    if size > _EVERY_WORKER_BYTES:
        by_host: dict[str, str] = {}
        for address in targets:
            by_host.setdefault(str(workers[address].get("host", address)), address)
        targets = sorted(by_host.values())
    found = client.run(_load, payloads, workers=targets)
    for address, failed in sorted(found.items()):
        for what, error in failed.items():
            raise TrainerError(f"the workers cannot load {what} (on {address}: {error}): "
                               f"{_FIX}")
