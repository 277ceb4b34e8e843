"""The roles proposed to a table given none: from what its columns hold, in the error that asks for roles."""

from __future__ import annotations

import gzip

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.data.config import DataConfig
from pipeline.data.role_hint import label_column, propose_roles
from pipeline.data.roles import table_role_hint
from pipeline.errors import BadInputError
from pipeline.stages.config import load_config

SAMPLE = pa.table({
    "__index_level_0__": [0, 1, 2, 3],
    "userId": [10, 11, 12, 13],
    "item_id": [5, 6, 5, 7],
    "zip": [10115, 20095, 10115, 80331],
    "age": [31, 45, 22, 38],
    "price": [1.5, 2.0, None, 3.25],
    "city": ["berlin", "hamburg", None, "munich"],
    "premium": [True, False, True, True],
    "tags": ["a|b", "c", "a|c|d", ""],
    "genres": pa.array([["x"], ["y", "z"], [], None]),
    "ts": pa.array([1, 2, 3, 4], pa.timestamp("s")),
    "day": ["2024-03-01", "2024-03-02", None, "2024-03-04"],
    "clicked": [0, 1, 1, 0],
})


def test_each_kind_of_column_gets_the_role_its_values_and_name_say():
    assert propose_roles(SAMPLE, "clicked", "|") == {
        "categorical": ["userId", "item_id", "zip", "city", "premium"],
        "continuous": ["age", "price"],
        "multihot": ["tags", "genres"],
        "time_column": "ts",  # the first column of times; "day" is left out, no feature as it is
        "ignore": [],
    }


def test_the_label_proposed_is_the_zero_one_column_named_so_or_the_only_one():
    assert label_column(SAMPLE) == "clicked"  # "premium" holds booleans too, but its name says nothing
    assert label_column(pa.table({"a": [0, 1], "b": [2, 3]})) == "a"
    assert label_column(pa.table({"a": [0, 1], "b": [1, 0]})) == ""  # two of them, neither named: no guess
    assert label_column(pa.table({"a": [0.0, 1.0]})) == ""


def _hint(path, label: str) -> str:
    return table_role_hint(DataConfig(source="table", path=str(path), label=label))


def test_the_hint_reads_the_first_rows_of_csv_tsv_gzip_and_parquet(tmp_path):
    rows = "user_id,price,city,ts,clicked\n" + "".join(f"{i},{i / 2},c{i % 3},2024-01-0{i % 9 + 1},{i % 2}\n"
                                                          for i in range(50))
    (tmp_path / "a.csv").write_text(rows)
    (tmp_path / "a.tsv").write_text(rows.replace(",", "\t"))
    (tmp_path / "a.csv.gz").write_bytes(gzip.compress(rows.encode()))
    pq.write_table(pa.Table.from_pylist([{"user_id": 1, "price": 0.5, "city": "c", "clicked": 1}]),
                   tmp_path / "a.parquet")
    expected = "data.categorical=[user_id,city] data.continuous=[price] data.time_column=ts"
    for name in ("a.csv", "a.tsv", "a.csv.gz"):
        assert _hint(tmp_path / name, "clicked") == f"perhaps, from {name}: {expected}"
    assert _hint(tmp_path / "a.csv", "label") == f"perhaps, from a.csv: data.label=clicked {expected}"
    assert _hint(tmp_path / "a.parquet", "clicked") == \
        "perhaps, from a.parquet: data.categorical=[user_id,city] data.continuous=[price]"
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    assert _hint(tmp_path / "bad.parquet", "clicked") == ""
    assert _hint(tmp_path / "missing.csv", "clicked") == ""


@pytest.mark.parametrize("roles, message", [
    ([], (r"needs column roles: .*; perhaps, from events.csv: data.label=clicked data.categorical=\[user_id,city\] "
         r"data.continuous=\[price\]$")),
    (["data.label=clicked", "data.continuous=[price]"],
     (r"no categorical or multi-hot feature.*; perhaps, from events.csv: data.categorical=\[user_id,city\] "
     r"data.continuous=\[price\]$")),
])
def test_run_all_without_roles_proposes_them_before_any_stage(tmp_path, roles, message):
    from pipeline.stages.cli import run_stages

    (tmp_path / "events.csv").write_text("user_id,price,city,clicked\n" + "".join(f"{i},{i / 2},c{i % 3},{i % 2}\n"
                                                                               for i in range(50)))
    cfg = load_config(None, [f"workdir={tmp_path / 'work'}", "data.source=table",
                             f"data.path={tmp_path / 'events.csv'}", *roles])
    with pytest.raises(BadInputError, match=message):
        run_stages(["data", "etl", "train"], cfg)
    assert not (tmp_path / "work").exists()


def test_the_hint_for_a_file_pandas_wrote_with_its_index_and_odd_names_pastes_into_a_shell_and_runs(tmp_path):
    """``to_csv`` keeps the index as a column named "" (``Unnamed: 0`` once read back and written again); names
    such as ``a: b``, ``#tag``, ``a,b`` or ``x[0]`` broke the pasted list (YAML read them otherwise)."""
    import json
    import shlex

    import pandas as pd

    from pipeline.stages.cli import run_stages

    n = 60
    frame = pd.DataFrame({"clicked": [i % 2 for i in range(n)], "price usd": [i / 2 for i in range(n)],
                          "a: b": [i * 1.5 for i in range(n)], "#tag": [f"t{i % 3}" for i in range(n)],
                          "x[0]": [f"v{i % 4}" for i in range(n)], "it's": [f"w{i % 2}" for i in range(n)]})
    frame.to_csv(tmp_path / "events.csv")
    pd.read_csv(tmp_path / "events.csv").to_parquet(tmp_path / "events.parquet")
    for name, index in (("events.csv", '""'), ("events.parquet", '"Unnamed: 0"')):
        hint = _hint(tmp_path / name, "label")
        assert f"data.ignore=[{index}]" in hint
        settings = shlex.split(hint.split(": ", 1)[1])
        work = tmp_path / f"work-{name}"
        cfg = load_config(None, [f"workdir={work}", "data.source=table", f"data.path={tmp_path / name}", *settings])
        assert sorted(cfg.data.continuous) == ["a: b", "price usd"]
        assert sorted(cfg.data.categorical) == ["#tag", "it's", "x[0]"]
        run_stages(["data"], cfg)
        assert json.loads(next(work.rglob("ingest_report.json")).read_text())["rows_kept"] == n
    with pytest.raises(BadInputError, match=r"have no role.*drop them: 'data.ignore=\[\"\"\]'"):
        run_stages(["data"], load_config(None, [f"workdir={tmp_path / 'w'}", "data.source=table", "data.label=clicked",
                                                f"data.path={tmp_path / 'events.csv'}", *settings[1:-1]]))
