"""Another preparation publishing while one runs: the moment between a preparation's check
that its output is free and its publish, reached through the line it logs there."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

_LOGGER = "dasktrain.datasets.prepare"


class _Once(logging.Handler):
    """Runs ``action`` inside the first "preparing ..." record: the preparation logging it
    has checked its output and not yet written anything."""

    def __init__(self, action: Callable[[], object]) -> None:
        super().__init__()
        self.action = action
        self.ran = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.ran and record.getMessage().startswith("preparing "):
            self.ran = True  # first: the action's own preparation logs the same line
            self.action()


@contextlib.contextmanager
def meanwhile(action: Callable[[], object]) -> Iterator[_Once]:
    """Within the ``with``, the first preparation to start runs ``action`` (another
    preparation into the same output, say) after its check of the output, before its
    build; ``.ran`` says whether it did."""
    log = logging.getLogger(_LOGGER)
    handler = _Once(action)
    level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    try:
        yield handler
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
