"""One process's copy of a run: its spec, the algorithm, the state at some generation, and
a model to evaluate members in.

Copies are kept per process by run key (:func:`find_replica`), the two most recently used
runs at most. A copy is made from a :class:`~dasktrain.evolve.spec.Snapshot` and then kept in
step by :meth:`Replica.catch_up`, which applies the generations' update records in order;
every copy therefore holds bit-identical state (see :mod:`dasktrain.evolve.openai_es`).
"""

from __future__ import annotations

import collections
import threading
import traceback

import numpy as np
import torch
from distributed.protocol import pickle

from dasktrain.evolve.errors import FitnessFailed, InvalidFitness
from dasktrain.evolve.model import made_with_seed
from dasktrain.evolve.spec import RunSpec, Snapshot
from dasktrain.evolve.wire import Record
from dasktrain.evolve.worker.data import BatchReader
from dasktrain.evolve.worker.fitness import LossFitness
from dasktrain.trainer.flat import FlatModel

__all__ = ["Replica", "find_replica", "forget_run", "keep_replica", "replica_from"]


class Replica:
    """A copy of a run's state at :attr:`generation`, and a model to evaluate members."""

    def __init__(self, spec: RunSpec, generation: int, state: object) -> None:
        self.spec = spec
        self.algorithm = spec.make_algorithm()
        self.generation = generation
        self.state = state
        # One evaluation at a time per copy: a worker with several threads runs its tasks
        # of one run one after another (the model and the state are shared).
        self.lock = threading.Lock()
        model = made_with_seed(spec.model, spec.seed)
        model.eval()
        self.model = model
        self._flat = FlatModel(model)
        self._member = self._flat.params.numpy()  # the model's own parameters, writable
        self.reader = (BatchReader(spec.fitness.batches)
                       if isinstance(spec.fitness, LossFitness) else None)
        self._digest: tuple[int, int] | None = None
        self.checked = -1
        """The last generation whose checksum this copy reported (once per generation)."""

    @classmethod
    def from_snapshot(cls, snapshot: Snapshot) -> Replica:
        # A copy: a snapshot read from this worker's own memory is the stored object, which
        # the ES update would otherwise advance in place.
        return cls(pickle.loads(snapshot.spec), snapshot.generation, snapshot.state.copy())

    def catch_up(self, record: Record) -> None:
        """Advance to the record's generation with its ranks of generations ``base ..
        generation - 1``."""
        while self.generation < record.generation:
            ranks = record.ranks_of(self.generation, self.spec.population)
            self.state = self.algorithm.advance(self.state, self.generation, ranks)
            self.generation += 1

    def digest(self) -> int:
        """The state's checksum at the current generation (computed once per generation)."""
        if self._digest is None or self._digest[0] != self.generation:
            self._digest = (self.generation, self.algorithm.digest(self.state))
        return self._digest[1]

    def evaluate(self, start: int, stop: int) -> np.ndarray:
        """The fitness of members ``start .. stop - 1`` of the current generation
        (float64, each checked to be one finite number)."""
        spec, generation = self.spec, self.generation
        if spec.torch_threads > 0 and torch.get_num_threads() != spec.torch_threads:
            torch.set_num_threads(spec.torch_threads)
        inputs = spec.fitness.inputs(generation, spec.evaluation_seed(generation), self.reader)
        seeds = self.algorithm.seeds(generation)
        values = np.empty(stop - start, dtype=np.float64)
        with torch.no_grad():
            for index in range(start, stop):
                self.algorithm.member(self.state, generation, index, self._member, seeds)
                try:
                    values[index - start] = spec.fitness.value(self.model, inputs)
                except InvalidFitness as exc:
                    raise InvalidFitness(f"{exc.args[0]} for member {index} of generation "
                                         f"{generation}") from None
                except Exception as exc:  # the user's reward or loss (or model) raised
                    raise _failed(exc, spec.fitness.label, index, generation) from None
        return values

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()


def _failed(error: Exception, label: str, index: int, generation: int) -> FitnessFailed:
    """The error that names the member whose ``label`` (reward or loss) raised ``error``,
    carrying it and, as a note, its traceback here (which pickling would drop)."""
    failed = FitnessFailed(f"the {label} of member {index} of generation {generation} "
                           f"raised {type(error).__name__}: {error}", error)
    failed.add_note("".join(traceback.format_exception(error)).rstrip())
    return failed


_REPLICAS: collections.OrderedDict[str, Replica] = collections.OrderedDict()
_REPLICAS_LOCK = threading.Lock()
_REPLICAS_KEEP = 2


def find_replica(run_key: str, base: int, generation: int) -> Replica | None:
    """This process's copy of the run if it can reach ``generation`` from the records
    that start at ``base``."""
    with _REPLICAS_LOCK:
        replica = _REPLICAS.get(run_key)
        if replica is None or not base <= replica.generation <= generation:
            return None
        _REPLICAS.move_to_end(run_key)
        return replica


_MAKING_LOCK = threading.Lock()


def replica_from(snapshot: Snapshot, run_key: str, base: int, generation: int) -> Replica:
    """This process's copy of run ``run_key`` that can reach ``generation`` from the
    records that start at ``base``: the one kept, or a new one made from ``snapshot`` and
    kept. One thread at a time: two tasks of a worker's first generation of the run would
    otherwise each make a copy, and keeping the second would close the first in use."""
    with _MAKING_LOCK:
        replica = find_replica(run_key, base, generation)
        if replica is None:
            replica = Replica.from_snapshot(snapshot)
            keep_replica(replica)
        return replica


def keep_replica(replica: Replica) -> None:
    """Keep ``replica`` as this process's copy of its run (the least recently used run's
    copy goes beyond two)."""
    with _REPLICAS_LOCK:
        old = _REPLICAS.pop(replica.spec.run_key, None)
        _REPLICAS[replica.spec.run_key] = replica
        dropped = [old] if old is not None and old is not replica else []
        while len(_REPLICAS) > _REPLICAS_KEEP:
            dropped.append(_REPLICAS.popitem(last=False)[1])
    for gone in dropped:
        gone.close()


def forget_run(run_key: str) -> bool:
    """Drop this process's copy of a run (the driver's clean-up after a fit)."""
    with _REPLICAS_LOCK:
        replica = _REPLICAS.pop(run_key, None)
    if replica is not None:
        replica.close()
    return replica is not None
