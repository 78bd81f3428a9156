"""What a generation exchanges between the driver and the workers, byte for byte.

Three messages, each as small as it can be (``benchmarks/evolve.py`` counts them):

* **The update record** of a generation (:func:`encode_record`), sent once to every worker
  that evaluates members of it (a Dask dependency of its tasks: the cluster moves it to a
  worker once, whatever number of tasks the worker runs): the run, the generation, the
  generations whose ranks it carries (``base .. generation - 1``, usually just the last),
  the members per task, then each of those generations' ranks packed in ``ceil(log2 n)``
  bits a member (:func:`~dasktrain.evolve.shaping.encode_ranks`). A 20-byte header and 36
  bytes of ranks for a population of 48.
* **A task**: the record, the index of its members' chunk (a small integer) and, when the
  driver offers one, a snapshot of the state for a worker that has no copy.
* **A result** (:func:`encode_result`): the members' fitness as float32, the seconds the
  evaluation took (float32), the worker's 8-byte id (:func:`worker_id`, a hash of its
  address) and, in the worker's first result of each generation (or when the task asks),
  the 4-byte checksum of its copy of the state. 36 bytes for 6 members.

Records and results are ``bytes``, which Dask sends as raw frames, unpickled. A worker that
holds no copy it can bring to the generation and was offered no snapshot answers
``(MISS, address)`` instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct

import numpy as np

from dasktrain.evolve.shaping import decode_ranks, ranks_size

__all__ = ["MISS", "Record", "Result", "chunk_members", "decode_record", "decode_result",
           "encode_record", "encode_result", "worker_id"]

MISS = "miss"
"""First item of the answer of a worker that cannot evaluate without a snapshot."""

# run key (8 bytes: the run's 16 hex digits), generation, base, members per task.
_RECORD_HEADER = struct.Struct("<8sIII")
# seconds, worker id, [checksum]
_RESULT_TAIL = struct.Struct("<fQ")
_CHECKSUM = struct.Struct("<I")


@dataclasses.dataclass(frozen=True, slots=True)
class Record:
    """A generation's update record, decoded."""

    run_key: str
    generation: int
    base: int
    members_per_task: int
    ranks: bytes
    """The packed ranks of generations ``base .. generation - 1``, in order."""

    def ranks_of(self, generation: int, population: int) -> np.ndarray:
        """The ranks of ``generation`` (``base <= generation < self.generation``)."""
        size = ranks_size(population)
        offset = (generation - self.base) * size
        return decode_ranks(self.ranks[offset : offset + size], population)

    def members(self, chunk: int, population: int) -> tuple[int, int]:
        """Members ``[start, stop)`` of task ``chunk``."""
        start = chunk * self.members_per_task
        return start, min(start + self.members_per_task, population)


def encode_record(run_key: str, generation: int, base: int, members_per_task: int,
                  ranks: list[bytes]) -> bytes:
    """The record of ``generation``: ``ranks`` holds the packed ranks of generations
    ``base .. generation - 1``."""
    assert len(ranks) == generation - base, (len(ranks), generation, base)
    return _RECORD_HEADER.pack(bytes.fromhex(run_key), generation, base,
                               members_per_task) + b"".join(ranks)


def decode_record(data: bytes) -> Record:
    run, generation, base, per_task = _RECORD_HEADER.unpack_from(data)
    return Record(run.hex(), generation, base, per_task, bytes(data[_RECORD_HEADER.size :]))


def chunk_members(population: int, members_per_task: int) -> list[tuple[int, int]]:
    """Members ``[start, stop)`` of each task of a generation, by chunk index."""
    return [(s, min(s + members_per_task, population))
            for s in range(0, population, members_per_task)]


def worker_id(address: str) -> int:
    """The 8-byte id a worker's results carry: a hash of its address (the driver knows
    the addresses of the cluster's workers and hashes them too)."""
    return int.from_bytes(hashlib.blake2b(address.encode(), digest_size=8).digest(),
                          "little")


@dataclasses.dataclass(frozen=True, slots=True)
class Result:
    """A task's answer, decoded."""

    values: np.ndarray
    """The members' fitness (float32)."""
    seconds: float
    worker: int
    checksum: int | None


def encode_result(values: np.ndarray, seconds: float, worker: int, checksum: int | None
                  ) -> bytes:
    """A task's answer: ``checksum`` is the state's (a 32-bit integer), or None."""
    data = np.asarray(values, dtype="<f4").tobytes() + _RESULT_TAIL.pack(seconds, worker)
    return data if checksum is None else data + _CHECKSUM.pack(checksum)


def decode_result(data: bytes, members: int) -> Result:
    """The answer of a task of ``members`` members."""
    fitness = 4 * members
    expected = (fitness + _RESULT_TAIL.size, fitness + _RESULT_TAIL.size + _CHECKSUM.size)
    if len(data) not in expected:
        raise ValueError(f"a result of {members} members has {expected[0]} or "
                         f"{expected[1]} bytes, not {len(data)}")
    values = np.frombuffer(data, dtype="<f4", count=members).astype(np.float32)
    seconds, worker = _RESULT_TAIL.unpack_from(data, fitness)
    checksum = (_CHECKSUM.unpack_from(data, fitness + _RESULT_TAIL.size)[0]
                if len(data) == expected[1] else None)
    return Result(values, float(seconds), worker, checksum)
