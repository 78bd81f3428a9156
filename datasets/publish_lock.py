"""One publish at a time under a dataset's URL: a lock object made by a conditional write.

Publishing at a URL is a few steps (check what is there, write the dataset's metadata,
retire the builds it replaces), and two preparations publishing at once could interleave
them: one could retire the other's build after the other's metadata already points at it.
So a publish holds ``dasktrain-publish.lock`` under the dataset's URL while it runs them.

The lock is taken by writing the object only if it is absent (``pipe_file(...,
mode="create")``: on S3 a ``PutObject`` with ``If-None-Match: *``, on GCS a generation
match of 0; the store, not the client, decides which of two writers gets it). A publish
takes seconds; a lock older than :data:`STALE_SECONDS` was left by a process that died
while publishing. On S3 such a lock is taken over with a write conditional on its ETag, so
two processes finding it stale cannot both take it; elsewhere the error names the object
to delete.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

from dasktrain._deadline import wait_until

__all__ = ["LOCK_NAME", "STALE_SECONDS", "publish_lock"]

logger = logging.getLogger(__name__)

#: The lock's name under a dataset's URL.
LOCK_NAME = "dasktrain-publish.lock"
#: Age after which a lock is taken to be a dead process's.
STALE_SECONDS = 120.0
_POLL = 0.2


class _Busy(TimeoutError):
    """The lock is held by a live publish: wait a little and try again."""


def _read(fs: Any, path: str) -> tuple[dict[str, Any], str | None] | None:
    """The lock's content and its ETag (where the store gives one); None when absent."""
    try:
        fs.invalidate_cache(path)
        info = fs.info(path)
        held = json.loads(fs.cat_file(path))
    except FileNotFoundError:
        return None
    except ValueError:  # not ours, or half-read: treat as held since now
        held = {}
    return held, info.get("ETag")


def _take(fs: Any, path: str, body: bytes, etag: str | None) -> bool:
    """Write the lock if absent (``etag`` None) or still the one with ``etag``; whether
    this process got it."""
    try:
        if etag is None:
            fs.pipe_file(path, body, mode="create")
        else:
            fs.pipe_file(path, body, IfMatch=etag)
    except FileExistsError:  # S3's failed If-None-Match, and fsspec's own "create"
        return False
    except OSError as exc:
        text = str(exc).lower().replace("-", "")
        if etag is not None and "precondition" in text:  # another took it over first
            return False
        raise
    return True


def _is_s3(fs: Any) -> bool:
    protocol = fs.protocol
    return "s3" in ((protocol,) if isinstance(protocol, str) else protocol)


def _acquire(fs: Any, path: str, url: str, owner: str, timeout: float) -> None:
    def body() -> bytes:  # "since" is when it is taken, not when waiting began
        return json.dumps({"owner": owner, "since": time.time()}).encode()

    said: list[str] = []  # the holders waited for, each said once

    def attempt(seconds: float) -> None:
        if _take(fs, path, body(), None):
            return
        found = _read(fs, path)
        if found is None:
            raise _Busy  # released meanwhile: take it at once
        held, etag = found
        age = time.time() - float(held.get("since", time.time()))
        if age < STALE_SECONDS:
            if held.get("owner") not in said:
                said.append(held.get("owner"))
                logger.info("waiting for another preparation's publish of %s", url)
            time.sleep(min(seconds, _POLL))
            raise _Busy
        if etag is None or not _is_s3(fs):
            raise OSError(f"{url}/{LOCK_NAME} was left {age:.0f} s ago by a preparation that "
                          "stopped while publishing; delete it if no preparation into "
                          f"{url} is running, then run this one again")
        if not _take(fs, path, body(), etag):
            raise _Busy
        logger.warning("took over the publish lock of %s, left %.0f s ago by a preparation "
                       "that stopped while publishing", url, age)

    wait_until(attempt, timeout=timeout, slice_seconds=_POLL, expired=lambda: OSError(
        f"{url} is being published by another preparation for more than {timeout:.0f} s; "
        f"if none is running, delete {url}/{LOCK_NAME}"))


@contextlib.contextmanager
def publish_lock(fs: Any, root: str, url: str, timeout: float = 2 * STALE_SECONDS
                 ) -> Iterator[None]:
    """Hold the publish lock of the dataset at ``url`` (``root`` is its path in ``fs``)
    for the body of the ``with``; waits while another publish holds it."""
    path = f"{root}/{LOCK_NAME}"
    owner = uuid.uuid4().hex
    _acquire(fs, path, url, owner, timeout)
    try:
        yield
    finally:
        found = _read(fs, path)
        if found is not None and found[0].get("owner") == owner:
            with contextlib.suppress(FileNotFoundError):
                fs.rm_file(path)
