"""The ``pipeline::`` embedding custom ops on CPU: ``opcheck`` of their registrations (schema, fake
implementation, autograd), and a model that ``torch.compile`` traces whole, training like eager."""

from __future__ import annotations

import copy

import pytest
import torch

from pipeline.kernels.embedding import TablePacking, ops
from pipeline.modules.collection import EmbeddingCollection
from pipeline.modules.configs import EmbeddingOptimizerConfig, TableConfig
from pipeline.modules.models import DLRM, ModelSizes
from pipeline.sparse import KeyedJaggedTensor

TABLES = [TableConfig("a", 10, 4, ["C1"]), TableConfig("b", 7, 2, ["C2", "C3"], pooling="mean"),
          TableConfig("c", 5, 4, ["C3"])]


def _bags(packing: TablePacking, batch: int, gen: torch.Generator):
    """Slot-major ids and offsets: bags of 0..3 ids (empty bags and duplicates included)."""
    lengths = torch.randint(0, 4, (packing.num_slots * batch,), generator=gen)
    limit = torch.tensor(packing.rows)[torch.tensor(packing.slot_table)].repeat_interleave(batch)
    ids = torch.cat([torch.randint(0, int(r), (int(n),), generator=gen) for r, n in zip(limit, lengths)]
                    + [torch.zeros(0, dtype=torch.int64)])
    return ids, torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])


@pytest.mark.parametrize("batch", [0, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("suffix", ["", "_reference"])
def test_opcheck_forward_and_update(suffix, dtype, batch):
    gen = torch.Generator().manual_seed(0)
    packing = TablePacking.build(TABLES)
    weights = torch.randn(packing.total_elements, generator=gen).to(dtype)
    ids, offsets = _bags(packing, batch, gen)
    forward = getattr(torch.ops.pipeline, f"embedding_forward{suffix}")
    torch.library.opcheck(forward, (weights, ids, offsets, batch, *packing.op_args()))
    grad = torch.randn(batch, packing.total_dim, generator=gen)
    m1, m2 = torch.zeros(packing.total_elements), torch.zeros(packing.total_elements)
    hyper = torch.tensor([0.1, 1.0], dtype=torch.float64)
    update = getattr(torch.ops.pipeline, f"embedding_update{suffix}")
    torch.library.opcheck(update, (weights, m1, m2, None, ids, offsets, batch, grad, *packing.op_args(), "adam", hyper,
                                   1e-8, 0.9, 0.999, 0.0, False, 0))


def test_opcheck_lookup_and_its_backward():
    gen = torch.Generator().manual_seed(1)
    packing = TablePacking.build(TABLES)
    weights = torch.randn(packing.total_elements, generator=gen)
    ids, offsets = _bags(packing, 4, gen)
    trigger = torch.empty(0, requires_grad=True)
    args = (trigger, weights, torch.zeros(packing.total_rows), None, None, torch.zeros((), dtype=torch.int64),
            torch.tensor([0.1, 0.0, 0.0], dtype=torch.float64), ids, offsets, 4, *packing.op_args(), "adagrad",
            1e-8, 0.9, 0.999, 0.0, False, 0, torch.float32)
    # the backward updates the weights in place, so the gradient checks of opcheck do not apply
    torch.library.opcheck(torch.ops.pipeline.embedding_lookup_reference, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
    before = weights.clone()
    ops.embedding_lookup_reference(*args).sum().backward()
    assert not torch.equal(weights, before) and int(args[5]) == 1


def test_check_ids_op_names_the_feature_and_table():
    from pipeline.errors import BadInputError

    emb = EmbeddingCollection(TABLES, ["C1", "C2", "C3"])
    kjt = KeyedJaggedTensor.from_lists(["C1", "C2", "C3"], [[[1]], [[9]], [[1]]])
    with pytest.raises(BadInputError, match=r"feature C2: id 9 is outside table b \(expected 0 <= id < 7\)"):
        emb(kjt)


def _dlrm(backend: str) -> DLRM:
    features = [f"C{i}" for i in range(4)]
    tables = [TableConfig(f"t_{f}", rows, 8, [f]) for f, rows in zip(features, [50, 7, 300, 5])]
    emb = EmbeddingCollection(tables, features, EmbeddingOptimizerConfig("adam", lr=0.05), backend=backend,
                              generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)
    return DLRM(emb, 3, ModelSizes(embedding_dim=8, bottom_mlp=[16, 8], top_mlp=[16, 1]))


def _batches(model: DLRM, steps: int, batch: int, device: str):
    g = torch.Generator().manual_seed(3)
    features = model.embedding.feature_names
    out = []
    for _ in range(steps):
        ids = torch.stack([torch.randint(0, t.rows, (batch,), generator=g) for t in model.embedding.tables], 1)
        dense = torch.randn(batch, 3, generator=g)
        labels = (torch.rand(batch, generator=g) < 0.5).float()
        out.append((dense.to(device), KeyedJaggedTensor.from_dense(features, ids).to(device), labels.to(device)))
    return out


def train_steps(model, step_fn, batches, lrs):
    """Losses of one optimizer step per batch (dense SGD, the embedding's fused optimizer at ``lrs[i]``)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for (dense, kjt, labels), lr in zip(batches, lrs):
        model.embedding.set_lr(lr)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(step_fn(dense, kjt), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def test_compiled_model_trains_like_eager_on_cpu():
    eager = _dlrm("auto")
    compiled = copy.deepcopy(eager)
    batches = _batches(eager, steps=4, batch=16, device="cpu")
    lrs = [0.05, 0.04, 0.03, 0.02]  # a changing lr must reach the update without a recompile
    torch._dynamo.reset()
    step = torch.compile(compiled, backend="aot_eager", fullgraph=True)
    expected = train_steps(eager, eager, batches, lrs)
    with torch._dynamo.config.patch(error_on_recompile=True):  # one graph serves every step and lr
        got = train_steps(compiled, step, batches, lrs)
    # aot_eager runs the same eager kernels in the same order: equal to float rounding
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(compiled.embedding.weights, eager.embedding.weights, rtol=1e-6, atol=1e-6)
    for name, state in eager.embedding.optimizer_state().items():
        torch.testing.assert_close(compiled.embedding.optimizer_state()[name], state, rtol=1e-6, atol=1e-6)
    assert int(compiled.embedding.step) == int(eager.embedding.step) == 4
