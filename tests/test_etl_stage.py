"""The ETL stage end to end on small data: files, dtypes, schema, reloaded workflow, clear errors."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.errors import BadInputError
from pipeline.etl import Normalize, Workflow
from pipeline.etl.raw_check import check_raw_files
from pipeline.schema import Schema
from pipeline.stages.config import load_config
from pipeline.stages.etl import run


def _config(tmp_path, *overrides):
    return load_config(None, [f"workdir={tmp_path}", "device=cpu", "data.rows=12000", "etl.cluster=threads",
                              "etl.row_group_rows=2048", *overrides])


def _read(folder) -> pa.Table:
    return pa.concat_tables([pq.read_table(p) for p in sorted(folder.glob("part-*.parquet"))])


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("etl-stage")
    cfg = _config(tmp_path)
    return cfg, run(cfg)


def test_stage_writes_the_contract(synthetic_run):
    cfg, summary = synthetic_run
    schema = Schema.load(cfg.paths.schema)
    meta = json.loads((cfg.paths.raw / "meta.json").read_text())
    indicators = [f"{name}_missing" for name in meta["continuous"]]
    assert schema.label == "label" and schema.sparse == meta["categorical"]
    assert schema.continuous == meta["continuous"] + indicators
    assert schema.rows == meta["rows"] == summary["rows"]
    train = _read(cfg.paths.processed / "train")
    raw_train = pa.concat_tables([pq.read_table(p) for p in sorted((cfg.paths.raw / "train").glob("part-*.parquet"))])
    assert train.num_rows == raw_train.num_rows
    assert train.schema.field("label").type == pa.float32()
    for name in schema.continuous:
        assert train.schema.field(name).type == pa.float32() and train[name].null_count == 0
    left_out = 0  # values seen fewer than etl.freq_threshold times (2 by default: once), which map to OOV
    for name in schema.sparse:
        codes = train[name].to_numpy()
        assert train.schema.field(name).type == pa.int32()
        counts = pa.compute.value_counts(raw_train[name].drop_null())
        kept = sum(1 for count in counts.field("counts").to_pylist() if count >= cfg.etl.freq_threshold)
        left_out += len(counts) - kept
        assert schema.column(name).cardinality == kept + 2  # every value seen often enough has a code, plus 0 and 1
        assert codes.min() >= 0 and codes.max() < schema.column(name).cardinality
        assert (codes == 0).sum() == raw_train[name].null_count
    assert cfg.etl.freq_threshold == 2 and left_out > 0
    for part in (cfg.paths.processed / "train").glob("part-*.parquet"):
        meta_part = pq.read_metadata(part)
        assert all(meta_part.row_group(i).num_rows <= 2048 for i in range(meta_part.num_row_groups))


def test_a_missing_value_becomes_the_median_and_its_indicator_is_one_exactly_there(synthetic_run):
    cfg, _ = synthetic_run
    raw_train = pd.concat([pd.read_parquet(p) for p in sorted((cfg.paths.raw / "train").glob("part-*.parquet"))],
                          ignore_index=True)
    train = _read(cfg.paths.processed / "train").to_pandas()
    workflow = Workflow.load(cfg.paths.workflow)
    normalize = next(op for op, _ in workflow.operators() if isinstance(op, Normalize))
    for name in [c for c in raw_train.columns if c.startswith("I")]:
        missing = raw_train[name].isna().to_numpy()
        np.testing.assert_array_equal(train[f"{name}_missing"].to_numpy(), missing.astype(np.float32))
        median = float(raw_train[name].median())
        at_median = np.float32((np.log1p(max(median, 0.0)) - normalize.means[name]) / normalize.stds[name])
        assert (train[name][missing] == at_median).all(), name
        filled = workflow.transform(raw_train.iloc[:1].assign(**{name: None}))
        assert filled[name].iloc[0] == at_median and filled[f"{name}_missing"].iloc[0] == 1.0
    assert train["I1_missing"].sum() > 0 and train["I2_missing"].sum() == 0  # I2 is never missing
    fill = json.loads((cfg.paths.workflow / "workflow.json").read_text())
    saved = next(n["op"] for n in fill["nodes"] if n.get("op", {}).get("type") == "FillMissing")
    assert saved["params"]["strategy"] == "median"
    assert saved["state"]["fill_values"]["I5"] == float(raw_train["I5"].median())


def test_missing_indicators_can_be_left_out_and_must_not_take_an_input_name(tmp_path):
    cfg = _config(tmp_path, "data.rows=3000", "etl.missing_indicator=false")
    run(cfg)
    assert Schema.load(cfg.paths.schema).continuous == [f"I{i}" for i in range(1, 14)]
    rows = "label,price,price_missing\n" + "".join(f"{i % 2},{i},{i % 3}\n" for i in range(60))
    (tmp_path / "clash.csv").write_text(rows)
    clash = _config(tmp_path, "data.source=table", f"data.path={tmp_path / 'clash.csv'}", "data.name=clash",
                    "data.continuous=[price]", "data.categorical=[price_missing]")
    with pytest.raises(BadInputError, match=r"etl.missing_indicator adds the column\(s\) \['price_missing'\], which "
                                            "the data already has.*etl.missing_indicator=false"):
        run(clash)


def test_reloaded_workflow_transforms_raw_rows_to_the_written_output(synthetic_run):
    cfg, _ = synthetic_run
    workflow = Workflow.load(cfg.paths.workflow)
    raw_test = pd.concat([pd.read_parquet(p) for p in sorted((cfg.paths.raw / "test").glob("part-*.parquet"))],
                         ignore_index=True)
    again = pa.Table.from_pandas(workflow.transform(raw_test), preserve_index=False).replace_schema_metadata(None)
    written = _read(cfg.paths.processed / "test")
    assert again.equals(written.cast(again.schema))


def test_outputs_are_lz4_with_columns_without_nulls_required(synthetic_run):
    """What the loader decodes fastest: LZ4 pages, and no definition levels where a column holds no nulls; no min /
    max statistics, which nothing reads (cuDF's writer leaves them out too)."""
    cfg, _ = synthetic_run
    for path in sorted((cfg.paths.processed / "train").glob("part-*.parquet")):
        pf = pq.ParquetFile(path)
        group = pf.metadata.row_group(0)
        assert {group.column(i).compression for i in range(group.num_columns)} <= {"LZ4", "LZ4_RAW"}
        assert not any(field.nullable for field in pf.schema_arrow)
        assert not any(group.column(i).is_stats_set for i in range(group.num_columns))


def test_uncompressed_outputs_hold_the_same_table_and_the_loader_reads_the_same_batches(synthetic_run, tmp_path):
    """``etl.compression=none``: the same required columns and values in plain pages, batches equal to LZ4's."""
    from pipeline.loader import Loader

    cfg, _ = synthetic_run
    plain = _config(tmp_path, "etl.compression=none")
    run(plain)
    for path in sorted((plain.paths.processed / "train").glob("part-*.parquet")):
        group = pq.ParquetFile(path).metadata.row_group(0)
        assert {group.column(i).compression for i in range(group.num_columns)} == {"UNCOMPRESSED"}
        assert not any(field.nullable for field in pq.ParquetFile(path).schema_arrow)
    assert _read(plain.paths.processed / "train").equals(_read(cfg.paths.processed / "train"))
    batches = [list(Loader(c.paths.processed / "train", 512, shuffle=True, seed=1)) for c in (cfg, plain)]
    for a, b in zip(*batches, strict=True):
        assert a.dense.equal(b.dense) and a.label.equal(b.label) and a.sparse.values.equal(b.sparse.values)


def test_an_unknown_compression_is_one_error_line(tmp_path, capsys):
    from pipeline.__main__ import main

    assert main(["run", "etl", f"workdir={tmp_path}", "etl.compression=gzip"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "etl.compression" in err[0] and "lz4" in err[0], err


def test_hash_buckets_and_thresholds(tmp_path):
    cfg = _config(tmp_path, "etl.hash_buckets={C1: 50, C2: 50}", "etl.freq_threshold=5", "etl.max_vocab_size=40")
    run(cfg)
    schema = Schema.load(cfg.paths.schema)
    assert schema.column("C1").cardinality == 51 and schema.column("C2").cardinality == 51
    assert schema.sparse[:3] == ["C1", "C2", "C3"]
    assert max(c for n, c in schema.cardinalities().items() if n not in ("C1", "C2")) <= 42
    assert _read(cfg.paths.processed / "train")["C1"].to_numpy().max() <= 50


def test_hash_ids_keep_columns_as_64_bit_ids_marked_dynamic_in_the_schema(tmp_path):
    from pipeline.etl.ops.hashing import hash_ids

    cfg = _config(tmp_path, "data.rows=3000", "etl.hash_ids={C1: 1024, C3: 256}")
    run(cfg)
    schema = Schema.load(cfg.paths.schema)
    assert schema.dynamic == ["C1", "C3"] and schema.sparse[:3] == ["C1", "C2", "C3"]
    c1 = schema.column("C1")
    assert (c1.dtype, c1.cardinality, schema.column("C2").dynamic) == ("int64", 1024, False)
    columns = {c["name"]: c for c in json.loads(cfg.paths.schema.read_text())["columns"]}
    assert columns["C1"]["dynamic"] is True and "dynamic" not in columns["C2"]  # a static column's is as before
    train = _read(cfg.paths.processed / "train")
    raw = pa.concat_tables([pq.read_table(p) for p in sorted((cfg.paths.raw / "train").glob("part-*.parquet"))])
    assert train.schema.field("C1").type == pa.int64()
    strings = pa.compute.cast(raw["C1"], pa.string()).combine_chunks()
    assert train["C1"].to_numpy().tolist() == hash_ids(strings).tolist()
    assert len(np.unique(train["C1"].to_numpy())) == pa.compute.count_distinct(raw["C1"], mode="all").as_py()


@pytest.mark.parametrize("setting, message", [
    ("etl.hash_ids={C1: 1000}", "etl.hash_ids.C1: expected a multiple of 128"),
    ("etl.hash_ids={C1: 0}", "etl.hash_ids.C1: expected an integer >= 128"),
    ("etl.hash_ids={nope: 128}", r"etl.hash_ids names \['nope'\]"),
])
def test_hash_ids_settings_are_checked(tmp_path, setting, message):
    with pytest.raises((ValueError, BadInputError), match=message):
        run(_config(tmp_path, "data.rows=3000", setting))


def test_multihot_table_source(tmp_path):
    rows = ["label,price,shop,tags"]
    rng = np.random.default_rng(0)
    for i in range(400):
        tags = "|".join(f"t{j}" for j in rng.integers(0, 9, i % 4))
        rows.append(f"{i % 2},{'' if i % 7 == 0 else i},{'s' + str(i % 5) if i % 11 else ''},{tags}")
    (tmp_path / "table.csv").write_text("\n".join(rows) + "\n")
    table = ["data.source=table", f"data.path={tmp_path / 'table.csv'}", "data.continuous=[price]",
             "data.categorical=[shop]", "data.multihot=[tags]"]
    cfg = _config(tmp_path, *table)
    run(cfg)
    schema = Schema.load(cfg.paths.schema)
    tags = schema.column("tags")
    assert (tags.role, tags.dtype, tags.cardinality, tags.max_length) == ("multihot", "list<int32>", 9 + 2, 3)
    train = _read(cfg.paths.processed / "train")
    assert pa.types.is_list(train.schema.field("tags").type) and train.schema.field("tags").type.value_type == pa.int32()
    assert pa.compute.max(pa.compute.list_flatten(train["tags"])).as_py() <= 10

    hashed = _config(tmp_path, *table, "etl.hash_buckets={tags: 16}")
    run(hashed)
    tags = Schema.load(hashed.paths.schema).column("tags")
    assert (tags.cardinality, tags.max_length) == (17, 3)
    codes = pa.compute.list_flatten(_read(hashed.paths.processed / "train")["tags"]).to_numpy()
    assert codes.min() >= 1 and codes.max() <= 16


def test_declared_column_missing_from_the_raw_files_is_one_clear_error(tmp_path):
    from pipeline.data.raw_folder import RawDataset
    from pipeline.etl.defaults import roles_of

    cfg = _config(tmp_path, "data.rows=3000")
    run(cfg)
    raw = RawDataset.load(cfg.paths.raw)
    roles = roles_of(raw)
    roles["continuous"].append("I99")
    with pytest.raises(BadInputError, match=r"column 'I99' \(continuous\) is missing.*remove .*meta.json"):
        check_raw_files(raw.splits, roles)


def test_wrong_raw_types_are_reported_together(tmp_path):
    path = tmp_path / "part-00000.parquet"
    pq.write_table(pa.table({"label": ["yes"], "I1": ["3"], "C1": [1.5], "M": ["a"]}), path)
    roles = {"label": "label", "continuous": ["I1"], "categorical": ["C1"], "multihot": ["M"]}
    with pytest.raises(BadInputError) as err:
        check_raw_files({"train": [path]}, roles)
    message = str(err.value)
    for expected in ("'label' should be integer", "'I1' should be integer or float, found string",
                     "'C1' should be string or integer, found double", "'M' should be list"):
        assert expected in message


def test_training_rows_of_one_label_are_one_clear_error(tmp_path):
    path = tmp_path / "clicks.csv"
    path.write_text("clicked,price,user\n" + "".join(f"1,{i * 0.5},u{i % 3}\n" for i in range(300)))
    roles = ["data.source=table", f"data.path={path}", "data.label=clicked", "data.continuous=[price]",
             "data.categorical=[user]"]
    with pytest.raises(BadInputError, match=r"every one of the \d+ training rows has the label 1: .*data.label"):
        run(_config(tmp_path, *roles))
    path.write_text("clicked,price,user\n" + "".join(f"{int(i % 5 == 0)},{i * 0.5},u{i % 3}\n" for i in range(300)))
    cfg = _config(tmp_path, *roles, "data.rebuild=true")
    assert sum(run(cfg)["rows"].values()) == 300


@pytest.mark.parametrize("split", ["valid", "test"])
def test_validation_or_test_rows_of_one_label_are_one_clear_error(tmp_path, split):
    """Their AUC is undefined: a validation split of one label stopped training after a few steps (no epoch
    improved on NaN) and wrote NaN into result.json."""
    mixed, one = tmp_path / "mixed.csv", tmp_path / "one.csv"
    mixed.write_text("clicked,price,user\n" + "".join(f"{int(i % 4 == 0)},{i * 0.5},u{i % 3}\n" for i in range(400)))
    one.write_text("clicked,price,user\n" + "".join(f"0,{i * 0.5},u{i % 3}\n" for i in range(40)))
    other = "test" if split == "valid" else "valid"
    roles = ["data.source=table", f"data.path={mixed}", f"data.{split}_path={one}", f"data.{other}_fraction=0.2",
             "data.label=clicked", "data.continuous=[price]", "data.categorical=[user]"]
    name = "validation" if split == "valid" else "test"
    use = "the epoch kept is chosen" if split == "valid" else "the model is scored"
    with pytest.raises(BadInputError, match=rf"every one of the 40 {name} rows has the label 0, so their AUC, by which "
                                            rf"{use}, is undefined: .*data.{split}_fraction, or more rows in "
                                            rf"data.{split}_path"):
        run(_config(tmp_path, *roles))


def test_input_too_small_to_leave_training_rows_is_one_clear_error(tmp_path):
    path = tmp_path / "clicks.csv"
    path.write_text("clicked,price\n1,2.5\n0,3.5\n")
    cfg = _config(tmp_path, "data.source=table", f"data.path={path}", "data.label=clicked",
                  "data.continuous=[price]", "data.valid_fraction=0.45", "data.test_fraction=0.45")
    with pytest.raises(BadInputError, match=r"no training rows .*data.path more rows.*data.valid_fraction"):
        run(cfg)


def test_hash_buckets_naming_an_unknown_column(tmp_path):
    with pytest.raises(BadInputError, match=r"etl.hash_buckets names \['nope'\]"):
        run(_config(tmp_path, "data.rows=3000", "etl.hash_buckets={nope: 10}"))


def test_command_line_runs_the_stage_and_prints_bad_input_plainly(tmp_path, capsys):
    from pipeline.stages.cli import main

    common = ["run", "etl", f"workdir={tmp_path}", "data.rows=3000", "--device", "cpu"]
    assert main(common) == 0
    assert (tmp_path / "synthetic" / "processed" / "schema.json").is_file()
    assert main(common + ["etl.hash_buckets={nope: 10}"]) == 2
    err = capsys.readouterr().err
    assert "error: etl.hash_buckets names ['nope']" in err and "Traceback" not in err


def test_an_etl_killed_while_it_transforms_leaves_the_previous_outputs_whole(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    settings = [f"workdir={tmp_path}", "device=cpu", "data.rows=200000", "etl.cluster=threads"]
    first = subprocess.run([sys.executable, "-m", "pipeline", "run", "etl", *settings], capture_output=True,
                           text=True, timeout=300, check=False)
    assert first.returncode == 0, first.stderr
    cfg = load_config(None, settings)
    old_train = sorted(p.name for p in (cfg.paths.processed / "train").glob("*.parquet"))
    old_rows = Schema.load(cfg.paths.schema).rows
    again = subprocess.Popen([sys.executable, "-m", "pipeline", "run", "etl", *settings, "etl.freq_threshold=3"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (cfg.paths.processed / "train.partial").is_dir() and time.monotonic() < deadline:
        time.sleep(0.01)
    again.send_signal(signal.SIGKILL)
    again.wait(30)
    assert Schema.load(cfg.paths.schema).rows == old_rows  # the last finished outputs, which training may take
    assert sorted(p.name for p in (cfg.paths.processed / "train").glob("*.parquet")) == old_train
    assert sum(pq.ParquetFile(p).metadata.num_rows for p in (cfg.paths.processed / "train").glob("*.parquet")) \
        == old_rows["train"]


def test_an_etl_failing_while_it_transforms_leaves_the_previous_outputs_and_no_partial_split(tmp_path, monkeypatch,
                                                                                             capsys):
    """A full disk under an ETL with other settings took the previous outputs' schema with it, and left the
    splits it had written (``<split>.partial``) on the full disk."""
    import errno

    from pipeline.etl import output
    from pipeline.stages.cli import main

    settings = [f"workdir={tmp_path}", "device=cpu", "data.rows=12000", "etl.cluster=threads", "progress=off"]
    assert main(["run", "etl", *settings]) == 0
    processed = load_config(None, settings).paths.processed
    before = {p: p.read_bytes() for p in processed.rglob("*") if p.is_file()}
    written = output.write_part

    def full_after_one(part, path, *args):
        if path.parent.name != "train.partial" or path.name != "part-00000.parquet":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return written(part, path, *args)

    monkeypatch.setattr(output, "write_part", full_after_one)
    capsys.readouterr()
    assert main(["run", "etl", *settings, "etl.freq_threshold=3"]) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in processed.rglob("*") if p.is_file()} == before


def test_values_a_served_request_cannot_carry_are_named_when_the_etl_is_fitted(tmp_path, capsys):
    """Categorical values ending in a zero byte went through data, ETL, training and export, and `run all` failed
    only at the serving stage, whose request tensor pads values with zero bytes."""
    rng = np.random.default_rng(0)
    values = ["a", "a\x00", "b", "b\x00\x00"]
    pd.DataFrame({"x": rng.normal(size=400), "c": pd.Series([values[i % 4] for i in range(400)], dtype=object),
                  "y": rng.integers(0, 2, 400)}).to_parquet(tmp_path / "nul.parquet")
    run(load_config(None, [f"workdir={tmp_path / 'work'}", "device=cpu", "progress=off", "data.source=table",
                           f"data.path={tmp_path / 'nul.parquet'}", "data.label=y", "data.continuous=[x]",
                           "data.categorical=[c]"]))
    said = capsys.readouterr().out
    assert "[etl] note: column c: 2 of its values end in a zero byte" in said and "'a\\x00'" in said


def test_features_the_training_rows_tell_nothing_of_are_named(tmp_path, capsys):
    """A column an export left empty, or one holding a single value, went through every stage without a word."""
    rng = np.random.default_rng(0)
    n = 400
    pd.DataFrame({"x": rng.normal(size=n), "flat": np.full(n, 3.5), "gone": np.full(n, np.nan),
                  "c": [f"u{i % 9}" for i in range(n)], "empty": pd.Series([None] * n, dtype=object),
                  "y": rng.integers(0, 2, n)}).to_parquet(tmp_path / "t.parquet")
    common = [f"workdir={tmp_path / 'work'}", "device=cpu", "progress=off", "data.source=table",
              f"data.path={tmp_path / 't.parquet'}", "data.label=y", "data.categorical=[c,empty]"]
    run(load_config(None, [*common, "data.continuous=[x,flat,gone]"]))
    said = capsys.readouterr().out
    assert "[etl] note: empty kept no value in the training rows" in said
    assert "flat, gone held one value or none in the training rows: the model sees 0 for it" in said
    run(load_config(None, [*common, "data.continuous=[x]", "data.categorical=[c]", "data.ignore=[flat,gone,empty]",
                           "data.rebuild=true"]))
    assert "note:" not in capsys.readouterr().out
