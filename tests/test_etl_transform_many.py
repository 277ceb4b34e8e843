"""An operator's columns computed together (``transform_many``, the serving path) equal each computed alone
(``transform_column``), bit for bit.

The numeric operators compute one float64 matrix of all their columns, Categorify looks all its
one-hot columns up in one pass; each is compared with its own ``transform_column`` on the same
arrays, drawn with missing values, values unseen at fit, empty strings, every column representation
the serving path and the in-memory frames give, and 0, 1, 32 or 1,000 rows.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from pipeline.etl import Categorify, Clip, FillMissing, LogOp, MissingIndicator, Normalize, Workflow
from pipeline.etl.ops import categorify

# LogOp of the negative values drawn below gives -inf and NaN on purpose (their bits are compared too).
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in log1p:RuntimeWarning")

ROWS = [0, 1, 32, 1000]


def _numbers(n: int, seed: int) -> dict:
    """Numeric columns in the representations the serving path and in-memory frames hand an operator."""
    rng = np.random.default_rng(seed)
    missing = rng.random(n) < 0.25
    counts = rng.lognormal(1, 2, n).round() - 3
    floats = np.where(missing, np.nan, rng.standard_normal(n) * 10)
    floats[rng.random(n) < 0.05] = -0.0
    return {
        "f64": floats,  # a row of the request's matrix: float64, NaN missing
        "int_rows": np.where(missing, np.nan, counts),
        "arrow_int": pd.arrays.ArrowExtensionArray(pa.array(counts, mask=missing).cast(pa.int64())),
        "arrow_float": pd.arrays.ArrowExtensionArray(pa.array(floats * 0.5, mask=missing)),
        "nullable": pd.array(np.where(missing, np.nan, counts), dtype="Float64").astype("Int64"),
        "int64": rng.integers(-5, 60, n),
        "all_missing": np.full(n, np.nan),
        "constant": np.full(n, 7.0),
    }


def _words(n: int, seed: int, vocab: int, uniform: bool = False) -> np.ndarray:
    rng = np.random.default_rng(seed)
    drawn = rng.integers(0, vocab, n) if uniform else rng.zipf(1.3, n) % vocab
    words = np.array([f"w{i}" for i in drawn], dtype=object)
    words[rng.random(n) < 0.1] = None
    words[rng.random(n) < 0.05] = ""  # an empty string is a value, not a missing one
    return words


def _categories(n: int, seed: int) -> dict:
    """String columns, their vocabularies from 3 to a few thousand values, in each representation."""
    small, large = _words(n, seed, 3), _words(n, seed + 1, 5000, uniform=True)
    return {
        "small": pd.arrays.ArrowExtensionArray(pa.array(small, pa.string())),
        "large": pd.arrays.ArrowExtensionArray(pa.array(large, pa.string())),
        "object": _words(n, seed + 2, 60),
        "dictionary": pd.arrays.ArrowExtensionArray(pa.array(_words(n, seed + 3, 60), pa.string()).dictionary_encode()),
        "large_string": pd.arrays.ArrowExtensionArray(pa.array(_words(n, seed + 4, 60), pa.large_string())),
        "integers": pd.arrays.ArrowExtensionArray(pa.array(np.arange(n) % 13, pa.int64())),
        "lists": pd.arrays.ArrowExtensionArray(pa.array(
            [None if i % 7 == 0 else [f"t{(i * j) % 9}" for j in range(i % 4)] for i in range(n)],
            pa.list_(pa.string()))),
    }


def _fitted(op, columns: dict):
    frame = pd.DataFrame({name: pd.Series(values) for name, values in columns.items()})
    return Workflow(list(columns) >> op).fit(frame).output.op


def _assert_same(many: dict, alone: dict) -> None:
    assert list(many) == list(alone)
    for name, expected in alone.items():
        got = many[name]
        if isinstance(expected, (pd.Series, pd.api.extensions.ExtensionArray)):  # multi-hot lists
            assert pa.array(got).equals(pa.array(expected)), name
            continue
        expected, got = np.asarray(expected), np.asarray(got)
        assert got.dtype == expected.dtype and got.shape == expected.shape, name
        assert got.view(f"u{got.itemsize}").tolist() == expected.view(f"u{expected.itemsize}").tolist(), name


def _each(op, columns: dict) -> dict:
    names = op.output_columns(list(columns))
    return {out: op.transform_column(name, values) for (name, values), out in zip(columns.items(), names)}


NUMERIC = [
    FillMissing(fill_value=-1.5), FillMissing(strategy="median"), MissingIndicator(), Clip(min_value=0),
    Clip(max_value=3.5), Clip(min_value=-2, max_value=4), LogOp(), LogOp(signed=True), Normalize(),
]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("op", NUMERIC, ids=repr)
def test_numeric_columns_together_equal_each_alone(op, rows):
    fitted = _fitted(op, _numbers(500, seed=0))
    columns = _numbers(rows, seed=rows + 1)
    many = fitted.transform_many(columns)
    assert all(isinstance(values, np.ndarray) and values.base is not None for values in many.values())  # rows of one matrix
    _assert_same(many, _each(fitted, columns))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("freq_threshold", "max_vocab_size"), [(0, 0), (3, 0), (0, 20), (2, 1000)])
def test_categorify_columns_together_equal_each_alone(freq_threshold, max_vocab_size, rows):
    fitted = _fitted(Categorify(freq_threshold=freq_threshold, max_vocab_size=max_vocab_size), _categories(6000, 0))
    columns = _categories(rows, seed=rows + 7)  # many values unseen at fit: a zipf draw of another seed
    _assert_same(fitted.transform_many(columns), _each(fitted, columns))


def test_categorify_finds_a_block_in_one_pass_up_to_a_bound_and_beyond_it_each_column_alone(monkeypatch):
    """Up to ``_INDEXED_VALUES`` values a block of text columns is looked up in one pass of the operator's index
    (its codes the rows of one matrix); beyond it each column goes through ``index_in`` alone: the same codes."""
    from pipeline.etl.blocks import ColumnRows, ColumnSlices

    fitted = _fitted(Categorify(), _categories(6000, 0))
    names = ["small", "large", "object"]
    text = pa.concat_arrays([pa.array(_words(32, k, size), pa.string()) for k, size in enumerate((3, 5000, 60))])
    block = ColumnSlices(names, text, rows=32)
    together = fitted.transform_many(block)
    assert isinstance(together, ColumnRows)
    monkeypatch.setattr(categorify, "_INDEXED_VALUES", 3 * 32 - 1)
    alone = fitted.transform_many(block)
    assert not isinstance(alone, ColumnRows)
    _assert_same({name: together[name] for name in names}, alone)
    _assert_same(alone, _each(fitted, {name: block[name] for name in names}))


def test_a_refit_vocabulary_is_looked_up_afresh_by_the_many_column_transform():
    workflow = Workflow(["C", "D"] >> Categorify())
    one_row = {"C": np.array(["b"], dtype=object), "D": np.array(["x"], dtype=object)}
    workflow.fit(pd.DataFrame({"C": list("aaabbc") * 3, "D": list("xxyyyz") * 3}))
    assert {n: v.tolist() for n, v in workflow.transform_columns(one_row).items()} == {"C": [3], "D": [3]}
    workflow.fit(pd.DataFrame({"C": list("abbbcc") * 3, "D": list("xxxyyz") * 3}))
    assert {n: v.tolist() for n, v in workflow.transform_columns(one_row).items()} == {"C": [2], "D": [2]}


def _blocks_workflow() -> tuple[Workflow, list[str], list[str], list[str]]:
    """The ETL's usual graph (numbers filled, clipped, logged and normalized beside their missing indicators; text
    and list columns through one Categorify), fitted on in-memory rows."""
    numbers, words, lists = ["a", "b", "c"], ["small", "large", "object"], ["tags"]
    graph = (numbers >> FillMissing(strategy="median") >> Clip(min_value=0) >> LogOp() >> Normalize()) \
        + (numbers >> MissingIndicator()) + ((words + lists) >> Categorify())
    fit = {**dict(zip(numbers, (v for v in _numbers(400, 1).values()))), **_categories(6000, 0)}
    frame = pd.DataFrame({name: pd.Series(fit[name]) for name in numbers + words})
    frame["tags"] = pd.Series(pd.arrays.ArrowExtensionArray(pa.array(
        [[f"t{(i * j) % 9}" for j in range(i % 4)] for i in range(len(frame))], pa.list_(pa.string()))))
    return Workflow(graph).fit(frame), numbers, words, lists


@pytest.mark.parametrize("rows", ROWS)
def test_columns_in_blocks_give_the_bits_of_the_same_columns_one_by_one(rows):
    """A request's columns kind by kind (a matrix of numbers, the text and the list columns each in one Arrow
    array) through ``transform_columns``: each output column holds the bits of the same columns handed over one by
    one, and the numbers and the codes come out as the rows of one matrix each."""
    from pipeline.etl.blocks import BlockColumns, ColumnRows, ColumnSlices

    workflow, numbers, words, lists = _blocks_workflow()
    drawn = _numbers(rows, seed=rows + 3)
    matrix = np.array([drawn["f64"], drawn["int_rows"], drawn["constant"]])
    text = pa.concat_arrays([pa.array(_words(rows, rows + k, size), pa.string()) for k, size in enumerate((3, 5000, 60))])
    tags = pa.array([None if i % 5 == 0 else [f"t{(i + j) % 11}" for j in range(i % 3)] for i in range(rows)],
                    pa.list_(pa.string()))
    blocks = BlockColumns([ColumnRows(numbers, matrix), ColumnSlices(words, text, rows), ColumnSlices(lists, tags, rows)])
    one_by_one = {**dict(zip(numbers, matrix)), **{name: blocks[name] for name in words + lists}}
    got = workflow.transform_columns(blocks)
    assert isinstance(got, BlockColumns)
    _assert_same({name: got[name] for name in got}, workflow.transform_columns(one_by_one))
    dense = got.matrix(numbers + [f"{n}_missing" for n in numbers], np.float32)
    assert dense is not None and dense.shape == (rows, 6) and dense.flags.c_contiguous
    codes = got.matrix(words, np.int64)
    assert codes is not None or rows > 16, "at a few rows every text column is looked up in one pass: one matrix"
    if codes is not None:
        np.testing.assert_array_equal(codes, np.stack([got[name] for name in words], axis=1))


def test_a_block_selects_its_columns_without_a_copy_where_they_follow_each_other():
    from pipeline.etl.blocks import BlockColumns, ColumnRows, ColumnSlices

    matrix = np.arange(12.0).reshape(4, 3)
    rows = ColumnRows(["w", "x", "y", "z"], matrix)
    assert rows.select(["w", "x", "y", "z"]) is rows
    assert np.shares_memory(rows.select(["x", "y"]).matrix, matrix)
    assert rows.select(["z", "w"]).matrix.tolist() == [[9.0, 10.0, 11.0], [0.0, 1.0, 2.0]]
    text = ColumnSlices(["p", "q"], pa.array(["a", None, "b", "c", "d", None]), rows=3)
    assert text["q"].tolist()[:2] == ["c", "d"] and pd.isna(text["q"][2])
    both = BlockColumns([rows, text, {"label": np.zeros(3)}])
    assert list(both) == ["w", "x", "y", "z", "p", "q", "label"]
    assert both.matrix(["y", "z", "label"], np.float32) is None
    assert both.matrix(["y", "z", "w"], np.float32).tolist() == [[6, 9, 0], [7, 10, 1], [8, 11, 2]]
    mixed = both.select(["z", "p", "q"])
    assert isinstance(mixed, BlockColumns) and [type(b).__name__ for b in mixed.blocks] == ["ColumnRows", "ColumnSlices"]
