"""The workers a run evaluates on, and what the driver knows of each: the generation its
copy of the state was at when it last answered, and its address from the id its results
carry.

With ``workers=k`` the run keeps to k chosen workers, the same ones while they live (their
copies stay in step); otherwise every worker of the cluster may take members.
"""

from __future__ import annotations

from distributed import Client

from dasktrain._cluster import worker_info
from dasktrain.evolve.errors import EvolutionError
from dasktrain.evolve.wire import worker_id

__all__ = ["MAX_LAG", "WorkerPool", "lost_contact"]

#: Generations of ranks a record carries at most; a worker further behind gets a snapshot.
MAX_LAG = 8


def lost_contact(exc: BaseException) -> EvolutionError:
    """The error of a call to the cluster that failed: its scheduler is gone."""
    return EvolutionError(f"lost contact with the Dask cluster: its scheduler is gone or "
                          f"unreachable ({type(exc).__name__}: {exc})")


class WorkerPool:
    """The workers of ``client``'s cluster a run may use (at most ``workers``; None: all).

    ``timeout`` bounds the wait for a worker when the cluster has none.
    """

    def __init__(self, client: Client, workers: int | None, timeout: float) -> None:
        self.client = client
        self.workers = workers
        self.timeout = timeout
        self.known: dict[str, int] = {}
        """The generation each worker's copy was at when it last answered."""
        self.chosen: list[str] = []
        """With ``workers=k``: the k workers tasks are restricted to."""
        self._addresses: dict[int, str] = {}

    def live(self) -> list[str]:
        """The cluster's workers now (waiting up to ``timeout`` for one if there is none)."""
        try:
            live = sorted(worker_info(self.client))
            if not live:
                self.client.wait_for_workers(1, timeout=self.timeout)
                live = sorted(worker_info(self.client))
        except TimeoutError:
            raise EvolutionError(f"the cluster has had no worker for {self.timeout:.0f} s"
                                 ) from None
        except Exception as exc:
            raise lost_contact(exc) from exc
        self._addresses.update((worker_id(address), address) for address in live)
        return live

    def choose(self, live: list[str]) -> list[str]:
        """The workers tasks may go to now: the chosen ones that live, topped up from
        ``live`` (with ``workers=k``), else every live worker."""
        if self.workers is None:
            return live
        kept = [w for w in self.chosen if w in live]
        kept += [w for w in live if w not in kept][: self.workers - len(kept)]
        self.chosen = kept
        return kept

    def restriction(self) -> dict[str, list[str]]:
        """``client.submit`` keywords that keep a task to the chosen workers (strictly:
        with ``allow_other_workers``, Dask's work stealing would move tasks to the others
        as soon as they idle)."""
        return {} if self.workers is None else {"workers": list(self.chosen)}

    def all_chosen_gone(self, live: list[str]) -> bool:
        return self.workers is not None and not set(self.chosen) & set(live)

    def forget_gone(self, live: list[str]) -> list[str]:
        """Drop the workers that left the cluster; returns them."""
        gone = [w for w in self.known if w not in live]
        for worker in gone:
            del self.known[worker]
        return gone

    def all_known(self, workers: list[str]) -> bool:
        """Whether each of ``workers`` has answered (so holds a copy the records reach)."""
        return all(w in self.known for w in workers)

    def base(self, generation: int, live: list[str]) -> int:
        """The oldest generation a worker that may take the tasks is known to hold (at
        most :data:`MAX_LAG` back)."""
        pool = set(self.chosen if self.workers is not None else live)
        held = [g for w, g in self.known.items()
                if w in pool and generation - MAX_LAG <= g <= generation]
        return min(held, default=generation)

    def address(self, worker: int) -> str | None:
        """The address of the worker whose id is ``worker`` (None if it is gone)."""
        if worker not in self._addresses:
            self.live()
        return self._addresses.get(worker)

    def name(self, worker: int) -> str:
        """The worker's address, or a name for one that is gone."""
        return self.address(worker) or f"a lost worker ({worker:016x})"
