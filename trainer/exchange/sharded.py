"""Calling a holder in shards (see :mod:`dasktrain.trainer.holder.shards`) as if it were one:
:class:`HolderShards` is the driver's view, :class:`ShardedHandle` a trainer worker's.

They run where the calls start (the driver's process, a worker's task), never on a shard,
and they are made of one :class:`~dasktrain.trainer.exchange.handle.HolderHandle` per shard:
so they live with the handle in the exchange, and take from the holder's room only the pure
layout of the slices.

A call goes to every shard, and its answers are awaited together (:meth:`_Shards.gather`):
one deadline for all, and after each slice of waiting one question to the scheduler about
every shard's worker, so that a dead shard is noticed within a slice whichever shard's
answer is awaited at that moment.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from distributed import Client, get_client

from dasktrain._cluster import worker_info
from dasktrain._deadline import wait_until
from dasktrain.trainer.errors import HolderLost, TrainerError
from dasktrain.trainer.exchange.client import PendingPush
from dasktrain.trainer.exchange.handle import HolderHandle
from dasktrain.trainer.flat import FlatLayout
from dasktrain.trainer.holder.arithmetic import Lease
from dasktrain.trainer.holder.divergence import all_finite
from dasktrain.trainer.holder.shards import shard_layouts, shard_states

__all__ = ["HolderShards", "ShardedHandle", "open_handle"]

_SLICE = 2.0  # seconds between liveness checks while waiting, as one holder's handle


def open_handle(holder: Any, timeout: float) -> HolderHandle | ShardedHandle:
    """A worker's handle on the holder: one actor, or a list of shards."""
    if isinstance(holder, (list, tuple)):
        return ShardedHandle(holder, timeout)
    return HolderHandle(holder, timeout)


class _Shards:
    """What both views share: a handle per shard, one liveness question for all of them,
    and the wait on every shard's answer at once."""

    def __init__(self, handles: list[HolderHandle], client: Client | None) -> None:
        self.handles = handles
        self._client = client  # default: the current one, found when first needed
        self.address = ", ".join(h.address for h in handles)
        self.last_workers: dict[str, dict] | None = None

    def holder_alive(self) -> bool:
        """Every shard's worker lives (one question to the scheduler for all)."""
        try:
            self._client = self._client or get_client()
            workers = worker_info(self._client)
        except Exception:  # cannot tell right now
            return True
        self.last_workers = workers
        for handle in self.handles:
            handle.last_workers = workers
        return all(h.address in workers for h in self.handles)

    def describe_lost(self) -> str:
        """Which shards' workers are gone (as the last liveness check saw it)."""
        alive = self.last_workers or {}
        lost = [f"{k} ({h.address})" for k, h in enumerate(self.handles)
                if h.address not in alive] or [f"of {self.address}"]
        return f"the worker of the parameter holder's shard {', '.join(lost)}"

    def gather(self, futures: Sequence[Any], what: str, timeout: float | None = None,
               own: Callable[[int, Any], Any] | None = None) -> list[Any]:
        """Every shard's answer (``futures[k]`` is shard k's), within ``timeout`` seconds in
        all (default: the handles'); ``own(k, answer)`` takes each answer as it comes.

        Answers that have come are taken first, so that a shard's error is not held up
        behind another shard's wait; between slices the liveness check covers every shard.
        A reply on a direct channel cannot be awaited in slices (a partly read reply would
        be lost to the stream): those are received last, with what is left of the
        deadline, and their channel checks its own shard's worker meanwhile.
        """
        seconds = timeout or self.handles[0].timeout
        deadline = time.monotonic() + seconds
        results: dict[int, Any] = {}
        sliced = [k for k, f in enumerate(futures) if not isinstance(f, PendingPush)]

        def take(k: int, wait: float) -> None:
            try:
                answer = futures[k].result(timeout=wait)
            except TimeoutError:  # an OSError too, and no sign of a lost worker
                raise
            except OSError as exc:
                raise HolderLost(f"cannot reach the worker of the parameter holder's shard "
                                 f"{k} ({self.handles[k].address}): {exc}") from exc
            results[k] = answer if own is None else own(k, answer)

        def get(seconds: float) -> None:
            end = time.monotonic() + seconds
            while waiting := [k for k in sliced if k not in results]:
                answered = [k for k in waiting if futures[k].done()]
                for k in answered:
                    take(k, _SLICE)  # done: no wait
                if not answered:
                    take(waiting[0], max(end - time.monotonic(), 0.001))

        def check() -> None:
            if not self.holder_alive():
                raise HolderLost(f"{self.describe_lost()} died while waiting for {what}")

        def expired() -> TrainerError:
            silent = ", ".join(str(k) for k in range(len(futures)) if k not in results)
            return TrainerError(f"no answer from the parameter holder for {what} after "
                                f"{seconds:.0f}s (from shard {silent})")

        wait_until(get, timeout=seconds, check=check, slice_seconds=_SLICE, expired=expired)
        for k, future in enumerate(futures):
            if k not in results:
                left = max(deadline - time.monotonic(), 0.01)
                answer = self.handles[k].wait(future, f"{what} (shard {k})", left)
                results[k] = answer if own is None else own(k, answer)
        return [results[k] for k in range(len(futures))]


class _Joined:
    """Calls on every shard, merged into one result (``done``/``result`` like a future)."""

    def __init__(self, shards: _Shards, futures: list[Any],
                 merge: Callable[[list[Any]], Any], what: str) -> None:
        self._shards = shards
        self._futures = futures
        self._merge = merge
        self._what = what

    def done(self) -> bool:
        """Every shard answered, or one failed (its error is then the result)."""
        return all(f.done() for f in self._futures) or any(
            f.done() and _failed(f) for f in self._futures)

    def result(self, timeout: float | None = None) -> Any:
        """The merged answer, within ``timeout`` seconds in all (default: the handles'),
        failing as soon as any shard's worker is found dead."""
        return self._merge(self._shards.gather(self._futures, self._what, timeout))


class HolderShards(_Shards):
    """The driver's view of a holder in shards: each call goes to every shard, and the
    answers are merged into what one holder would have said."""

    def __init__(self, actors: Sequence[Any], timeout: float, client: Client) -> None:
        super().__init__([HolderHandle(a, timeout, client) for a in actors], client)

    def call(self, method: str, *args: Any, what: str | None = None) -> _Joined:
        """Start ``method`` on every shard (``load_state_dict`` gives each its own part)."""
        if method == "load_state_dict":
            parts = shard_states(args[0], len(self.handles))
            futures = [h.call(method, part) for h, part in zip(self.handles, parts,
                                                                strict=True)]
        else:
            futures = [h.call(method, *args) for h in self.handles]
        return _Joined(self, futures, _MERGE.get(method, _first), what or method)

    def request(self, method: str, *args: Any, what: str | None = None) -> Any:
        """Call and wait, failing clearly if a shard's worker dies."""
        return self.call(method, *args, what=what).result()

    def call_living(self, method: str, *args: Any, timeout: float = 10.0) -> None:
        """``method`` on every shard whose worker lives, as the last liveness check saw it
        (to abort or close the others when one died); errors are the caller's to ignore."""
        alive = self.last_workers
        for handle in self.handles:
            if alive is None or handle.address in alive:
                handle.wait(handle.call(method, *args), method, timeout)


class _ShardedPush:
    def __init__(self, futures: list[Any]) -> None:
        self.futures = futures


class ShardedHandle(_Shards):
    """A trainer worker's view of a holder in shards, with the calls of
    :class:`HolderHandle` that the worker loop makes: a push sends each shard its slice, and
    the replies land in their slices of the receive buffer."""

    def __init__(self, actors: Sequence[Any], timeout: float) -> None:
        super().__init__([HolderHandle(a, timeout) for a in actors], None)
        self._bounds: list[tuple[int, int]] = []
        self._versions = [0] * len(self.handles)
        self._into: np.ndarray | None = None

    @property
    def via(self) -> str:
        """How pushes reach the shards, e.g. ``"shards:local+direct"``."""
        return "shards:" + "+".join(sorted({h.via for h in self.handles}))

    @property
    def transport(self) -> str | None:
        found = sorted({t for h in self.handles if (t := h.transport) is not None})
        return "+".join(found) or None

    order = None  # buckets are not sent to shards

    def join(self, worker: int, address: str | None, layout: FlatLayout,
             into: np.ndarray | None = None) -> dict[str, Any]:
        """Join every shard; the parameters are assembled from their slices, and the worker
        continues after the last batch any shard took."""
        self._bounds = [bounds for bounds, _ in shard_layouts(layout, len(self.handles))]
        size = self._bounds[-1][1]
        self._into = np.empty(size, dtype=np.float32) if into is None else into
        if self._into.shape != (size,):
            raise ValueError(f"the receive buffer must hold {size} values")
        # One shard after the other: joining opens each shard's direct channel.
        infos = [h.join(worker, address, layout, into=self._into[a:b])
                 for h, (a, b) in zip(self.handles, self._bounds, strict=True)]
        if any(info.get("surplus") for info in infos):
            return {"surplus": True}
        if any("wait" in info for info in infos):
            return {"wait": infos[0]["wait"]}
        return self._assembled(infos)

    @property
    def incarnation(self) -> int:
        """The first shard's incarnation of this worker (each shard hands out its own)."""
        return self.handles[0].incarnation

    def next_epoch(self, after: int, report: dict[str, Any] | None = None,
                   timeout: float | None = None) -> dict[str, Any] | None:
        """:meth:`HolderHandle.next_epoch` of every shard at once (each begins the epoch
        when its own part of the last one is complete), assembled as :meth:`join` does."""
        futures = [h.member_call("next_epoch", after, h._address, 0.0, report)
                   for h in self.handles]
        first = self.gather(futures, f"epoch {after + 1}")
        infos = [h.next_epoch(after, timeout=timeout) if info.get("wait") else info
                 for h, info in zip(self.handles, first, strict=True)]
        if any(info is None or "end" in info for info in infos):
            return None
        return self._assembled(infos)

    def _assembled(self, infos: list[dict[str, Any]]) -> dict[str, Any]:
        """One answer from the shards' answers to a join: the parameters from their
        slices, and the place after the last batch any shard took."""
        params = np.empty(self._bounds[-1][1], dtype=np.float32)
        for (a, b), info in zip(self._bounds, infos, strict=True):
            params[a:b] = info["params"]
        self._versions = [int(info["version"]) for info in infos]
        return {"params": params, "version": min(self._versions), "epoch": infos[0]["epoch"],
                "lr_factor": infos[0]["lr_factor"], "world": infos[0]["world"],
                "position": max(int(info["position"]) for info in infos), "channel": None,
                "rank": infos[0]["rank"], "incarnation": infos[0]["incarnation"],
                # The first shard's cut of the epoch's steps: every worker follows it.
                "shares": infos[0].get("shares")}

    def share(self, adopt: Callable[[np.ndarray, np.ndarray], bool]) -> bool:
        """The model stays one buffer: each shard's channel copies its slice in and out of
        the memory it shares with that shard, if any."""
        return False

    def lend_replies(self) -> bool:
        """Replies are assembled from the shards' slices: always copied."""
        return False

    def begin_push(self, *args: Any) -> None:
        return None

    def push(self, version: int, payload: np.ndarray | None, count: int,
             loss: float, position: tuple[int, int]) -> _ShardedPush:
        """Send each shard its slice (``version`` is each shard's own, from its last
        reply). A gradient that is not finite goes with a NaN loss, so that every shard
        refuses it, not only those whose slice shows it."""
        if payload is not None and math.isfinite(loss) and \
                not all_finite(torch.from_numpy(payload)):
            loss = math.nan
        return _ShardedPush([
            h.push(v, None if payload is None else payload[a:b], count, loss, position)
            for h, v, (a, b) in zip(self.handles, self._versions, self._bounds, strict=True)])

    def wait(self, future: Any, what: str, timeout: float | None = None) -> Any:
        """The parameters assembled from every shard's reply, and the lowest version."""
        if not isinstance(future, _ShardedPush):
            raise TypeError("a sharded holder waits on its own pushes only")
        self.gather(future.futures, what, timeout, own=self._land)
        return self._into, min(self._versions)

    def _land(self, k: int, reply: Any) -> None:
        """Shard k's reply in its slice of the receive buffer. The channel and an in-process
        shard reply into the slice (the latter under a lease, given back at once); the
        actor's calls hand back an array of their own."""
        start, stop = self._bounds[k]
        into = self._into[start:stop]
        if isinstance(reply, Lease):
            try:
                np.copyto(into, reply.array)
                self._versions[k] = reply.version
            finally:
                reply.release()
            return
        params, self._versions[k] = reply
        if params.ctypes.data != into.ctypes.data:
            np.copyto(into, params)

    def request(self, method: str, *args: Any, what: str | None = None) -> Any:
        """Call every shard and wait (the first shard's answer)."""
        futures = [h.call(method, *args) for h in self.handles]
        return self.gather(futures, what or method)[0]

    def member_request(self, method: str, *args: Any, what: str | None = None) -> Any:
        """A call of this worker's incarnation on every shard (each its own incarnation)
        and wait; a worker's warnings go to the first only, which the driver reads them
        from."""
        targets = self.handles[:1] if method == "notify" else self.handles
        futures = [h.member_call(method, *args) for h in targets]
        return self.gather(futures, what or method)[0]

    def close(self) -> None:
        for handle in self.handles:
            handle.close()


# -- merging the shards' answers ---------------------------------------------------------
def _failed(future: Any) -> bool:
    try:
        future.result(timeout=0)
    except Exception:
        return True
    return False


def _first(results: list[Any]) -> Any:
    return results[0]


def _progress(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The first shard's records (every shard sees the same losses and workers), the
    others' events it did not see, and the lowest version."""
    merged = dict(results[0])
    merged["version"] = min(r["version"] for r in results)
    merged["refused"] = max(r["refused"] for r in results)
    merged["diverged"] = next((r["diverged"] for r in results if r["diverged"]), None)
    seen = set(merged["events"])
    merged["events"] = list(merged["events"]) + [
        f"shard {k}: {event}" for k, r in enumerate(results[1:], 1)
        for event in r["events"] if event not in seen]
    return merged


def _state(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One holder's state for the driver (version, epoch, the whole parameters and buffers
    to load a model from), with every shard's own under ``"shards"`` to resume from."""
    merged = {k: v for k, v in results[0].items() if k not in ("optimizer", "params")}
    versions = sorted({int(r["version"]) for r in results})
    merged["version"] = versions[0]
    if len(versions) > 1:
        # A shard asked for a version it has passed answers with its state now, and the
        # shards of a step finish it one after the other: these are not one model's state.
        merged["mixed_versions"] = versions
    merged["params"] = torch.cat([r["params"] for r in results])
    merged["buffers"] = results[-1]["buffers"]
    merged["shards"] = results
    return merged


def _epoch_end(results: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """An epoch is complete once it is on every shard (each takes every worker's report)."""
    return None if any(r is None for r in results) else results[0]


def _pull(results: list[tuple[np.ndarray, int]]) -> tuple[np.ndarray, int]:
    return (np.concatenate([params for params, _ in results]),
            min(version for _, version in results))


_MERGE: dict[str, Callable[[list[Any]], Any]] = {
    "progress": _progress, "state_dict": _state, "state_at": _state, "pull": _pull,
    "boundary": _state, "epoch_end": _epoch_end}
