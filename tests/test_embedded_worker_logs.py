"""What the embedded cluster's workers keep off the command's terminal: a failed sample of
Dask's statistical profiler (a race with the sampled thread on CPython 3.11) logs a
traceback from a worker's event loop; it is dropped there, other errors are not."""

from __future__ import annotations

import logging

from distributed import Client

from dasktrain._cluster import start_local_cluster


def _log_a_profiler_race_and_another_error() -> list[str]:
    """In a worker: the error a racing sample raises (distributed's profiler handed what is
    no longer a frame) and an unrelated one, each logged as tornado logs a failed periodic
    callback; what the worker's loggers let through."""
    from distributed import profile

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    log = logging.getLogger("tornado.application")
    keep = Keep()
    log.addHandler(keep)
    try:
        try:
            profile.process(compile("0", "<gone>", "eval"), None, profile.create())
        except AttributeError:
            log.error("Exception in callback %r", "trigger_profile", exc_info=True)
        try:
            {}["missing"]
        except KeyError:
            log.error("Exception in callback %r", "something_else", exc_info=True)
    finally:
        log.removeHandler(keep)
    return seen


def test_embedded_workers_drop_a_failed_profiler_sample_and_keep_other_errors():
    cluster = start_local_cluster(n_workers=1)
    try:
        with Client(cluster) as client:
            (seen,) = client.run(_log_a_profiler_race_and_another_error).values()
    finally:
        cluster.close(timeout=30)
    assert seen == ["Exception in callback 'something_else'"]
