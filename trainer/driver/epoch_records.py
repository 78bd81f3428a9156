"""An epoch's entry of ``History.epochs``, from the reports of the workers that ran it."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from dasktrain.trainer.worker.compute import MetricTotals

__all__ = ["epoch_ends", "epoch_record", "merged_metrics"]


def merged_metrics(reports: list[dict[str, Any]]) -> dict[str, float]:
    """The epoch's training metrics over every worker's batches (sample-weighted means)."""
    totals = MetricTotals()
    for report in reports:
        totals.merge(report.get("metrics") or {})
    return totals.means()


def epoch_record(epoch: int, reports: list[dict[str, Any]], wall: float,
                 previous_ends: dict[int, float] | None = None,
                 applied: int | None = None, applied_loss: float | None = None
                 ) -> dict[str, Any]:
    """What epoch ``epoch`` did, over ``wall`` seconds, by the workers' ``reports``;
    ``previous_ends``: when each worker finished its last step of the epoch before (wall
    clock), for the gap between the two epochs; ``applied``: the samples the holder's
    updates applied in the epoch, which count the work of a worker that died or left
    without a report (else the reports' sum); ``applied_loss``: their mean loss, which
    stands for the reports' (a dead worker's batches count too). The other training
    metrics are the reports' own, over ``per_worker``'s samples."""
    samples = applied if applied is not None else sum(r["samples"] for r in reports)
    train = merged_metrics(reports)
    if applied_loss is not None:
        train["loss"] = float(applied_loss)
    gaps = {int(r["worker"]): _gap(r, previous_ends or {}) for r in reports}
    known = [g for g in gaps.values() if g is not None]
    return {
        "epoch": epoch,
        "wall_s": wall,
        "samples": samples,
        "samples_per_s": samples / wall if wall > 0 else 0.0,
        "stall": float(np.mean([r["stall"] for r in reports])) if reports else None,
        "exchange_s": float(np.mean([r["exchange_s"] for r in reports]))
        if reports else None,
        "workers_finished": len(reports),
        # The longest time a worker trained nothing between its last step of the epoch
        # before and its first of this one (None for a fit's first epoch).
        "gap_s": max(known) if known else None,
        # How each worker reached the holder: in its process, direct channel, actor.
        "exchange_via": dict(Counter(r["exchange_via"] for r in reports)),
        "train": train,
        # Batches whose loss was not finite (on_nonfinite="skip"): refused by the
        # holder, and left out of "train" so that one bad batch cannot make it NaN.
        "skipped_steps": sum(int(r.get("skipped_nonfinite", 0)) for r in reports),
        # precision="fp16": batches whose scaled gradients overflowed float16, skipped by
        # their worker (which then lowered its loss scale), not pushed.
        "overflow_steps": sum(int(r.get("skipped_overflow", 0)) for r in reports),
        # Per worker, so a report can show which replica waited on data or lagged.
        "per_worker": [
            {"worker": int(r["worker"]), "samples": int(r["samples"]),
             "address": r.get("address"),  # the Dask worker it ran on
             "stall": float(r["stall"]),
             "samples_per_s": r["samples"] / r["elapsed_s"] if r["elapsed_s"] > 0 else 0.0,
             # Seconds of forward and backward passes, and of waiting for the holder's
             # replies (the exchange, and the slower workers of a lock-step round).
             "compute_s": float(r.get("compute_s", 0.0)),
             "exchange_s": float(r.get("exchange_s", 0.0)),
             # Rows of each of its batches: more for a faster worker (Trainer's balance).
             "batch_rows": r.get("batch_rows"),
             # Of the stall, the wait for the epoch's first batch (the pipeline starting).
             "first_batch_s": float(r.get("first_batch_s", 0.0)),
             "gap_s": gaps[int(r["worker"])],
             # "shared", "local" or "tcp" over the direct channel; None without one.
             "transport": r.get("transport"),
             # Pushes sent bucket by bucket during backward (direct channel only).
             "pushes_in_buckets": int(r.get("pushes_in_buckets", 0)),
             # Replies received bucket by bucket as the next forward pass began (see
             # dasktrain.trainer.worker.gate).
             "replies_streamed": bool(r.get("replies_streamed", False)),
             # The model computed on the holder's own parameters (a worker in the holder's
             # process, see HolderHandle.lend_replies): replies cost it no copy.
             "replies_viewed": bool(r.get("replies_viewed", False))}
            for r in sorted(reports, key=lambda r: r["worker"])],
    }


def epoch_ends(reports: list[dict[str, Any]]) -> dict[int, float]:
    """When each worker finished its last step of an epoch (wall clock, its host's)."""
    return {int(r["worker"]): float(r["last_step_at"]) for r in reports
            if r.get("last_step_at") is not None}


def _gap(report: dict[str, Any], previous_ends: dict[int, float]) -> float | None:
    """Seconds ``report``'s worker trained nothing between two epochs: from its last step
    of the one before to its first of this one (setting up its task, the driver's work at
    the boundary, the first batch), on the worker's own clock."""
    before = previous_ends.get(int(report["worker"]))
    first = report.get("first_step_at")
    if before is None or first is None:
        return None
    return max(float(first) - before, 0.0)
