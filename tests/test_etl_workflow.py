"""Workflow: graph composition, save/load, the version check, serving-side transform, clear errors."""

from __future__ import annotations

import json
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
    Cast,
    Categorify,
    Clip,
    FillMissing,
    HashBucket,
    HashedCross,
    LogOp,
    Normalize,
    Workflow,
    WorkflowVersionError,
)

REPO = Path(__file__).resolve().parents[1]


def _frame(n=600, seed=0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    cats = np.array([f"c{i}" for i in rng.zipf(1.4, n) % 50], dtype=object)
    cats[rng.random(n) < 0.1] = None
    counts = rng.lognormal(1, 2, n).round()
    counts[rng.random(n) < 0.2] = np.nan
    lists = [None if i % 9 == 0 else [f"t{j}" for j in rng.integers(0, 15, i % 4)] for i in range(n)]
    return pd.DataFrame({
        "label": rng.integers(0, 2, n).astype("int8"),
        "I1": pd.array(counts, dtype="Float64").astype("Int64"),
        "C1": cats,
        "C2": rng.choice(["a", "b", "c"], n),
        # Arrow lists, as read from parquet: Dask turns object columns into text.
        "M": pd.Series(pd.arrays.ArrowExtensionArray(pa.array(lists, pa.list_(pa.string())))),
    })


def _workflow() -> Workflow:
    return Workflow(
        (["label"] >> Cast("float32"))
        + (["I1"] >> FillMissing() >> Clip(min_value=0) >> LogOp() >> Normalize())
        + (["C1", "M"] >> Categorify(freq_threshold=2))
        + (["C2"] >> HashBucket(11))
        + (["C1", "C2"] >> HashedCross(7))
    )


def test_graph_composition_and_output_order():
    node = (["A", "B"] >> Clip(min_value=0)) + ["C"] + (["D"] >> LogOp())
    assert node.output_columns == ["A", "B", "C", "D"]
    assert Workflow(node).input_columns == ["A", "B", "C", "D"]
    assert _workflow().output_columns == ["label", "I1", "C1", "M", "C2", "C1_C2"]
    with pytest.raises(ValueError, match="column 'A' would come out twice"):
        (["A"] >> LogOp()) + ["A"]
    with pytest.raises(TypeError, match="expected an operator"):
        Workflow(["A"]).output >> "LogOp"


def test_save_load_round_trip_gives_identical_output(tmp_path):
    train, test = _frame(seed=1), _frame(seed=2)
    workflow = _workflow().fit(dd.from_pandas(train, npartitions=3))
    before = workflow.transform(test)
    workflow.save(tmp_path / "wf")
    record = json.loads((tmp_path / "wf" / "workflow.json").read_text())
    assert record["version"] == 1 and record["output_columns"] == workflow.output_columns
    assert sorted(p.name for p in (tmp_path / "wf").rglob("*.parquet")) == ["00000-C1.parquet", "00001-M.parquet"]
    loaded = Workflow.load(tmp_path / "wf")
    pd.testing.assert_frame_equal(loaded.transform(test), before)
    lazy = loaded.transform(dd.from_pandas(test, npartitions=2)).compute()
    pd.testing.assert_frame_equal(lazy, before)
    workflow.save(tmp_path / "wf")  # saving over an existing workflow replaces it
    pd.testing.assert_frame_equal(Workflow.load(tmp_path / "wf").transform(test), before)


def test_any_column_name_saves_and_loads(tmp_path):
    names = ["a/b", "..", "L" * 300, "prix unitaire é", "%2F"]
    train = pd.DataFrame({name: [f"v{(i + k) % 5}" for i in range(40)] for k, name in enumerate(names)})
    workflow = Workflow(names >> Categorify()).fit(dd.from_pandas(train, npartitions=2))
    before = workflow.transform(train)
    loaded = Workflow.load(workflow.save(tmp_path / "wf"))
    assert len(list((tmp_path / "wf").rglob("*.parquet"))) == len(names)
    pd.testing.assert_frame_equal(loaded.transform(train), before)
    assert all(before[name].nunique() == 5 for name in names)


def test_serving_rows_with_unseen_and_missing_values(tmp_path):
    workflow = _workflow().fit(_frame())
    rows = pd.DataFrame({"label": [0, 1], "I1": [None, 3], "C1": ["never-seen", None], "C2": ["a", None],
                         "M": [["t1", "unseen"], None]})
    out = Workflow.load(workflow.save(tmp_path / "wf")).transform(rows)
    assert out["C1"].tolist() == [1, 0]
    assert out["C2"].tolist()[1] == 0 and out["C1_C2"].tolist()[1] == 0
    assert list(out["M"].tolist()[1]) == [] and out["M"].tolist()[0][1] == 1
    assert not out["I1"].isna().any()


def test_version_check(tmp_path):
    path = _workflow().fit(_frame()).save(tmp_path / "wf")
    record = json.loads((path / "workflow.json").read_text())
    record["version"] = 99
    (path / "workflow.json").write_text(json.dumps(record))
    with pytest.raises(WorkflowVersionError, match="expected pipeline.etl.Workflow version 1, found .* version 99"):
        Workflow.load(path)
    with pytest.raises(FileNotFoundError, match="no saved workflow"):
        Workflow.load(tmp_path / "nothing-here")


def test_missing_columns_and_unfitted_use_are_clear_errors():
    workflow = _workflow()
    with pytest.raises(RuntimeError, match="not fitted"):
        workflow.transform(_frame())
    with pytest.raises(BadInputError, match=r"missing \[.M., .C2.\]; found"):
        workflow.fit(_frame().drop(columns=["C2", "M"]))


def test_fit_in_phases_when_a_statistic_depends_on_another():
    train = pd.DataFrame({"X": [1.0, np.nan, 3.0, 5.0, np.nan]})
    workflow = Workflow(["X"] >> FillMissing(strategy="median") >> Normalize()).fit(dd.from_pandas(train, npartitions=1))
    filled = train["X"].fillna(3.0)
    out = workflow.transform(pd.DataFrame({"X": [np.nan, 5.0]}))["X"]
    np.testing.assert_allclose(out, [(3.0 - filled.mean()) / filled.std(), (5.0 - filled.mean()) / filled.std()], rtol=1e-6)


def test_parquet_path_input(tmp_path):
    frame = _frame()
    (tmp_path / "raw").mkdir()
    for i, rows in enumerate((frame.iloc[:300], frame.iloc[300:])):
        pq.write_table(pa.Table.from_pandas(rows, preserve_index=False).replace_schema_metadata(None),
                       tmp_path / "raw" / f"part-{i}.parquet")
    from_path = _workflow().fit(str(tmp_path / "raw"))
    from_frame = _workflow().fit(frame)
    pd.testing.assert_frame_equal(from_path.transform(frame), from_frame.transform(frame))


SERVE_PYTHON = REPO / ".venv-triton" / "bin" / "python"


@pytest.mark.skipif(not SERVE_PYTHON.exists(), reason="the serving environment (make serve-env) is not built here")
def test_transform_in_the_serving_environment(tmp_path):
    """The saved workflow loads and transforms in the numpy<2 / pandas 2.2 environment, without Dask."""
    workflow = _workflow().fit(_frame())
    workflow.save(tmp_path / "wf")
    rows = _frame(n=40, seed=3)
    records = [{k: (list(v) if isinstance(v, (list, np.ndarray)) else None if pd.isna(v) else v)
                for k, v in row.items()} for row in rows.astype(object).to_dict(orient="records")]
    (tmp_path / "rows.json").write_text(json.dumps(records))
    expected = workflow.transform(pd.DataFrame(records))
    script = (
        "import sys, json, pandas as pd, pyarrow as pa, pyarrow.parquet as pq\n"
        "from pipeline.etl import Workflow\n"
        "rows = pd.DataFrame(json.load(open(sys.argv[2])))\n"
        "out = Workflow.load(sys.argv[1]).transform(rows)\n"
        "assert 'dask' not in sys.modules, 'the serving transform imported dask'\n"
        "pq.write_table(pa.Table.from_pandas(out, preserve_index=False), sys.argv[3])\n"
        "import numpy; print(numpy.__version__, pd.__version__)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([str(SERVE_PYTHON), "-c", script, str(tmp_path / "wf"), str(tmp_path / "rows.json"),
                             str(tmp_path / "out.parquet")], check=False, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("1.") and " 2.2" in result.stdout
    served = pq.read_table(tmp_path / "out.parquet").replace_schema_metadata(None)
    assert served.equals(pa.Table.from_pandas(expected, preserve_index=False).replace_schema_metadata(None))


def test_a_workflow_fitted_on_the_gpu_loads_for_serving_on_cpu(tmp_path):
    """The serving side transforms pandas rows whatever backend the workflow was fitted with."""
    workflow = _workflow().fit(_frame())
    path = workflow.save(tmp_path / "wf")
    record = json.loads((path / "workflow.json").read_text())
    record["backend"] = "cudf"
    (path / "workflow.json").write_text(json.dumps(record))
    rows = _frame(n=20, seed=4)
    pd.testing.assert_frame_equal(Workflow.load(path).transform(rows), workflow.transform(rows))


def test_the_output_schema_comes_from_the_operators():
    from pipeline.etl import Bucketize
    from pipeline.etl.column_schema import CATEGORICAL, CONTINUOUS, LABEL, ColumnSchema, input_schema, to_schema

    workflow = _workflow().fit(_frame())
    roles = {"label": "label", "continuous": ["I1"], "categorical": ["C1", "C2"], "multihot": ["M"]}
    columns = {c.name: c for c in workflow.output_schema(input_schema(roles))}
    assert list(columns) == workflow.output_columns
    assert columns["label"] == ColumnSchema("label", frozenset({LABEL}), "float32")
    assert columns["I1"] == ColumnSchema("I1", frozenset({CONTINUOUS}), "float32")
    categorify = next(op for op, names in workflow.operators() if "C1" in names)
    assert columns["C1"] == ColumnSchema("C1", frozenset({CATEGORICAL}), "int32",
                                         cardinality=len(categorify.vocabularies["C1"]) + 2)
    assert columns["M"].is_list and columns["M"].max_length == categorify.max_lengths["M"] == 3
    assert columns["C2"].cardinality == 12 and columns["C1_C2"].cardinality == 8
    schema = to_schema(list(columns.values()), rows={"train": 600}, row_group_rows=100)
    assert [(c.name, c.role, c.dtype) for c in schema.columns] == [
        ("label", "label", "float32"), ("I1", "continuous", "float32"), ("C1", "categorical", "int32"),
        ("M", "multihot", "list<int32>"), ("C2", "categorical", "int32"), ("C1_C2", "categorical", "int32")]
    assert schema.column("M").max_length == 3 and schema.column("C1").max_length == 0

    # A numeric operator after Categorify makes a continuous column; Bucketize makes a categorical one.
    chained = Workflow((["C1"] >> Categorify() >> Normalize()) + (["I1"] >> Bucketize([1, 10]))).fit(_frame())
    out = {c.name: c for c in chained.output_schema(input_schema(roles))}
    assert out["C1"].tags == frozenset({CONTINUOUS}) and out["C1"].dtype == "float32"
    assert out["I1"].tags == frozenset({CATEGORICAL}) and out["I1"].cardinality == 3
    with pytest.raises(ValueError, match="lacks the columns"):
        chained.output_schema([ColumnSchema("C1")])
    with pytest.raises(ValueError, match="has no role"):
        to_schema([ColumnSchema("x", dtype="float32")], rows={}, row_group_rows=0)


@pytest.mark.parametrize("points", [65_536, 50])
def test_normalize_after_a_median_fill_is_fitted_in_the_fills_phases_with_the_statistics_of_filled_values(
        monkeypatch, points):
    """``FillMissing(median) >> Clip >> LogOp >> Normalize``: Normalize's moments are taken in the fill's phase(s),
    from the present values, and finished with the fill's value once known (``points`` 50: the median takes a
    second phase). The means and stds are those of the filled values; no phase of Normalize's own reads the data."""
    import dask
    import dask.dataframe as dd

    from pipeline.etl import workflow as workflow_module
    from pipeline.etl.ops import median

    monkeypatch.setattr(median, "SUMMARY_POINTS", points)
    rng = np.random.default_rng(4)
    n = 3000
    frame = pd.DataFrame({
        "a": np.where(rng.random(n) < 0.3, np.nan, rng.normal(5, 3, n)),    # clipped at 0, some missing
        "b": np.where(rng.random(n) < 0.5, np.nan, rng.integers(0, 9, n)),  # half missing, ties at the median
        "c": np.full(n, np.nan),                                            # all missing: filled with 0
        "d": rng.normal(-4, 1, n),                                          # none missing, all clipped
    })
    phases = []
    compute = workflow_module._compute_by_kind
    monkeypatch.setattr(workflow_module, "_compute_by_kind", lambda lazy, progress: phases.append(len(lazy))
                        or compute(lazy, progress))
    chain = list(frame.columns) >> FillMissing(strategy="median") >> Clip(min_value=0) >> LogOp() >> Normalize()
    with dask.config.set(scheduler="sync"):
        fitted = Workflow(chain).fit(dd.from_pandas(frame, npartitions=4))
    assert phases == ([2] if points > 100 else [2, 1])
    fill, normalize = fitted.operators()[0][0], fitted.operators()[3][0]
    for name in frame.columns:
        values = np.log1p(frame[name].fillna(frame[name].median() if frame[name].notna().any() else 0.0).clip(0))
        assert fill.fill_of(name) == (frame[name].median() if frame[name].notna().any() else 0.0)
        assert normalize.means[name] == pytest.approx(values.mean(), rel=1e-12, abs=1e-12), name
        if values.std() > 0:
            assert normalize.stds[name] == pytest.approx(values.std(), rel=1e-9), name
        else:
            assert normalize.stds[name] == 0.0, name


def test_a_fill_whose_value_the_chain_makes_missing_adds_nothing_and_other_graphs_keep_their_phases():
    """A fill value that ``LogOp`` makes NaN (below -1) is not counted, as after a fill it is skipped; a statistic
    whose path from the fill is not element-wise (a second parent) waits for the fill's phase as before."""
    import dask.dataframe as dd

    frame = pd.DataFrame({"a": [-5.0, -3.0, np.nan, -2.0, np.nan, 0.5, 1.0]})  # the median, -2, becomes NaN
    fitted = Workflow(["a"] >> FillMissing(strategy="median") >> LogOp() >> Normalize()).fit(
        dd.from_pandas(frame, npartitions=2))
    normalize = fitted.operators()[2][0]
    want = np.log1p(frame["a"].fillna(frame["a"].median()))  # log1p(-3) is NaN: missing, as are the filled ones
    assert want.count() == 2
    assert normalize.means["a"] == pytest.approx(want.mean()) and normalize.stds["a"] == pytest.approx(want.std())
    both = ((["a"] >> FillMissing(strategy="median")) + ["b"]) >> Normalize()
    frame["b"] = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    fitted = Workflow(both).fit(dd.from_pandas(frame, npartitions=2))
    assert fitted.operators()[1][0].means["a"] == pytest.approx(frame["a"].fillna(frame["a"].median()).mean())


def test_save_replaces_only_a_saved_workflow_and_never_the_current_folder(tmp_path, monkeypatch):
    workflow = Workflow(["n"] >> Clip(min_value=0)).fit(pd.DataFrame({"n": [1.0, -2.0]}))
    notebook = tmp_path / "work" / "notebook.ipynb"
    notebook.parent.mkdir()
    notebook.write_text("{}")
    monkeypatch.chdir(notebook.parent)
    for target in (".", "", str(notebook.parent), str(notebook)):
        with pytest.raises(BadInputError, match="replaces its folder"):
            workflow.save(target)
    assert sorted(p.name for p in notebook.parent.iterdir()) == ["notebook.ipynb"]
    (tmp_path / "empty").mkdir()
    workflow.save(tmp_path / "empty")
    saved = workflow.save("wf")  # a relative folder below the current one
    assert saved == notebook.parent / "wf" and (saved / "workflow.json").is_file()
    monkeypatch.chdir(saved)
    with pytest.raises(BadInputError, match="current folder"):
        workflow.save(saved)
    assert Workflow.load(saved).transform(pd.DataFrame({"n": [-1.0]}))["n"].tolist() == [0.0]


def test_operator_parameters_given_as_numpy_values_save_and_load(tmp_path):
    frame = pd.DataFrame({"label": [0, 1, 1], "n": [5, -3, 8], "c": ["a", "b", "a"]})
    workflow = Workflow((["label"] >> Cast(np.float32)) + (["n"] >> Clip(min_value=np.int64(0), max_value=frame.n.max()))
                        + (["c"] >> HashBucket(np.int64(7))))
    before = workflow.fit(frame).transform(frame)
    loaded = Workflow.load(workflow.save(tmp_path / "wf"))
    pd.testing.assert_frame_equal(loaded.transform(frame), before)
    assert before["label"].dtype == np.float32 and before["n"].tolist() == [5.0, 0.0, 8.0]


def test_one_operator_object_on_two_parts_of_the_graph_is_refused():
    norm = Normalize()
    with pytest.raises(ValueError, match="one Normalize object works on two parts"):
        Workflow((["x"] >> norm) + (["y"] >> FillMissing() >> norm))
    both = Workflow(["x", "y"] >> Normalize()).fit(pd.DataFrame({"x": [1.0, 2.0], "y": [10.0, 30.0]}))
    assert both.transform(pd.DataFrame({"x": [1.0], "y": [30.0]})).iloc[0].tolist() == pytest.approx([-0.7071, 0.7071],
                                                                                                      abs=1e-4)


def test_a_column_repeated_in_a_selection_or_in_the_data_is_named():
    with pytest.raises(ValueError, match=r"names \['c'\] more than once"):
        ["c", "c"] >> Categorify()
    frame = pd.DataFrame({"c": ["a", "b", "a"], "x": [1.0, None, 3.0]})
    workflow = Workflow((["c"] >> Categorify()) + (["x"] >> FillMissing())).fit(frame)
    twice = pd.concat([frame, frame[["x"]]], axis=1)
    for data in (twice, dd.from_pandas(twice, npartitions=1)):
        with pytest.raises(BadInputError, match=r"\['x'\] appear more than once"):
            workflow.transform(data)
    with pytest.raises(BadInputError, match=r"\['x'\] appear more than once"):
        Workflow(["x"] >> FillMissing()).fit(twice)


def test_clip_and_cast_refuse_what_they_cannot_do():
    with pytest.raises(ValueError, match="above max_value"):
        Clip(min_value=8, max_value=2)
    with pytest.raises(ValueError, match="NaN"):
        Clip(min_value=float("nan"))
    with pytest.raises(ValueError, match="numeric dtype"):
        Cast("str")
    frame = pd.DataFrame({"x": [1.0, 5.0, 300.0, np.nan]})
    with pytest.raises(BadInputError, match=r"column 'x': Cast to int64 found 1 missing"):
        Workflow(["x"] >> Cast("int64")).fit(frame).transform(frame)
    with pytest.raises(BadInputError, match=r"column 'x': Cast to int8 found values from 1 to 300"):
        Workflow(["x"] >> Cast("int8")).fit(frame[:3]).transform(frame[:3])
    assert Workflow(["x"] >> Cast("int16")).fit(frame[:3]).transform(frame[:3])["x"].tolist() == [1, 5, 300]


def test_hashed_codes_stay_int32():
    for op in (HashBucket, HashedCross):
        with pytest.raises(ValueError, match="int32 codes"):
            op(2**31 - 1)
    frame = pd.DataFrame({"c": ["a", "b", None], "d": ["x", "y", "z"]})
    codes = Workflow(["c"] >> HashBucket(2**31 - 2)).fit(frame).transform(frame)["c"]
    assert codes.dtype == np.int32 and codes.iloc[2] == 0 and (codes.iloc[:2] > 0).all()


def test_id_columns_of_numbers_beyond_int64_are_named_or_read_whole():
    for value in (np.inf, 1e20):
        frame = pd.DataFrame({"item": [1.0, 2.0, value]})
        for op in (Categorify(), HashBucket(10)):
            with pytest.raises(BadInputError, match="column 'item': expected strings or integers"):
                Workflow(["item"] >> op).fit(frame).transform(frame)
    ids = pd.DataFrame({"item": np.array([2**64 - 1, 7, 2**64 - 1], dtype=np.uint64)})
    workflow = Workflow(["item"] >> Categorify()).fit(ids)
    assert workflow.operators()[0][0].vocabularies["item"].to_pylist() == [str(2**64 - 1), "7"]
    assert workflow.transform(ids)["item"].tolist() == [2, 3, 2]


def test_a_parameter_json_cannot_hold_is_refused_not_written_as_null(tmp_path, monkeypatch):
    """Any value other than a numpy one was written as null, and the workflow loaded with that parameter lost."""
    workflow = Workflow(["n"] >> Clip(min_value=0)).fit(pd.DataFrame({"n": [1.0, -2.0]}))
    monkeypatch.setattr(Clip, "get_params", lambda self: {"min_value": object(), "max_value": None})
    with pytest.raises(TypeError, match="a workflow's operators keep JSON values; found <object"):
        workflow.save(tmp_path / "wf")
    assert not (tmp_path / "wf").exists()


def test_a_dask_frame_whose_lists_dask_made_text_is_refused_naming_the_columns():
    """dd.from_pandas turns a column of lists into text ("[1, 2]"); the multi-hot column became one category a row."""
    import dask

    from pipeline.etl.config import EtlConfig
    from pipeline.etl.defaults import default_workflow

    pdf = pd.DataFrame({"label": [0, 1, 0, 1] * 5, "m": [[1, 2], [3], [], [2]] * 5, "c": ["a", "b", "c", "a"] * 5,
                        "x": [1.0, 2, 3, 4] * 5})
    roles = {"label": "label", "continuous": ["x"], "categorical": ["c"], "multihot": ["m"]}
    workflow = default_workflow(roles, EtlConfig(freq_threshold=0))
    made = dd.from_pandas(pdf, npartitions=2)
    with pytest.raises(BadInputError, match=r"the Dask frame's column\(s\) \['m'\] hold lists .* turned into text "
                                            r"\(Dask's dataframe.convert-string\): pass the pandas frame itself"):
        workflow.fit(made[made.c != "z"])
    with dask.config.set({"dataframe.convert-string": False}):
        kept = dd.from_pandas(pdf, npartitions=2)
    with dask.config.set(scheduler="sync"):
        lists = workflow.fit(kept).transform(kept).compute()
    assert lists["m"].tolist() == default_workflow(roles, EtlConfig(freq_threshold=0)).fit(pdf).transform(pdf)["m"].tolist()
    assert isinstance(lists["m"].iloc[0], (list, np.ndarray)) and len(lists["m"].iloc[0]) == 2
