"""The holder in shards: each owns a contiguous slice of the parameters and of the optimizer's
state, on a worker of its own.

One holder receives every worker's payload and sends every reply: per ``sync`` step,
2 x N payloads through its worker's network interface, where a ring all-reduce moves about
two payloads per process whatever N is. Across hosts that interface becomes the limit (on
one host, memory shared with the holder makes the exchange cost a memory copy per worker;
see :mod:`dasktrain.trainer.exchange.shared`). ``Trainer(holder_shards=K)`` splits the
holder into K actors, placed on K workers spread over the cluster's hosts (see
:func:`shard_workers`), each a
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

This module is the plan, pure functions of a layout, worker addresses and settings, testable
without a cluster: which slice each shard owns (:func:`shard_layouts`), where shards go
(:func:`shard_workers`), each shard's part of a checkpoint (:func:`shard_states`) and the
settings shards refuse (:func:`check_shards`). The driver and the workers call the shards
through the views in :mod:`dasktrain.trainer.exchange.sharded`, which offer the calls of one
holder: a checkpoint holds every shard's state, and resumes with the same number of shards.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dasktrain.trainer.flat import FlatLayout

__all__ = ["check_shards", "shard_layouts", "shard_states", "shard_workers"]


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

