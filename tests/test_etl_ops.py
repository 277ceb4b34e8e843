"""Each ETL operator against a plain pandas / numpy / mmh3 computation of the same thing."""

from __future__ import annotations

import dask.dataframe as dd
import mmh3
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet
import pytest

from pipeline.errors import BadInputError, UserError
from pipeline.etl import (
    Bucketize,
    Cast,
    Categorify,
    Clip,
    FillMissing,
    HashBucket,
    HashedCross,
    HashIds,
    LambdaOp,
    LogOp,
    Normalize,
    Workflow,
)
from pipeline.etl.column_schema import input_schema
from pipeline.etl.ops.murmur import combine_row_hashes, hash_combine, murmur3_int64, murmur3_strings


def _op(workflow: Workflow, column: str):
    """The operator of ``workflow`` that takes ``column`` in."""
    return next(op for op, columns in workflow.operators() if column in columns)


def _strings(rng, n, vocab=40, null_rate=0.1):
    words = np.array([f"v{int(i):03d}" for i in rng.zipf(1.5, n) % vocab], dtype=object)
    words[rng.random(n) < null_rate] = None
    return words


def _with_empty_partitions(df: pd.DataFrame, parts: int = 4) -> dd.DataFrame:
    """A Dask frame whose partitions include empty ones (first, middle and last)."""
    chunks = np.array_split(np.arange(len(df)), parts)
    pieces = [df.iloc[:0]] + [df.iloc[c] for c in chunks[:2]] + [df.iloc[:0]] + [df.iloc[c] for c in chunks[2:]] + [df.iloc[:0]]
    return dd.from_map(lambda p: p, pieces, meta=df.iloc[:0])


def _vocab_oracle(values: pd.Series, freq_threshold=0, max_size=0) -> dict:
    counts = values.dropna().value_counts()
    table = counts.rename_axis("value").reset_index(name="count").sort_values(["count", "value"], ascending=[False, True])
    table = table[table["count"] >= max(freq_threshold, 1)]
    if max_size:
        table = table.head(max_size)
    return {v: i + 2 for i, v in enumerate(table["value"])}


def _codes_oracle(values, vocab: dict) -> np.ndarray:
    return np.array([0 if v is None or v is pd.NA or (isinstance(v, float) and np.isnan(v)) else vocab.get(v, 1)
                     for v in values], dtype=np.int32)


@pytest.mark.parametrize("freq_threshold, max_size", [(0, 0), (3, 0), (0, 5), (2, 7)])
def test_categorify_matches_pandas(freq_threshold, max_size):
    rng = np.random.default_rng(1)
    train = pd.DataFrame({"A": _strings(rng, 2000), "B": _strings(rng, 2000, vocab=7, null_rate=0.3)})
    workflow = Workflow(["A", "B"] >> Categorify(freq_threshold=freq_threshold, max_vocab_size=max_size))
    workflow.fit(_with_empty_partitions(train))
    test = pd.DataFrame({"A": ["v001", "never-seen", None, "v002"], "B": [None, "v003", "zzz", "v001"]})
    out = workflow.transform(test)
    for name in ("A", "B"):
        vocab = _vocab_oracle(train[name], freq_threshold, max_size)
        np.testing.assert_array_equal(out[name].to_numpy(), _codes_oracle(test[name], vocab))
        assert out[name].dtype == np.int32
        assert _op(workflow, name).cardinality(name) == len(vocab) + 2


def test_categorify_ties_break_by_value_and_unseen_go_to_oov():
    train = pd.DataFrame({"A": ["b", "a", "c", "a", "c", "d"]})
    workflow = Workflow(["A"] >> Categorify()).fit(train)
    out = workflow.transform(pd.DataFrame({"A": ["a", "c", "b", "d", "e", None]}))
    assert out["A"].tolist() == [2, 3, 4, 5, 1, 0]


def test_dictionary_encoded_input_gives_the_same_codes_and_hashes():
    """Parquet string columns arrive dictionary-encoded (one dictionary per chunk); results must not change."""
    words = ["b", None, "a", "c", "a", "zz", None, "b"]
    chunked = pa.chunked_array([pa.array(words[:3]).dictionary_encode(), pa.array(words[3:]).dictionary_encode()])
    encoded = pd.DataFrame({"A": pd.Series(pd.arrays.ArrowExtensionArray(chunked)), "B": words})
    plain = pd.DataFrame({"A": words, "B": words})
    workflow = Workflow((["A"] >> Categorify()) + (["B"] >> HashBucket(13))).fit(plain.iloc[:5])
    expected = workflow.transform(plain)
    pd.testing.assert_frame_equal(workflow.transform(encoded.assign(B=encoded["A"])), expected)
    refit = Workflow((["A"] >> Categorify()) + (["B"] >> HashBucket(13))).fit(encoded.assign(B=encoded["A"]).iloc[:5])
    assert _op(refit, "A").vocabularies["A"].equals(_op(workflow, "A").vocabularies["A"])


def test_categorify_integers_are_categories_too():
    train = pd.DataFrame({"A": pd.array([10, 20, 20, None], dtype="Int64")})
    workflow = Workflow(["A"] >> Categorify()).fit(train)
    assert workflow.transform(pd.DataFrame({"A": [20.0, 10.0, np.nan, 30.0]}))["A"].tolist() == [2, 3, 0, 1]


def test_categorify_multihot_matches_pandas():
    rng = np.random.default_rng(2)
    lists = []
    for _ in range(500):
        r = rng.random()
        lists.append(None if r < 0.1 else [] if r < 0.2 else list(_strings(rng, rng.integers(1, 5), vocab=12)))
    train = pd.DataFrame({"M": lists})
    workflow = Workflow(["M"] >> Categorify(freq_threshold=2)).fit(train)
    vocab = _vocab_oracle(train["M"].explode(), freq_threshold=2)
    test = pd.DataFrame({"M": [["v001", "nope", None], None, [], ["v002"]]})
    out = workflow.transform(test)
    got = [list(x) for x in out["M"]]
    expected = [list(_codes_oracle(cell, vocab)) if cell is not None else [] for cell in test["M"]]
    assert got == expected
    assert str(out["M"].dtype) == "list<item: int32>[pyarrow]"
    op = _op(workflow, "M")
    assert op.max_lengths["M"] == max(len(x) for x in lists if x is not None)
    assert op.cardinality("M") == len(vocab) + 2


def test_categorify_fit_through_shuffled_counts_equals_tree(tmp_path):
    """The shuffle path (split_out > 1, for huge inputs) learns what the tree reduction learns."""
    from pipeline.etl.frame_library import read_parquet

    rng = np.random.default_rng(3)
    for i in range(4):
        lists = [[f"t{j}" for j in rng.integers(0, 20, k)] for k in rng.integers(0, 3, 800)]
        table = pa.table({"A": pa.array(_strings(rng, 800, vocab=200)), "M": pa.array(lists, pa.list_(pa.string()))})
        pa.parquet.write_table(table, tmp_path / f"part-{i}.parquet")
    data = read_parquet(tmp_path, None, "pandas")
    tree = Workflow(["A", "M"] >> Categorify(freq_threshold=2)).fit(data)
    shuffled = Workflow(["A", "M"] >> Categorify(freq_threshold=2, split_out=3)).fit(data)
    for name in ("A", "M"):
        a, b = _op(tree, name), _op(shuffled, name)
        assert len(a.vocabularies[name]) > 10
        assert a.vocabularies[name].equals(b.vocabularies[name])
        np.testing.assert_array_equal(a.counts[name], b.counts[name])
    assert _op(tree, "M").max_lengths == _op(shuffled, "M").max_lengths == {"M": 2}


@pytest.mark.parametrize("seed", [0, 1])
def test_murmur3_strings_equals_mmh3(seed):
    rng = np.random.default_rng(seed)
    alphabet = list("abcdefghij0123456789") + ["é", "✓", "😀"]
    words = ["".join(rng.choice(alphabet, rng.integers(0, 40))) for _ in range(300)] + [""]
    array = pa.array(words)
    expected = [mmh3.hash(w.encode(), 0, signed=False) for w in words]
    assert murmur3_strings(array).tolist() == expected
    assert murmur3_strings(array.slice(7, 50)).tolist() == expected[7:57]


def test_murmur3_int64_equals_mmh3():
    values = np.array([0, 1, -1, 7, 2**40 + 3, -(2**63), 2**63 - 1], dtype=np.int64)
    expected = [mmh3.hash(int(v).to_bytes(8, "little", signed=True), 0, signed=False) for v in values]
    assert murmur3_int64(values).tolist() == expected


def _boost_combine(lhs: int, rhs: int) -> int:
    return (lhs ^ ((rhs + 0x9E3779B9 + (lhs << 6) + (lhs >> 2)) & 0xFFFFFFFF)) & 0xFFFFFFFF


def test_hash_combine_is_boosts():
    pairs = [(0, 0), (1, 2), (0xFFFFFFFF, 0x12345678), (0xDEADBEEF, 0xFFFFFFFF)]
    got = hash_combine(np.array([p[0] for p in pairs], np.uint32), np.array([p[1] for p in pairs], np.uint32))
    assert got.tolist() == [_boost_combine(a, b) for a, b in pairs]


def test_hash_bucket_matches_mmh3():
    words = ["a", "hello", None, "", "ünï"]
    numbers = [5, None, -3, 2**33, 0]
    df = pd.DataFrame({"S": words, "N": pd.array(numbers, dtype="Int64")})
    out = Workflow(["S", "N"] >> HashBucket(97)).fit(df).transform(df)

    def expected(value: bytes | None) -> int:
        return 0 if value is None else 1 + _boost_combine(0, mmh3.hash(value, 0, signed=False)) % 97

    assert out["S"].tolist() == [expected(None if s is None else s.encode()) for s in words]
    assert out["N"].tolist() == [expected(None if v is None else v.to_bytes(8, "little", signed=True)) for v in numbers]
    assert out["S"].dtype == np.int32


def test_hash_bucket_on_multihot_lists_hashes_each_element():
    cells = [["a", None, "hello"], None, [], ["a"]]
    train = pd.DataFrame({"M": cells, "S": ["x", "y", "z", "w"]})
    workflow = Workflow(["M", "S"] >> HashBucket(31)).fit(train)
    op = _op(workflow, "M")
    assert op.multihot == {"M": True, "S": False} and op.max_lengths == {"M": 3}
    out = workflow.transform(train)

    def code(value):
        return 0 if value is None else 1 + _boost_combine(0, mmh3.hash(value.encode(), 0, signed=False)) % 31

    assert [list(x) for x in out["M"]] == [[code(v) for v in cell] if cell is not None else [] for cell in cells]
    assert str(out["M"].dtype) == "list<item: int32>[pyarrow]"


def _raw_id(text: str | None) -> int:
    """HashIds' id of a value's text: its mmh3 with seed 0 (high half) and seed 1 (low half), as an int64."""
    if text is None:
        return 0
    bits = mmh3.hash(text.encode(), 0, signed=False) << 32 | mmh3.hash(text.encode(), 1, signed=False)
    return bits - 2**64 if bits >= 2**63 else bits


def test_hash_ids_are_64_bit_hashes_of_the_values_text():
    words = ["a", "hello", None, "", "ünï", "5"]
    numbers = [5, None, -3, 2**33, 0, 5]
    cells = [["a", None, "hello"], None, [], ["a"], ["5"], []]
    df = pd.DataFrame({"S": words, "N": pd.array(numbers, dtype="Int64"), "M": cells})
    workflow = Workflow(["S", "N", "M"] >> HashIds(1024)).fit(df)
    out = workflow.transform(df)
    assert out["S"].tolist() == [_raw_id(w) for w in words] and out["S"].dtype == np.int64
    assert out["N"].tolist() == [_raw_id(None if v is None else str(v)) for v in numbers]  # as Categorify, text
    assert out["N"][0] == out["S"][5]
    assert [list(x) for x in out["M"]] == [[_raw_id(v) for v in cell] if cell is not None else [] for cell in cells]
    assert str(out["M"].dtype) == "list<item: int64>[pyarrow]"
    schema = {c.name: c for c in workflow.output_schema(input_schema({"label": "y", "continuous": [],
                                                                        "categorical": ["S", "N"],
                                                                        "multihot": ["M"]}))}
    assert all(c.dynamic and c.cardinality == 1024 and c.dtype == "int64" for c in schema.values())
    assert schema["M"].is_list and schema["M"].max_length == 3


def test_hashed_cross_matches_mmh3_and_folds_like_cudf():
    a_values, b_values, c_values = ["x", "y", None, "x"], [1, 2, 3, None], ["p", "q", "r", "s"]
    df = pd.DataFrame({"A": a_values, "B": pd.array(b_values, dtype="Int64"), "C": c_values})
    out = Workflow(["A", "B", "C"] >> HashedCross(1000)).fit(df).transform(df)
    assert list(out.columns) == ["A_B_C"]
    rows = []
    for a, b, c in zip(a_values, b_values, c_values):
        if a is None or b is None:
            rows.append(0)
            continue
        h = 0
        for value in (a.encode(), int(b).to_bytes(8, "little", signed=True), c.encode()):
            h = _boost_combine(h, mmh3.hash(value, 0, signed=False))
        rows.append(1 + h % 1000)
    assert out["A_B_C"].tolist() == rows
    assert combine_row_hashes([np.array([5], np.uint32)]).tolist() == [_boost_combine(0, 5)]


def test_hashing_refuses_fractional_numbers():
    df = pd.DataFrame({"X": [1.5, 2.0]})
    with pytest.raises(BadInputError, match="expected strings or integers"):
        Workflow(["X"] >> HashBucket(10)).fit(df).transform(df)


def _numbers(rng, n=1000):
    values = rng.lognormal(1, 2, n).round() - 3
    values[rng.random(n) < 0.2] = np.nan
    return values


def test_continuous_chain_matches_pandas():
    rng = np.random.default_rng(4)
    train = pd.DataFrame({"I": pd.array(_numbers(rng), dtype="Float64").astype("Int64"), "F": _numbers(rng)})
    chain = ["I", "F"] >> FillMissing(2.0) >> Clip(min_value=0, max_value=500) >> LogOp() >> Normalize()
    workflow = Workflow(chain).fit(_with_empty_partitions(train))
    test = pd.DataFrame({"I": pd.array([None, 3, -5, 10_000], dtype="Int64"), "F": [np.nan, 1.0, 2.5, -1.0]})
    out = workflow.transform(test)
    for name in ("I", "F"):
        fitted = np.log1p(train[name].astype("float64").fillna(2.0).clip(0, 500))
        expected = (np.log1p(test[name].astype("float64").fillna(2.0).clip(0, 500)) - fitted.mean()) / fitted.std()
        np.testing.assert_allclose(out[name].to_numpy(), expected.to_numpy(dtype="float64"), rtol=1e-6)
        assert out[name].dtype == np.float32


def _drifting_partitions(rng) -> tuple[dd.DataFrame, dict[str, np.ndarray]]:
    """Partitions of very different sizes whose values drift (as files of successive days), one all-missing."""
    pieces, columns = [], {"I": [], "F": []}
    for size, shift in ((3000, 0), (7, 500), (0, 0), (1200, 40), (25, 0), (900, 2000)):
        counts = np.floor(rng.lognormal(2, 1.5, size)) + shift
        floats = rng.normal(shift, 3, size)
        counts[rng.random(size) < 0.2] = np.nan
        floats[rng.random(size) < 0.1] = np.nan
        if size == 25:
            counts[:] = np.nan
        pieces.append(pd.DataFrame({"I": counts, "F": floats}))
        columns["I"].append(counts)
        columns["F"].append(floats)
    meta = pieces[0].iloc[:0]
    return dd.from_map(lambda p: p, pieces, meta=meta), {k: np.concatenate(v) for k, v in columns.items()}


@pytest.mark.parametrize("one_graph", [False, True], ids=["two phases", "one graph"])
@pytest.mark.parametrize("points", [65_536, 50, 1])
def test_fill_missing_median_is_exact_over_uneven_drifting_partitions(monkeypatch, points, one_graph):
    from pipeline.etl.ops import continuous, median

    monkeypatch.setattr(median, "SUMMARY_POINTS", points)  # 50 and 1: summaries compressed, a second pass
    monkeypatch.setattr(continuous, "in_one_graph", lambda ddf: one_graph)
    data, values = _drifting_partitions(np.random.default_rng(5))
    workflow = Workflow(["I", "F"] >> FillMissing(strategy="median")).fit(data)
    filled = workflow.transform(pd.DataFrame({"I": [np.nan, 1.0], "F": [np.nan, np.nan]}))
    for name in ("I", "F"):
        assert _op(workflow, name).fill_values[name] == np.nanmedian(values[name]), name
        assert filled[name][0] == np.nanmedian(values[name])
    assert filled["I"][1] == 1.0


@pytest.mark.parametrize("points", [65_536, 50])
def test_fill_missing_median_of_as_many_partitions_as_workers_is_one_phase(monkeypatch, points):
    """No more partitions than workers: the second round of a compressed summary goes in the first round's graph
    (no return to the client between them), the median still exact."""
    import dask

    from pipeline.etl import workflow as workflow_module
    from pipeline.etl.ops import median

    monkeypatch.setattr(median, "SUMMARY_POINTS", points)
    rng = np.random.default_rng(8)
    frame = pd.DataFrame({"w": np.where(rng.random(5000) < 0.2, np.nan, rng.normal(0, 1, 5000)),
                          "t": rng.integers(0, 3, 5000).astype(np.float64)})
    phases = []
    compute = workflow_module._compute_by_kind
    monkeypatch.setattr(workflow_module, "_compute_by_kind", lambda lazy, progress: phases.append(len(lazy))
                        or compute(lazy, progress))
    with dask.config.set(scheduler="sync"):
        fitted = Workflow(["w", "t"] >> FillMissing(strategy="median")).fit(dd.from_pandas(frame, npartitions=1))
    assert phases == [1]
    assert _op(fitted, "w").fill_values == {"w": np.nanmedian(frame["w"]), "t": np.median(frame["t"])}


def test_fill_missing_median_of_ties_an_even_count_and_no_values():
    train = pd.DataFrame({"T": [5.0, 5.0, 5.0, 1.0, np.nan], "E": [1.0, 2.0, 4.0, 10.0, np.nan],
                          "N": [np.nan] * 5})
    workflow = Workflow(["T", "E", "N"] >> FillMissing(-1.0, strategy="median")).fit(train)
    assert _op(workflow, "T").fill_values == {"T": 5.0, "E": 3.0, "N": -1.0}


@pytest.mark.parametrize("points", [65_536, 1])
def test_fill_missing_median_of_the_largest_floats_is_finite(monkeypatch, points):
    from pipeline.etl.ops import median

    monkeypatch.setattr(median, "SUMMARY_POINTS", points)  # 1: the exact median from the second pass
    big = np.finfo(np.float64).max
    train = pd.DataFrame({"H": [big, big, np.nan, 1e308], "L": [-big, -big, -big, -big]})
    workflow = Workflow(["H", "L"] >> FillMissing(strategy="median")).fit(dd.from_pandas(train, npartitions=2))
    assert _op(workflow, "H").fill_values == {"H": big, "L": -big}


def test_normalize_of_a_column_constant_in_training_is_0_whatever_is_served():
    """The model learns nothing from a column constant in training (all missing and filled, say); only centred, a
    value served later reached it unscaled (1e6 after the log as 13.8), far outside everything it trained on, and
    moved the prediction (0.297 to 0.400)."""
    train = pd.DataFrame({"X": [4.0, 4.0, 4.0], "Y": [np.nan] * 3})
    workflow = Workflow(["X", "Y"] >> Normalize()).fit(train)
    out = workflow.transform(pd.DataFrame({"X": [4.0, 6.0, -1e300, np.nan], "Y": [1.0, 2.0, 3.0, np.nan]}))
    assert out["X"].fillna(9).abs().tolist() == [0.0, 0.0, 0.0, 9.0]  # missing stays missing
    assert out["Y"].fillna(9).abs().tolist() == [0.0, 0.0, 0.0, 9.0]


@pytest.mark.parametrize("partitions", [1, 3])
def test_normalize_of_a_column_with_infinite_values_is_refused_naming_it(partitions):
    """An infinity left no mean or spread, and the column became 0 everywhere (NaN where it was infinite), silently."""
    ratio = pd.DataFrame({"ratio": [0.5, 1.5, 2.5, np.inf, 3.5, 4.5]})
    with pytest.raises(BadInputError, match="column 'ratio': Normalize found infinite values"):
        Workflow(["ratio"] >> FillMissing(strategy="median") >> Normalize()).fit(dd.from_pandas(ratio, npartitions=partitions))
    counts = pd.DataFrame({"x": [-1.0, 0.0, 1.0, 2.0, 3.0, 4.0]})
    with pytest.raises(BadInputError, match="column 'x': Normalize found infinite values.*LogOp of -1"):
        Workflow(["x"] >> LogOp() >> Normalize()).fit(dd.from_pandas(counts, npartitions=partitions))
    fine = Workflow(["x"] >> LogOp(signed=True) >> Normalize()).fit(dd.from_pandas(counts, npartitions=partitions))
    assert np.isfinite(fine.transform(counts)["x"]).all()


@pytest.mark.parametrize("partitions", [1, 3])
def test_normalize_of_one_value_after_log_has_std_0_and_of_a_large_offset_its_std(partitions):
    """Moments as sums of squares cancel: log1p(7) in every row had a std of 1e-8 (a 7.5 served later became
    millions), and values near 1e9 with std 1 got a std that was rounding noise."""
    rng = np.random.default_rng(0)
    train = pd.DataFrame({"K": np.full(3000, 7.0), "B": rng.normal(1e9, 1.0, 3000)})
    chained = Workflow((["K"] >> LogOp() >> Normalize()) + (["B"] >> Normalize()))
    workflow = chained.fit(dd.from_pandas(train, npartitions=partitions))
    normalize = [op for ops in workflow.operators() for op in ops if isinstance(op, Normalize)]
    assert [op.stds.get("K") for op in normalize if "K" in op.stds] == [0.0]
    assert next(op.stds["B"] for op in normalize if "B" in op.stds) == pytest.approx(train["B"].std(), rel=1e-9)
    out = workflow.transform(pd.DataFrame({"K": [7.0, 7.5], "B": [1e9, 1e9 + 1]}))
    assert out["K"].abs().tolist() == [0.0, 0.0]


def test_normalize_shifts_by_the_first_present_value_even_past_the_first_thousand_rows():
    """The moments' shift is each column's first present value, looked for in the first rows before all of them."""
    from pipeline.etl.ops.continuous import _first_true, _moments

    mask = np.zeros((3, 3000), dtype=bool)
    mask[0, 5] = mask[0, 2900] = mask[1, 2500] = True
    assert _first_true(mask).tolist() == [5, 2500, 0]
    assert _first_true(mask[:, :10]).tolist() == [5, 0, 0]
    late = pd.DataFrame({"L": [np.nan] * 2000 + [1e9 + 1.0, 1e9 + 3.0]})
    count, mean, squares, missing = _moments(late, ["L"])[:, 0]
    assert (count, mean, squares, missing) == (2.0, 1e9 + 2.0, 2.0, 2000.0)


def test_the_standard_workflow_keeps_the_order_and_sign_of_negative_values():
    """Clip(min_value=0) before the log made every negative value 0: a column of temperatures below zero
    became one value, and a model of it learned nothing."""
    from pipeline.etl.config import EtlConfig
    from pipeline.etl.defaults import default_workflow

    values = [-1e6, -12.5, -10.0, -1.0, -0.5, 0.0, 0.5, 3.0, 50.0, 1e9]
    train = pd.DataFrame({"label": [0, 1] * 5, "t": values, "c": ["a"] * 10})
    roles = {"label": "label", "continuous": ["t"], "categorical": ["c"], "multihot": []}
    out = default_workflow(roles, EtlConfig(freq_threshold=0)).fit(train).transform(train)["t"].to_numpy()
    assert (np.diff(out) > 0).all()
    logged = np.sign(values) * np.log1p(np.abs(values))
    np.testing.assert_allclose(out, (logged - logged.mean()) / logged.std(ddof=1), rtol=1e-6)


def test_bucketize_and_cast_match_numpy():
    values = np.array([-1.0, 0.0, 0.5, 1.0, 9.0, np.nan])
    df = pd.DataFrame({"X": values, "L": pd.array([1, 0, 1, 1, 0, 0], dtype="int8")})
    out = Workflow((["X"] >> Bucketize([0, 1, 5])) + (["L"] >> Cast("float32"))).fit(df).transform(df)
    np.testing.assert_array_equal(out["X"].to_numpy(), np.digitize(values, [0, 1, 5]))
    assert out["X"].dtype == np.int32 and out["L"].dtype == np.float32
    assert out["L"].tolist() == [1.0, 0.0, 1.0, 1.0, 0.0, 0.0]


def test_ops_handle_an_all_empty_frame():
    empty = pd.DataFrame({"C": pd.Series([], dtype="str"), "I": pd.Series([], dtype="float64")})
    train = pd.DataFrame({"C": ["a", "b"], "I": [1.0, 2.0]})
    workflow = Workflow((["C"] >> Categorify()) + (["I"] >> FillMissing() >> LogOp() >> Normalize()))
    out = workflow.fit(train).transform(empty)
    assert len(out) == 0 and out["C"].dtype == np.int32 and out["I"].dtype == np.float32


def test_lambda_op_runs_in_process_but_refuses_to_save(tmp_path):
    df = pd.DataFrame({"X": [1.0, 2.0]})
    workflow = Workflow(["X"] >> LambdaOp(lambda s: s * 10, name="times_ten")).fit(df)
    assert workflow.transform(df)["X"].tolist() == [10.0, 20.0]
    with pytest.raises(UserError, match=r"LambdaOp\(times_ten\) runs only in this process and cannot be saved"):
        workflow.save(tmp_path / "wf")
    assert not (tmp_path / "wf").exists()


def test_bad_numbers_say_what_was_expected():
    df = pd.DataFrame({"X": ["1", "two"]})
    with pytest.raises(BadInputError, match="column 'X': expected numbers"):
        Workflow(["X"] >> FillMissing()).transform(df)


@pytest.mark.parametrize("make, message", [
    (lambda: Clip(), "give min_value, max_value or both"),
    (lambda: Bucketize([3, 1]), "increasing"),
    (lambda: HashBucket(0), "num_buckets must be in \\[1, "),
    (lambda: HashIds(1000), "capacity must be a positive multiple of 128"),
    (lambda: FillMissing(strategy="mode"), "constant or median"),
    (lambda: ["A"] >> HashedCross(10), "two or more columns"),
    (lambda: Categorify(freq_threshold=-1), ">= 0"),
])
def test_bad_operator_settings(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_an_operators_output_frame_holds_its_columns_as_they_are():
    """Each operator's pandas output is put together without copying its columns into one 2-d block (pandas'
    consolidation copied every column of every operator's output, a third of a partition's transform)."""
    from pipeline.etl.frames import frame_like

    like = pd.DataFrame({"a": [1.0, 2.0, 3.0]})
    columns = {"x": np.arange(3.0), "y": np.arange(3.0) * 2, "z": np.arange(3, dtype=np.int32)}
    frame = frame_like(like, columns)
    assert all(np.shares_memory(frame[name].to_numpy(), values) for name, values in columns.items())
    assert frame.index.equals(like.index) and list(frame.columns) == ["x", "y", "z"]
