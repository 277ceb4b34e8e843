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
        if isinstance(expected, pd.Series):  # multi-hot lists
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
    Clip(max_value=3.5), Clip(min_value=-2, max_value=4), LogOp(), Normalize(),
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


def test_categorify_looks_small_batches_up_in_one_pass_and_large_ones_as_each_column_would():
    """At 32 rows every one-hot string column goes through the one pass; at 1,000 rows only the large vocabulary."""
    fitted = _fitted(Categorify(), _categories(6000, 0))
    vocabularies = {name: len(fitted.vocabularies[name]) for name in ("small", "large", "object")}
    assert vocabularies["small"] == 4 and vocabularies["large"] > 3000  # "" is a value of each
    looked_up = {rows: [name for name, size in vocabularies.items() if categorify._looked_up(rows, size)]
                 for rows in (32, 1000)}
    assert looked_up == {32: ["small", "large", "object"], 1000: ["large"]}


def test_a_refit_vocabulary_is_looked_up_afresh_by_the_many_column_transform():
    workflow = Workflow(["C", "D"] >> Categorify())
    one_row = {"C": np.array(["b"], dtype=object), "D": np.array(["x"], dtype=object)}
    workflow.fit(pd.DataFrame({"C": list("aaabbc") * 3, "D": list("xxyyyz") * 3}))
    assert {n: v.tolist() for n, v in workflow.transform_columns(one_row).items()} == {"C": [3], "D": [3]}
    workflow.fit(pd.DataFrame({"C": list("abbbcc") * 3, "D": list("xxxyyz") * 3}))
    assert {n: v.tolist() for n, v in workflow.transform_columns(one_row).items()} == {"C": [2], "D": [2]}
