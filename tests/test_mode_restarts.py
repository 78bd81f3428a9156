"""A trainer worker killed mid-epoch and restarted, in every update mode: the fit completes,
the History says what happened, and every batch of every epoch is applied exactly once
(nothing is dropped: the dead worker's late pushes are fenced, and gradients computed ahead
on parameters that turned out stale are computed again).

Real processes: a LocalCluster of three; the holder runs beside one trainer worker, and the
other trainer worker's process is killed (SIGKILL) mid-epoch; Dask runs its task again and
it rejoins. The third process lets the next test start while the nanny starts the killed
one again (so which rank is killed follows where the ranks were placed; the marker names
it). The model is ``Tally`` (:mod:`tests.common.counting`): one parameter per row of an
indexed dataset, counting the gradients of that row the holder applied. Rules the process
tests cannot pin down by timing are checked on a real holder, step by step.
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from distributed import Client, LocalCluster, get_worker

import dasktrain as dt
from dasktrain.trainer.holder import ParameterHolder
from tests.common.builders import claim_marker, wait_for
from tests.common.counting import Tally, register_tally
from tests.common.data import indexed_dataset
from tests.common.training import alive_workers, zeros_holder

ROWS, BATCH = 480, 8  # 60 full batches an epoch: a gradient is always BATCH samples
KILL_AFTER = 5  # the killed worker dies at its 5th batch of epoch 1 (of about 30)
F32 = np.float32
DROPPED = re.compile(r"worker \d+ dropped")

# Each mode, with options under which an update waits for the dead worker (so that the
# holder drops it, which the History records), except ``async``, where none ever waits.
MODES = {
    "sync": {},
    "average": {"average_every": 2},
    "soft": {"wait_for": 2},
    "ssp": {"staleness_bound": 2},
    "async": {},
}


# -- pieces that run on the cluster (they travel by reference) ---------------------------
def _rank_and_epoch() -> tuple[int, int] | None:
    """(worker, epoch) of the trainer task this runs in (see trainer_place), else None."""
    from dasktrain.trainer.worker.loop import trainer_place

    return trainer_place()


def killed_rank(marker: str | Path) -> int | None:
    """The rank whose process was killed, once it was."""
    path = Path(marker)
    return int(path.read_text()) if path.exists() else None


_CALLS: dict[str, int] = {}


def dying_spread(output: torch.Tensor, target: torch.Tensor, holder: str, killed: str,
                 epoch: int) -> torch.Tensor:
    """The mean output (its gradient marks the rows of the batch, see ``Tally``); the
    process of a worker not beside the holder dies (SIGKILL) at that worker's
    ``KILL_AFTER``-th batch of ``epoch``, once per test (the ``killed`` marker names it).
    The worker beside the holder starts ``epoch`` only once another has (``started``
    marker): where work is claimed on demand it could otherwise take all of it. The
    others start the epoch after it only once the killed worker's task, run again,
    computes (``back`` marker): so it surely rejoins before the fit ends."""
    del target
    task = _rank_and_epoch()
    if task is None:
        return output.mean()
    if Path(killed).exists():
        back = Path(f"{killed}-back")
        if task[0] == killed_rank(killed):
            back.touch()
        elif task[1] == epoch + 1:
            wait_for(back.exists, 60, "the killed worker's task to compute again")
        return output.mean()
    if task[1] != epoch:
        return output.mean()
    started = Path(f"{killed}-started")
    if get_worker().address == holder:
        wait_for(started.exists, 60, f"another worker to start epoch {epoch}")
        return output.mean()
    started.touch()
    key = f"{killed}:{task[0]}"
    _CALLS[key] = _CALLS.get(key, 0) + 1
    if _CALLS[key] >= KILL_AFTER and claim_marker(Path(killed), str(task[0])):
        os.kill(os.getpid(), signal.SIGKILL)
    return output.mean()


def tally_after_drop(killed: str, dropped: str | None) -> Tally:
    """``Tally``; once a worker was killed, its task run again first waits (at most 60 s)
    until the driver saw the holder drop the dead worker (``dropped`` marker), so that the
    rerun rejoins after the drop, not before the holder noticed (None: it does not wait)."""
    task = _rank_and_epoch()
    if dropped is not None and task is not None and task[0] == killed_rank(killed):
        wait_for(Path(dropped).exists, 60, "the holder to drop the killed worker")
    return Tally(ROWS)


class EpochMarks(dt.Callback):
    """In the driver: leaves the ``dropped`` marker once the History records a worker's
    drop, and notes where each epoch's updates, gradients and tallies end."""

    def __init__(self, dropped: str) -> None:
        self.dropped = Path(dropped)
        self.ends: list[tuple[int, int]] = []  # (updates, gradient entries) at epoch end
        self.tallies: list[np.ndarray] = []  # the parameters at each epoch's end

    def on_update(self, trainer: Any, records: dict[str, list]) -> None:
        if any(DROPPED.search(e) for e in trainer.history.events):
            self.dropped.touch()

    def on_epoch_end(self, trainer: Any, record: dict[str, Any]) -> None:
        history = trainer.history
        self.ends.append((len(history.loss), len(history.dropped)))
        self.tallies.append(trainer.model.w.detach().numpy().copy())


# -- fixtures ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trio():
    """Three single-threaded worker processes of its own: each test kills one of them (the
    nanny starts it again meanwhile)."""
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster, Client(cluster) as c:
        c.wait_for_workers(3, timeout=60)
        yield c


@pytest.fixture(scope="module")
def rows(trio, tmp_path_factory):
    return indexed_dataset(trio, tmp_path_factory.mktemp("restarts"), rows=ROWS,
                           chunk_rows=120)


def _holder_address(client: Client) -> str:
    """The first of the processes alive (two at least: the one an earlier test killed may
    be starting again): the ranks go to the first ones, so one runs beside the holder."""
    return alive_workers(client, 2)[0]


def _per_epoch(history: dt.History, marks: EpochMarks) -> list[dict[str, Any]]:
    """Each epoch's applied samples, gradient entries (dropped ones too) and tally."""
    out, updates, entries, tally = [], 0, 0, np.zeros(ROWS, dtype=F32)
    for (u, e), after in zip(marks.ends, marks.tallies, strict=True):
        out.append({"samples": sum(history.samples[updates:u]),
                    "dropped": sum(history.dropped[entries:e]), "entries": e - entries,
                    "contributors": sum(history.contributors[updates:u]),
                    "tally": after - tally})
        updates, entries, tally = u, e, after
    return out


# -- every mode: killed mid-epoch, restarted, nothing lost ---------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_a_worker_killed_mid_epoch_rejoins_and_every_batch_counts_once(trio, rows, tmp_path,
                                                                        mode):
    holder = _holder_address(trio)
    killed, dropped = tmp_path / "killed", tmp_path / "dropped"
    waits = mode != "async"  # in async no update waits for the dead worker: no drop
    marks = EpochMarks(str(dropped))
    # Killed in epoch 1 of 3: Dask runs the worker's task (one for the fit) again, which
    # joins wherever the holder is; it must not come back twice.
    trainer = dt.Trainer(
        functools.partial(tally_after_drop, str(killed), str(dropped) if waits else None),
        functools.partial(dying_spread, holder=holder, killed=str(killed), epoch=1),
        register_tally(), mode=mode, workers=2, batch_size=BATCH, holder_worker=holder,
        progress=False, **MODES[mode])
    try:
        history = trainer.fit(rows, epochs=3, client=trio, callbacks=[marks])
    except dt.TrainerError as error:  # what the holder saw says why
        raise AssertionError("\n".join([str(error), *(error.history.events
                                                     if error.history else [])])) from error

    victim = killed_rank(killed)
    assert victim is not None  # the process really died mid-epoch
    assert [e["epoch"] for e in history.epochs] == [0, 1, 2]
    rejoins = [e for e in history.events if f"worker {victim} rejoined" in e]
    assert len(rejoins) == 1, history.events  # one task came back, not two
    drops = [e for e in history.events if DROPPED.search(e)]
    assert drops == ([e for e in drops if f"worker {victim} dropped" in e] if waits else []), \
        history.events
    if waits:
        assert len(drops) == 1, history.events
        assert history.events.index(drops[0]) < history.events.index(rejoins[0])

    for epoch in _per_epoch(history, marks):
        if mode == "average":  # an entry is a worker's parameters after up to K batches
            assert epoch["samples"] == ROWS and not epoch["dropped"], epoch
            continue
        # Every gradient taken is one entry, applied or dropped, of one step's share (one
        # full batch, or in sync the share the balance cut, the same for the task run
        # again): they are the epoch's samples, each exactly once.
        assert epoch["entries"] * BATCH == ROWS, epoch
        assert epoch["samples"] == ROWS and not epoch["dropped"], epoch
        assert epoch["contributors"] == epoch["entries"], epoch
        # The holder stepped the tally: each row exactly once.
        np.testing.assert_array_equal(epoch["tally"], np.ones(ROWS, dtype=F32))
    # Nothing arrives late: a dead worker's pushes are fenced, its task run again joins in
    # step, and a gradient computed ahead on parameters the epoch did not begin with is
    # computed again.
    assert not [e for e in history.events if "arrived at version" in e], history.events
    assert not any(history.dropped), history.events
    assert np.isfinite(trainer.model.w.detach().numpy()).all()


# -- soft: killed while its gradient waits in the round ------------------------------------
def _holder_in_this_process() -> ParameterHolder:
    """The holder actor living in this worker process (the latest one started)."""
    holders = [a for a in get_worker().state.actors.values() if isinstance(a, ParameterHolder)]
    assert holders, "no parameter holder in this process"
    return holders[-1]


def kill_while_held(output: torch.Tensor, target: torch.Tensor, holder: str, markers: str,
                    at: int) -> torch.Tensor:
    """The mean output. The worker not beside the holder notes its process id. The one
    beside it, at its ``at``-th batch: waits until the other's gradient waits in the round
    (the holder counted one more of its gradients than of this one's: ``soft`` counts a
    gradient as it enters the round, and with S = N = 2 none is applied without this
    one's), kills the other's process, and lets its own gradient go only once the other,
    restarted, got past its first push (``rerun`` marker): until then the round can close
    only with the restarted worker's gradients."""
    del target
    task = _rank_and_epoch()
    if task is None:
        return output.mean()
    rank, folder = task[0], Path(markers)
    killed, rerun = folder / "killed", folder / "rerun"
    victim = killed_rank(killed)
    if victim is not None:
        key = str(rerun)
        if rank == victim:
            _CALLS[key] = _CALLS.get(key, 0) + 1
            if _CALLS[key] == 2:  # its first push came back
                rerun.touch()
    elif get_worker().address != holder:
        (folder / f"pid-{rank}").write_text(str(os.getpid()))
    else:
        _CALLS[markers] = _CALLS.get(markers, 0) + 1
        if _CALLS[markers] == at:
            other, own = 1 - rank, _holder_in_this_process()
            wait_for(lambda: own.clocks[other] > own.clocks[rank], 30,
                     f"worker {other}'s gradient to wait in the round")
            claim_marker(killed, str(other))
            os.kill(int((folder / f"pid-{other}").read_text()), signal.SIGKILL)
            wait_for(rerun.exists, 30, f"the restarted worker {other} to get past its first "
                     "push (it waits in a round that lost the gradient held at the kill)")
    return output.mean()


@pytest.mark.parametrize("assignment", ["static", "dynamic"])
def test_soft_applies_the_gradient_held_when_its_worker_died(trio, rows, tmp_path,
                                                              assignment):
    holder = _holder_address(trio)
    marks = EpochMarks(str(tmp_path / "dropped"))
    trainer = dt.Trainer(functools.partial(Tally, ROWS),
                         functools.partial(kill_while_held, holder=holder,
                                           markers=str(tmp_path), at=6),
                         register_tally(), mode="soft", wait_for=2, workers=2,
                         batch_size=BATCH, holder_worker=holder, assignment=assignment,
                         progress=False)
    history = trainer.fit(rows, epochs=1, client=trio, callbacks=[marks])
    victim = killed_rank(tmp_path / "killed")
    assert victim is not None and (tmp_path / "rerun").exists()
    assert any(f"worker {victim} rejoined" in e for e in history.events), history.events
    # The held gradient was applied with the restarted worker's next one, in one update.
    at, rounds = 0, []
    for n in history.gradients:
        rounds.append(history.staleness_worker[at:at + n])
        at += n
    assert [victim, victim] in rounds, rounds
    (epoch,) = _per_epoch(history, marks)
    assert not any(history.dropped)
    assert epoch["samples"] == ROWS == epoch["entries"] * BATCH, epoch
    np.testing.assert_array_equal(epoch["tally"], np.ones(ROWS, dtype=F32))


# -- the rules, step by step on a real holder (plain SGD at lr 1 from zeros: the parameters
# are minus the sum of the updates' sample-weighted means) ---------------------------------
def _push(holder: ParameterHolder, worker: int, version: int, value: float, batches: int):
    """A push of ``worker``'s current incarnation (the one its latest join made)."""
    grads = np.full(2, value, dtype=F32)
    incarnation = holder._roster.incarnation(worker)
    return asyncio.ensure_future(holder.push(worker, incarnation, version, grads, 1, 0.5,
                                             (0, batches)))


async def _until(condition) -> None:
    """Let the event loop run until ``condition()`` (a few turns: no time passes)."""
    for _ in range(100):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the holder never got there")


@pytest.mark.parametrize("how", ["restarted", "resumed"])
def test_soft_keeps_a_held_gradient_beside_its_worker_s_next_one(how):
    """Worker 1's gradient waits in a round of S = 2 when its worker restarts (or the run
    resumes from a checkpoint taken then): the worker goes on after that batch, and its
    next gradient joins the round beside the held one, not in its place."""

    async def scenario():
        config = zeros_holder(2, workers=2, mode="soft")
        config.mode_options = {"wait_for": 2}
        holder = ParameterHolder(config)
        await holder.begin_epoch(0)
        for w in range(2):
            await holder.join(w, None, holder.layout)
        held = _push(holder, 1, 0, 1.0, 1)
        await _until(lambda: holder.clocks[1] == 1)
        if how == "resumed":
            state = await holder.state_dict()
            await holder.close()
            with pytest.raises(dt.TrainerError):
                await held
            holder = ParameterHolder(config)
            await holder.load_state_dict(state)
            await holder.begin_epoch(0, fresh=False)
            await holder.join(0, None, holder.layout)
        info = await holder.join(1, None, holder.layout)
        assert info["position"] == 1  # after the held batch
        nxt = _push(holder, 1, info["version"], 10.0, 2)
        late = _push(holder, 0, 0, 100.0, 1)
        await asyncio.wait_for(nxt, 10)
        await holder.leave(1, holder._roster.incarnation(1))  # worker 0's gradient is then
        # alone in its round
        await asyncio.wait_for(late, 10)
        if how == "restarted":
            await asyncio.wait_for(held, 10)  # the old push returned with its round
        params, version = await holder.pull()
        records = (await holder.progress())["records"]
        await holder.close()
        return params, version, records

    params, version, records = asyncio.run(scenario())
    assert version == 2
    assert records["contributors"] == [2, 1]
    assert records["staleness_worker"] == [1, 1, 0]
    assert not any(records["dropped"])
    np.testing.assert_array_equal(params, np.full(2, -(5.5 + 100.0), dtype=F32))


@pytest.mark.parametrize("round_closed", [False, True])
def test_sync_restarts_at_a_push_waiting_in_the_round_which_counts_once(round_closed):
    """Worker 1 died while its gradient waited in the round: its rerun computes that batch
    again. The copy replaces the waiting one while the round is open; once the round was
    applied with the first, the copy is a repeat, ignored (neither applied nor dropped)."""

    async def scenario():
        holder = ParameterHolder(zeros_holder(2, workers=2, mode="sync"))
        await holder.begin_epoch(0)
        for w in range(2):
            await holder.join(w, None, holder.layout)
        waiting = _push(holder, 1, 0, 1.0, 1)  # in round 0, waiting for worker 0
        await _until(lambda: holder._mode.waiting_for() == {0})
        info = await holder.join(1, None, holder.layout)  # its process died; rerun
        assert (info["position"], info["version"]) == (0, 0)
        if round_closed:  # worker 0's gradient completes the round with the first copy
            await asyncio.wait_for(asyncio.gather(waiting, _push(holder, 0, 0, 100.0, 1)), 10)
        again = _push(holder, 1, 0, 10.0, 1)  # the same batch, computed again
        if not round_closed:  # the copy comes first, then worker 0's completes the round
            await asyncio.wait_for(asyncio.gather(waiting, again,
                                                  _push(holder, 0, 0, 100.0, 1)), 10)
        await asyncio.wait_for(again, 10)
        params, version = await holder.pull()
        progress = await holder.progress()
        await holder.close()
        return params, version, progress

    params, version, progress = asyncio.run(scenario())
    records = progress["records"]
    assert version == 1 and records["contributors"] == [2]
    assert not any(records["dropped"])
    repeats = [e for e in progress["events"] if "applied already" in e]
    assert len(repeats) == round_closed, progress["events"]
    mean = (1.0 if round_closed else 10.0) / 2 + 50.0
    np.testing.assert_array_equal(params, np.full(2, -mean, dtype=F32))


def test_sync_rejoins_where_the_dropped_worker_left_off():
    """The rounds went on without worker 1: it rejoins at its own next batch (not at the
    rounds' count, which would skip the batches of the rounds it missed), in step."""

    async def scenario():
        holder = ParameterHolder(zeros_holder(2, workers=2, mode="sync"))
        await holder.begin_epoch(0)
        for w in range(2):
            await holder.join(w, None, holder.layout)
        await asyncio.gather(_push(holder, 0, 0, 1.0, 1), _push(holder, 1, 0, 1.0, 1))
        alone = _push(holder, 0, 1, 1.0, 2)
        await holder.drop(1, "its Dask worker is gone")
        await asyncio.wait_for(alone, 10)
        await _push(holder, 0, 2, 1.0, 3)
        info = await holder.join(1, None, holder.layout)
        assert (info["position"], info["version"]) == (1, 3)
        await asyncio.wait_for(asyncio.gather(_push(holder, 1, 3, 1.0, 2),
                                              _push(holder, 0, 3, 1.0, 4)), 10)
        records = (await holder.progress())["records"]
        await holder.close()
        return records

    records = asyncio.run(scenario())
    assert records["contributors"] == [2, 1, 1, 2]
    assert not any(records["dropped"])


def test_ssp_lets_the_push_of_a_worker_s_earlier_task_return_when_it_rejoins():
    async def scenario():
        config = zeros_holder(2, workers=2, mode="ssp")
        config.mode_options = {"staleness_bound": 0}
        holder = ParameterHolder(config)
        await holder.begin_epoch(0)
        for w in range(2):
            await holder.join(w, None, holder.layout)
        ahead = _push(holder, 1, 0, 1.0, 1)  # one clock ahead of worker 0: it waits
        await _until(lambda: holder.clocks[1] == 1)
        assert not ahead.done()
        info = await holder.join(1, None, holder.layout)  # its process died; rerun
        await asyncio.wait_for(ahead, 10)
        await holder.close()
        return info

    assert asyncio.run(scenario())["position"] == 1
