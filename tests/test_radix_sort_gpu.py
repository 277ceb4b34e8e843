"""The radix sort of (key, int32 value) pairs against torch's stable sort, on a GPU: sizes around a tile and
the empty and one-pair cases, every pass count, keys all equal and Zipf-skewed (long runs within a tile and
across tiles), int64 keys past 32 bits, and the embedding backward's row keys."""

from __future__ import annotations

import pytest
import torch

from pipeline.kernels.radix_sort import _ITEMS, THREADS, sort_pairs

pytestmark = pytest.mark.gpu


def _reference(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ordered, order = torch.sort(keys, stable=True)
    return ordered, values[order]


def _check(keys: torch.Tensor, values: torch.Tensor, key_bits: int) -> None:
    before = keys.clone(), values.clone()
    got_keys, got_values = sort_pairs(keys, values, key_bits)
    want_keys, want_values = _reference(keys, values)
    assert torch.equal(got_keys, want_keys)
    assert torch.equal(got_values, want_values)  # equal keys keep their values' order: the sort is stable
    assert torch.equal(keys, before[0]) and torch.equal(values, before[1])  # the inputs are left as they were


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("extra", [-1, 0, 1])
@pytest.mark.parametrize("tiles", [0, 1, 3])
def test_sizes_around_a_tile(dtype, tiles, extra):
    n = max(tiles * THREADS * _ITEMS[dtype] + extra, 0)
    g = torch.Generator(device="cuda").manual_seed(n)
    keys = torch.randint(0, 2**20, (n,), generator=g, device="cuda", dtype=dtype)
    _check(keys, torch.arange(n, dtype=torch.int32, device="cuda"), 20)


@pytest.mark.parametrize("key_bits", [1, 5, 9, 10, 18, 19, 27, 31])
def test_every_pass_count(key_bits):
    g = torch.Generator(device="cuda").manual_seed(key_bits)
    keys = torch.randint(0, 2**key_bits, (100_003,), generator=g, device="cuda", dtype=torch.int32)
    values = torch.randint(-2**31, 2**31 - 1, (100_003,), generator=g, device="cuda", dtype=torch.int32)
    _check(keys, values, key_bits)


def test_int64_keys_past_32_bits():
    g = torch.Generator(device="cuda").manual_seed(1)
    keys = torch.randint(0, 2**40, (50_000,), generator=g, device="cuda", dtype=torch.int64)
    keys[::7] = 2**39 + 5  # equal keys across the high digits
    _check(keys, torch.arange(50_000, dtype=torch.int32, device="cuda"), 40)


def test_equal_and_skewed_keys():
    n = 300_000
    _check(torch.full((n,), 12345, dtype=torch.int32, device="cuda"),
           torch.arange(n, dtype=torch.int32, device="cuda"), 27)
    g = torch.Generator(device="cuda").manual_seed(2)
    ranks = torch.rand(n, generator=g, device="cuda").pow(-2).clamp(max=2**24).to(torch.int32) - 1
    assert torch.bincount(ranks).max() > n // 10  # hot keys: long runs inside tiles and across them
    _check(ranks, torch.arange(n, dtype=torch.int32, device="cuda"), 24)


def test_the_backwards_row_keys_are_grouped_as_torch_groups_them():
    from pipeline.kernels.embedding import TablePacking, launcher
    from pipeline.modules.configs import TableConfig

    tables = [TableConfig(f"t{i}", rows, 16, [f"t{i}"]) for i, rows in enumerate([7, 300_000, 5_000_000])]
    packing = TablePacking.build(tables)
    slots = launcher.SlotArrays.from_packing(packing, "cuda")
    batch, g = 4096, torch.Generator(device="cuda").manual_seed(3)
    lengths = torch.randint(0, 30, (3 * batch,), generator=g, device="cuda")
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    rows = torch.tensor([7, 300_000, 5_000_000], device="cuda").repeat_interleave(batch).repeat_interleave(lengths)
    indices = (torch.rand(int(offsets[-1]), generator=g, device="cuda") ** 3 * rows).long()
    keys, bags = launcher.row_keys(slots, indices, offsets, batch)
    want_keys, want_bags = _reference(keys, bags)
    got_keys, got_bags = launcher.sort_by_row(slots, indices, offsets, batch)
    assert torch.equal(got_keys, want_keys) and torch.equal(got_bags, want_bags)
