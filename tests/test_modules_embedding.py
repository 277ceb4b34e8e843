"""EmbeddingCollection and its torch reference against slow, obvious loops and hand computations."""

import math

import pytest
import torch

from pipeline.errors import BadInputError
from pipeline.kernels.embedding import TorchBackend, reference
from pipeline.modules.backends import available_backends, register_backend, resolve_backend
from pipeline.modules.collection import EmbeddingCollection
from pipeline.modules.configs import EmbeddingOptimizerConfig, TableConfig, tables_from_schema
from pipeline.schema import Column, Schema
from pipeline.sparse import KeyedJaggedTensor

FEATURES = ["C1", "C2", "C3"]


def _mixed_tables():
    # C3 is served by two tables (a shared one of dim 2 and its own of dim 4): mixed dims, reordering.
    return [
        TableConfig("a", 10, 4, ["C1"]),
        TableConfig("b", 7, 2, ["C2", "C3"], pooling="mean"),
        TableConfig("c", 5, 4, ["C3"]),
    ]


def _random_kjt(gen, batch, rows=(10, 7, 5), max_len=3):
    bags = []
    for k in range(len(FEATURES)):
        limit = min(rows[k], 5) if k == 2 else rows[k]
        bags.append([torch.randint(0, limit, (int(torch.randint(0, max_len + 1, (1,), generator=gen)),),
                                   generator=gen).tolist() for _ in range(batch)])
    return KeyedJaggedTensor.from_lists(FEATURES, bags), bags


def _naive_forward(emb, bags):
    """Per slot, per sample: sum (or mean) of the table rows, by Python loops."""
    batch = len(bags[0])
    cols = []
    for table in emb.tables:
        w = emb.table_weight(table.name).float()
        for feature in table.features:
            per_sample = []
            for ids in bags[FEATURES.index(feature)]:
                v = torch.zeros(table.dim)
                for i in ids:
                    v = v + w[i]
                if table.pooling == "mean" and ids:
                    v = v / len(ids)
                per_sample.append(v)
            cols.append(torch.stack(per_sample) if batch else torch.zeros(0, table.dim))
    return torch.cat(cols, dim=1)


def _naive_row_grads(emb, bags, grad_out):
    """Gradient of sum(out * grad_out) for every row of every table, by loops: {table: [rows, dim]}."""
    grads = {t.name: torch.zeros(t.rows, t.dim) for t in emb.tables}
    col = 0
    for table in emb.tables:
        for feature in table.features:
            for b, ids in enumerate(bags[FEATURES.index(feature)]):
                g = grad_out[b, col : col + table.dim]
                for i in ids:
                    grads[table.name][i] += g / len(ids) if table.pooling == "mean" else g
            col += table.dim
    return grads


@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-6), ("fp16", 2e-3), ("bf16", 2e-2)])
def test_forward_matches_loops_with_empty_bags_duplicates_and_shared_tables(dtype, tol):
    gen = torch.Generator().manual_seed(0)
    emb = EmbeddingCollection(_mixed_tables(), FEATURES, weights_dtype=dtype, generator=gen)
    kjt, bags = _random_kjt(gen, batch=9)
    bags[0][0] = [3, 3, 3]  # duplicates in one bag
    bags[1][1] = []  # an empty bag
    kjt = KeyedJaggedTensor.from_lists(FEATURES, bags)
    out = emb(kjt)
    assert out.shape == (9, 4 + 2 + 2 + 4) and out.dtype == torch.float32
    torch.testing.assert_close(out, _naive_forward(emb, bags), atol=tol, rtol=tol)
    assert torch.all(out[1, 4:6] == 0)


def test_sum_and_mean_pooling_by_hand():
    emb = EmbeddingCollection([TableConfig("s", 3, 2, ["C1"]), TableConfig("m", 3, 2, ["C2"], pooling="mean")],
                              ["C1", "C2"])
    for name in ("s", "m"):
        emb.table_weight(name).copy_(torch.tensor([[1.0, 2.0], [10.0, 20.0], [100.0, 200.0]]))
    kjt = KeyedJaggedTensor.from_lists(["C1", "C2"], [[[0, 2], [1, 1]], [[0, 2], []]])
    out = emb(kjt)
    assert out.tolist() == [[101.0, 202.0, 50.5, 101.0], [20.0, 40.0, 0.0, 0.0]]


def test_zero_batch():
    emb = EmbeddingCollection(_mixed_tables(), FEATURES)
    kjt = KeyedJaggedTensor(FEATURES, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
    out = emb(kjt)
    assert out.shape == (0, 12)
    out.sum().backward()


def test_reference_forward_gradcheck():
    gen = torch.Generator().manual_seed(1)
    emb = EmbeddingCollection(_mixed_tables(), FEATURES, generator=gen)
    kjt, _ = _random_kjt(gen, batch=4)
    indices, offsets, batch = emb.slot_bags(kjt)
    weights = emb.weights.double().requires_grad_()
    fn = lambda w: reference.pooled_forward(w, emb.packing, indices, offsets, batch)
    assert torch.autograd.gradcheck(fn, (weights,), eps=1e-6, atol=1e-5)


def test_sgd_update_equals_weights_minus_lr_times_autograd_gradient():
    gen = torch.Generator().manual_seed(2)
    emb = EmbeddingCollection(_mixed_tables(), FEATURES, EmbeddingOptimizerConfig("sgd", lr=0.5), generator=gen)
    kjt, bags = _random_kjt(gen, batch=6)
    before = emb.weights.clone()
    # Oracle: autograd through the differentiable reference forward, on a copy of the weights.
    w = before.clone().requires_grad_()
    indices, offsets, batch = emb.slot_bags(kjt)
    grad_out = torch.randn(6, 12, generator=gen)
    (reference.pooled_forward(w, emb.packing, indices, offsets, batch) * grad_out).sum().backward()
    emb.set_lr(0.25)
    (emb(kjt) * grad_out).sum().backward()
    torch.testing.assert_close(emb.weights, before - 0.25 * w.grad)
    naive = _naive_row_grads(emb, bags, grad_out)
    for t in emb.tables:
        start = emb.packing.weights_offsets[emb.packing.table_names.index(t.name)]
        torch.testing.assert_close(w.grad[start : start + t.rows * t.dim].view(t.rows, t.dim), naive[t.name])
    assert int(emb.step) == 1


@pytest.mark.parametrize("tables", [
    # the features in another order than the batch's
    [TableConfig("c", 5, 4, ["C3"]), TableConfig("a", 10, 2, ["C1"]), TableConfig("b", 7, 4, ["C2"], pooling="mean")],
    # every feature in two tables, as DeepFM's deep and wide ones
    [TableConfig("a", 10, 4, ["C1"]), TableConfig("b", 7, 4, ["C2"]), TableConfig("c", 5, 4, ["C3"]),
     TableConfig("wa", 10, 1, ["C1"]), TableConfig("wb", 7, 1, ["C2"], pooling="mean"), TableConfig("wc", 5, 1, ["C3"])],
], ids=["reordered", "twice"])
def test_forward_and_update_match_loops_when_tables_reorder_or_repeat_the_features(tables):
    gen = torch.Generator().manual_seed(4)
    emb = EmbeddingCollection(tables, FEATURES, EmbeddingOptimizerConfig("sgd", lr=0.5), generator=gen)
    kjt, bags = _random_kjt(gen, batch=7)
    bags[2][3] = []  # an empty bag
    kjt = KeyedJaggedTensor.from_lists(FEATURES, bags)
    out = emb(kjt)
    torch.testing.assert_close(out, _naive_forward(emb, bags))
    before = {t.name: emb.table_weight(t.name).clone() for t in tables}
    grad_out = torch.randn(out.shape, generator=gen)
    (out * grad_out).sum().backward()
    naive = _naive_row_grads(emb, bags, grad_out)
    for t in tables:
        torch.testing.assert_close(emb.table_weight(t.name), before[t.name] - 0.5 * naive[t.name])


def test_sgd_weight_decay_and_low_precision_weights():
    emb = EmbeddingCollection([TableConfig("t", 4, 2, ["C1"])], ["C1"],
                              EmbeddingOptimizerConfig("sgd", lr=0.1, weight_decay=0.5), weights_dtype="bf16")
    emb.table_weight("t").copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0], [0.5, 0.5], [0.0, 0.0]]))
    kjt = KeyedJaggedTensor.from_lists(["C1"], [[[1, 1], [2]]])
    (emb(kjt) * torch.tensor([[1.0, 2.0], [3.0, 4.0]])).sum().backward()
    # row 1: g = 2*[1, 2] + 0.5*[3, 4]; row 2: g = [3, 4] + 0.5*[0.5, 0.5]
    expect = torch.tensor([[1.0, 2.0], [3 - 0.1 * 3.5, 4 - 0.1 * 6.0], [0.5 - 0.1 * 3.25, 0.5 - 0.1 * 4.25], [0, 0]])
    torch.testing.assert_close(emb.table_weight("t").float(), expect, atol=1e-2, rtol=1e-2)
    assert emb.weights.dtype == torch.bfloat16


def test_rowwise_adagrad_by_hand_over_two_steps():
    opt = EmbeddingOptimizerConfig("adagrad", lr=0.1, eps=1e-6)
    emb = EmbeddingCollection([TableConfig("t", 3, 2, ["C1"])], ["C1"], opt)
    w = torch.tensor([[1.0, 1.0], [2.0, -2.0], [0.0, 3.0]])
    emb.table_weight("t").copy_(w)
    m = torch.zeros(3)
    for step_bags, grad_out in [([[0], [0, 2]], [[1.0, 2.0], [3.0, 4.0]]), ([[2], []], [[-1.0, 0.5], [9.0, 9.0]])]:
        g = torch.zeros(3, 2)
        for b, ids in enumerate(step_bags):
            for i in ids:
                g[i] += torch.tensor(grad_out[b])
        for r in range(3):
            if any(r in ids for ids in step_bags):
                m[r] += (g[r] ** 2).mean()
                w[r] -= 0.1 * g[r] / (math.sqrt(m[r]) + 1e-6)
        (emb(KeyedJaggedTensor.from_lists(["C1"], [step_bags])) * torch.tensor(grad_out)).sum().backward()
    torch.testing.assert_close(emb.table_weight("t"), w)
    torch.testing.assert_close(emb.state_momentum1, m)
    assert w[1].tolist() == [2.0, -2.0]


def test_lazy_adam_by_hand_untouched_rows_keep_their_moments():
    opt = EmbeddingOptimizerConfig("adam", lr=0.01, beta1=0.8, beta2=0.9, eps=1e-8)
    emb = EmbeddingCollection([TableConfig("t", 3, 1, ["C1"])], ["C1"], opt)
    w = torch.tensor([[1.0], [2.0], [3.0]])
    emb.table_weight("t").copy_(w)
    m1, m2 = torch.zeros(3), torch.zeros(3)
    steps = [([[0], [1]], [[2.0], [-1.0]]), ([[1, 1], []], [[0.5], [7.0]])]
    for step, (bags, grad_out) in enumerate(steps, start=1):
        g = torch.zeros(3)
        for b, ids in enumerate(bags):
            for i in ids:
                g[i] += grad_out[b][0]
        for r in range(3):
            if any(r in ids for ids in bags):
                m1[r] = 0.8 * m1[r] + 0.2 * g[r]
                m2[r] = 0.9 * m2[r] + 0.1 * g[r] ** 2
                w[r] -= 0.01 * (m1[r] / (1 - 0.8**step)) / (math.sqrt(m2[r] / (1 - 0.9**step)) + 1e-8)
        (emb(KeyedJaggedTensor.from_lists(["C1"], [bags])) * torch.tensor(grad_out)).sum().backward()
    torch.testing.assert_close(emb.table_weight("t"), w)
    torch.testing.assert_close(emb.state_momentum1, m1)
    torch.testing.assert_close(emb.state_momentum2, m2)
    assert w[2].item() == 3.0 and m1[2].item() == 0.0


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "adam"])
def test_state_dict_round_trip_continues_identically(kind):
    gen = torch.Generator().manual_seed(3)
    make = lambda: EmbeddingCollection(_mixed_tables(), FEATURES, EmbeddingOptimizerConfig(kind, lr=0.05))
    a = make()
    batches = [_random_kjt(gen, batch=5)[0] for _ in range(4)]
    for kjt in batches[:2]:
        a(kjt).pow(2).sum().backward()
    b = make()
    b.load_state_dict(a.state_dict())
    assert set(a.state_dict()) >= {"weights", "step"} | {f"state_{n}" for n in a.optimizer_state()}
    for kjt in batches[2:]:
        a(kjt).pow(2).sum().backward()
        b(kjt).pow(2).sum().backward()
    torch.testing.assert_close(a.weights, b.weights, rtol=0, atol=0)


def test_a_training_lookup_under_autocast_gives_its_dtype_and_trains_as_in_fp32():
    gen = torch.Generator().manual_seed(7)
    kjt, _ = _random_kjt(gen, 6)
    made = [EmbeddingCollection(_mixed_tables(), FEATURES, EmbeddingOptimizerConfig("adagrad", lr=0.1),
                                generator=torch.Generator().manual_seed(1)) for _ in range(2)]
    plain, autocast = made
    plain.train(), autocast.train()
    before = plain.weights.clone()
    pooled = plain(kjt)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rounded = autocast(kjt)
    assert pooled.dtype == torch.float32 and rounded.dtype == torch.bfloat16
    assert torch.equal(rounded, pooled.to(torch.bfloat16))  # the fp32 sums rounded once
    grad = torch.randn(pooled.shape, generator=gen).to(torch.bfloat16)
    pooled.backward(grad.float())
    rounded.backward(grad)
    assert torch.equal(autocast.weights, plain.weights) and not torch.equal(plain.weights, before)
    assert torch.equal(autocast.optimizer_state()["momentum1"], plain.optimizer_state()["momentum1"])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast(kjt).dtype == torch.float32  # evaluation and serving: fp32, as before


def test_eval_mode_and_no_grad_do_not_update():
    emb = EmbeddingCollection(_mixed_tables(), FEATURES)
    kjt, _ = _random_kjt(torch.Generator().manual_seed(4), batch=3)
    before = emb.weights.clone()
    emb.eval()
    out = emb(kjt)
    assert not out.requires_grad
    torch.testing.assert_close(emb.weights, before, rtol=0, atol=0)


@pytest.mark.parametrize("value,feature", [(10, "C1"), (-1, "C2")])
def test_id_outside_the_table_names_feature_and_value(value, feature):
    emb = EmbeddingCollection(_mixed_tables(), FEATURES)
    bags = [[[1], [2]], [[3], [4]], [[0], [1]]]
    bags[FEATURES.index(feature)][1] = [0, value]
    with pytest.raises(BadInputError, match=rf"feature {feature}: id {value} is outside table"):
        emb(KeyedJaggedTensor.from_lists(FEATURES, bags))


def test_keys_in_another_order_are_rejected():
    emb = EmbeddingCollection(_mixed_tables(), FEATURES)
    kjt = KeyedJaggedTensor.from_lists(["C2", "C1", "C3"], [[[1]], [[1]], [[1]]])
    with pytest.raises(BadInputError, match="in this order"):
        emb(kjt)


class Counting(TorchBackend):
    """A backend registered by ``module:attr``, imported on first use; it counts the lookups it serves."""

    name = "counting"
    made = 0

    def __init__(self) -> None:
        super().__init__()
        Counting.made += 1


def test_backend_registry_plugs_in_without_model_changes():
    register_backend("counting", f"{__name__}:Counting")
    assert "counting" in available_backends()
    gen = torch.Generator().manual_seed(5)
    ref = EmbeddingCollection(_mixed_tables(), FEATURES, EmbeddingOptimizerConfig("adam"), generator=gen)
    other = EmbeddingCollection(_mixed_tables(), FEATURES, EmbeddingOptimizerConfig("adam"), backend="counting")
    other.load_state_dict(ref.state_dict())
    kjt, _ = _random_kjt(gen, batch=4)
    ref(kjt).sum().backward()
    other(kjt).sum().backward()
    assert Counting.made == 1 and other.backend.name == "counting"
    torch.testing.assert_close(ref.weights, other.weights, rtol=0, atol=0)
    assert resolve_backend("auto", "cpu").name == "torch"
    with pytest.raises(ValueError, match="not registered"):
        resolve_backend("nope", "cpu")
    with pytest.raises(ValueError, match="module:attr"):
        register_backend("bad", "no_colon")


def test_tables_from_schema_follow_the_feature_order_and_cardinalities():
    schema = Schema([
        Column("label", "label", "float32"),
        Column("I1", "continuous", "float32"),
        Column("C1", "categorical", "int32", cardinality=11),
        Column("T", "multihot", "int32", cardinality=5, max_length=3),
        Column("C2", "categorical", "int32", cardinality=7),
    ])
    tables = tables_from_schema(schema, dim=8, pooling="mean")
    assert [(t.name, t.rows, t.dim, t.features, t.pooling) for t in tables] == [
        ("t_C1", 11, 8, ["C1"], "sum"), ("t_T", 5, 8, ["T"], "mean"), ("t_C2", 7, 8, ["C2"], "sum")]
    shared = tables_from_schema(schema, dim=8, shared={"cats": ["C1", "C2"]})
    assert [(t.name, t.rows, t.features) for t in shared] == [("cats", 11, ["C1", "C2"]), ("t_T", 5, ["T"])]


def test_loading_an_older_state_rewinds_the_step_adam_uses():
    gen = torch.Generator().manual_seed(6)
    emb = EmbeddingCollection(_mixed_tables(), FEATURES, EmbeddingOptimizerConfig("adam", lr=0.05))
    batches = [_random_kjt(gen, batch=5)[0] for _ in range(3)]
    emb(batches[0]).sum().backward()
    snapshot = {k: v.clone() for k, v in emb.state_dict().items()}
    emb(batches[1]).sum().backward()
    emb(batches[2]).sum().backward()
    emb.load_state_dict(snapshot)
    fresh = EmbeddingCollection(_mixed_tables(), FEATURES, EmbeddingOptimizerConfig("adam", lr=0.05))
    fresh.load_state_dict(snapshot)
    for model in (emb, fresh):
        model(batches[1]).sum().backward()
    assert int(emb.step) == 2
    torch.testing.assert_close(emb.weights, fresh.weights, rtol=0, atol=0)


def test_bf16_master_weights_keep_updates_that_bf16_alone_rounds_away():
    # lr * grad far below bf16's resolution at 1.0: plain bf16 tables never move, the fp32 master does.
    tables = [TableConfig("a", 4, 8, ["C1"])]
    kjt = KeyedJaggedTensor.from_lists(["C1"], [[[1]]])
    runs = {}
    for master in (False, True):
        emb = EmbeddingCollection(tables, ["C1"], EmbeddingOptimizerConfig("sgd", lr=1e-4, master_weights=master),
                                  weights_dtype="bf16", backend="torch", init_scale=1.0)
        with torch.no_grad():
            emb.weights.fill_(1.0)
            if master:
                emb.state_master_weights.fill_(1.0)
        for _ in range(200):
            emb(kjt).sum().backward()
        runs[master] = emb
    assert torch.all(runs[False].table_weight("a") == 1.0)
    moved = runs[True].state_master_weights.view(4, 8)[1]
    assert torch.allclose(moved, torch.full((8,), 1.0 - 200 * 1e-4), atol=1e-5)
    assert torch.all(runs[True].table_weight("a")[1].float() < 1.0)
    assert torch.all(runs[True].table_weight("a")[0].float() == 1.0)
    assert "state_master_weights" in runs[True].state_dict() and "state_master_weights" not in runs[False].state_dict()


def test_stochastic_rounding_is_refused_by_the_reference():
    emb = EmbeddingCollection([TableConfig("a", 4, 8, ["C1"])], ["C1"],
                              EmbeddingOptimizerConfig("sgd", stochastic_rounding=True), weights_dtype="fp16",
                              backend="torch")
    with pytest.raises(ValueError, match="cuda backend only"):
        emb(KeyedJaggedTensor.from_lists(["C1"], [[[1]]])).sum().backward()


def test_tables_start_from_the_same_values_whatever_the_number_of_threads_that_draw_them():
    """The tables are drawn in chunks on torch's threads side by side (one generator over a table draws on one
    thread): the values depend on the seed alone, each table's within its bound (rows ** -0.5) and spread over it,
    and a table of several chunks draws no chunk twice."""
    from pipeline.modules import collection

    tables = [TableConfig("big", 3 * collection.INIT_CHUNK // 8 + 5, 8, ["A"]), TableConfig("small", 10, 8, ["B"])]
    built = {}
    threads = torch.get_num_threads()
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            built[count] = EmbeddingCollection(tables, ["A", "B"], generator=torch.Generator().manual_seed(4))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(built[1].weights, built[3].weights)
    for table in tables:
        assert built[1].table_weight(table.name).abs().max() <= table.rows ** -0.5
    big = built[1].table_weight("big")
    assert big.std() == pytest.approx(tables[0].rows ** -0.5 / math.sqrt(3), rel=0.01)  # uniform over the bound
    big = big.reshape(-1)
    chunks = [big[k * collection.INIT_CHUNK: (k + 1) * collection.INIT_CHUNK][:1000] for k in range(3)]
    assert not torch.equal(chunks[0], chunks[1]) and not torch.equal(chunks[1], chunks[2])
    other = EmbeddingCollection(tables, ["A", "B"], generator=torch.Generator().manual_seed(5))
    assert not torch.equal(other.weights, built[1].weights)
