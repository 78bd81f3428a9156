"""Epoch plans are pure: checked exhaustively over sizes, world sizes and settings."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dasktrain.pipeline.budget import prefetch_rows
from dasktrain.pipeline.plan import EpochPlan, Window


def _rank_rows(plan: EpochPlan, rank: int, world: int) -> list[np.ndarray]:
    order = plan.sample_order()
    rows = []
    for unit in plan.units(rank, world):
        for pieces in unit.pieces:
            offsets = plan.window_offsets
            rows.append(np.concatenate([order[offsets[p.window] + p.start:
                                              offsets[p.window] + p.stop] for p in pieces]))
    return rows


SETTINGS = list(itertools.product(
    [(0, 97), (5, 1003), (100, 161)],  # uneven sizes: no range divides evenly
    [1, 7, 64],                      # block rows
    [1, 3],                          # shuffle blocks
    [10, 33],                        # batch size
    [False, True],                   # drop_last
))


@pytest.mark.parametrize(("span", "block_rows", "shuffle_blocks", "batch", "drop_last"),
                         SETTINGS)
def test_every_sample_once_and_order_independent_of_world_size(span, block_rows,
                                                               shuffle_blocks, batch, drop_last):
    start, stop = span
    plan = EpochPlan(start, stop, block_rows, batch, seed=3, epoch=2,
                     shuffle_blocks=shuffle_blocks, drop_last=drop_last)
    order = plan.sample_order()
    assert sorted(order.tolist()) == list(range(start, stop))
    expected = [order[b * batch:(b + 1) * batch] for b in range(plan.num_batches)]
    for world in (1, 2, 3):
        per_rank = [_rank_rows(plan, r, world) for r in range(world)]
        counts = [len(r) for r in per_rank]
        assert max(counts) - min(counts) <= 1  # balanced
        # Interleaving the ranks' batches (step k: rank 0, 1, ...) gives the global batches.
        interleaved = [per_rank[r][k] for k in range(max(counts)) for r in range(world)
                       if k < counts[r]]
        assert len(interleaved) == len(expected)
        for got, want in zip(interleaved, expected, strict=True):
            np.testing.assert_array_equal(got, want)
        seen = np.concatenate([b for rank in per_rank for b in rank])
        assert len(np.unique(seen)) == len(seen)
        if not drop_last:
            assert len(seen) == stop - start
        else:
            assert len(seen) == (stop - start) // batch * batch


@pytest.mark.parametrize(("span", "block_rows", "shuffle_blocks", "batch", "drop_last"),
                         SETTINGS)
def test_a_unit_is_exclusive_exactly_when_no_other_unit_needs_its_window(
        span, block_rows, shuffle_blocks, batch, drop_last):
    plan = EpochPlan(*span, block_rows, batch, seed=1, epoch=0,
                     shuffle_blocks=shuffle_blocks, drop_last=drop_last)
    for world in (1, 2, 3):
        units = [u for r in range(world) for u in plan.units(r, world)]
        for unit in units:
            others = [o for o in units if o is not unit and unit.window in o.windows]
            assert unit.exclusive == (unit.windows == (unit.window,) and not others)
    aligned = EpochPlan(0, 1000, 100, 50, seed=1, epoch=0)  # no batch crosses a window
    assert all(u.exclusive for u in aligned.units(0, 1))
    # Two ranks share every window of two batches (the epoch's first two windows are of
    # one batch each: its first piece is one batch)
    assert not any(u.exclusive for u in aligned.units(0, 2)
                   if aligned.window_spans[u.window].group > 0)


def test_order_depends_only_on_seed_and_epoch():
    a = EpochPlan(0, 5000, 100, 32, seed=1, epoch=0, shuffle_blocks=4).sample_order()
    assert np.array_equal(a, EpochPlan(0, 5000, 100, 32, seed=1, epoch=0,
                                       shuffle_blocks=4).sample_order())
    assert not np.array_equal(a, EpochPlan(0, 5000, 100, 32, seed=1, epoch=1,
                                           shuffle_blocks=4).sample_order())
    assert not np.array_equal(a, EpochPlan(0, 5000, 100, 32, seed=2, epoch=0,
                                           shuffle_blocks=4).sample_order())


def test_no_shuffle_keeps_stored_order():
    plan = EpochPlan(10, 1000, 64, 50, seed=0, epoch=3, shuffle=False, shuffle_blocks=2)
    np.testing.assert_array_equal(plan.sample_order(), np.arange(10, 1000))


def test_shuffle_mixes_within_windows_only():
    plan = EpochPlan(0, 1000, 100, 10, seed=0, epoch=0, shuffle_blocks=2)
    order = plan.sample_order()
    seen: dict[int, set] = {}
    for w, blocks in enumerate(plan.windows):
        a, b = plan.window_offsets[w], plan.window_offsets[w + 1]
        allowed = set(np.concatenate([np.arange(*plan.block_range(k)) for k in blocks]))
        assert set(order[a:b].tolist()) <= allowed
        seen.setdefault(plan.window_spans[w].group, set()).update(order[a:b].tolist())
    # The group's windows (the first group's: its first batch, then the rest) hold it all
    assert [seen[g] == set(np.concatenate([np.arange(*plan.block_range(k)) for k in blocks]))
            for g, blocks in enumerate(plan.groups)] == [True] * len(plan.groups)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"block_rows": 0}, "block_rows"), ({"batch_size": 0}, "batch_size"),
    ({"shuffle_blocks": 0}, "shuffle_blocks"), ({"seed": -1}, "non-negative"),
])
def test_plan_refuses_bad_settings(kwargs, message):
    base = {"start": 0, "stop": 100, "block_rows": 10, "batch_size": 5, "seed": 0, "epoch": 0}
    with pytest.raises(ValueError, match=message):
        EpochPlan(**{**base, **kwargs})


def test_rank_must_be_in_world():
    with pytest.raises(ValueError, match="rank 3"):
        EpochPlan(0, 100, 10, 5, seed=0, epoch=0).rank_batches(3, 3)


# Blocks of several pieces: the windows ramp up, and groups are cut into several windows.
RAMP_SETTINGS = list(itertools.product(
    [(5, 3003), (0, 4096)],
    [(1000, 1), (700, 2), (4096, 1)],  # (block rows, shuffle blocks)
    [10, 64],                          # batch size: pieces of 260 or 256 rows
    [300, 2048],                       # task rows
))


@pytest.mark.parametrize(("span", "blocks", "batch", "task_rows"), RAMP_SETTINGS)
def test_ramp_windows_cover_each_group_in_order_and_keep_every_guarantee(span, blocks, batch,
                                                                         task_rows):
    block_rows, shuffle_blocks = blocks
    common = {"seed": 4, "epoch": 1, "shuffle_blocks": shuffle_blocks}
    plan = EpochPlan(*span, block_rows, batch, task_rows=task_rows, **common)
    piece = plan.piece_rows
    assert piece % batch == 0 and piece >= 256
    spans = plan.window_spans
    # The first window is the epoch's first piece, one batch: the first batch waits for one
    # batch of transform work; the next piece is the rest of a regular one.
    assert spans[0] == Window(0, 0, batch)
    assert spans[1].start == batch and spans[1].stop in (*range(piece, 10**6, piece),
                                                        plan.group_size(0))
    assert plan.pieces_in(spans[1])[0] == (1, batch, min(piece, plan.group_size(0)))
    cap = max(1, task_rows // piece) * piece
    for g in range(len(plan.groups)):
        mine = [s for s in spans if s.group == g]
        assert mine[0].start == 0 and mine[-1].stop == plan.group_size(g)
        assert all(a.stop == b.start for a, b in itertools.pairwise(mine))
        regular = mine[2:] if g == 0 else mine
        assert all(s.start % piece == 0 and 0 < s.stop - s.start <= cap for s in regular)
    sizes = [s.stop - s.start for s in spans]
    assert sizes[:2] == sorted(sizes[:2])  # growing at first
    # Same order as without a ramp and with any task size: the cut is work, not order.
    flat = EpochPlan(*span, block_rows, batch, task_rows=10**6, ramp=False, **common)
    assert len(flat.window_spans) == len(flat.groups)
    np.testing.assert_array_equal(plan.sample_order(), flat.sample_order())
    order = plan.sample_order()
    expected = [order[b * batch:(b + 1) * batch] for b in range(plan.num_batches)]
    for world in (1, 2, 3):
        per_rank = [_rank_rows(plan, r, world) for r in range(world)]
        interleaved = [per_rank[r][k] for k in range(len(per_rank[0])) for r in range(world)
                       if k < len(per_rank[r])]
        assert len(interleaved) == len(expected)
        for got, want in zip(interleaved, expected, strict=True):
            np.testing.assert_array_equal(got, want)


def test_ramp_grows_by_doubling_to_the_task_size():
    plan = EpochPlan(0, 3 * 8192, 8192, 256, seed=0, epoch=0)  # the defaults of W1
    sizes = [s.stop - s.start for s in plan.window_spans]
    # The first group: one piece, doubling to 2,048 rows, and what is left; then 2,048s.
    assert sizes == [256, 512, 1024, 2048, 2048, 2048, 256] + [2048] * 8


def test_the_default_prefetch_keeps_two_batches_per_reader_in_flight():
    # Images: 38 rows a 4 MiB block; 14 readers for one consumer: 2 x 14 batches of 256.
    assert prefetch_rows(None, 38, readers=14, world_size=1, batch_size=256) == 7168
    # Shared by 4 ranks: ceil(14 / 4) = 4 readers each.
    assert prefetch_rows(None, 38, readers=14, world_size=4, batch_size=256) == 2048
    # Small rows (a table): four blocks already hold more than two batches per reader.
    assert prefetch_rows(None, 32768, readers=2, world_size=1, batch_size=256) == 4 * 32768
    # Given, prefetch counts groups, whatever the readers.
    assert prefetch_rows(2, 38, readers=14, world_size=1, batch_size=256) == 76
