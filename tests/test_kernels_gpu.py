"""The CUDA embedding kernels against the plain-torch reference backend, on a GPU.

Every case runs the same batch through two collections with identical weights, one per backend, and
compares the pooled output, then the weights and optimizer state after the fused backward updates.
Shapes cover a zero batch, empty bags, duplicate ids within and across bags, a shared table, dims
that are not a multiple of 4 (1, 7, 12, 130), rows wider than one warp pass (300), tables from 3 to
300k rows, and fp32 / fp16 / bf16 weights. The update's checks run with every candidate update
kernel (``launcher.UPDATE_KERNELS``), and so do those of Zipf-hot rows with tens of thousands of ids.
"""

from __future__ import annotations

import pytest
import torch

from pipeline.kernels.embedding import launcher
from pipeline.modules.collection import EmbeddingCollection
from pipeline.modules.configs import EmbeddingOptimizerConfig, TableConfig
from pipeline.sparse import KeyedJaggedTensor
from tests.test_kernels_ops import train_steps

pytestmark = pytest.mark.gpu


@pytest.fixture(params=list(launcher.UPDATE_KERNELS))
def update_kernel(request, monkeypatch):
    """Each candidate update kernel in turn, as the one every fused update of the test runs."""
    monkeypatch.setattr(launcher, "UPDATE_KERNEL", request.param)
    return request.param

DTYPES = ["fp32", "fp16", "bf16"]
OPTIMIZERS = ["sgd", "adagrad", "adam"]

# name -> (tables as (rows, dim, features, pooling), features, batch, max bag length, id range cap)
CASES = {
    "one_hot": ([(1000, 16, ["a"], "sum"), (3, 8, ["b"], "sum"), (300_000, 128, ["c"], "sum")], ["a", "b", "c"], 257, 1, None),
    "multi_hot_odd_dims": ([(37, 12, ["a"], "sum"), (5000, 7, ["b"], "mean"), (100, 64, ["c"], "sum"),
                            (20, 130, ["d"], "mean"), (9, 1, ["e"], "sum")], ["a", "b", "c", "d", "e"], 64, 9, None),
    "shared_and_hot_rows": ([(50, 32, ["a", "c"], "mean"), (4000, 300, ["b"], "sum")], ["a", "b", "c"], 128, 20, 6),
    # over 65536 bags: the forward pools 8 consecutive bags per thread group
    "large_batch": ([(100_000, 32, ["a"], "sum"), (50, 7, ["b"], "mean"), (1000, 64, ["c"], "sum")], ["a", "b", "c"],
                    30_000, 3, None),
    # over a thousand ids on each of a few rows: their runs cross many update segments (summed apart, then
    # together); more would only test fp32 summation order against the reference's
    "tiny_tables_hot_rows": ([(3, 128, ["a"], "sum"), (7, 300, ["b"], "mean"), (20_000, 64, ["c"], "sum")],
                             ["a", "b", "c"], 4_000, 2, None),
    "zero_batch": ([(10, 16, ["a"], "sum"), (10, 8, ["b"], "sum")], ["a", "b"], 0, 3, None),
    "all_empty": ([(10, 16, ["a"], "sum"), (10, 8, ["b"], "mean")], ["a", "b"], 16, 0, None),
}


def _tables(spec):
    return [TableConfig(f"t{i}", rows, dim, feats, pooling) for i, (rows, dim, feats, pooling) in enumerate(spec)]


def _batch(tables, features, batch, max_len, cap, seed):
    """A KJT with lengths 0..max_len (one-hot when max_len == 1) and ids below ``cap`` (forces duplicates)."""
    g = torch.Generator().manual_seed(seed)
    rows_of = {f: t.rows for t in tables for f in t.features}
    lengths, values = [], []
    for f in features:
        if max_len == 1:
            n = torch.ones(batch, dtype=torch.int64)
        else:
            n = torch.randint(0, max_len + 1, (batch,), generator=g)
        high = rows_of[f] if cap is None else min(cap, rows_of[f])
        lengths.append(n)
        values.append(torch.randint(0, high, (int(n.sum()),), generator=g))
    return KeyedJaggedTensor(features, torch.cat(values), torch.cat(lengths))


def _pair(case, dtype, optimizer, seed=0):
    spec, features, batch, max_len, cap = CASES[case]
    tables = _tables(spec)
    opt = EmbeddingOptimizerConfig(optimizer, lr=0.05, weight_decay=0.01 if optimizer != "sgd" else 0.0)
    made = []
    for backend in ("torch", "cuda"):
        emb = EmbeddingCollection(tables, features, opt, weights_dtype=dtype, backend=backend,
                                  generator=torch.Generator().manual_seed(seed)).cuda()
        made.append(emb)
    assert made[1].backend.name == "cuda"
    return made, tables, features, batch, max_len, cap


def _tolerance(dtype, optimizer):
    # Rows are compared after each step, starting from equal weights. fp32: a hot row sums hundreds
    # of gradients in another order than the reference (absolute error ~1e-6 on updates of ~1).
    # 16-bit: the fp32 results round to the storage type, so they may land one ulp apart. Adam
    # divides by the gradient's magnitude, so a row gradient that nearly cancels carries only a few
    # digits into a step of up to lr: allow 2e-3 * lr absolute.
    rtol = {"fp32": 1e-5, "fp16": 2.0**-10 * 1.01, "bf16": 2.0**-7 * 1.01}[dtype]
    atol = 1e-4 if optimizer == "adam" else 1e-5
    return dict(rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_forward_matches_reference(case, dtype):
    (ref, cuda), tables, features, batch, max_len, cap = _pair(case, dtype, "sgd")
    kjt = _batch(tables, features, batch, max_len, cap, seed=1).to("cuda")
    with torch.no_grad():
        expected = ref(kjt)
        out = cuda(kjt)
    assert out.dtype == torch.float32 and out.shape == (batch, ref.output_dim)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_forward_writes_every_column():
    (_ref, cuda), tables, features, batch, max_len, cap = _pair("multi_hot_odd_dims", "fp32", "sgd")
    kjt = _batch(tables, features, batch, max_len, cap, seed=2).to("cuda")
    indices, offsets, b = cuda.slot_bags(kjt)
    out = cuda.backend.forward(cuda.weights, cuda.packing, indices, offsets, b)
    assert torch.isfinite(out).all()
    empty = (offsets[1:] == offsets[:-1]).view(-1, b)
    for s in range(cuda.packing.num_slots):
        cols = out[:, cuda.packing.output_offsets[s] : cuda.packing.output_offsets[s + 1]]
        assert (cols[empty[s]] == 0).all()
        assert (cols[~empty[s]].abs().sum(1) > 0).all()


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_backward_update_matches_reference(case, dtype, optimizer, update_kernel):
    (ref, cuda), tables, features, batch, max_len, cap = _pair(case, dtype, optimizer)
    before = cuda.weights.clone()
    for step in range(3):
        kjt = _batch(tables, features, batch, max_len, cap, seed=10 + step).to("cuda")
        grad = torch.randn(batch, ref.output_dim, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        for emb in (ref, cuda):
            emb.train()
            emb(kjt).backward(grad)
        torch.testing.assert_close(cuda.weights.float(), ref.weights.float(), **_tolerance(dtype, optimizer))
        for name, state in ref.optimizer_state().items():
            # state sums squared gradients: near-cancelling sums again carry few digits
            torch.testing.assert_close(cuda.optimizer_state()[name], state, rtol=1e-4, atol=1e-5)
        if batch and max_len:
            assert not torch.equal(cuda.weights, before), "the update changed nothing"
        cuda.weights.copy_(ref.weights)
        for name, state in ref.optimizer_state().items():
            cuda.optimizer_state()[name].copy_(state)
        before = cuda.weights.clone()


_OUT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.mark.parametrize("out", list(_OUT_DTYPES))
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("case", ["one_hot", "multi_hot_odd_dims", "shared_and_hot_rows", "large_batch", "all_empty"])
def test_the_training_lookup_under_autocast_rounds_its_fp32_sums_once(case, dtype, out):
    (ref, cuda), tables, features, batch, max_len, cap = _pair(case, dtype, "sgd")
    kjt = _batch(tables, features, batch, max_len, cap, seed=3).to("cuda")
    with torch.no_grad():
        expected = ref(kjt).to(_OUT_DTYPES[out])
    cuda.train()
    with torch.autocast("cuda", dtype=_OUT_DTYPES[out]):
        pooled = cuda(kjt)
    assert pooled.dtype == _OUT_DTYPES[out] and pooled.shape == expected.shape
    # the same fp32 sums as the reference's up to their order, rounded once: at most one unit in the last place
    ulp = {"bf16": 2.0**-7, "fp16": 2.0**-10}[out]
    torch.testing.assert_close(pooled.float(), expected.float(), rtol=ulp, atol=1e-6)


@pytest.mark.parametrize("column", [8, 3])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["multi_hot_odd_dims", "shared_and_hot_rows"])
def test_the_update_reads_a_bf16_gradient_slice_in_place_as_its_fp32_copy(case, dtype, optimizer, column,
                                                                          update_kernel):
    """A bf16 gradient given as columns ``column ..`` of a wider tensor (as the dense part's backward leaves the
    pooled rows' gradient): read where it lies, it updates the rows exactly as its values copied to contiguous
    fp32 do (every bf16 is an fp32, summed in the same order). Column 3 leaves the rows off the vector boundary."""
    (_ref, cuda), tables, features, batch, max_len, cap = _pair(case, dtype, optimizer)
    kjt = _batch(tables, features, batch, max_len, cap, seed=4).to("cuda")
    indices, offsets, b = cuda.slot_bags(kjt)
    slots = launcher.SlotArrays.from_packing(cuda.storage_packing, "cuda")
    g = torch.Generator("cuda").manual_seed(5)
    width = column + cuda.output_dim
    wide = torch.randn(b, width + 8 + -width % 8, device="cuda", generator=g).to(torch.bfloat16)
    sliced = wide[:, column : column + cuda.output_dim]
    assert sliced.data_ptr() == wide.data_ptr() + 2 * column and not sliced.is_contiguous()
    results = []
    for grad in (sliced.float().contiguous(), sliced):
        weights = cuda.weights.clone()
        state = {name: t.clone() for name, t in cuda.optimizer_state().items()}
        launcher.backward_update(weights, state, slots, indices, offsets, b, grad, optimizer, 0.05, 1)
        results.append((weights, state))
    (w32, s32), (w16, s16) = results
    assert torch.equal(w16, w32)
    for name in s32:
        assert torch.equal(s16[name], s32[name]), name
    assert not torch.equal(w16, cuda.weights), "the update changed nothing"


def test_update_rejects_rows_wider_than_supported():
    from pipeline.kernels.embedding.launcher import MAX_UPDATE_DIM

    emb = EmbeddingCollection([TableConfig("t", 10, MAX_UPDATE_DIM + 8, ["a"])], ["a"], backend="cuda").cuda()
    kjt = KeyedJaggedTensor.from_lists(["a"], [[[1], [2]]]).to("cuda")
    emb.train()
    out = emb(kjt)
    with pytest.raises(ValueError, match=f"dim <= {MAX_UPDATE_DIM}, got dim {MAX_UPDATE_DIM + 8}"):
        out.sum().backward()


def test_stochastic_rounding_is_unbiased_where_nearest_stalls(update_kernel):
    from pipeline.kernels.embedding import CudaBackend

    rows, dim = 4096, 64
    emb = EmbeddingCollection([TableConfig("t", rows, dim, ["a"])], ["a"], EmbeddingOptimizerConfig("sgd", lr=1e-3),
                              weights_dtype="bf16", backend="cuda").cuda()
    emb.weights.fill_(1.0)
    ids = torch.arange(rows, device="cuda")
    kjt = KeyedJaggedTensor(["a"], ids, torch.ones(rows, dtype=torch.int64, device="cuda"))
    grad = torch.ones(rows, dim, device="cuda")
    nearest = emb.weights.clone()
    emb.backend.backward_update(nearest, {}, emb.packing, ids, kjt.offsets(), rows, grad, emb.optimizer, 1e-3, 1)
    assert torch.equal(nearest, emb.weights)  # 1 - 1e-3 rounds back to 1 in bf16 (half an ulp is 2e-3)

    backend = CudaBackend(stochastic_rounding=True, seed=7)
    w = emb.weights.clone()
    backend.backward_update(w, {}, emb.packing, ids, kjt.offsets(), rows, grad, emb.optimizer, 1e-3, 1)
    below = 1.0 - 2.0**-8
    values = w.float()
    assert bool(((values == 1.0) | (values == below)).all())
    exact, n = 1.0 - 1e-3, values.numel()
    p = 1e-3 / 2.0**-8
    sigma = (p * (1 - p) / n) ** 0.5 * 2.0**-8
    assert abs(values.mean().item() - exact) < 5 * sigma


def test_master_weights_keep_fp32_updates(update_kernel):
    spec, features, batch, max_len, cap = CASES["multi_hot_odd_dims"]
    tables = _tables(spec)
    opt = EmbeddingOptimizerConfig("adagrad", lr=0.05)
    ref = EmbeddingCollection(tables, features, opt, weights_dtype="fp32", backend="torch",
                              generator=torch.Generator().manual_seed(0)).cuda()
    half = EmbeddingCollection(tables, features, opt, weights_dtype="fp16", backend="cuda",
                               generator=torch.Generator().manual_seed(0)).cuda()
    master = ref.weights.clone()
    half.weights.copy_(master.half())
    ref.weights.copy_(master.half().float())
    master.copy_(ref.weights)
    kjt = _batch(tables, features, batch, max_len, cap, seed=3).to("cuda")
    grad = torch.randn(batch, ref.output_dim, device="cuda")
    ref.train()
    ref(kjt).backward(grad)
    indices, offsets, b = half.slot_bags(kjt)
    state = dict(half.optimizer_state(), master_weights=master)
    half.backend.backward_update(half.weights, state, half.packing, indices, offsets, b, grad, opt, opt.lr, 1)
    torch.testing.assert_close(master, ref.weights, rtol=1e-5, atol=1e-6)
    assert torch.equal(half.weights, master.half())


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_zipf_hot_rows_with_tens_of_thousands_of_ids_match_reference(dtype, optimizer, update_kernel):
    """Zipf-skewed ids put tens of thousands of occurrences of a batch on its hottest rows, so their runs
    cross hundreds of update segments, summed apart and then together. Weights, gradients and the
    learning rate are multiples of powers of two small enough that every sum and SGD step is exact in
    fp32, in any order: SGD must give the reference's bits, the others its values to the usual
    tolerance; and the same update twice gives the same bits (no atomics, a fixed order). Rows of at
    most 128 columns, so the kernels that halve a row's lanes halve them here."""
    import numpy as np

    from pipeline.bench.train import draw_ids

    # bags of 8 ids: a mean-pooled bag's gradient is scaled by 1/8, exactly
    tables = [TableConfig("hot", 1000, 128, ["a"]), TableConfig("mean", 20_000, 64, ["b"], pooling="mean"),
              TableConfig("narrow", 50, 12, ["c"])]
    features, batch, hot = ["a", "b", "c"], 16_384, 8
    opt = EmbeddingOptimizerConfig(optimizer, lr=2.0**-4)
    ref, cuda = (EmbeddingCollection(tables, features, opt, weights_dtype=dtype, backend=backend).cuda()
                 for backend in ("torch", "cuda"))
    rng = np.random.default_rng(5)
    ids = np.concatenate([draw_ids("zipf", t.rows, (batch * hot, 1), 1.1, rng)[:, 0] for t in tables])
    hottest = [np.bincount(ids[t * batch * hot : (t + 1) * batch * hot]).max() for t in range(len(tables))]
    assert min(hottest) >= 10_000 and max(hottest) >= 20_000
    lengths = torch.full((len(features) * batch,), hot, dtype=torch.int64)
    kjt = KeyedJaggedTensor(features, torch.from_numpy(ids), lengths).to("cuda")
    g = torch.Generator("cuda").manual_seed(1)
    grad = torch.randint(-4, 5, (batch, ref.output_dim), device="cuda", generator=g).float() / 8
    start = (torch.randint(-64, 65, ref.weights.shape, device="cuda", generator=g).float() / 128).to(ref.weights.dtype)
    indices, offsets, b = cuda.slot_bags(kjt)
    results = []
    for emb in (ref, cuda, cuda):
        emb.weights.copy_(start)
        for state in emb.optimizer_state().values():
            state.zero_()
        emb.backend.backward_update(emb.weights, emb.optimizer_state(), emb.packing, indices, offsets, b, grad, opt,
                                    opt.lr, 1)
        results.append((emb.weights.clone(), {k: v.clone() for k, v in emb.optimizer_state().items()}))
    (ref_w, ref_state), (w, state), (again_w, again_state) = results
    assert torch.equal(again_w, w) and all(torch.equal(again_state[k], v) for k, v in state.items())
    assert not torch.equal(w, start)
    if optimizer == "sgd":
        assert torch.equal(w, ref_w)
    else:
        torch.testing.assert_close(w.float(), ref_w.float(), **_tolerance(dtype, optimizer))
        for name, value in ref_state.items():
            torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_singles_apart_sums_in_the_capped_loops_order(optimizer, monkeypatch):
    """The default update kernel (rows of one occurrence apart) gives the same bits as the capped per-segment loop
    it was split from, on gradients whose sums round: both add a segment's rows two at a time in position order.
    Zipf ids, bags of 1 to 12, so segments of every length."""
    import numpy as np

    from pipeline.bench.train import draw_ids

    tables = [TableConfig("hot", 5000, 128, ["a"]), TableConfig("mean", 20_000, 64, ["b"], pooling="mean"),
              TableConfig("narrow", 300, 12, ["c"])]
    features, batch = ["a", "b", "c"], 4096
    opt = EmbeddingOptimizerConfig(optimizer, lr=0.05)
    emb = EmbeddingCollection(tables, features, opt, backend="cuda").cuda()
    rng = np.random.default_rng(11)
    lengths = torch.from_numpy(rng.integers(1, 13, len(features) * batch))
    per_feature = lengths.view(len(features), batch).sum(1).tolist()
    ids = np.concatenate([draw_ids("zipf", t.rows, (n, 1), 1.1, rng)[:, 0] for t, n in zip(tables, per_feature)])
    kjt = KeyedJaggedTensor(features, torch.from_numpy(ids), lengths).to("cuda")
    g = torch.Generator("cuda").manual_seed(3)
    grad = torch.randn(batch, emb.output_dim, device="cuda", generator=g)
    start = torch.randn(emb.weights.shape, device="cuda", generator=g) * 0.1
    indices, offsets, b = emb.slot_bags(kjt)
    results = []
    for kernel in ("singles_apart", "segments_looped_capped"):
        monkeypatch.setattr(launcher, "UPDATE_KERNEL", kernel)
        emb.weights.copy_(start)
        for state in emb.optimizer_state().values():
            state.fill_(0.01)
        emb.backend.backward_update(emb.weights, emb.optimizer_state(), emb.packing, indices, offsets, b, grad, opt,
                                    opt.lr, 1)
        results.append((emb.weights.clone(), {k: v.clone() for k, v in emb.optimizer_state().items()}))
    (w, state), (capped_w, capped_state) = results
    assert not torch.equal(w, start)
    assert torch.equal(w, capped_w)
    assert all(torch.equal(state[k], capped_state[k]) for k in state)


def test_dlrm_follows_the_reference_loss_curve():
    from pipeline.modules.models import DLRM, ModelSizes

    steps, batch, features = 300, 256, [f"C{i}" for i in range(6)]
    tables = [TableConfig(f"t_{f}", rows, 16, [f]) for f, rows in zip(features, [50, 1000, 7, 20000, 300, 5])]
    sizes = ModelSizes(embedding_dim=16, bottom_mlp=[32, 16], top_mlp=[64, 32, 1])
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randint(0, t.rows, (steps * batch,), generator=g) for t in tables], 1)
    dense = torch.randn(steps * batch, 4, generator=g)
    planted = 2.0 * ((ids % 3 == 0).float().sum(1) - 2.0) + 2.0 * dense[:, 0]
    labels = (torch.rand(steps * batch, generator=g) < torch.sigmoid(planted)).float()

    curves = {}
    for backend in ("torch", "cuda"):
        emb = EmbeddingCollection(tables, features, EmbeddingOptimizerConfig("adagrad", lr=0.05), backend=backend,
                                  generator=torch.Generator().manual_seed(1))
        torch.manual_seed(2)
        model = DLRM(emb, 4, sizes).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(steps):
            sl = slice(step * batch, (step + 1) * batch)
            kjt = KeyedJaggedTensor.from_dense(features, ids[sl]).to("cuda")
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense[sl].cuda(), kjt), labels[sl].cuda())
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        curves[backend] = torch.tensor(losses)
    ref, cuda = curves["torch"], curves["cuda"]
    assert ref[-50:].mean() < ref[:50].mean() - 0.05  # the model learns the planted signal
    torch.testing.assert_close(cuda[:20], ref[:20], rtol=1e-4, atol=1e-4)
    assert (cuda - ref).abs().max() < 0.02


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_compiled_model_with_the_cuda_backend_trains_like_eager(optimizer):
    """A DLRM on the ``cuda`` backend under ``torch.compile`` (inductor, whole graph): the forward op and the
    fused backward update run as custom ops inside the compiled graphs, step after step, lr changing."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # true fp32 matmuls in both runs
    try:
        _compare_compiled_with_eager(optimizer)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _compare_compiled_with_eager(optimizer: str) -> None:
    import copy

    from pipeline.modules.models import DLRM, ModelSizes

    features = [f"C{i}" for i in range(4)]
    tables = [TableConfig(f"t_{f}", rows, 16, [f]) for f, rows in zip(features, [50, 7, 3000, 5])]
    emb = EmbeddingCollection(tables, features, EmbeddingOptimizerConfig(optimizer, lr=0.05), backend="cuda",
                              generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)
    eager = DLRM(emb, 3, ModelSizes(embedding_dim=16, bottom_mlp=[32, 16], top_mlp=[32, 1])).cuda()
    compiled = copy.deepcopy(eager)
    assert compiled.embedding.backend.name == "cuda"
    g = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(5):
        ids = torch.stack([torch.randint(0, t.rows, (64,), generator=g) for t in tables], 1)
        kjt = KeyedJaggedTensor.from_dense(features, ids).to("cuda")
        labels = (torch.rand(64, generator=g) < 0.5).float()
        batches.append((torch.randn(64, 3, generator=g).cuda(), kjt, labels.cuda()))
    lrs = [0.05, 0.04, 0.03, 0.02, 0.01]
    torch._dynamo.reset()
    expected = train_steps(eager, eager, batches, lrs)
    got = train_steps(compiled, torch.compile(compiled, fullgraph=True), batches, lrs)
    # Inductor fuses and reorders the dense part's fp32 arithmetic (the embedding kernels are the same
    # launches), so results agree to fp32 rounding accumulated over a few steps, not bit for bit.
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(compiled.embedding.weights, eager.embedding.weights, rtol=1e-4, atol=1e-5)
    for name, state in eager.embedding.optimizer_state().items():
        torch.testing.assert_close(compiled.embedding.optimizer_state()[name], state, rtol=1e-4, atol=1e-5)
    assert int(compiled.embedding.step) == int(eager.embedding.step) == len(batches)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_of_the_cuda_ops(dtype):
    from pipeline.kernels.embedding import TablePacking

    tables = [TableConfig("a", 10, 8, ["a"]), TableConfig("b", 7, 4, ["b", "c"], pooling="mean")]
    packing = TablePacking.build(tables)
    g = torch.Generator().manual_seed(0)
    batch = 3
    lengths = torch.randint(0, 4, (packing.num_slots * batch,), generator=g)
    ids = torch.randint(0, 7, (int(lengths.sum()),), generator=g).cuda()
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).cuda()
    weights = torch.randn(packing.total_elements, generator=g).to(dtype).cuda()
    torch.library.opcheck(torch.ops.pipeline.embedding_forward, (weights, ids, offsets, batch, *packing.op_args()))
    grad = torch.randn(batch, packing.total_dim, generator=g).cuda()
    m1 = torch.zeros(packing.total_elements, device="cuda")
    m2 = torch.zeros(packing.total_elements, device="cuda")
    hyper = torch.tensor([0.1, 1.0], dtype=torch.float64)  # lr and step, read on the host
    torch.library.opcheck(torch.ops.pipeline.embedding_update, (weights, m1, m2, None, ids, offsets, batch, grad,
                                                                *packing.op_args(), "adam", hyper, 1e-8, 0.9, 0.999,
                                                                0.0, False, 0))


@pytest.mark.parametrize("rows_per_warp", [1, 2, 4, 8])
def test_the_row_traffic_kernel_writes_back_exactly_the_rows_it_is_given(rows_per_warp):
    """``rows_read_write`` (bench embedding's rate of the update's bytes) reads each given row and its gradient
    row and writes the row back with the lowest bit of each word changed by the lowest bit of the gradient word beside
    it: the given rows change so (so the gradient row was read), no other byte does, and a second call restores them."""
    g = torch.Generator(device="cuda").manual_seed(rows_per_warp)
    for dim, dtype in ((128, torch.float32), (64, torch.float32), (256, torch.bfloat16)):
        table = torch.randn(1000, dim, device="cuda", generator=g).to(dtype)
        grad = torch.randn(300, 4 * dim, device="cuda", generator=g)  # 4 slots' columns, fp32
        rows = torch.randperm(1000, device="cuda", generator=g)[:37].sort().values
        bags = torch.randint(0, 300, (37,), device="cuda", generator=g)
        es = table.element_size()
        row_vec = rows * (dim * es // 16)
        grad_vec = (bags * 4 * dim + 2 * dim) // 4  # slot 2's columns of each bag's gradient row
        before = table.clone()
        launcher.rows_read_write(table.view(-1), grad, row_vec, grad_vec, dim * es // 16, dim // 4, rows_per_warp)
        words, words_before = table.view(torch.int32), before.view(torch.int32)
        touched = torch.zeros(1000, dtype=torch.bool, device="cuda")
        touched[rows] = True
        row_words = dim * es // 4
        grad_words = grad.view(torch.int32).view(300, 4, dim)[bags, 2, :row_words]  # beside each row's words
        assert torch.equal(words[rows], words_before[rows] ^ (grad_words & 1))
        assert (grad_words & 1).any()  # some words did change
        assert torch.equal(words[~touched], words_before[~touched])
        launcher.rows_read_write(table.view(-1), grad, row_vec, grad_vec, dim * es // 16, dim // 4, rows_per_warp)
        assert torch.equal(table.view(torch.int32), words_before)
