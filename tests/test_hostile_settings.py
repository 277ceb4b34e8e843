"""Hostile settings and saved artifacts through the real command line.

Each refused case must end with exit code 2 and exactly one ``error: ...`` line naming the setting
or the file, never a traceback; each accepted case must keep what the user wrote. The counts of
these cases are in ``docs/HOSTILE_INPUT.md``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import typing
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from pipeline.etl import Categorify, FillMissing, Normalize, Workflow
from pipeline.etl.workflow import WorkflowVersionError
from pipeline.stages.cli import main
from pipeline.stages.config import PipelineConfig, load_config

REPO = Path(__file__).resolve().parents[1]


def _refused(capsys, argv: list[str], *expected: str) -> str:
    """Run the CLI; it must exit 2 with one ``error:`` line that holds every ``expected`` text."""
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for text in expected:
        assert text in err, err
    return err


def _shown(capsys, *overrides: str) -> dict:
    assert main(["config", "show", *overrides]) == 0
    return yaml.safe_load(capsys.readouterr().out)


# -- settings on the command line -------------------------------------------------------------

REFUSED_OVERRIDES = [
    ("train.lr=.nan", "train.lr", ">= 0"),
    ("train.lr=nan", "train.lr", ">= 0"),
    ("train.lr=inf", "train.lr", ">= 0"),
    ("train.lr=-0.1", "train.lr", ">= 0"),
    ("train.embedding_lr=-.inf", "train.embedding_lr", ">= 0"),
    ("train.weight_decay=-1e-4", "train.weight_decay", ">= 0"),
    ("train.min_lr_ratio=1.5", "train.min_lr_ratio", "[0, 1]"),
    ("serve.http_port=70000", "serve.http_port", "[0, 65535]"),
    ("serve.grpc_port=-1", "serve.grpc_port", "[0, 65535]"),
    ("serve.startup_timeout=nan", "serve.startup_timeout", "> 0"),
    ("serve.smoke_rows=0", "serve.smoke_rows", ">= 1"),
    ("data.size=inf", "data.size", "> 0"),
    ("data.valid_fraction=1.5", "data.valid_fraction", "[0, 1)"),
    ("data.test_fraction=nan", "data.test_fraction", "[0, 1)"),
    ("data.rows=0", "data.rows", ">= 1"),
    ("export.cache_fraction=nan", "export.cache_fraction", "[0, 1]"),
    ("export.max_queue_delay_us=-5", "export.max_queue_delay_us", ">= 0"),
    ("distributed.timeout_s=0", "distributed.timeout_s", "> 0"),
    ("distributed.memory_per_rank_mb=.inf", "distributed.memory_per_rank_mb", ">= 0"),
    ("distributed.sharding={t_C1: 'table_wise:x'}", "distributed.sharding.t_C1", "table_wise"),
    ("etl.row_group_rows=0", "etl.row_group_rows", ">= 1"),
    ("etl.workers=-1", "etl.workers", ">= 0"),
    ("etl.hash_buckets={C1: 0}", "etl.hash_buckets.C1", "in [1, 2147483646]"),
    ("etl.hash_buckets={C1: 3000000000}", "etl.hash_buckets.C1", "in [1, 2147483646]"),
    ("etl.cluster=dask", "etl.cluster", "auto, local or threads"),
    ("serve.host=::1", "serve.host", "IPv6 addresses are not served"),
    ("etl.hash_ids={C3:1024}", "etl.hash_ids", "write {C3: 1024} (a space after the colon)"),
    ("train.run=" + "a" * 300, "train.run", "at most 200 characters, got 300"),
    ("train.log_every=0", "train.log_every", ">= 1"),
    ("train.reader=arrow", "train.reader", "auto, pyarrow, cudf"),
    ("train.keep_checkpoints=0", "train.keep_checkpoints", ">= 1"),
    ("train.bottom_mlp=64,-3", "train.bottom_mlp", ">= 1"),
    ("seed=-1", "seed", "[0, 4294967295]"),
    ("data.rows=0x1F", "data.rows", "decimal integer"),
    ("data.rows=0o17", "data.rows", "decimal integer"),
    ("train.epochs=1.5", "train.epochs", "integer"),
    ("train.resume=maybe", "train.resume", "true or false"),
    ("train.top_mlp=[64, 1", "train.top_mlp=[64, 1", "column"),
]


@pytest.mark.parametrize("override, name, allowed", REFUSED_OVERRIDES, ids=[c[0] for c in REFUSED_OVERRIDES])
def test_a_hostile_override_is_one_error_line_naming_the_setting_and_its_range(capsys, override, name, allowed):
    _refused(capsys, ["config", "show", override], name, allowed)


def test_a_hostile_override_through_python_dash_m_has_no_traceback(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for override in ("train.lr=.nan", "serve.http_port=70000", "data.rows=0x1F"):
        proc = subprocess.run([sys.executable, "-m", "pipeline", "run", "train", f"workdir={tmp_path}", override],
                              check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and override.split("=")[0] in lines[0], proc.stderr
    assert not (tmp_path / "synthetic").exists()


def _numeric_settings(cls=PipelineConfig, prefix=""):
    """(key, hostile values) of every setting that holds numbers, found from the dataclasses."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint, key = hints[f.name], f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hint):
            yield from _numeric_settings(hint, f"{key}.")
        elif hint is float:
            yield key, ["-1", ".nan", "inf", "-.inf"]
        elif hint is int:
            yield key, ["-1"]
        elif typing.get_args(hint) == (int,):
            yield key, ["-1", "0"]
        elif typing.get_args(hint) == (str, int):
            yield key, ["{t: -1}", "{t: 0}"]


NUMERIC = list(_numeric_settings())


@pytest.mark.parametrize("key, values", NUMERIC, ids=[k for k, _ in NUMERIC])
def test_every_numeric_setting_has_a_range(capsys, key, values):
    """No number of the settings may be negative, and none may be nan or infinite."""
    for value in values:
        _refused(capsys, ["config", "show", f"{key}={value}"], key, "expected")


def test_string_settings_keep_the_text_as_written(capsys):
    shown = _shown(capsys, "data.source=table", "data.path=t.csv", "data.name=0123", "workdir=0x1F", "data.label=1e3", "data.categorical=0123,0x1F,true",
                   "data.list_separator=;", "etl.scheduler=tcp://10.0.0.5:8786", "data.continuous=[07, 1_000]")
    assert shown["data"]["name"] == "0123"
    assert shown["workdir"] == "0x1F"
    assert shown["data"]["label"] == "1e3"
    assert shown["data"]["categorical"] == ["0123", "0x1F", "true"]
    assert shown["data"]["continuous"] == ["07", "1_000"]
    assert shown["data"]["list_separator"] == ";"
    assert shown["etl"]["scheduler"] == "tcp://10.0.0.5:8786"
    assert str(load_config(None, ["data.name=0123"]).paths.root) == "data/0123"


def test_string_settings_keep_the_text_as_written_in_the_yaml_file(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text("workdir: 0x1F\ndata:\n  source: table\n  path: t.csv\n  name: 0123\n  label: 1_0\n"
                 "  categorical: [0123, on, 1e3]\n"
                 "etl:\n  hash_buckets: {0123: 7}\n")
    cfg = load_config(f)
    assert (cfg.workdir, cfg.data.name, cfg.data.label) == ("0x1F", "0123", "1_0")
    assert cfg.data.categorical == ["0123", "on", "1e3"]
    assert cfg.etl.hash_buckets == {"0123": 7}


@pytest.mark.parametrize("text, value", [("1e-5", 1e-5), ("1E5", 1e5), (".5", 0.5), ("3", 3.0), ("2.5e-3", 2.5e-3)])
def test_floats_in_every_notation(tmp_path, text, value):
    assert load_config(None, [f"train.lr={text}"]).train.lr == value
    f = tmp_path / "s.yaml"
    f.write_text(f"train:\n  lr: {text}\n")
    got = load_config(f).train.lr
    assert got == value and isinstance(got, float)


def test_integers_are_decimal(capsys):
    cfg = load_config(None, ["data.rows=0123", "train.epochs=2.0", "data.chunk_rows=1_000"])
    assert (cfg.data.rows, cfg.train.epochs, cfg.data.chunk_rows) == (123, 2, 1000)


# -- the YAML file ---------------------------------------------------------------------------

@pytest.mark.parametrize("text, line, column", [
    ("train:\n  lr: [0.1\n  epochs: 2\n", 3, 9),
    ("data:\n\trows: 5\n", 2, 1),
    ("train: {lr: 0.1\n", 2, 1),
    ("a: b\n- c\n", 2, 1),
])
def test_a_yaml_syntax_error_names_the_file_line_and_column(tmp_path, capsys, text, line, column):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    err = _refused(capsys, ["config", "show", "--config", str(f)], str(f), f"line {line}")
    assert "column" in err


def test_a_hostile_value_in_the_yaml_file_names_the_setting(tmp_path, capsys):
    f = tmp_path / "s.yaml"
    f.write_text("train:\n  lr: .nan\n")
    _refused(capsys, ["config", "show", "--config", str(f)], "train.lr", ">= 0")
    f.write_text("serve:\n  http_port: 99999\n")
    _refused(capsys, ["config", "show", "--config", str(f)], "serve.http_port", "[0, 65535]")


@pytest.mark.parametrize("content", [b"\xff\xfe\x00bin\x00", b"- 1\n- 2\n", b"--- {a: 1}\n--- {b: 2}\n",
                                     b"train: !!python/object:os.system {}\n", b"train:\n  lr: 0.1\n  lr: 0.2\n"])
def test_a_config_file_that_is_not_settings_is_refused(tmp_path, capsys, content):
    f = tmp_path / "s.yaml"
    f.write_bytes(content)
    _refused(capsys, ["config", "show", "--config", str(f)], str(f))


def test_a_folder_as_the_config_file_is_refused(tmp_path, capsys):
    _refused(capsys, ["config", "show", "--config", str(tmp_path)], str(tmp_path))


# -- saved artifacts: the workflow -------------------------------------------------------------

def _saved_workflow(folder: Path) -> Path:
    rng = np.random.default_rng(0)
    frame = pd.DataFrame({"I1": rng.random(200), "C1": rng.choice(["a", "b", "c"], 200)})
    workflow = Workflow((["I1"] >> FillMissing() >> Normalize()) + (["C1"] >> Categorify()))
    workflow.fit(frame)
    return workflow.save(folder)


def _corrupt(folder: Path, how: str) -> None:
    record_path = folder / "workflow.json"
    record = json.loads(record_path.read_text())
    if how == "not json":
        record_path.write_text(record_path.read_text()[:50])
        return
    if how == "empty":
        record_path.write_text("")
        return
    if how == "a list":
        record_path.write_text("[1, 2]")
        return
    if how == "no nodes":
        del record["nodes"]
    elif how == "version 99":
        record["version"] = 99
    elif how == "no output":
        del record["output"]
    elif how == "parent out of range":
        record["nodes"][-1]["parents"] = [42]
    elif how == "operator params":
        next(n for n in record["nodes"] if "op" in n)["op"]["params"] = {"bogus": 1}
    elif how == "operator state":
        next(n for n in record["nodes"] if "op" in n)["op"]["state"] = {}
    elif how in ("state without a column", "state of text for numbers"):  # a workflow.json edited by hand
        node = next(n for n in record["nodes"] if "op" in n and n["op"]["type"] == "Normalize")
        means = node["op"]["state"]["means"]
        node["op"]["state"]["means"] = {} if how == "state without a column" else {k: "abc" for k in means}
    elif how == "output columns":
        record["output_columns"] = ["I1", "other"]
    elif how == "vocabulary file":
        for path in (folder / "ops").rglob("*.parquet"):
            path.unlink()
    record_path.write_text(json.dumps(record))


CORRUPTIONS = ["not json", "empty", "a list", "no nodes", "version 99", "no output", "parent out of range",
               "operator params", "operator state", "state without a column", "state of text for numbers",
               "output columns", "vocabulary file"]


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_a_corrupt_workflow_is_refused_when_loaded(tmp_path, how):
    folder = _saved_workflow(tmp_path / "workflow")
    _corrupt(folder, how)
    with pytest.raises(WorkflowVersionError, match="workflow"):
        Workflow.load(folder)


@pytest.mark.parametrize("how", ["not json", "no nodes", "version 99", "vocabulary file"])
def test_run_export_refuses_a_corrupt_workflow(tmp_path, capsys, how):
    folder = _saved_workflow(tmp_path / "synthetic" / "workflow")
    _corrupt(folder, how)
    _refused(capsys, ["run", "export", f"workdir={tmp_path}", "device=cpu"], str(folder))
    assert not (tmp_path / "synthetic" / "export").exists()


# -- saved artifacts: raw parquet files ---------------------------------------------------------

@pytest.mark.parametrize("damage", ["a column missing from a middle file", "a truncated file"])
def test_a_damaged_raw_file_is_named_and_the_data_made_again(tmp_path, capsys, damage):
    args = [f"workdir={tmp_path}", "device=cpu", "data.rows=3000", "data.chunk_rows=500", "etl.cluster=threads"]
    assert main(["data", *args]) == 0
    capsys.readouterr()
    files = sorted((tmp_path / "synthetic" / "raw" / "train").glob("part-*.parquet"))
    assert len(files) >= 3
    middle = files[len(files) // 2]
    whole = pq.read_table(middle)
    if damage == "a truncated file":
        middle.write_bytes(middle.read_bytes()[:100])
    else:
        pq.write_table(whole.drop_columns(["C5"]), middle)
    assert main(["run", "etl", *args]) == 0
    out = capsys.readouterr().out
    assert f"{middle}" in out and "building it again" in out
    assert pq.read_table(middle).equals(whole)
    assert json.loads((tmp_path / "synthetic" / "processed" / "schema.json").read_text())["rows"]["train"] == 2400


# -- model sizes that the model cannot be built with --------------------------------------------

def _processed(workdir: Path) -> list[str]:
    """Small processed splits under ``workdir``; the arguments that train on them."""
    from pipeline.loader.synthetic import criteo_schema, write_processed

    args = [f"workdir={workdir}", "device=cpu", "progress=off", "train.batch_size=64", "train.max_steps=2",
            "train.threads=1"]
    write_processed(load_config(None, args).paths.processed, criteo_schema(size=0.0001, categorical=3, continuous=2),
                    {"train": 200, "valid": 100, "test": 100}, row_group_rows=100, seed=1)
    return args


@pytest.mark.parametrize("sizes, expected", [
    (["train.bottom_mlp=[8]"], ("train.bottom_mlp=[8]", "embedding dim (32, the small preset's)",
                                "train.embedding_dim=8")),
    (["train.bottom_mlp=[16,8]", "train.embedding_dim=4"], ("train.bottom_mlp=[16, 8]", "(4, train.embedding_dim)")),
    (["train.model=dcnv2", "train.embedding_dim=8", "train.cross_rank=100000"],
     ("train.cross_rank=100000", "width of the cross layers, 32", "train.cross_rank=32 or less")),
])
def test_model_sizes_that_do_not_fit_together_are_one_error_line_before_a_run_starts(tmp_path, capsys, sizes,
                                                                                    expected):
    args = _processed(tmp_path)
    _refused(capsys, ["run", "train", *args, *sizes], *expected)
    assert not (tmp_path / "synthetic" / "train").exists()


@pytest.mark.parametrize("preset, embedding_dim, rank", [("mlperf", 4, 0), ("mlperf", 128, 0), ("mlperf", 512, 512),
                                                       ("small", 0, 0), ("small", 128, 128)])
def test_a_presets_cross_rank_gives_way_to_full_rank_on_narrow_cross_layers(tmp_path, preset, embedding_dim, rank):
    """The mlperf preset's rank 512 on a table of 3 features (cross layers 16 to 512 wide here) was refused, naming a
    setting the user had not set; a low-rank layer of half the width or more is larger than the full one."""
    from pipeline.schema import Schema
    from pipeline.train.model import model_spec

    cfg = load_config(None, ["train.model=dcnv2", f"train.preset={preset}", f"train.embedding_dim={embedding_dim}"])
    schema = Schema.load(Path(_processed(tmp_path)[0].split("=", 1)[1]) / "synthetic" / "processed" / "schema.json")
    spec = model_spec(cfg.train, schema, "cpu")
    width = spec["embedding_output_dim"] + spec["sizes"]["bottom_mlp"][-1]
    assert spec["sizes"]["cross_rank"] == rank, (width, spec["sizes"])
    assert rank == 0 or 2 * rank < width


def test_a_cross_rank_set_to_the_width_is_full_rank_and_one_below_it_is_kept(tmp_path):
    """Full rank stays a choice on every preset (a run of full-rank layers resumes with it)."""
    from pipeline.schema import Schema
    from pipeline.train.model import model_spec

    schema = Schema.load(Path(_processed(tmp_path)[0].split("=", 1)[1]) / "synthetic" / "processed" / "schema.json")
    width = 32 + 3 * 32  # the small preset's bottom MLP output and 3 tables of dim 32
    for rank, kept in ((width, 0), (width - 1, width - 1), (64, 64)):
        cfg = load_config(None, ["train.model=dcnv2", "train.preset=small", f"train.cross_rank={rank}"])
        assert model_spec(cfg.train, schema, "cpu")["sizes"]["cross_rank"] == kept, rank


def test_dcnv2_with_zero_cross_layers_has_none(tmp_path, capsys):
    from pipeline.modules.models import ModelSizes

    cfg = load_config(None, ["train.model=dcnv2", "train.cross_layers=0"])
    assert ModelSizes.from_train_config(cfg.train, "cpu").cross_layers == 0
    args = _processed(tmp_path)
    assert main(["run", "train", *args, "train.model=dcnv2", "train.cross_layers=0", "train.run=deep"]) == 0
    weights = torch.load(tmp_path / "synthetic" / "train" / "deep" / "model.pt", weights_only=True)
    assert not [k for k in weights if k.startswith("cross.")] and [k for k in weights if k.startswith("deep.")]


def test_an_empty_section_in_the_yaml_file_takes_overrides(tmp_path, capsys):
    f = tmp_path / "s.yaml"
    f.write_text("train:\ndata: ~\nserve:\n  smoke_rows: 3\n")
    shown = _shown(capsys, "--config", str(f), "train.epochs=2", "data.rows=5", "serve.http_port=8000")
    assert (shown["train"]["epochs"], shown["data"]["rows"]) == (2, 5)
    assert (shown["serve"]["smoke_rows"], shown["serve"]["http_port"]) == (3, 8000)


def test_a_section_given_a_value_in_the_yaml_file_is_blamed_on_the_file_under_overrides(tmp_path, capsys):
    f = tmp_path / "s.yaml"
    f.write_text("seed: 1\ntrain: 3\n")
    _refused(capsys, ["config", "show", "--config", str(f), "train.epochs=2"], str(f), "line 2", "train is a section")


def test_nproc_zero_is_refused(capsys):
    _refused(capsys, ["run", "train", "--nproc", "0"], "distributed.nproc", ">= 1")


def test_what_the_machine_refuses_a_write_is_one_error_line_naming_the_file(tmp_path):
    """A folder where the data stage writes raw/meta.json (as a full or read-only disk, an operating system
    error) was a traceback."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    meta = tmp_path / "synthetic" / "raw" / "meta.json"
    meta.mkdir(parents=True)
    proc = subprocess.run([sys.executable, "-m", "pipeline", "data", f"workdir={tmp_path}", "data.rows=2000",
                           "progress=off"], check=False, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr
    expected = f"error: {meta}: Is a directory: a folder stands where a file is written: remove it"
    assert proc.stderr.splitlines() == [expected], proc.stderr


def test_a_write_that_fails_on_a_full_disk_says_so_naming_the_file(tmp_path, monkeypatch):
    """torch.save on a full disk says only "unexpected pos", and Arrow names no file: each write that fails with
    under 1 MiB left is a 'no space left' naming the file, and an Arrow error's errno is read from its text."""
    import errno

    from pipeline import files
    from pipeline.errors import environment_problem

    monkeypatch.setattr(files, "_full", lambda folder: True)
    with pytest.raises(OSError) as err, files.atomic_open(tmp_path / "step-1.pt") as f:
        f.write(b"abc")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    assert err.value.errno == errno.ENOSPC and not list(tmp_path.iterdir())
    assert environment_problem(err.value) == (f"{tmp_path / 'step-1.pt'}: No space left on device: free space on "
                                              "that disk, or choose another workdir")
    try:
        try:
            raise OSError("Error writing bytes to file. Detail: [errno 30] Read-only file system")
        except OSError as arrow:
            raise ValueError("a task failed") from arrow
    except ValueError as chained:
        assert environment_problem(chained) == ("Error writing bytes to file. Detail: [errno 30] Read-only file "
                                                "system: choose a writable workdir")
        # the command line names the workdir where the error names no file
        assert environment_problem(chained, where="writing under workdir=w").startswith(
            "writing under workdir=w: Error writing bytes to file.")
    assert environment_problem(ValueError("no")) is None and environment_problem(OSError(errno.EINVAL, "x")) is None


def test_one_port_for_http_and_grpc_is_refused(capsys):
    """Triton was started three times on it, each failing to bind, and a page of its log was printed."""
    _refused(capsys, ["config", "show", "serve.http_port=18010", "serve.grpc_port=18010"], "serve.http_port",
             "serve.grpc_port are both 18010")


def test_a_table_of_continuous_features_only_is_refused_before_any_stage_runs(tmp_path, capsys):
    """Every model embeds a sparse feature: `run all` on a table of numbers only read it, fitted the ETL, then
    refused at the training stage."""
    pd.DataFrame({"y": [0, 1] * 100, "x": np.arange(200.0)}).to_csv(tmp_path / "numbers.csv", index=False)
    args = [f"workdir={tmp_path / 'work'}", "device=cpu", "data.source=table", f"data.path={tmp_path / 'numbers.csv'}",
            "data.label=y", "data.continuous=[x]"]
    _refused(capsys, ["run", "all", *args], "no categorical or multi-hot feature", "data.categorical")
    assert not (tmp_path / "work").exists()


@pytest.mark.parametrize("settings, said", [
    (["data.test_fraction=0"], "data.test_fraction=0 of data.rows=1,000 gives the test split no rows"),
    (["data.valid_fraction=0", "data.test_fraction=0"], "give the valid and test splits no rows"),
    (["data.rows=4", "data.test_fraction=0.2"], "data.valid_fraction=0.1 of data.rows=4 gives the valid split no rows"),
    (["table", "data.test_fraction=0"], "give it a larger fraction or files of its own (data.test_path)"),
    (["train.embedding_backend=cuda"], "train.embedding_backend=cuda: embedding backend 'cuda' cannot run on cpu"),
])
def test_settings_that_training_refuses_are_refused_before_any_stage_runs(tmp_path, capsys, settings, said):
    """Training needs rows in valid and test, and tables its device can run: `run all` with a fraction of 0 (or the
    CUDA tables on a CPU) made the data, fitted the ETL, then refused at the training stage."""
    args = [f"workdir={tmp_path / 'work'}", "device=cpu", "data.rows=1000"]
    if settings[0] == "table":
        pd.DataFrame({"y": [0, 1] * 100, "c": np.arange(200) % 7}).to_csv(tmp_path / "rows.csv", index=False)
        args += ["data.source=table", f"data.path={tmp_path / 'rows.csv'}", "data.label=y", "data.categorical=[c]"]
        settings = settings[1:]
    for command in ("all", "train"):  # run train runs the data and ETL stages first where their output is missing
        _refused(capsys, ["run", command, *args, *settings], said)
        assert not (tmp_path / "work").exists()


def test_an_etl_alone_may_leave_a_split_empty(tmp_path):
    """The refusal above is training's: the data and ETL stages alone take a fraction of 0."""
    args = [f"workdir={tmp_path / 'work'}", "device=cpu", "progress=off", "data.rows=1000", "data.test_fraction=0",
            "etl.cluster=threads"]
    assert main(["run", "etl", *args]) == 0


def test_training_on_an_etl_output_of_changed_inputs_says_so(tmp_path, capsys):
    """`run train` trains on the ETL output as it is; when the input file changed since (or the data settings), it
    trained on the old rows without a word."""
    rng = np.random.default_rng(0)
    path = tmp_path / "clicks.csv"
    frame = pd.DataFrame({"y": rng.integers(0, 2, 600), "x": rng.random(600), "c": rng.integers(0, 9, 600)})
    frame.to_csv(path, index=False)
    args = [f"workdir={tmp_path / 'work'}", "device=cpu", "progress=off", "data.source=table", f"data.path={path}",
            "data.label=y", "data.continuous=[x]", "data.categorical=[c]", "train.max_steps=2", "etl.cluster=threads"]
    assert main(["run", "etl", *args]) == 0
    assert main(["run", "train", *args]) == 0
    assert "[train] note:" not in capsys.readouterr().out
    pd.concat([frame, frame]).to_csv(path, index=False)
    assert main(["run", "train", *args]) == 0
    said = capsys.readouterr().out
    assert "[train] note: the ETL output at" in said and "(changed: inputs)" in said and "data.rebuild=true" in said


def test_a_full_disk_under_an_arrow_write_names_the_workdir(tmp_path, monkeypatch, capsys):
    """Arrow's "No space left on device" names no file: the one error line said nothing of where the disk is full."""
    import pyarrow.parquet as pq

    from pipeline.stages.cli import main

    def full(*args, **kwargs):
        raise OSError("Error writing bytes to file. Detail: [errno 28] No space left on device")

    monkeypatch.setattr(pq, "write_table", full)
    monkeypatch.setattr(pq.ParquetWriter, "write_table", full)
    assert main(["data", f"workdir={tmp_path / 'w'}", "data.rows=2000", "progress=off"]) == 2
    expected = (f"error: writing under workdir={tmp_path / 'w'}: Error writing bytes to file. Detail: [errno 28] No "
                "space left on device: free space on that disk, or choose another workdir")
    assert capsys.readouterr().err.splitlines() == [expected]


@pytest.mark.parametrize("source", ["synthetic", "table"])
def test_a_data_stage_that_fails_after_its_first_parts_removes_them(tmp_path, monkeypatch, capsys, source):
    """A full disk as the raw data is finished: the parts already written stayed on the disk they filled (found on a
    3 MB tmpfs), in a dataset no stage reads."""
    import errno

    import pipeline.stages.data as data_stage
    from pipeline.data import ingest
    from pipeline.files import write_json

    def full_at_meta(path, *args, **kwargs):
        if Path(path).name == "meta.json":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return write_json(path, *args, **kwargs)

    monkeypatch.setattr(data_stage, "write_json", full_at_meta)
    monkeypatch.setattr(ingest, "write_json", full_at_meta)
    args = [f"workdir={tmp_path / 'w'}", "data.rows=2000", "progress=off"]
    if source == "table":
        rows = pd.DataFrame({"y": [0, 1] * 100, "c": np.arange(200) % 7})
        rows.to_csv(tmp_path / "rows.csv", index=False)
        args = [f"workdir={tmp_path / 'w'}", "progress=off", "data.source=table", f"data.path={tmp_path / 'rows.csv'}",
                "data.label=y", "data.categorical=[c]"]
    assert main(["data", *args]) == 2
    assert "No space left on device" in capsys.readouterr().err
    raw = tmp_path / "w" / source / "raw"
    assert raw.is_dir() and not list(raw.rglob("*.parquet")) and not (raw / "meta.json").exists()


def test_a_command_without_its_stage_names_only_what_is_missing(capsys):
    """`python -m pipeline run` said the optional key=value overrides were required too."""
    for argv, missing in ((["run"], "stage"), (["config"], "action")):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1, err
        assert f"error: the following arguments are required: {missing} (" in err and "key=value" not in err
