"""The four models: built from a schema, dense part separable, each learns a planted signal on CPU."""

import pytest
import torch

from pipeline.modules.configs import EmbeddingOptimizerConfig
from pipeline.modules.models import MODEL_CLASSES, ModelSizes, build_model
from pipeline.schema import Column, Schema
from pipeline.sparse import KeyedJaggedTensor

SIZES = ModelSizes(embedding_dim=8, bottom_mlp=[16, 8], top_mlp=[32, 16, 1])





def _schema():
    return Schema([
        Column("label", "label", "float32"),
        *[Column(f"I{i}", "continuous", "float32") for i in range(3)],
        Column("C1", "categorical", "int32", cardinality=20),
        Column("C2", "categorical", "int32", cardinality=30),
        Column("T1", "multihot", "int32", cardinality=15, max_length=4),
    ])


def _planted_batch(gen, batch=512):
    """Dense features, ids and labels drawn from a known logistic model with per-id effects."""
    dense = torch.randn(batch, 3, generator=gen)
    c1 = torch.randint(0, 20, (batch,), generator=gen)
    c2 = torch.randint(0, 30, (batch,), generator=gen)
    lengths = torch.randint(0, 5, (batch,), generator=gen)
    tags = torch.randint(0, 15, (int(lengths.sum()),), generator=gen)
    effects = torch.linspace(-2, 2, 30)
    tag_sum = torch.zeros(batch).index_add_(0, torch.repeat_interleave(torch.arange(batch), lengths), effects[tags])
    logit = dense[:, 0] - dense[:, 1] + effects[c1] + effects[c2] + 0.5 * tag_sum
    label = torch.bernoulli(torch.sigmoid(logit), generator=gen)
    values = torch.cat([c1, c2, tags])
    all_lengths = torch.cat([torch.ones(2 * batch, dtype=torch.int64), lengths])
    return dense, KeyedJaggedTensor(["C1", "C2", "T1"], values, all_lengths), label


@pytest.mark.parametrize("name", sorted(MODEL_CLASSES))
def test_each_model_learns_on_cpu(name):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = build_model(name, _schema(), SIZES, EmbeddingOptimizerConfig("adagrad", lr=0.1), seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    held_out = _planted_batch(gen, 1024)
    loss_fn = torch.nn.BCEWithLogitsLoss()

    def held_out_loss():
        model.eval()
        with torch.no_grad():
            loss = loss_fn(model(held_out[0], held_out[1]), held_out[2]).item()
        model.train()
        return loss

    before = held_out_loss()
    for _ in range(40):
        dense, sparse, label = _planted_batch(gen)
        loss = loss_fn(model(dense, sparse), label)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert held_out_loss() < before - 0.05


@pytest.mark.parametrize("name", sorted(MODEL_CLASSES))
def test_each_model_learns_one_categorical_column_without_dense_features(name):
    """A DLRM of one table and no dense features had no pair to feed its top MLP: it learned a constant."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    schema = Schema([Column("label", "label", "float32"), Column("C1", "categorical", "int32", cardinality=20)])
    model = build_model(name, schema, SIZES, EmbeddingOptimizerConfig("adagrad", lr=0.1), seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    effects = torch.linspace(-2, 2, 20)

    def batch(size):
        ids = torch.randint(0, 20, (size,), generator=gen)
        label = torch.bernoulli(torch.sigmoid(effects[ids]), generator=gen)
        return torch.zeros(size, 0), KeyedJaggedTensor(["C1"], ids, torch.ones(size, dtype=torch.int64)), label

    dense, sparse, _ = batch(2048)
    for _ in range(60):
        step_dense, step_sparse, step_label = batch(512)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(step_dense, step_sparse), step_label)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        scores = model(dense, sparse)
    # the learned scores order the ids as their planted effects do
    by_id = torch.stack([scores[sparse.values == i].mean() for i in range(20)])
    assert torch.corrcoef(torch.stack([by_id, effects]))[0, 1] > 0.9


@pytest.mark.parametrize("name", sorted(MODEL_CLASSES))
def test_start_at_rate_sets_the_bias_added_last_to_the_logit_to_the_log_odds(name):
    import math

    model = build_model(name, _schema(), SIZES, seed=2).eval()
    dense, sparse, _ = _planted_batch(torch.Generator().manual_seed(2), 16)
    with torch.no_grad():
        before = model(dense, sparse)
        start = float(model.output_bias())
        model.start_at_rate(0.03)
        after = model(dense, sparse)
    assert float(model.output_bias()) == pytest.approx(math.log(0.03 / 0.97))
    torch.testing.assert_close(after - before, torch.full_like(before, math.log(0.03 / 0.97) - start))
    model.start_at_rate(float("nan"))  # a split without labels' rate: left as it is
    model.start_at_rate(0.0)
    assert float(model.output_bias()) == pytest.approx(math.log(0.03 / 0.97))


@pytest.mark.parametrize("name", sorted(MODEL_CLASSES))
def test_dense_part_runs_apart_from_the_embedding(name):
    model = build_model(name, _schema(), SIZES, seed=1).eval()
    dense, sparse, _ = _planted_batch(torch.Generator().manual_seed(1), 16)
    with torch.no_grad():
        whole = model(dense, sparse)
        pooled = model.embedding(sparse)
        apart = model.dense_part()(dense, pooled)
    assert whole.shape == (16,)
    torch.testing.assert_close(whole, apart, rtol=0, atol=0)
    assert not any(p is model.embedding.weights for p in model.parameters())


def test_same_seed_same_model_and_tables_follow_the_schema():
    a = build_model("deepfm", _schema(), SIZES, seed=3)
    b = build_model("deepfm", _schema(), SIZES, seed=3)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    names = [(t.name, t.rows, t.dim) for t in a.embedding.tables]
    assert names == [("t_C1", 20, 8), ("t_C2", 30, 8), ("t_T1", 15, 8), ("w_C1", 20, 1), ("w_C2", 30, 1),
                     ("w_T1", 15, 1)]


def test_logistic_regression_is_one_weight_per_category_and_dense_feature_starting_at_zero():
    model = build_model("logistic", _schema(), SIZES, seed=3)
    assert [(t.name, t.rows, t.dim) for t in model.embedding.tables] == [("w_C1", 20, 1), ("w_C2", 30, 1),
                                                                          ("w_T1", 15, 1)]
    assert not model.embedding.weights.any()
    assert sum(p.numel() for p in model.parameters()) == 3 + 1  # one weight per dense feature and the bias
    deepfm = build_model("deepfm", _schema(), SIZES, seed=3)
    for table in deepfm.embedding.tables:  # deep rows start random, the wide (linear) ones at zero
        assert deepfm.embedding.table_weight(table.name).any() == (not table.name.startswith("w_"))
    # DeepFM's factors start small (the FM term multiplies pairs of them); DLRM's at 1/sqrt(rows)
    assert deepfm.embedding.table_weight("t_C1").abs().max() <= 0.01
    assert build_model("dlrm", _schema(), SIZES, seed=3).embedding.table_weight("t_C1").abs().max() > 0.05


def test_dlrm_interaction_width_and_bad_bottom_mlp():
    model = build_model("dlrm", _schema(), SIZES)
    # 3 slots + the bottom output: 4 vectors, 6 pairs, plus the bottom output itself.
    assert model.top[0].pad == 2 and model.top[1].in_features == 8 + 6 + 2  # padded to a multiple of 8
    with pytest.raises(ValueError, match="must end in the embedding dim 8"):
        build_model("dlrm", _schema(), ModelSizes(8, [16, 4], [8, 1]))


def test_dcnv2_is_mlperfs_dlrm_dcnv2_with_the_mlperf_preset():
    sizes = ModelSizes.preset("mlperf")
    model = build_model("dcnv2", _schema(), sizes)
    width = sizes.bottom_mlp[-1] + 3 * 128  # the bottom MLP's output and three pooled embeddings
    assert len(model.cross) == 3
    low, up = model.cross[0]
    assert (low.in_features, low.out_features, up.out_features) == (width, 512, width)
    dense, sparse, _ = _planted_batch(torch.Generator().manual_seed(2), 8)
    assert model(dense, sparse).shape == (8,)
    full = build_model("dcnv2", _schema(), SIZES)  # the small preset keeps full-rank cross layers
    assert isinstance(full.cross[0], torch.nn.Linear) and full.cross[0].in_features == SIZES.bottom_mlp[-1] + 3 * 8


def test_presets():
    mlperf = ModelSizes.preset("mlperf")
    assert (mlperf.embedding_dim, mlperf.bottom_mlp, mlperf.top_mlp) == (128, [512, 256, 128], [1024, 1024, 512, 256, 1])
    with pytest.raises(ValueError, match="model preset"):
        ModelSizes.preset("huge")


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(MODEL_CLASSES))
def test_models_on_gpu_match_cpu_and_train_with_the_auto_backend(name):
    cpu = build_model(name, _schema(), SIZES, EmbeddingOptimizerConfig("adagrad", lr=0.1), seed=4, backend="torch")
    gpu = build_model(name, _schema(), SIZES, EmbeddingOptimizerConfig("adagrad", lr=0.1), seed=4).to("cuda")
    dense, sparse, label = _planted_batch(torch.Generator().manual_seed(4), 256)
    for model, dev in ((cpu, "cpu"), (gpu, "cuda")):
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense.to(dev), sparse.to(dev)), label.to(dev))
        loss.backward()
    # The fused kernels sum duplicate rows in another order than the reference: float rounding only.
    torch.testing.assert_close(gpu.embedding.weights.cpu(), cpu.embedding.weights, rtol=1e-4, atol=1e-5)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        out = gpu.eval()(dense.cuda(), sparse.to("cuda"))
    assert out.shape == (256,) and torch.isfinite(out.float()).all()
