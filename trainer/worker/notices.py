"""What trainer workers tell the driver besides gradients: warnings and first-batch checks.

A warning raised inside a trainer task (torch's "target size differs from input size", a
deprecation in the user's model...) lands in a Dask worker's log, where nobody looks. Each
worker process installs one hook (:func:`capture_warnings`) that keeps, per thread, the
warnings Python shows; the trainer task hands them to the holder, and the driver raises the
first occurrence of each as a warning of its own. Python shows a warning once per place it
is raised, so a process forwards each at most once.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import torch

__all__ = ["Notice", "capture_warnings", "shape_notice", "taken_warnings", "watch_this_thread"]

Notice = dict[str, str]

_install_lock = threading.Lock()
_installed = False
# Per thread: the warnings shown in it and not yet taken, or no attribute when the thread
# is not watched. The hook runs in the thread that warns, so no lock is needed: the
# per-step check of a trainer task is one attribute read.
_watched = threading.local()


def capture_warnings() -> None:
    """Install the per-process hook (once); warnings are still shown as before."""
    global _installed
    with _install_lock:
        if _installed:
            return
        shown = warnings.showwarning

        def keep(message: Warning | str, category: type[Warning], filename: str,
                 lineno: int, file: Any = None, line: str | None = None) -> None:
            queue = getattr(_watched, "queue", None)
            if queue is not None:
                queue.append({"category": category.__name__,
                              "message": f"{message} ({filename}:{lineno})"})
            shown(message, category, filename, lineno, file, line)

        warnings.showwarning = keep
        _installed = True


def watch_this_thread() -> None:
    """Keep the warnings shown in the calling thread from now on."""
    _watched.queue = []


def taken_warnings(stop: bool = False) -> list[Notice]:
    """The warnings shown in the calling thread since the last call (``stop``: and stop
    keeping them)."""
    queue = getattr(_watched, "queue", None)
    if stop:
        _watched.__dict__.pop("queue", None)
    elif queue:
        _watched.queue = []
    return queue or []


def shape_notice(output: Any, target: Any) -> Notice | None:
    """A warning when a floating-point target's shape differs from the model's output: most
    losses then broadcast (``(N, 1)`` against ``(N,)`` becomes ``(N, N)``) and train on a
    wrong objective without an error. Class labels (integer targets) are not checked."""
    if not (isinstance(output, torch.Tensor) and isinstance(target, torch.Tensor)):
        return None
    if not target.is_floating_point() or output.shape == target.shape:
        return None
    try:
        broadcast = tuple(torch.broadcast_shapes(output.shape, target.shape))
        effect = f"a loss that compares them element-wise broadcasts to {broadcast}"
    except RuntimeError:
        effect = "they do not even broadcast"
    return {"category": "UserWarning",
            "message": f"the model's output has shape {tuple(output.shape)} but the targets "
                       f"{tuple(target.shape)}: {effect}, so unless the loss reshapes them "
                       "on purpose it trains on the wrong objective. Make the model's output "
                       "match the targets (or reshape in the loss)"}
