"""What the parameter holder keeps that could grow with a run, counted.

Every collection the holder keeps (records and events not yet reported, waiters, per-epoch
and per-worker tables, buffers) must stay bounded however long a fit runs;
``benchmarks/soak.py`` samples these counts after every epoch to show it. Read from any
thread: counts of a moment, for a check, not for the holder's own decisions.
"""

from __future__ import annotations

from typing import Any

__all__ = ["footprint"]


def footprint(holder: Any) -> dict[str, int]:
    """Entries in each collection ``holder`` (a :class:`ParameterHolder`) keeps."""
    epochs, claims, host = holder._epochs, holder._claims, holder._host
    ledger = holder._roster.ledger
    sizes = {
        "records": len(host.records._columns["staleness"]),
        "events": len(host.events),
        "notices": len(holder._notices),
        "claims_unreported": len(claims.claims),
        "claim_waiters": len(claims._waiters),
        "epoch_waiters": len(epochs._waiters),
        "epoch_tasks": len(epochs._tasks),
        "state_waiters": len(holder._state_waiters._waiting),
        "epoch_reports": sum(len(r) for r in epochs.reports.values()),
        "epoch_boundaries": len(epochs.boundaries),
        "epoch_outcomes": len(epochs.outcomes),
        "epochs_queued": len(epochs.queued),
        "balance_epochs": len(holder._balance.decided),
        "positions": len(holder._roster.positions),
        "arriving": len(holder._intake.arriving),
        "buffers_leased": len(holder._arith._leases),
        "buffers_spare": len(holder._arith._spare),
    }
    if ledger is not None:
        sizes["ledger_runs"] = len(ledger._runs)
    return sizes
