"""Gathering many futures with a progress bar, and cancelling them all on any failure."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from distributed import Client, Future, as_completed
from tqdm.auto import tqdm

__all__ = ["gather_with_progress"]


def gather_with_progress(
    client: Client, futures: Sequence[Future], desc: str, progress: bool = True
) -> list[Any]:
    """Results of ``futures`` in their order, a bar ticking as each finishes.

    The first failure (or a Ctrl-C) cancels whatever is still running, so an aborted job
    does not keep the cluster busy, then re-raises.
    """
    index = {f.key: i for i, f in enumerate(futures)}
    results: list[Any] = [None] * len(futures)
    try:
        with tqdm(total=len(futures), desc=desc, unit="chunk", disable=not progress,
                  leave=False, dynamic_ncols=True) as bar:
            for future in as_completed(futures, loop=client.loop):
                results[index[future.key]] = future.result()
                bar.update(1)
    except BaseException:
        client.cancel(list(futures))
        raise
    return results
