"""A Python process on a host of :mod:`dasktrain._hosts` that runs the functions it is sent.

Code that must run on another host (a fit's driver, whose cluster is reachable only there; a
DDP rank) runs in such a process: the caller sends a function and its arguments, the process
runs it and sends back what it returned, or its error with the traceback, one call at a
time for as long as it lives; what a call leaves in the process (a Dask client, say) is
there for the next. Functions travel with cloudpickle: one of an importable module by its
name, one of a script by value. The process takes the caller's ``sys.path`` before anything
else, so a module imports there as it does here.

The frames on the process's stdin and stdout are 8 bytes of length and a pickle. Its own
``sys.stdout`` goes to its stderr, which is the caller's: a print cannot break a frame.
"""

from __future__ import annotations

import os
import pickle
import select
import struct
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any, BinaryIO

import cloudpickle

from dasktrain._hosts import Host, Hosts

__all__ = ["Remote", "RemoteError"]

_LENGTH = struct.Struct("<Q")
_CLOSE_TIMEOUT = 10.0  # seconds the process has to end once its stdin closed


class RemoteError(RuntimeError):
    """A function run by a :class:`Remote` raised; the message ends with its traceback."""


class Remote:
    """A Python process on ``host`` that runs the functions :meth:`submit` sends.

    Parameters
    ----------
    hosts, host
        Where it runs.
    environment
        Variables set for it, beside this process's own.
    cwd
        Its working directory (default: this process's).
    """

    def __init__(self, hosts: Hosts, host: Host, *,
                 environment: Mapping[str, str] | None = None,
                 cwd: str | os.PathLike | None = None) -> None:
        self.host = host
        self._hosts = hosts
        self._pending = False
        self._process = hosts.popen(
            host, [sys.executable, "-c", "from dasktrain._remote import serve; serve()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=cwd,
            env={**os.environ, **(environment or {})})
        _write(self._process.stdin, pickle.dumps(list(sys.path)))

    def __enter__(self) -> Remote:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def submit(self, function: Callable[..., Any], /, *args: Any, **kwargs: Any) -> None:
        """Send ``function(*args, **kwargs)`` to run; :meth:`result` is what it returns."""
        if self._pending:
            raise RuntimeError(f"the process on {self.host.name} still runs a call: take "
                               "its result first")
        _write(self._process.stdin, cloudpickle.dumps((function, args, kwargs)))
        self._pending = True

    def result(self, timeout: float) -> Any:
        """What the call sent last returned, within ``timeout`` seconds: RemoteError if it
        raised; TimeoutError if it did not end in time (the process is then killed, as a
        call cannot be taken back)."""
        if not self._pending:
            raise RuntimeError("no call was sent")
        self._pending = False
        try:
            status, value = pickle.loads(_read(self._process.stdout, timeout))
        except TimeoutError:
            self.close(kill=True)
            raise TimeoutError(f"the call on {self.host.name} did not end within "
                               f"{timeout:.0f}s") from None
        except EOFError:
            code = self._process.wait(timeout=_CLOSE_TIMEOUT)
            raise RemoteError(f"the process on {self.host.name} ended (exit status {code}) "
                              "before it answered") from None
        if status == "error":
            raise RemoteError(f"on {self.host.name}: {value}")
        return value

    def call(self, function: Callable[..., Any], /, *args: Any, timeout: float,
             **kwargs: Any) -> Any:
        """``function(*args, **kwargs)`` run in the process, within ``timeout`` seconds."""
        self.submit(function, *args, **kwargs)
        return self.result(timeout)

    def close(self, kill: bool = False) -> None:
        """End the process: its stdin closes and it returns, else (or with ``kill``) it is
        killed."""
        if self._process.poll() is None and not kill:
            try:
                self._process.stdin.close()
                self._process.wait(timeout=_CLOSE_TIMEOUT)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self._process.poll() is None:
            self._hosts.kill(self.host, [self._process])
        for stream in (self._process.stdin, self._process.stdout):
            if not stream.closed:
                stream.close()


def serve() -> None:
    """The process's side: run each call received on stdin, answer on stdout, until stdin
    closes."""
    calls, answers = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # prints go to stderr from now on
    sys.path[:] = pickle.loads(_read(calls, None))
    while True:
        try:
            frame = _read(calls, None)
        except EOFError:
            return
        try:
            function, args, kwargs = pickle.loads(frame)
            answer = ("ok", function(*args, **kwargs))
            payload = cloudpickle.dumps(answer)
        except BaseException as exc:  # the caller gets it, whatever it is
            text = "".join(traceback.format_exception(exc))
            payload = cloudpickle.dumps(("error", text))
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                _write(answers, payload)
                raise
        _write(answers, payload)


def _write(stream: BinaryIO, payload: bytes) -> None:
    stream.write(_LENGTH.pack(len(payload)))
    stream.write(payload)
    stream.flush()


def _read(stream: BinaryIO, timeout: float | None) -> bytes:
    """One frame from ``stream``: EOFError if it ends first, TimeoutError if the frame
    is not whole within ``timeout`` seconds (None: no limit)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    fd = stream.fileno()

    def exactly(n: int) -> bytes:
        parts, got = [], 0
        while got < n:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    raise TimeoutError
            part = os.read(fd, min(n - got, 1 << 20))
            if not part:
                raise EOFError
            parts.append(part)
            got += len(part)
        return b"".join(parts)

    (length,) = _LENGTH.unpack(exactly(_LENGTH.size))
    return exactly(length)
