"""The holder's watchdog outlives a round that fails: a dead worker is still dropped when
the next round can tell."""

from __future__ import annotations

import asyncio

from dasktrain.trainer.holder.roster import Roster
from dasktrain.trainer.holder.watchdog import Watchdog


def test_a_failed_round_does_not_end_the_watch():
    async def scenario() -> tuple[list[tuple[int, str]], int]:
        members = Roster(2)
        members.admit(0, "tcp://127.0.0.1:1", "active")  # a worker that died
        members.admit(1, "tcp://127.0.0.1:2", "active")
        dropped: list[tuple[int, str]] = []
        done = asyncio.Event()
        calls = 0

        async def alive() -> set[str]:
            nonlocal calls
            calls += 1
            if calls == 1:  # the scheduler did not answer this round
                raise OSError("the scheduler did not answer")
            return {"tcp://127.0.0.1:2"}

        async def drop(worker: int, why: str) -> None:
            dropped.append((worker, why))
            done.set()

        watchdog = Watchdog(members, lambda: {0}, drop, alive, interval=0.01, timeout=60)
        watchdog.ensure_running()
        try:
            await asyncio.wait_for(done.wait(), timeout=10)
        finally:
            watchdog.stop()
        return dropped, watchdog.failed_rounds

    dropped, failed = asyncio.run(scenario())
    assert dropped == [(0, "its Dask worker tcp://127.0.0.1:1 is gone")]
    assert failed == 1
