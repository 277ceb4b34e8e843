"""assemble_columns: the same values and gradients as index_select, without a scatter backward."""

import itertools
import random

import pytest
import torch

from pipeline.modules.columns import ColumnRun, assemble_columns, merge_runs


def random_runs(widths, rng):
    """Disjoint runs over random blocks, in random output order, leaving some columns out."""
    runs = []
    for k, width in enumerate(widths):
        cuts = sorted(rng.sample(range(width + 1), min(width + 1, 4)))
        runs += [ColumnRun(k, lo, hi) for lo, hi in itertools.pairwise(cuts) if rng.random() < 0.8]
    rng.shuffle(runs)
    return runs


def reference(blocks, runs):
    flat = torch.cat(blocks, 1)
    starts = [0]
    for b in blocks:
        starts.append(starts[-1] + b.shape[1])
    index = torch.tensor([starts[r.block] + c for r in runs for c in range(r.lo, r.hi)], dtype=torch.int64)
    return flat.index_select(1, index)


@pytest.mark.parametrize("seed", range(5))
def test_values_and_gradients_equal_index_select(seed):
    rng = random.Random(seed)
    blocks = [torch.randn(5, rng.randint(1, 9), dtype=torch.float64, requires_grad=True) for _ in range(3)]
    runs = random_runs([b.shape[1] for b in blocks], rng)
    out, ref = assemble_columns(blocks, runs), reference(blocks, runs)
    assert torch.equal(out, ref)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, blocks, grad, allow_unused=True)
    want = torch.autograd.grad(ref, blocks, grad, allow_unused=True)
    for g, w, b in zip(got, want, blocks):
        torch.testing.assert_close(g if g is not None else torch.zeros_like(b), w, rtol=0, atol=0)
    torch.autograd.gradcheck(lambda *bs: assemble_columns(bs, runs), blocks)


def test_dtype_converts_in_the_copy_and_gradients_come_back_in_each_blocks_dtype():
    half = torch.randn(4, 6).bfloat16().requires_grad_()
    full = torch.randn(4, 3, requires_grad=True)
    runs = [ColumnRun(1, 1, 3), ColumnRun(0, 0, 6)]
    out = assemble_columns([half, full], runs, torch.float32)
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.cat([full[:, 1:3], half.float()], 1))
    (out * torch.arange(8.0)).sum().backward()
    assert half.grad.dtype == torch.bfloat16 and full.grad.dtype == torch.float32
    assert torch.equal(half.grad.float(), torch.arange(2.0, 8.0).expand(4, 6))
    assert torch.equal(full.grad, torch.tensor([0.0, 0.0, 1.0]).expand(4, 3))


def test_lower_triangle_as_dlrm_picks_it():
    v = 6
    z = torch.randn(3, v * v)
    rows, cols = torch.tril_indices(v, v, offset=-1)
    runs = [ColumnRun(0, i * v, i * v + i) for i in range(1, v)]
    assert torch.equal(assemble_columns([z], runs), z[:, rows * v + cols])


def test_merge_runs_joins_touching_runs_of_one_block_only():
    runs = [ColumnRun(0, 0, 2), ColumnRun(0, 2, 5), ColumnRun(1, 5, 6), ColumnRun(0, 5, 7), ColumnRun(0, 7, 7)]
    assert merge_runs(runs) == [ColumnRun(0, 0, 5), ColumnRun(1, 5, 6), ColumnRun(0, 5, 7)]


def test_a_whole_block_in_order_is_returned_without_a_copy():
    block = torch.randn(4, 5)
    assert assemble_columns([block], [ColumnRun(0, 0, 5)]) is block


@pytest.mark.parametrize("device, compiler", [
    ("cpu", "aot_eager"),
    pytest.param("cuda", "aot_eager", marks=pytest.mark.gpu),
    pytest.param("cuda", "inductor", marks=pytest.mark.gpu),
])
def test_under_torch_compile_values_and_gradients_equal_eager(device, compiler):
    """The DLRM interaction's use, compiled: a picked lower triangle of a product, converted to fp32."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 5, 8, generator=g).to(device).bfloat16().requires_grad_()
    weight = torch.randn(64, 10, generator=g).to(device)
    runs = merge_runs([ColumnRun(0, i * 5, i * 5 + i) for i in range(1, 5)])

    def loss(x):
        return (assemble_columns([torch.bmm(x, x.transpose(1, 2)).flatten(1)], runs, torch.float32) * weight).sum()

    (want,) = torch.autograd.grad(loss(x), x)
    (got,) = torch.autograd.grad(torch.compile(loss, backend=compiler, fullgraph=True)(x), x)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=1e-2)  # bf16 products, summed in any order
    assert want.abs().max() > 1
