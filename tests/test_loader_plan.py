"""The shard plan from row counts alone: equal shards, padding that wraps, windows and batch bounds, orders."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.loader.plan import (
    RowGroup,
    Segment,
    _hash32,
    group_order,
    plan_shard,
    window_order,
    window_segments,
    windows,
)


def groups(*rows: int) -> list[RowGroup]:
    return [RowGroup(file=0, index=i, first_row=sum(rows[:i]), rows=n) for i, n in enumerate(rows)]


def positions(segments: list[Segment]) -> list[int]:
    return [s.group.first_row + r for s in segments for r in range(s.start, s.stop)]


def test_fewer_rows_than_ranks_pads_every_short_rank():
    shards = [plan_shard(groups(2), rank, 5, batch_size=4, drop_last=False) for rank in range(5)]
    assert [positions(s.segments) for s in shards] == [[0], [1], [0], [1], [0]]
    assert [s.padding for s in shards] == [0, 0, 1, 1, 1]
    assert all(s.batches == 1 and s.rows == 1 for s in shards)


@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_shards_cover_the_rows_in_order(world):
    g = groups(5, 0, 17, 9)
    shards = [plan_shard(g, r, world, batch_size=4, drop_last=False) for r in range(world)]
    real = [p for s in shards for p in positions(s.segments)[: s.rows - s.padding]]
    assert real == list(range(31))
    assert len({s.batches for s in shards}) == 1


def test_windows_cut_batches_and_skip_to_a_batch():
    shard = plan_shard(groups(10, 10, 10), 0, 1, batch_size=4, drop_last=False)
    assert shard.batches == 8
    all_windows = windows(shard, window_rows=12, batch_size=4)
    assert [(w.start, w.stop) for w in all_windows] == [(0, 12), (12, 24), (24, 30)]
    assert all_windows[-1].batch_bounds == ((0, 4), (4, 6))
    later = windows(shard, window_rows=12, batch_size=4, start_batch=4)
    assert later[0].index == 1 and later[0].first_batch == 4 and later[0].batch_bounds == ((4, 8), (8, 12))
    assert positions(window_segments(shard, 12, 30)) == list(range(12, 30))
    assert positions(window_segments(shard, 5, 12)) == list(range(5, 12))
    assert [(s.group.index, s.start, s.stop) for s in window_segments(shard, 5, 12)] == [(0, 5, 10), (1, 0, 2)]
    with pytest.raises(ValueError, match="multiple of batch_size"):
        windows(shard, window_rows=10, batch_size=4)


def test_orders_are_seeded_and_padding_stays_last():
    g = groups(*([3] * 20))
    assert group_order(g, True, 0, 1) == group_order(g, True, 0, 1) != group_order(g, True, 0, 2)
    assert group_order(g, False, 0, 1) == g
    perm = window_order(10, 8, True, 0, 0, 0, 0)
    assert sorted(perm[:8]) == list(range(8)) and list(perm[8:]) == [8, 9]
    assert window_order(10, 10, False, 0, 0, 0, 0) is None


def test_window_order_is_a_seeded_permutation_that_moves_rows_far():
    rows = 100_000
    perm = window_order(rows, rows, True, 3, 1, 0, 2)
    assert perm.dtype == np.int64 and np.array_equal(np.sort(perm), np.arange(rows))
    assert np.array_equal(perm, window_order(rows, rows, True, 3, 1, 0, 2))
    others = [window_order(rows, rows, True, *key) for key in [(4, 1, 0, 2), (3, 2, 0, 2), (3, 1, 1, 2), (3, 1, 0, 3)]]
    assert all(np.mean(perm == other) < 0.001 for other in others), "each of seed, epoch, rank, window counts"
    assert np.mean(np.abs(np.diff(perm))) > rows / 4, "neighbours end up far apart"
    assert abs(np.corrcoef(np.arange(rows), perm)[0, 1]) < 0.02


def lowbias32(v: int) -> int:
    """The reference, in Python's unbounded integers."""
    v ^= v >> 16
    v = v * 0x7FEB352D % 2**32
    v ^= v >> 15
    v = v * 0x846CA68B % 2**32
    return v ^ (v >> 16)


def test_the_position_hash_is_lowbias32_in_numpy_and_torch_and_a_bijection():
    x = np.concatenate([np.arange(1 << 16), [2**31 - 1, 2**32 - 1, 123_456_789, 0xDEADBEEF]]).astype(np.int64)
    expected = np.array([lowbias32(v) for v in x.tolist()])
    assert np.array_equal(_hash32(x), expected)
    assert np.array_equal(_hash32(torch.from_numpy(x)).numpy(), expected)
    assert len(np.unique(expected)) == len(x)


@pytest.mark.gpu
def test_window_order_on_a_gpu_equals_the_host_order():
    for rows, real in [(1 << 20, 1 << 20), (1000, 997)]:
        host = window_order(rows, real, True, 5, 2, 1, 7)
        device = window_order(rows, real, True, 5, 2, 1, 7, device="cuda")
        assert device.is_cuda and np.array_equal(device.cpu().numpy(), host)
