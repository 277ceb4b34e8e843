import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from pipeline.data import synthetic
from pipeline.data.metrics import ClickMetrics, auc_standard_error, log_loss, roc_auc
from pipeline.data.synthetic import BLOCK_ROWS, ClickModel, generate_block, iter_split


@pytest.fixture(scope="module")
def model():
    return ClickModel.create(seed=3, size=0.01)


@pytest.fixture(scope="module")
def block(model):
    return generate_block(model, "train", 0)


def test_same_seed_same_rows_other_seed_other_rows(model, block):
    again = generate_block(ClickModel.create(seed=3, size=0.01), "train", 0)
    assert again.table.equals(block.table)
    np.testing.assert_array_equal(again.probability, block.probability)
    other = generate_block(ClickModel.create(seed=4, size=0.01), "train", 0)
    assert not other.table.column("C1").equals(block.table.column("C1"))
    assert not generate_block(model, "valid", 0).table.equals(block.table)
    assert not generate_block(model, "train", 1).table.equals(block.table)


def test_rows_do_not_depend_on_chunk_size(model):
    rows = BLOCK_ROWS + 5_000
    small = list(iter_split(model, "test", rows, chunk_rows=7_000))
    large = list(iter_split(model, "test", rows, chunk_rows=40_000))
    assert [len(c) for c in small] == [7_000] * 10 + [rows - 70_000]
    assert pa.concat_tables([c.table for c in small]).equals(pa.concat_tables([c.table for c in large]))
    np.testing.assert_array_equal(np.concatenate([c.probability for c in small]),
                                  np.concatenate([c.probability for c in large]))
    # a block can be made alone: block 1 is rows BLOCK_ROWS.. of the split
    alone = generate_block(model, "test", 1, rows - BLOCK_ROWS)
    assert pa.concat_tables([c.table for c in small]).slice(BLOCK_ROWS).equals(alone.table)


def test_columns_and_types(block):
    schema = block.table.schema
    assert schema.names == ["label", *[f"I{i}" for i in range(1, 14)], *[f"C{i}" for i in range(1, 27)]]
    assert schema.field("label").type == pa.int8()
    assert all(schema.field(f"I{i}").type == pa.int64() for i in range(1, 14))
    assert all(schema.field(f"C{i}").type == pa.string() for i in range(1, 27))
    assert len(block) == BLOCK_ROWS == block.probability.size
    hex8 = pc.match_substring_regex(block.table.column("C3").drop_null(), r"^[0-9a-f]{8}$")
    assert pc.all(hex8).as_py()


def test_null_rates_follow_each_feature(block):
    t = block.table
    rate = {name: t.column(name).null_count / len(t) for name in t.column_names}
    assert rate["label"] == 0 and rate["I2"] == 0 and rate["C1"] == 0
    assert rate["C22"] == pytest.approx(0.76, abs=0.02)
    assert rate["C19"] == pytest.approx(0.44, abs=0.02)
    assert rate["I12"] == pytest.approx(0.77, abs=0.02)
    assert rate["I1"] == pytest.approx(0.45, abs=0.02)


def test_counts_are_heavy_tailed_and_only_some_can_be_negative(block):
    t = block.table
    assert pc.min(t.column("I2")).as_py() < 0
    for name in ("I1", "I3", "I5", "I13"):
        assert pc.min(t.column(name)).as_py() >= 0
    i5 = t.column("I5").drop_null().to_numpy()
    assert i5.max() > 50 * np.median(i5)


def test_cardinalities_scale_from_criteo_with_a_floor():
    assert synthetic.cardinalities(1.0) == list(synthetic.CRITEO_CARDINALITIES)
    small = synthetic.cardinalities(0.01)
    assert small[2] == 101_312 and small[8] == 3 and small[5] == 24 and small[0] == synthetic.SMALL_FLOOR
    assert all(k >= min(base, synthetic.SMALL_FLOOR) for k, base in zip(small, synthetic.CRITEO_CARDINALITIES))
    with pytest.raises(ValueError, match="size must be positive"):
        synthetic.cardinalities(0)


def test_values_stay_within_each_vocabulary_and_spellings_are_one_to_one(model, block):
    for f, k in enumerate(model.cardinality):
        assert pc.count_distinct(block.table.column(f"C{f + 1}")).as_py() <= k
    ranks = np.arange(1, 200_001)
    spelled = model.hex_values(2, ranks)
    assert np.unique(spelled.view("S8").ravel()).size == ranks.size


def test_values_are_zipf_like(block):
    for name in ("C3", "C12", "C15", "C24"):
        counts = pc.value_counts(block.table.column(name).drop_null()).field("counts").to_numpy()
        top, second = np.sort(counts)[::-1][:2]
        assert top > 1.3 * second, name


def test_click_rate_and_oracle_quality(model):
    metrics = ClickMetrics()
    for index in range(3):
        chunk = generate_block(model, "valid", index)
        metrics.update(chunk.table.column("label").to_numpy(), chunk.probability)
    result = metrics.result()
    assert result["rows"] == 3 * BLOCK_ROWS
    assert result["positive_rate"] == pytest.approx(0.25, abs=0.02)
    assert 0.75 < result["auc"] < 0.85


def test_streaming_metrics_match_the_exact_ones(block):
    labels = block.table.column("label").to_numpy()
    metrics = ClickMetrics()
    metrics.update(labels[:30_000], block.probability[:30_000])
    metrics.update(labels[30_000:], block.probability[30_000:])
    result = metrics.result()
    assert result["auc"] == pytest.approx(roc_auc(labels, block.probability), abs=1e-4)
    assert result["logloss"] == pytest.approx(log_loss(labels, block.probability), rel=1e-9)
    assert result["positive_rate"] == pytest.approx(labels.mean())


def test_roc_auc_against_counting_pairs():
    rng = np.random.default_rng(0)
    labels = rng.random(300) < 0.3
    scores = rng.integers(0, 20, 300).astype(float)  # many ties
    pos, neg = scores[labels], scores[~labels]
    pairs = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    assert roc_auc(labels, scores) == pytest.approx(pairs / (pos.size * neg.size))
    assert np.isnan(roc_auc(np.ones(3), np.arange(3.0)))


@pytest.mark.parametrize(("auc", "positives", "negatives"), [(0.75, 100, 100), (0.6, 300, 1200), (0.75, 3, 3)])
def test_the_aucs_standard_error_is_the_spread_of_aucs_drawn_on_as_many_rows(auc, positives, negatives):
    """Scores of positives and negatives drawn from two normals as far apart as the AUC asks: the AUCs of 1,000 such
    draws spread as the standard error says (within 15%)."""
    import math
    from statistics import NormalDist

    rng = np.random.default_rng(0)
    shift = NormalDist().inv_cdf(auc) * math.sqrt(2)
    labels = np.r_[np.ones(positives), np.zeros(negatives)]
    drawn = [roc_auc(labels, np.r_[rng.normal(shift, 1, positives), rng.normal(0, 1, negatives)]) for _ in range(1000)]
    assert np.mean(drawn) == pytest.approx(auc, abs=0.02)
    assert auc_standard_error(auc, positives, negatives) == pytest.approx(np.std(drawn), rel=0.15)
    assert np.isnan(auc_standard_error(auc, 0, 10)) and np.isnan(auc_standard_error(float("nan"), 5, 5))


def test_bad_arguments_are_named(model):
    with pytest.raises(ValueError, match="split: expected one of"):
        generate_block(model, "training", 0)
    with pytest.raises(ValueError, match="chunk_rows must be positive"):
        next(iter_split(model, "train", 10, 0))
