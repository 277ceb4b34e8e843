"""Dynamic tables through the stages: the ETL's raw 64-bit ids, the loader, training, resuming, export."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from pipeline.errors import UserError
from pipeline.schema import Schema
from pipeline.stages.cli import main
from pipeline.stages.config import load_config
from pipeline.stages.etl import run as run_etl
from pipeline.stages.train import run
from pipeline.train.driver import train
from pipeline.train.loop import Callback
from pipeline.train.model import load_trained
from tests.test_train import ROOT, Crash, CrashAfter

# every value its own row (etl.freq_threshold=0): the tables' sizes below were set on that
SMALL = ["device=cpu", "data.rows=6000", "etl.cluster=threads", "etl.row_group_rows=1024", "etl.freq_threshold=0",
         "progress=off", "etl.hash_ids={C1: 256, C4: 128}", "train.batch_size=128", "train.eval_batch_size=512",
         "train.embedding_dim=8", "train.bottom_mlp=[16,8]", "train.top_mlp=[16,1]", "train.log_every=4",
         "train.warmup_steps=3", "train.threads=1", "train.admit_after=2"]


def _config(workdir, *overrides):
    return load_config(None, [f"workdir={workdir}", *SMALL, *overrides])


@pytest.fixture(scope="module")
def processed(tmp_path_factory):
    """The workdir of a data and ETL run whose C1 and C4 are raw ids (C4: more values than its 128 rows)."""
    workdir = tmp_path_factory.mktemp("dynamic")
    run_etl(_config(workdir))
    return workdir


def _copy(processed, workdir):
    """A workdir holding the processed data of ``processed`` (its own runs)."""
    shutil.copytree(processed / "synthetic" / "processed", workdir / "synthetic" / "processed")
    shutil.copytree(processed / "synthetic" / "workflow", workdir / "synthetic" / "workflow")
    shutil.copytree(processed / "synthetic" / "raw", workdir / "synthetic" / "raw")
    return workdir


def _same(a, b, where="") -> None:
    """Equal state dicts, the dynamic tables' extra states (nested dicts of tensors and values) included."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


def test_raw_ids_train_dynamic_tables_that_evict_and_score_as_they_trained(processed, tmp_path):
    cfg = _config(_copy(processed, tmp_path), "train.epochs=2", "train.model=deepfm", "train.early_stopping=0")
    schema = Schema.load(cfg.paths.schema)
    assert schema.dynamic == ["C1", "C4"]
    result = run(cfg)
    assert result["test"]["auc"] > 0.6
    model, _ = load_trained(cfg.paths.train / "latest")
    assert result["dynamic_tables"]["t_C4"] == {"rows": 128, **model.embedding.dynamic["t_C4"].stats()}
    assert sorted(model.embedding.dynamic.tables) == ["t_C1", "t_C4", "w_C1", "w_C4"]  # deep and wide tables
    c4 = model.embedding.dynamic["t_C4"].stats()
    assert c4["ids"] > 100 and c4["evictions"] > 0 and c4["candidates"] > 0
    assert model.embedding.dynamic["t_C1"].stats()["evictions"] == 0

    from pipeline.loader import Loader
    from pipeline.train.evaluate import evaluate

    again = evaluate(model, Loader(cfg.paths.processed / "test", 512, schema=schema), torch.device("cpu"))
    assert again["auc"] == pytest.approx(result["test"]["auc"], abs=1e-6)


class Pipelines(Callback):
    """Records the training pipeline of each run it sees (None: the loop reads its batches itself)."""

    def __init__(self) -> None:
        self.seen: list[str | None] = []

    def on_fit_start(self, trainer) -> None:
        self.seen.append(type(trainer.pipeline).__name__ if trainer.pipeline is not None else None)


def _stage(cfg, callbacks=()):
    """The training stage's run of ``cfg``, with ``callbacks``."""
    return train(cfg.train, cfg.paths.processed, cfg.paths.train, schema=Schema.load(cfg.paths.schema), seed=cfg.seed,
                 distributed=cfg.distributed, callbacks=callbacks, progress="off")


def test_ids_placed_a_step_ahead_and_resumed_train_and_score_as_one_batch_after_the_other(processed, tmp_path):
    """The stage places each batch's ids while the batch before trains (distributed.pipeline, the default); a run
    that crashes and resumes so ends with the ids, rows and state of an uninterrupted run that places each batch at
    its lookup, and every validation between steps scores alike: no batch is placed before the evaluation and the
    checkpoint of the step before."""
    common = ["train.epochs=2", "train.checkpoint_every=7", "train.eval_every=10", "train.embedding_optimizer=adam",
              "seed=3"]
    pipelines = Pipelines()
    straight = _config(_copy(processed, tmp_path / "straight"), *common, "distributed.pipeline=false")
    _stage(straight, [pipelines])
    crashed = _config(_copy(processed, tmp_path / "crashed"), *common)
    with pytest.raises(Crash):
        _stage(crashed, [pipelines, CrashAfter(30)])
    _stage(_config(tmp_path / "crashed", *common, "train.resume=true"), [pipelines])
    assert pipelines.seen == [None, "PrefetchPipeline", "PrefetchPipeline"]
    final = [torch.load(c.paths.train / "latest" / "model.pt", weights_only=True) for c in (straight, crashed)]
    assert any(key.endswith("_extra_state") for key in final[0])
    _same(*final)
    scores = [[(r["step"], r["auc"]) for r in map(json.loads, (c.paths.train / "latest" / "metrics.jsonl")
                                                  .read_text().splitlines()) if r.get("split") == "valid"]
              for c in (straight, crashed)]
    assert len(scores[0]) >= 7 and scores[0] == scores[1]


def test_resume_with_another_admit_after_is_refused_naming_the_setting(processed, tmp_path):
    cfg = _config(_copy(processed, tmp_path), "train.max_steps=8", "train.checkpoint_every=4")
    with pytest.raises(Crash):
        _stage(cfg, [CrashAfter(5)])
    with pytest.raises(UserError, match=r"trained with train.admit_after=2, not 3: resume with train.admit_after=2"):
        run(_config(tmp_path, "train.max_steps=8", "train.resume=true", "train.admit_after=3"))


def test_the_exported_parts_look_raw_ids_up_as_the_trained_model(processed, tmp_path):
    import numpy as np

    from export.dense import DenseRunner
    from export.inprocess import InProcessModel
    from export.lookup import EmbeddingLookup, LookupConfig
    from export.preprocess import Preprocessor
    from export.repository import artifacts_dir, lookup_dir, raw_columns
    from export.store import open_current
    from pipeline.data.raw_folder import RawDataset
    from pipeline.etl.workflow import Workflow
    from pipeline.stages.export import run as run_export
    from pipeline.stages.serve import sample_rows

    cfg = _config(_copy(processed, tmp_path), "train.max_steps=20", "train.model=wide_deep",
                  "train.multihot_pooling=mean")
    run(cfg)
    run_export(cfg)
    model, schema = load_trained(cfg.paths.train / "latest")
    rows = sample_rows(cfg, 200)
    rows.loc[0:9, "C1"] = "never-seen-before"  # no row: it reads zeros, as in training
    rows.loc[5:14, "C4"] = None
    expected = InProcessModel(model, schema, Workflow.load(cfg.paths.workflow)).predict(rows)
    assert expected.std() > 0.01

    export = cfg.paths.export
    raw = raw_columns(RawDataset.load(cfg.paths.raw), cfg.data.list_separator)
    tensors = Preprocessor.load(artifacts_dir(export))(raw.layout.tensors(rows))
    served_by = lookup_dir(export)  # the fused model: the workflow, the lookup and the dense part in one model
    lookup = EmbeddingLookup(served_by / "store", LookupConfig.load(served_by / "1" / "layout.json"))
    pooled = lookup(tensors["CATEGORICAL_IDS"])
    served = DenseRunner(served_by / "1" / "model.pt")(tensors["DENSE"], pooled)[:, 0]
    np.testing.assert_allclose(served, expected, rtol=0, atol=1e-5)
    ids = model.embedding.dynamic["t_C1"].stats()["ids"]
    assert open_current(served_by / "store").tables["t_C1"].shape[0] == ids + 1  # its ids' rows and the zero row


def test_a_model_json_without_the_dynamic_fields_builds_its_model(tmp_path):
    from pipeline.loader.synthetic import criteo_schema
    from pipeline.train.model import check_same_model, model_from_spec, model_spec

    cfg = _config(tmp_path)
    spec = model_spec(cfg.train, criteo_schema(size=0.0001, categorical=3, continuous=2), "cpu")
    older = {k: v for k, v in spec.items() if k != "admit_after"}
    older["tables"] = [{k: v for k, v in t.items() if k not in ("dynamic", "admit_after")} for t in spec["tables"]]
    model = model_from_spec(older)
    assert model.embedding.dynamic is None and len(model.embedding.tables) == 3
    (tmp_path / "model.json").write_text(json.dumps(older))
    check_same_model(spec, tmp_path)  # the same model: resuming it is not refused


def test_run_all_trains_raw_ids_to_the_auc_of_categorify_and_serves_them_as_the_trained_model(tmp_path, capsys):
    """C12 and C21 as raw ids in dynamic tables smaller than their vocabularies, so that ids are evicted: `run all`
    scores at least the test AUC of the same run with Categorify less 0.005 (no loss from raw ids: the two runs'
    tables start from other values, so either may be the better by about that much), and the served probabilities
    of raw test rows, among them ids without a row, are the in-process model's."""
    import re

    import numpy as np

    from pipeline.etl.workflow import Workflow
    from pipeline.stages.serve import sample_rows

    common = ["device=cpu", "data.rows=100000", "etl.cluster=threads", "progress=off", "serve.smoke_rows=256"]
    hashed = ["etl.hash_ids={C12: 1024, C21: 512}"]
    # the run with Categorify, side by side with `run all` in this process
    categorify_run = subprocess.Popen([sys.executable, "-m", "pipeline", "run", "train",
                                       f"workdir={tmp_path / 'categorify'}", *common],
                                      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert main(["run", "all", f"workdir={tmp_path / 'dynamic'}", *common, *hashed]) == 0
    finally:
        categorify_out = categorify_run.communicate(timeout=600)[0]
    assert categorify_run.returncode == 0, categorify_out[-2000:]
    out = capsys.readouterr().out
    categorify, dynamic = (load_config(None, [f"workdir={tmp_path / name}", *common, *extra])
                           for name, extra in (("categorify", []), ("dynamic", hashed)))
    results = [json.loads((c.paths.train / "latest" / "result.json").read_text()) for c in (categorify, dynamic)]
    assert "dynamic_tables" not in results[0]
    evicted = {name: table["evictions"] for name, table in results[1]["dynamic_tables"].items()}
    assert evicted.keys() == {"t_C12", "t_C21"} and min(evicted.values()) > 0, evicted
    aucs = [r["test"]["auc"] for r in results]
    assert aucs[1] >= aucs[0] - 0.005, f"test AUC with Categorify {aucs[0]:.4f}, with dynamic tables {aucs[1]:.4f}"

    difference = re.search(r"largest difference from the in-process model of run \S+: (\S+)", out)
    assert difference and float(difference.group(1)) <= 1e-5, out[-2000:]
    model, _ = load_trained(dynamic.paths.train / "latest")
    served = Workflow.load(dynamic.paths.workflow).transform(sample_rows(dynamic, 256))
    for column in ("C12", "C21"):
        slots = model.embedding.dynamic[f"t_{column}"].find(torch.tensor(served[column].to_numpy(np.int64)))
        assert 0 < int((slots < 0).sum()) < len(slots), column  # served rows with and without a row of the table
