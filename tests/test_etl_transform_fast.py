"""The in-memory transform (pandas in, column by column) equals the partition path, bit for bit.

``Workflow.transform(pandas_frame)`` runs the serving path; ``Workflow.transform_partition`` is what every
Dask partition runs, a DataFrame per node and each operator's own ``transform``: the reference.
Frames are drawn with nulls, values unseen at fit, every column dtype the readers produce, and
0, 1 or many rows.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import dask.dataframe as dd
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.errors import BadInputError
from pipeline.etl import (
    Bucketize,
    Cast,
    Categorify,
    Clip,
    FillMissing,
    HashBucket,
    HashedCross,
    LambdaOp,
    LogOp,
    Normalize,
    Workflow,
)

# LogOp of the negative values drawn below gives -inf and NaN on purpose (their bits are compared too).
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in log1p:RuntimeWarning")


class _Shifted(Clip):
    """A subclass that changes ``transform``: the fast path must run it, not Clip's array version."""

    def transform(self, df):
        return super().transform(df) + 1.0


def _frame(n: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    missing = rng.random(n) < 0.2
    counts = rng.lognormal(1, 2, n).round() - 3
    counts_nan = np.where(missing, np.nan, counts)
    words = np.array([f"w{i}" for i in rng.zipf(1.3, n) % (40 + 10 * seed)], dtype=object)
    words[rng.random(n) < 0.15] = None
    ints = rng.integers(-5, 60, n)
    lists = [None if i % 7 == 0 else [None if j == 3 else f"t{j}" for j in rng.integers(0, 12 + seed, i % 4)]
             for i in range(n)]
    frame = pd.DataFrame({
        "label": rng.integers(0, 2, n).astype("int8"),
        "f64": counts_nan,
        "i64": ints,
        "nullable": pd.array(counts_nan, dtype="Float64").astype("Int64"),
        "arrow_int": pd.arrays.ArrowExtensionArray(pa.array(counts, mask=missing).cast(pa.int64())),
        "arrow_float": pd.arrays.ArrowExtensionArray(pa.array(counts_nan * 0.5, mask=missing)),
        "obj": words,
        "arrow_str": pd.arrays.ArrowExtensionArray(pa.array(words, pa.string())),
        "dict_str": pd.arrays.ArrowExtensionArray(pa.array(words, pa.string()).dictionary_encode()),
        "int_cat": pd.array(np.where(missing, np.nan, ints % 13), dtype="Float64").astype("Int64"),
        "tags": pd.arrays.ArrowExtensionArray(pa.array(lists, pa.list_(pa.string()))),
    }, index=pd.RangeIndex(100, 100 + 3 * n, 3))
    # The same columns again, for more chains (a column comes out of one branch only).
    return frame.assign(**{f"{name}{suffix}": frame[name] for name in frame.columns for suffix in ("_b", "_c")})


def _workflow(saveable: bool = False) -> Workflow:
    numbers = ["f64", "i64", "nullable", "arrow_int", "arrow_float"]
    categories = ["obj", "arrow_str", "dict_str", "int_cat", "tags"]
    graph = (
        (["label"] >> Cast("float32"))
        + (numbers >> FillMissing(fill_value=-1.5) >> Clip(min_value=0) >> LogOp() >> Normalize())
        + (["f64_b", "arrow_float_b"] >> FillMissing(strategy="median") >> Clip(max_value=3) >> Bucketize([0.5, 1, 2]))
        + (categories >> Categorify(freq_threshold=2))
        + (["obj_b", "tags_b"] >> HashBucket(17))
        + (["arrow_str_b", "int_cat_b"] >> HashedCross(5))
        + (["f64_c", "nullable_c", "arrow_float_c"] >> FillMissing() >> LogOp())  # float64 out: no rounding
        + (["arrow_int_c"] >> Clip(min_value=-1, max_value=5))
        + (["dict_str_b"] >> Categorify() >> Normalize())
    )
    if not saveable:  # operators that run only in this process
        graph = graph + (["i64_b"] >> Cast("int16") >> Clip(min_value=10, max_value=40) >> _Shifted(max_value=35))
        graph = graph + (["int_cat_c"] >> Categorify() >> LambdaOp(lambda s: s * 2, "double"))
    return Workflow(graph)


def _assert_identical(fast: pd.DataFrame, reference: pd.DataFrame) -> None:
    pd.testing.assert_frame_equal(fast, reference, check_exact=True)
    for name in reference.columns:
        expected = reference[name].to_numpy()
        if expected.dtype.kind == "f":  # same bits: -0.0 against 0.0, NaN payloads
            assert fast[name].to_numpy().view(f"u{expected.itemsize}").tolist() == \
                expected.view(f"u{expected.itemsize}").tolist(), name


@pytest.fixture(scope="module")
def fitted() -> Workflow:
    return _workflow().fit(_frame(400, seed=0))


@pytest.mark.parametrize("rows", [0, 1, 2, 64, 1024])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fast_path_equals_the_partition_path(fitted, rows, seed):
    frame = _frame(rows, seed)
    _assert_identical(fitted.transform(frame), Workflow.transform_partition(frame, fitted.output))


@pytest.mark.parametrize("rows", [0, 1, 64, 1024])
def test_transform_columns_equals_transform_without_a_frame(fitted, rows):
    frame = _frame(rows, seed=2)
    columns = {name: frame[name].array if isinstance(frame[name].dtype, pd.api.extensions.ExtensionDtype)
               else frame[name].to_numpy() for name in frame.columns}
    arrays = fitted.transform_columns(columns)
    assert list(arrays) == fitted.output_columns
    assert not any(isinstance(values, pd.Series) for values in arrays.values())
    _assert_identical(pd.DataFrame(arrays, index=frame.index), fitted.transform(frame))
    with pytest.raises(BadInputError, match=r"the columns to transform: .*missing \['tags'\]"):
        fitted.transform_columns({k: v for k, v in columns.items() if k != "tags"})


def test_a_refit_vocabulary_is_looked_up_afresh():
    workflow = Workflow(["C"] >> Categorify())
    one_row = pd.DataFrame({"C": ["b"]})
    workflow.fit(pd.DataFrame({"C": list("aaabbc") * 3}))
    assert workflow.transform(one_row)["C"].tolist() == [3]
    workflow.fit(pd.DataFrame({"C": list("abbbcc") * 3}))
    assert workflow.transform(one_row)["C"].tolist() == [2]
    _assert_identical(workflow.transform(one_row), Workflow.transform_partition(one_row, workflow.output))


def test_fast_path_equals_the_dask_path(fitted):
    frame = _frame(300, seed=3)
    lazy = fitted.transform(dd.from_pandas(frame, npartitions=1)).compute()
    _assert_identical(fitted.transform(frame), lazy)


def test_fast_path_with_a_repeated_column_name_reads_columns_as_series(fitted):
    frame = _frame(64, seed=1)
    extra = frame[["label"]].rename(columns={"label": "extra"})
    frame = pd.concat([frame, extra, extra], axis=1)  # "extra" twice: columns are looked up by name
    _assert_identical(fitted.transform(frame), Workflow.transform_partition(frame, fitted.output))


def test_fast_path_keeps_extra_columns_out_and_the_row_labels():
    workflow = Workflow(["C"] >> Categorify()).fit(pd.DataFrame({"C": ["a", "b", "a"]}))
    rows = pd.DataFrame({"unused": [1, 2], "C": ["a", "zz"]}, index=["r1", "r2"])
    out = workflow.transform(rows)
    assert list(out.columns) == ["C"] and list(out.index) == ["r1", "r2"]
    assert out["C"].tolist() == [2, 1] and out["C"].dtype == np.int32


def test_a_selection_alone_passes_columns_through():
    workflow = Workflow(["a", "b"]).fit(pd.DataFrame({"a": [1], "b": ["x"]}))
    rows = pd.DataFrame({"b": pd.array(["y", None], dtype="string"), "a": [1.5, np.nan]})
    _assert_identical(workflow.transform(rows), Workflow.transform_partition(rows, workflow.output))


SERVE_PYTHON = Path(__file__).resolve().parents[1] / ".venv-triton" / "bin" / "python"


@pytest.mark.skipif(not SERVE_PYTHON.exists(), reason="the serving environment (make serve-env) is not built here")
def test_fast_path_equals_the_partition_path_in_the_serving_environment(tmp_path):
    """The same comparisons under numpy 1.26 / pandas 2.2, on frames as the parquet reader and plain pandas give them
    (and ``transform_columns`` on their columns)."""
    _workflow(saveable=True).fit(_frame(400, seed=0)).save(tmp_path / "wf")
    for rows in (0, 1, 64):
        table = pa.Table.from_pandas(_frame(rows, seed=1), preserve_index=False).replace_schema_metadata(None)
        pq.write_table(table, tmp_path / f"{rows}.parquet")
    script = (
        "import sys, glob, numpy as np, pandas as pd, pyarrow.parquet as pq\n"
        "from pipeline.etl import Workflow\n"
        "workflow = Workflow.load(sys.argv[1])\n"
        "for path in sorted(glob.glob(sys.argv[2] + '/*.parquet')):\n"
        "    table = pq.read_table(path)\n"
        "    for frame in (table.to_pandas(types_mapper=pd.ArrowDtype), table.to_pandas()):\n"
        "        fast, reference = workflow.transform(frame), Workflow.transform_partition(frame, workflow.output)\n"
        "        pd.testing.assert_frame_equal(fast, reference, check_exact=True)\n"
        "        columns = {n: frame[n].array if isinstance(frame[n].dtype, pd.api.extensions.ExtensionDtype)\n"
        "                   else frame[n].to_numpy() for n in frame.columns}\n"
        "        arrays = pd.DataFrame(workflow.transform_columns(columns), index=frame.index)\n"
        "        pd.testing.assert_frame_equal(arrays, fast, check_exact=True)\n"
        "        for name in reference.columns:\n"
        "            a, b = fast[name].to_numpy(), reference[name].to_numpy()\n"
        "            assert a.dtype.kind != 'f' or (a.view(f'u{a.itemsize}') == b.view(f'u{b.itemsize}')).all(), name\n"
        "print(pd.__version__)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    result = subprocess.run([str(SERVE_PYTHON), "-W", "ignore::RuntimeWarning", "-c", script, str(tmp_path / "wf"),
                             str(tmp_path)], check=False, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("2.2"), result.stdout
