"""An operator's columns computed together (``transform_many``, the serving path) equal each computed alone
(``transform_column``), bit for bit.

The numeric operators compute one float64 matrix of all their columns; each is compared with its own
``transform_column`` on the same arrays, drawn with missing values, every column representation the
serving path and the in-memory frames give, and 0, 1, 32 or 1,000 rows.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from pipeline.etl import Clip, FillMissing, LogOp, MissingIndicator, Normalize, Workflow

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
