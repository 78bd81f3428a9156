"""The holder in shards: each owns a contiguous slice of the parameters and of the optimizer's
state, on a worker of its own.

One holder receives every worker's payload and sends every reply: per ``sync`` step,
2 x N payloads through its worker's network interface, where a ring all-reduce moves about
two payloads per process whatever N is. Across hosts that interface becomes the limit (on
one host, memory shared with the holder makes the exchange cost a memory copy per worker;
see :mod:`.shared`). ``Trainer(holder_shards=K)`` splits the holder into K actors, placed
on K workers spread over the cluster's hosts (see :func:`shard_workers`), each a
:class:`~dasktrain.trainer.holder.actor.ParameterHolder` over a slice of whole tensors: the
parameters are cut into K runs of consecutive tensors of about equal size, the last shard
also keeping the model's buffers. Every worker pushes slice k of its gradient to shard k
and receives slice k of the parameters from it, straight into its model's own memory, so
each host carries its share of the bytes, and the K optimizer steps run side by side.

Shards need no messages between them, because ``sync`` makes them agree: every shard
applies one update per round, the batch-size-weighted mean of the same workers' gradients,
so K slices of one optimizer over one buffer step exactly as that optimizer would (all
optimizers here are element-wise, and LARS/LAMB's trust ratios are per tensor, which a
slice of whole tensors keeps). What one shard would decide from its slice alone is decided
where the whole is known: a worker whose gradient is not finite says so to every shard
(its batch loss goes as NaN, so each refuses it alike); clipping to a global norm, which
needs the whole gradient, is refused with shards. A worker that dies in the middle of a
push may have reached some shards and not others: the others drop it at their barrier as
one holder would, so that round's slices average different sets of workers, and the
replacement continues after the last batch any shard took. Other modes decide from the
order in which gradients arrive, which shards would see differently: they keep one holder.

The driver sees the shards through :class:`HolderShards` and a worker through
:class:`ShardedHandle`, which offer the calls of one holder: a checkpoint holds every
shard's state, and resumes with the same number of shards.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from dasktrain._cluster import worker_info
from dasktrain.trainer.exchange.handle import HolderHandle
from dasktrain.trainer.flat import FlatLayout
from dasktrain.trainer.holder.divergence import all_finite

__all__ = ["HolderShards", "ShardedHandle", "check_shards", "open_handle", "shard_layouts",
           "shard_states", "shard_workers"]


def shard_layouts(layout: FlatLayout, shards: int
                  ) -> list[tuple[tuple[int, int], FlatLayout]]:
    """Each shard's ``(start, stop)`` slice of a payload and the layout of what it holds:
    ``shards`` runs of consecutive whole parameter tensors of about equal size, the last
    also holding the buffers (which come after every parameter in a payload)."""
    segments = layout.param_segments()
    n = len(segments)
    if not isinstance(shards, int) or not 1 <= shards <= n:
        raise ValueError(f"holder_shards must be between 1 and the model's {n} parameter "
                         f"tensors (a shard holds whole tensors), got {shards!r}")
    ends = [stop for _, _, stop, _ in segments]
    cuts = [0]
    for k in range(1, shards):
        target = layout.num_params * k / shards
        # At least one tensor in this shard, and one left for each shard after it.
        candidates = range(cuts[-1] + 1, n - (shards - k) + 1)
        cuts.append(min(candidates, key=lambda i: abs(ends[i - 1] - target)))
    cuts.append(n)
    result = []
    for k in range(shards):
        first, last = cuts[k], cuts[k + 1]
        start = segments[first][1]
        stop = layout.size if k == shards - 1 else ends[last - 1]
        buffers = layout.buffers if k == shards - 1 else ()
        result.append(((start, stop), FlatLayout(layout.params[first:last], buffers)))
    return result


def shard_workers(workers: Sequence[str], shards: int, first: str | None = None) -> list[str]:
    """Where the shards go: one worker per host in turn (every host carries a share of the
    exchange before any carries two), the hosts and their workers in address order;
    ``first``, if given, takes shard 0, and the turn goes on from the host after its own."""
    if shards > len(workers):
        raise ValueError(f"holder_shards={shards} needs as many workers; the cluster has "
                         f"{len(workers)}")
    by_host: dict[str, list[str]] = {}
    for address in sorted(workers):
        if address != first:
            by_host.setdefault(_host(address), []).append(address)
    hosts = sorted(by_host)
    if first is not None:
        # The round starts after ``first``'s host, which has its shard already.
        hosts = [h for h in hosts if h > _host(first)] + [h for h in hosts
                                                           if h <= _host(first)]
    order = [] if first is None else [first]
    while len(order) < shards:
        for host in hosts:
            if by_host[host] and len(order) < shards:
                order.append(by_host[host].pop(0))
    return order


def _host(address: str) -> str:
    rest = address.partition("://")[2] or address
    return rest.rpartition(":")[0] or rest


def open_handle(holder: Any, timeout: float) -> HolderHandle | ShardedHandle:
    """A worker's handle on the holder: one actor, or a list of shards."""
    if isinstance(holder, (list, tuple)):
        return ShardedHandle(holder, timeout)
    return HolderHandle(holder, timeout)


class _Joined:
    """Calls on every shard, merged into one result (``done``/``result`` like a future)."""

    def __init__(self, handles: list[HolderHandle], futures: list[Any],
                 merge: Callable[[list[Any]], Any], what: str) -> None:
        self._handles = handles
        self._futures = futures
        self._merge = merge
        self._what = what

    def done(self) -> bool:
        """Every shard answered, or one failed (its error is then the result)."""
        return all(f.done() for f in self._futures) or any(
            f.done() and _failed(f) for f in self._futures)

    def result(self, timeout: float | None = None) -> Any:
        """The merged answer; each shard's wait checks that shard's worker is alive, and
        all together take at most ``timeout`` seconds (default: the handles')."""
        deadline = None if timeout is None else time.monotonic() + timeout
        results = []
        for k, (handle, future) in enumerate(zip(self._handles, self._futures, strict=True)):
            left = None if deadline is None else max(deadline - time.monotonic(), 0.01)
            results.append(handle.wait(future, f"{self._what} (shard {k})", left))
        return self._merge(results)


class HolderShards:
    """The driver's view of a holder in shards: each call goes to every shard, and the
    answers are merged into what one holder would have said."""

    def __init__(self, actors: Sequence[Any], timeout: float, client: Any) -> None:
        self._client = client
        self.handles = [HolderHandle(a, timeout, client) for a in actors]
        self.address = ", ".join(h.address for h in self.handles)
        self.last_workers: dict[str, dict] | None = None

    def holder_alive(self) -> bool:
        """Every shard's worker lives (one question to the scheduler for all)."""
        try:
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

    def call(self, method: str, *args: Any, what: str | None = None) -> _Joined:
        """Start ``method`` on every shard (``load_state_dict`` gives each its own part)."""
        if method == "load_state_dict":
            parts = shard_states(args[0], len(self.handles))
            futures = [h.call(method, part) for h, part in zip(self.handles, parts,
                                                                strict=True)]
        else:
            futures = [h.call(method, *args) for h in self.handles]
        return _Joined(self.handles, futures, _MERGE.get(method, _first), what or method)

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


class ShardedHandle:
    """A trainer worker's view of a holder in shards, with the calls of
    :class:`HolderHandle` that the worker loop makes: a push sends each shard its slice, and
    the replies land in their slices of the receive buffer."""

    def __init__(self, actors: Sequence[Any], timeout: float) -> None:
        self.handles = [HolderHandle(a, timeout) for a in actors]
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
        infos = [h.join(worker, address, layout, into=self._into[a:b])
                 for h, (a, b) in zip(self.handles, self._bounds, strict=True)]
        params = np.empty(size, dtype=np.float32)
        for (a, b), info in zip(self._bounds, infos, strict=True):
            params[a:b] = info["params"]
        self._versions = [int(info["version"]) for info in infos]
        return {"params": params, "version": min(self._versions), "epoch": infos[0]["epoch"],
                "lr_factor": infos[0]["lr_factor"],
                "position": max(int(info["position"]) for info in infos), "channel": None}

    def share(self, adopt: Callable[[np.ndarray, np.ndarray], bool]) -> bool:
        """The model stays one buffer: each shard's channel copies its slice in and out of
        the memory it shares with that shard, if any."""
        return False

    def begin_push(self, *args: Any) -> None:
        return None

    def push(self, worker: int, version: int, payload: np.ndarray | None, count: int,
             loss: float, position: tuple[int, int]) -> _ShardedPush:
        """Send each shard its slice (``version`` is each shard's own, from its last
        reply). A gradient that is not finite goes with a NaN loss, so that every shard
        refuses it, not only those whose slice shows it."""
        if payload is not None and math.isfinite(loss) and \
                not all_finite(torch.from_numpy(payload)):
            loss = math.nan
        return _ShardedPush([
            h.push(worker, v, None if payload is None else payload[a:b], count, loss,
                   position)
            for h, v, (a, b) in zip(self.handles, self._versions, self._bounds, strict=True)])

    def wait(self, future: Any, what: str, timeout: float | None = None) -> Any:
        if not isinstance(future, _ShardedPush):
            raise TypeError("a sharded holder waits on its own pushes only")
        for k, (handle, part) in enumerate(zip(self.handles, future.futures, strict=True)):
            params, self._versions[k] = handle.wait(part, f"{what} (shard {k})", timeout)
            start, stop = self._bounds[k]
            into = self._into[start:stop]
            # The channel and an in-process shard reply into the slice; the actor's calls
            # hand back an array of their own.
            if params.ctypes.data != into.ctypes.data:
                np.copyto(into, params)
        return self._into, min(self._versions)

    def request(self, method: str, *args: Any, what: str | None = None) -> Any:
        """Call every shard and wait; a worker's warnings go to the first only, which the
        driver reads them from."""
        targets = self.handles[:1] if method == "notify" else self.handles
        futures = [h.call(method, *args) for h in targets]
        results = [h.wait(f, what or method) for h, f in zip(targets, futures, strict=True)]
        return results[0]

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
    merged["version"] = min(int(r["version"]) for r in results)
    merged["params"] = torch.cat([r["params"] for r in results])
    merged["buffers"] = results[-1]["buffers"]
    merged["shards"] = results
    return merged


def shard_states(state: dict[str, Any], shards: int) -> list[dict[str, Any]]:
    """Each shard's part of a holder's checkpointed state, refused with the number of shards
    to resume with if it was made by another number."""
    parts = state.get("shards")
    found = 1 if parts is None else len(parts)
    if found != shards:
        raise ValueError(f"the checkpoint was made by a holder in {found} "
                         f"shard{'s' if found > 1 else ''}; resume it with "
                         f"holder_shards={found}, not {shards}")
    return [state] if parts is None else list(parts)


def _pull(results: list[tuple[np.ndarray, int]]) -> tuple[np.ndarray, int]:
    return (np.concatenate([params for params, _ in results]),
            min(version for _, version in results))


_MERGE: dict[str, Callable[[list[Any]], Any]] = {
    "progress": _progress, "state_dict": _state, "state_at": _state, "pull": _pull}


def check_shards(shards: Any, mode: str, clip_grad_norm: float | None) -> None:
    """Refuse settings that shards cannot honour, by name (before any cluster work)."""
    if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
        raise ValueError(f"holder_shards must be a positive integer, got {shards!r}")
    if shards == 1:
        return
    if mode != "sync":
        raise ValueError(f"holder_shards > 1 needs mode='sync', whose rounds every shard "
                         f"applies alike; mode {mode!r} decides from the order in which "
                         "gradients arrive, which shards would see differently")
    if clip_grad_norm is not None:
        raise ValueError("clip_grad_norm needs the whole gradient's norm, which no shard "
                         "has: use holder_shards=1, or clip_grad_value")

