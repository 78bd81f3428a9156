"""The holder's records stay row-aligned while its serial thread and its event loop write
and read them at once (a holder on a threaded update)."""

from __future__ import annotations

import sys
import threading

from dasktrain.trainer.holder.records import PER_GRADIENT, Records


def test_rows_stay_aligned_under_concurrent_writes_and_takes():
    records = Records({"clock_lead": 0})
    stop = threading.Event()
    written = [0]

    def drops() -> None:  # the event loop recording dropped gradients
        while not stop.is_set():
            records.gradient(staleness=1, worker=0, dropped=True)
            written[0] += 1

    misaligned, taken = 0, 0
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    thread = threading.Thread(target=drops)
    thread.start()
    try:
        for i in range(20_000):
            if i % 50 == 0:
                records.update(version=i, loss=0.0, samples=1, contributors=1)
            rows = records.take()
            lengths = {len(rows[name]) for name in (*PER_GRADIENT, "clock_lead")}
            misaligned += len(lengths) > 1
            taken += len(rows["staleness"])
    finally:
        stop.set()
        thread.join(timeout=10)
        sys.setswitchinterval(interval)
    records.update(version=-1, loss=0.0, samples=0, contributors=0)
    taken += len(records.take()["staleness"])
    assert misaligned == 0
    assert taken == written[0]  # every entry handed out once, none lost
