"""The pipeline on a real cluster over real Zarr: order, resume, augmentation, bounds, errors."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
import time
from typing import Any

import dask
import numpy as np
import pytest
import torch
from distributed import Client, LocalCluster, get_task_stream

import dasktrain as dt
from dasktrain._cluster import worker_info
from dasktrain.pipeline import EpochPlan
from tests.common.data import indexed_dataset, slowly


@pytest.fixture(scope="module")
def indexed(client, tmp_path_factory):
    # 1,003 samples: no batch size or world size below divides it evenly.
    return indexed_dataset(client, tmp_path_factory.mktemp("indexed"), rows=1003,
                           chunk_rows=100)


def _ids(pipe: dt.Pipeline) -> list[np.ndarray]:
    return [y.numpy() for _, y in pipe]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_each_sample_exactly_once_and_global_order_fixed(client, indexed, world_size):
    common = {"batch_size": 32, "seed": 7, "block_rows": 64, "shuffle_blocks": 2,
              "client": client}
    single = _ids(dt.Pipeline(indexed, **common))
    ranks = [_ids(dt.Pipeline(indexed, rank=r, world_size=world_size, **common))
             for r in range(world_size)]
    seen = np.concatenate([b for rank in ranks for b in rank])
    assert sorted(seen.tolist()) == list(range(1003))
    interleaved = [ranks[r][k] for k in range(len(ranks[0])) for r in range(world_size)
                   if k < len(ranks[r])]
    assert len(interleaved) == len(single)
    for got, want in zip(interleaved, single, strict=True):
        np.testing.assert_array_equal(got, want)


def test_batches_match_the_stored_rows(client, indexed):
    pipe = dt.Pipeline(indexed, batch_size=50, seed=1, client=client)
    for x, y in pipe:
        assert x.dtype == torch.float32 and y.dtype == torch.int64
        np.testing.assert_array_equal(x[:, 0].numpy(), y.numpy().astype(np.float32))
        np.testing.assert_array_equal(x.numpy(), indexed.x.compute()[y.numpy()])


def test_order_does_not_depend_on_cluster_size(client, indexed):
    common = {"batch_size": 40, "seed": 3, "block_rows": 50, "shuffle_blocks": 3,
              "placement": "anywhere"}
    here = _ids(dt.Pipeline(indexed, client=client, **common))
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster, Client(cluster) as small:
        there = _ids(dt.Pipeline(indexed, client=small, **common))
    for a, b in zip(here, there, strict=True):
        np.testing.assert_array_equal(a, b)


def test_epochs_differ_and_advance(client, indexed):
    pipe = dt.Pipeline(indexed, batch_size=100, seed=0, client=client)
    first = np.concatenate(_ids(pipe))
    assert pipe.epoch == 1
    second = np.concatenate(_ids(pipe))
    assert not np.array_equal(first, second)
    pipe.set_epoch(0)
    np.testing.assert_array_equal(np.concatenate(_ids(pipe)), first)


def test_next_epoch_starts_ahead_and_is_dropped_when_another_comes(client, indexed):
    plain = dt.Pipeline(indexed, batch_size=100, seed=0, prefetch=3, client=client,
                        prefetch_next_epoch=False)
    expected = [np.concatenate(_ids(plain)) for _ in range(3)]
    assert plain.stats.blocks_in_flight == 0
    pipe = dt.Pipeline(indexed, batch_size=100, seed=0, prefetch=3, client=client)
    for epoch in range(3):
        np.testing.assert_array_equal(np.concatenate(_ids(pipe)), expected[epoch])
        assert pipe.stats.blocks_in_flight == 3  # the next epoch's first units, bounded
        # ... and brought into this process before that epoch begins.
        fetched = pipe._ahead.fetched
        assert len(fetched) == 3
        assert not concurrent.futures.wait(fetched, timeout=60).not_done
    pipe.set_epoch(0)  # not the epoch started ahead: that work is dropped
    assert pipe.stats.blocks_in_flight == 0
    np.testing.assert_array_equal(np.concatenate(_ids(pipe)), expected[0])
    batches = iter(pipe)  # interrupted: nothing is kept, the epoch resumes where it stopped
    first = next(batches)[1].numpy()
    batches.close()
    assert pipe.stats.blocks_in_flight == 0
    np.testing.assert_array_equal(np.concatenate([first, *_ids(pipe)]), expected[1])
    pipe.close()


def test_close_leaves_nothing_running_on_the_cluster(client, indexed):
    # The epoch's end submits the next epoch's first units (a head start), each a third of
    # a second of work: close() lets them finish before it releases them, so a cluster
    # closed next cuts off no task and no transfer.
    pipe = dt.Pipeline(indexed, batch_size=100, seed=0, prefetch=4, client=client,
                       transform=slowly, placement="anywhere")
    assert sum(len(y) for _, y in pipe) == len(indexed)
    assert pipe.stats.blocks_in_flight > 0  # the head start
    pipe.close()
    assert pipe.stats.blocks_in_flight == 0
    assert not any(client.processing().values()), client.processing()


def test_an_epoch_started_before_it_is_read_yields_the_same_batches(client, indexed):
    """``start()`` submits the epoch's first units before the iteration (a trainer starts
    reading while it builds its model); the iteration takes them, or drops them when it
    turns out another (a re-cut, a resumed position)."""
    common = {"batch_size": 100, "seed": 3, "prefetch": 3, "client": client,
              "prefetch_next_epoch": False}
    plain = dt.Pipeline(indexed, **common)
    expected = np.concatenate(_ids(plain))
    pipe = dt.Pipeline(indexed, **common)
    pipe.start()
    assert pipe.stats.blocks_in_flight == 3  # submitted, bounded by the prefetch
    assert not concurrent.futures.wait(pipe._ahead.fetched, timeout=60).not_done
    np.testing.assert_array_equal(np.concatenate(_ids(pipe)), expected)
    assert pipe.stats.blocks_in_flight == 0
    ranks = [dt.Pipeline(indexed, rank=r, world_size=2, **common) for r in range(2)]
    for rank in ranks:  # started for even shares, then cut (60, 140): dropped, re-read
        rank.set_epoch(1)
        rank.start()
        rank.set_shares((60, 140))
    cut = [_ids(rank) for rank in ranks]
    # Four whole steps of 200 rows cut (60, 140); the last 3 rows make a short fifth step.
    assert [len(b) for b in cut[0][:4]] == [60] * 4 and [len(b) for b in cut[1][:4]] == [140] * 4
    np.testing.assert_array_equal(np.sort(np.concatenate(cut[0] + cut[1])),
                                  np.arange(len(indexed)))
    resumed = dt.Pipeline(indexed, **common)
    resumed.start()
    state = resumed.state_dict()
    state["position"] = 4
    resumed.load_state_dict(state)  # past the start: what was read ahead goes
    assert resumed.stats.blocks_in_flight == 0
    np.testing.assert_array_equal(np.concatenate(_ids(resumed)), expected[400:])
    for p in [plain, pipe, resumed, *ranks]:
        p.close()


# The feeder of a head start, held up inside a submission until the test lets it go.
_LATE = {"gate": threading.Event(), "entered": threading.Event(), "thread": None}


class _LateFirstSubmission(EpochPlan):
    """A plan that holds up the feeder inside its first submission: the first read of
    ``num_batches`` on the feeder once the units are planned is the task's priority, read
    after the unit's prefetch was taken and before the unit is recorded anywhere."""

    def units(self, rank: int = 0, world_size: int = 1):
        units = super().units(rank, world_size)
        self.__dict__["units_planned"] = True  # frozen: set beside the cached properties
        return units

    @property
    def num_batches(self) -> int:
        if self.__dict__.get("units_planned") and not _LATE["entered"].is_set() \
                and threading.current_thread().name == "dasktrain-feeder":
            _LATE["thread"] = threading.current_thread()
            _LATE["entered"].set()
            assert _LATE["gate"].wait(60), "the test never let the feeder go on"
        return super().num_batches


class _LateHeadStart(dt.Pipeline):
    """Plans epoch 1 with :class:`_LateFirstSubmission` where its head start is made."""

    def plan(self, epoch: int | None = None) -> EpochPlan:
        plan = super().plan(epoch)
        if plan.epoch == 1 and threading.current_thread().name == "dasktrain-feeder":
            return _LateFirstSubmission(**{f.name: getattr(plan, f.name)
                                           for f in dataclasses.fields(plan)})
        return plan


@pytest.mark.slow
def test_a_late_head_start_is_released_by_its_feeder(client, indexed):
    """The epoch ends while its feeder is still inside a head-start submission: what that
    feeder submits afterwards is released, not added to a head start already given up."""
    _LATE["gate"].clear()
    _LATE["entered"].clear()
    common = {"batch_size": 100, "seed": 2, "prefetch": 2, "client": client,
              "placement": "anywhere"}
    plain = dt.Pipeline(indexed, prefetch_next_epoch=False, **common)
    expected = [np.concatenate(_ids(plain)) for _ in range(2)]
    pipe = _LateHeadStart(indexed, **common)
    try:
        np.testing.assert_array_equal(np.concatenate(_ids(pipe)), expected[0])
        assert _LATE["entered"].is_set(), "the head start never reached a submission"
        assert pipe.stats.blocks_in_flight == 0  # the consumer kept nothing of it
    finally:
        _LATE["gate"].set()
    late = _LATE["thread"]
    late.join(timeout=30)
    assert not late.is_alive()
    assert pipe.stats.blocks_in_flight == 0  # what it submitted late is released, not kept
    np.testing.assert_array_equal(np.concatenate(_ids(pipe)), expected[1])
    pipe.close()
    assert pipe.stats.blocks_in_flight == 0


def test_world_size_may_change_between_epochs(client, indexed):
    common = {"batch_size": 32, "seed": 5, "client": client}
    pipe = dt.Pipeline(indexed, **common)
    list(pipe)  # epoch 0 with one rank
    state = pipe.state_dict()
    ranks = []
    for r in range(3):
        p = dt.Pipeline(indexed, rank=r, world_size=3, **common)
        p.load_state_dict(state)  # at an epoch boundary: re-sharded, allowed
        assert p.epoch == 1
        ranks.append(np.concatenate(_ids(p)))
    assert sorted(np.concatenate(ranks).tolist()) == list(range(1003))


def _resumed_after(dataset, options: dict, stop_after: int) -> tuple[dt.Pipeline, dict]:
    """A fresh pipeline resumed from the state of another stopped after ``stop_after``
    batches, and that state."""
    pipe = dt.Pipeline(dataset, **options)
    it = iter(pipe)
    for _ in range(stop_after):
        next(it)
    state = pipe.state_dict()
    it.close()
    resumed = dt.Pipeline(dataset, **options)
    resumed.load_state_dict(state)
    return resumed, state


@pytest.mark.parametrize("stop_after", [1, 7, 15])
def test_resume_mid_epoch_yields_the_same_batches(client, indexed, stop_after):
    common = {"batch_size": 24, "seed": 11, "block_rows": 64, "shuffle_blocks": 2,
              "client": client, "rank": 1, "world_size": 2}
    uninterrupted = _ids(dt.Pipeline(indexed, **common))
    resumed, state = _resumed_after(indexed, common, stop_after)
    rest = _ids(resumed)
    assert len(rest) == len(uninterrupted) - stop_after
    for a, b in zip(rest, uninterrupted[stop_after:], strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="seed"):
        dt.Pipeline(indexed, **{**common, "seed": 12}).load_state_dict(state)
    with pytest.raises(ValueError, match="world_size"):
        dt.Pipeline(indexed, **{**common, "world_size": 3}).load_state_dict(state)


def _noise(arrays, rng):
    arrays["x"] = arrays["x"] + rng.standard_normal(arrays["x"].shape).astype(np.float32)
    return arrays


def test_augmentation_is_deterministic(client, indexed):
    def run(epoch: int) -> dict[int, np.ndarray]:
        pipe = dt.Pipeline(indexed, batch_size=64, seed=2, transform=_noise, client=client)
        pipe.set_epoch(epoch)
        return {int(i): row for x, y in pipe for i, row in zip(y, x.numpy(), strict=True)}

    a, b, c = run(0), run(0), run(1)
    raw = indexed.x.compute()
    assert all(np.array_equal(a[i], b[i]) for i in a)  # same (seed, epoch): same noise
    assert not all(np.allclose(a[i], c[i]) for i in a)  # another epoch: other noise
    assert not all(np.allclose(a[i], raw[i]) for i in a)


def test_prefetch_bounds_blocks_and_cluster_memory(client, tmp_path):
    """A dataset of 120 windows; the pipeline's data in cluster memory stays a few windows."""
    ds = indexed_dataset(client, tmp_path, rows=60_000, width=16, chunk_rows=500)
    prefetch, block_rows = 3, 500
    window_bytes = block_rows * (16 * 4 + 8)
    pipe = dt.Pipeline(ds, batch_size=250, seed=0, prefetch=prefetch, block_rows=block_rows,
                       client=client, placement="anywhere")

    def pipeline_bytes(dask_scheduler) -> int:
        return sum(ts.nbytes for key, ts in dask_scheduler.tasks.items()
                   if "dasktrain-" in str(key) and ts.state == "memory")

    peak = 0
    for i, _ in enumerate(pipe):
        if i % 5 == 0:
            peak = max(peak, client.run_on_scheduler(pipeline_bytes))
    # The bound is rows, prefetch windows' worth: the epoch's first two windows are half a
    # window each (its first batch, the rest of its first piece), so one more unit fits then
    assert pipe.stats.max_blocks_in_flight == prefetch + 1
    assert pipe.stats.batches == 240
    total = ds.x.nbytes + ds.y.nbytes
    # Each in-flight unit holds a window and its batches (2x), plus the window being read.
    assert 0 < peak <= 2 * (prefetch + 1) * window_bytes < total / 10


@pytest.mark.parametrize("placement", ["anywhere", "consumer"])
def test_one_window_of_prefetch_goes_on_unit_after_unit(client, indexed, placement):
    # A used-up unit's prefetch is handed back once the next batch is in hand, unless
    # nothing is queued yet: with room for one window, that next unit needs it first.
    pipe = dt.Pipeline(indexed, batch_size=50, seed=3, block_rows=100, prefetch=1,
                       transform=_noise, client=client, placement=placement, timeout=30)
    ids = np.concatenate(_ids(pipe))
    assert sorted(ids.tolist()) == list(range(1003))
    assert pipe.stats.blocks_done == len(pipe.plan(0).units()) > 10
    assert pipe.stats.max_blocks_in_flight <= 2  # a window's rows: two units at the start


def test_stats_are_reported(client, indexed):
    pipe = dt.Pipeline(indexed, batch_size=100, client=client)
    list(pipe)
    summary = pipe.stats.summary()
    assert summary["batches"] == 11 and summary["samples"] == 1003
    assert summary["bytes_received"] == 1003 * (3 * 4 + 8)
    assert 0 <= summary["stall"] <= 1 and summary["samples_per_s"] > 0
    assert len(pipe.stats.wait_per_batch) == 11


def test_dict_batches(client, indexed):
    batch = next(iter(dt.Pipeline(indexed, batch_size=10, as_dict=True, client=client)))
    assert set(batch) == {"x", "y"} and batch["x"].shape == (10, 3)


def _explode(arrays, rng):
    if arrays["y"].min() <= 500 < arrays["y"].max() + 1:
        raise ZeroDivisionError("bad sample 500")
    return arrays


def test_transform_error_names_block_and_epoch(client, indexed):
    pipe = dt.Pipeline(indexed, batch_size=10, transform=_explode, client=client,
                       shuffle=False)
    with pytest.raises(dt.PipelineError, match=r"transform failed on block 5 \(rows 500:600\) "
                                               r"of epoch 0: ZeroDivisionError") as info:
        list(pipe)
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def _drop_rows(arrays, rng):
    return {k: v[1:] for k, v in arrays.items()}


def test_transform_that_drops_rows_is_refused(client, indexed):
    with pytest.raises(dt.PipelineError, match="changed the number of samples"):
        list(dt.Pipeline(indexed, batch_size=10, transform=_drop_rows, client=client))


def test_corrupt_chunk_names_array_and_chunk(client, tmp_path):
    ds = indexed_dataset(client, tmp_path, rows=1000, chunk_rows=100)
    chunk = tmp_path / "indexed.zarr" / "x" / "c" / "4" / "0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    with pytest.raises(dt.PipelineError, match=r"cannot read array 'x' chunk 4 \(rows 400:500\)"):
        list(dt.Pipeline(ds, batch_size=100, shuffle=False, client=client))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"batch_size": 2000}, "larger than the 1003 samples"),
    ({"batch_size": 0}, "batch_size must be a positive integer"),
    ({"batch_size": 8, "seed": -1}, "seed must be a non-negative integer"),
    ({"batch_size": 8, "seed": 1.5}, "seed must be a non-negative integer"),
    ({"batch_size": 8, "rank": 2, "world_size": 2}, "rank must lie in"),
    ({"batch_size": 8, "prefetch": 0}, "prefetch must be None or >= 1"),
    ({"batch_size": 8, "placement": "moon"}, "placement must be one of"),
])
def test_bad_settings_are_refused_up_front(indexed, kwargs, message):
    with pytest.raises(ValueError, match=message):
        dt.Pipeline(indexed, **kwargs)


def test_splits_are_separate(client, tmp_path):
    ds = indexed_dataset(client, tmp_path, rows=500, split="train=0.8,val=0.2")
    train = np.concatenate(_ids(dt.Pipeline(ds.split("train"), batch_size=64, client=client)))
    val = np.concatenate(_ids(dt.Pipeline(ds.split("val"), batch_size=64, client=client)))
    assert len(train) == 400 and len(val) == 100
    assert not set(train) & set(val)


def _slow(arrays, rng):
    import time

    time.sleep(2)
    return arrays


def test_no_data_in_time_fails_with_a_clear_error(client, indexed):
    pipe = dt.Pipeline(indexed, batch_size=10, transform=_slow, timeout=0.3, prefetch=1,
                       client=client)
    with pytest.raises(dt.PipelineError, match=r"no data for block\(s\) .* of epoch 0 after"):
        next(iter(pipe))


@pytest.mark.slow
def test_killed_worker_during_an_epoch_completes(tmp_path):
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster, Client(cluster) as own:
        ds = indexed_dataset(own, tmp_path, rows=20_000, chunk_rows=500)
        pipe = dt.Pipeline(ds, batch_size=100, block_rows=500, seed=4, client=own, prefetch=4,
                           placement="anywhere")
        ids = []
        for i, (_, y) in enumerate(pipe):
            ids.append(y.numpy())
            if i == 20:  # kill a worker while blocks are in flight on it
                import os
                import signal

                victim = next(iter(worker_info(own)))
                pid = own.run(os.getpid, workers=[victim])[victim]
                os.kill(pid, signal.SIGKILL)
        seen = np.concatenate(ids)
        assert sorted(seen.tolist()) == list(range(20_000))
        fresh = np.concatenate(_ids(dt.Pipeline(ds, batch_size=100, block_rows=500, seed=4,
                                                client=own)))
        np.testing.assert_array_equal(seen, fresh)


def _consume_on_worker(path: str, placement: str) -> tuple[str, list[int]]:
    from distributed import get_worker, secede

    secede()  # a long-running consumer gives its thread slot back, as trainer workers do
    pipe = dt.Pipeline(path, batch_size=100, seed=9, placement=placement)
    ids = [int(i) for _, y in pipe for i in y]
    return get_worker().address, ids


def test_local_placement_runs_blocks_on_the_consumers_worker(client, indexed):
    from distributed import get_task_stream

    with get_task_stream(client) as stream:
        address, ids = client.submit(_consume_on_worker, indexed.url, "local",
                                     pure=False).result(timeout=120)
    assert sorted(ids) == list(range(1003))
    ran = {rec["worker"] for rec in stream.data if "-window-" in str(rec["key"])}
    assert ran == {address}
    expected = [int(i) for _, y in dt.Pipeline(indexed, batch_size=100, seed=9, client=client)
                for i in y]
    assert ids == expected


def test_local_placement_outside_a_worker_is_refused(client, indexed):
    with pytest.raises(dt.PipelineError, match="placement='local' needs"):
        next(iter(dt.Pipeline(indexed, batch_size=10, placement="local", client=client)))


class _CountedTransform:
    """Appends a line to ``log`` each time a process unpickles it."""

    def __init__(self, log: str) -> None:
        self.log = log

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()}\n")

    def __call__(self, arrays: dict, rng: np.random.Generator) -> dict:
        return arrays


def test_transform_is_unpickled_once_per_worker_and_epoch(client, indexed, tmp_path):
    log = tmp_path / "unpickled"
    pipe = dt.Pipeline(indexed, batch_size=50, transform=_CountedTransform(str(log)),
                       client=client, prefetch=3, prefetch_next_epoch=False)
    workers = {str(pid) for pid in client.run(os.getpid).values()}
    for epoch in range(2):
        assert sum(len(y) for _, y in pipe) == len(indexed)  # 11 block tasks per epoch
        on_workers = [pid for pid in log.read_text().split() if pid in workers]
        assert 1 <= len(on_workers) <= len(workers) * (epoch + 1)


def _busy(arrays, rng):
    """A few milliseconds of CPU per block: long enough for blocks to queue."""
    m = rng.standard_normal((64, 64))
    for _ in range(200):
        m = np.tanh(m @ m)
    return arrays


def test_blocks_run_in_the_order_they_are_consumed(indexed):
    """Units submitted in one burst share a scheduler generation; without an explicit
    priority the cluster would run them in any order and the first batch would wait.

    Checked per worker on the tasks that read (a whole unit, or a window shared by units);
    the small tasks that only cut a shared window into batches start when their windows
    are read. Without worker restrictions the scheduler would queue some of a burst and send
    others ahead (see ``dasktrain.pipeline.submit.placement_kwargs``), and this failed most
    runs. On a cluster of its own without work stealing: stealing may move a later block to
    an idle worker ahead of that worker's earlier ones (the consumer only gains from that),
    which a busy machine made this check see once."""
    with dask.config.set({"distributed.scheduler.work-stealing": False}), \
            LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                         dashboard_address=None) as cluster, Client(cluster) as client, \
            get_task_stream(client) as stream:
        pipe = dt.Pipeline(indexed, batch_size=100, transform=_busy, prefetch=11,
                           prefetch_next_epoch=False, client=client)
        assert sum(len(y) for _, y in pipe) == len(indexed)
    tasks = [(t["key"], t["worker"],
              next(s["start"] for s in t["startstops"] if s["action"] == "compute"))
             for t in stream.data if t["key"].startswith("dasktrain-")]
    assert sum("-window-" not in k for k, _, _ in tasks) == 11
    shared = {int(k.rsplit("-", 1)[1]) for k, _, _ in tasks if "-window-" in k}
    started: dict[str, list[tuple[float, int]]] = {}
    for key, worker, start in tasks:
        window = int(key.rsplit("-", 1)[1])
        if "-window-" in key or window not in shared:
            started.setdefault(worker, []).append((start, window))
    for runs in started.values():
        windows = [w for _, w in sorted(runs)]
        assert windows == sorted(windows)


@pytest.fixture(scope="module")
def wide(client, tmp_path_factory):
    # Chunks of 1,000 rows: several 256-row pieces per block, so each epoch ramps up.
    return indexed_dataset(client, tmp_path_factory.mktemp("wide"), rows=3001,
                           chunk_rows=1000)


def _xy(pipe: dt.Pipeline) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(x.numpy(), y.numpy()) for x, y in pipe]


def _assert_same(got: list, want: list) -> None:
    assert len(got) == len(want)
    for (x1, y1), (x2, y2) in zip(got, want, strict=True):
        np.testing.assert_array_equal(y1, y2)
        np.testing.assert_array_equal(x1, x2)


def test_values_do_not_depend_on_how_work_is_cut_or_where_it_runs(client, wide):
    common = {"batch_size": 64, "seed": 6, "transform": _noise, "client": client}
    pipe = dt.Pipeline(wide, **common)
    sizes = [s.stop - s.start for s in pipe.plan().window_spans]
    # One batch first (the epoch's first piece), then the rest of that piece, then two
    # pieces, cut at the block's end
    assert sizes[:4] == [64, 192, 512, 232]
    base = _xy(pipe)
    assert sorted(np.concatenate([y for _, y in base]).tolist()) == list(range(3001))
    for other in ({"task_rows": 256}, {"task_rows": 5000}, {"placement": "consumer"}):
        _assert_same(_xy(dt.Pipeline(wide, **common, **other)), base)


@pytest.mark.parametrize("stop_after", [1, 3, 6])
def test_resume_mid_ramp_yields_the_same_batches(client, wide, stop_after):
    common = {"batch_size": 64, "seed": 6, "transform": _noise, "client": client, "rank": 1,
              "world_size": 2}
    uninterrupted = _xy(dt.Pipeline(wide, **common))
    resumed, _ = _resumed_after(wide, common, stop_after)
    _assert_same(_xy(resumed), uninterrupted[stop_after:])


def test_without_a_transform_blocks_are_read_in_the_consumer(client, indexed):
    with get_task_stream(client) as stream:
        pipe = dt.Pipeline(indexed, batch_size=100, seed=2, client=client,
                           prefetch_next_epoch=False)
        mine = _ids(pipe)
    assert pipe.placement == "consumer"
    # This pipeline's tasks, by their key (an earlier test's may still be finishing).
    assert not [t for t in stream.data
                if str(t["key"]).startswith(f"dasktrain-batches-{pipe._token}")]
    there = _ids(dt.Pipeline(indexed, batch_size=100, seed=2, client=client,
                             placement="anywhere"))
    for a, b in zip(mine, there, strict=True):
        np.testing.assert_array_equal(a, b)


def _epoch_of_its_own(client, indexed, **plan: Any) -> tuple[EpochPlan, Any, str]:
    """A consumer-read pipeline's epoch-0 plan (with ``plan``'s fields changed) and a
    context for it under a token of this test's own (this process may have read the
    pipeline's groups in other tests)."""
    from dasktrain.pipeline.tasks import EpochContext

    pipe = dt.Pipeline(indexed, batch_size=100, seed=2, client=client)
    assert pipe.placement == "consumer"
    plan = dataclasses.replace(pipe.plan(0), **plan)
    token = f"own-{os.getpid()}-{time.monotonic_ns()}"
    return plan, EpochContext.here(f"{token}-0", pipe._ref, plan, None), token


def _window_read(plan: EpochPlan, read: concurrent.futures.Future, window: int = 0) -> None:
    """``read`` (of ``window``) ends within 30 s with the window's rows."""
    span = plan.window_spans[window]
    assert len(read.result(timeout=30)["x"]) == span.stop - span.start


def test_a_read_ahead_refused_by_a_closed_pipeline_holds_up_no_other(client, indexed):
    """Two replicas of a trainer in one process read the same data (a task run again
    beside another): their pipelines share the reads of each group. One closes while its
    feeder asks for a group to be read ahead; that read will never run, so the group must
    not stay claimed: the other pipeline's windows of it read it themselves at once (they
    would wait out a read's bound, minutes)."""
    from dasktrain.pipeline.submit import LocalReaders
    from dasktrain.pipeline.tasks import load_window

    plan, context, _ = _epoch_of_its_own(client, indexed)
    closed = LocalReaders()
    closed.shutdown(wait=True)
    group = plan.window_spans[0].group
    with pytest.raises(RuntimeError, match="shutdown"):
        closed.read_ahead(context, group)
    pool = concurrent.futures.ThreadPoolExecutor(1)  # the other pipeline's read thread
    try:
        _window_read(plan, pool.submit(load_window, context, 0))
    finally:
        pool.shutdown(wait=False)


def test_a_group_read_ahead_for_a_closed_pipeline_wakes_the_windows_waiting_for_it(
        client, indexed):
    """Two replicas in one process read the same data. One's read ahead of a group is under
    way, and a window of the other waits for it, when the first pipeline closes (it forgets
    which groups it read). The other pipeline's read ahead then finds the read under way
    and claims nothing: a second claim would take the first one's place, and the window
    waiting for the first would not be woken when it ends (it would wait out the read's
    bound, minutes)."""
    from dasktrain.pipeline.tasks import claim_read, forget_groups, load_window, read_ahead

    plan, context, token = _epoch_of_its_own(client, indexed)
    group = plan.window_spans[0].group
    first = claim_read(context, group)  # the first replica's read ahead, under way
    assert first is not None
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        waiting = pool.submit(load_window, context, 0)  # the other replica's window
        forget_groups(token)  # the first replica's pipeline closes
        assert claim_read(context, group) is None  # the read is under way: no second claim
        read_ahead(context, group, first)
        _window_read(plan, waiting)
    finally:
        pool.shutdown(wait=False)


def test_windows_waiting_for_a_read_that_hangs_go_on_with_one_that_takes_it_over(
        client, indexed, monkeypatch):
    """A group's read ahead hangs (its claim is never let go here). The windows of the
    group waiting for it wait out the bound once: the first to do so reads the group in
    its place and lets the hung read's waiters go, so they wait for that read instead of
    each waiting out the bound in turn."""
    from dasktrain.pipeline import tasks

    monkeypatch.setattr(tasks, "_READ_WAIT", 1.0)
    # Groups of 4 blocks cut into windows: each window keeps its group for the others.
    plan, context, _ = _epoch_of_its_own(client, indexed, shuffle_blocks=4, task_rows=100)
    group = plan.window_spans[0].group
    windows = [w for w, span in enumerate(plan.window_spans) if span.group == group]
    assert len(windows) >= 2, plan.window_spans
    hung = tasks.claim_read(context, group)
    assert hung is not None
    pool = concurrent.futures.ThreadPoolExecutor(len(windows))
    try:
        reads = [pool.submit(tasks.load_window, context, w) for w in windows]
        for w, read in zip(windows, reads, strict=True):
            _window_read(plan, read, w)
        assert hung.is_set()  # whoever waited for the hung read was let go
        assert tasks.claim_read(context, group) is None  # nothing left claimed twice
    finally:
        tasks.drop_claim(context, group, hung)
        pool.shutdown(wait=False)
