"""The training stage with an embedding budget far below the tables: host-cached tables, the same model.

On the synthetic Criteo-like data through the data and ETL stages, one process on the CPU trains
with ``distributed.memory_per_rank_mb`` at a quarter of what its tables take: the planner host-caches
the large ones, the caches evict, and the run ends with the very weights and test AUC of the run
with every table in memory, and reports each cache's hit rate. A run killed after a checkpoint
resumes into other cache sizes and still ends there; the export of a host-cached run writes the
trained tables to the embedding store, the exported parts answer as the model does in process, and
a real Triton server serves it; a plan file host-caches a table of one process too.
"""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pandas as pd
import pytest
import torch

from pipeline.distributed.types import ParameterSharding, ShardingPlan
from pipeline.errors import UserError
from pipeline.schema import Schema
from pipeline.stages.config import load_config
from pipeline.stages.train import run as run_train
from pipeline.train.driver import train
from tests.test_train import CrashAfter

BUDGET_MB = "0.25"  # the tables take 1.08 MiB (8,604 rows x 32 fp32 + a row of Adagrad state)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from pipeline.stages.cli import run_stages

    workdir = tmp_path_factory.mktemp("host-cache")
    # every value its own row (etl.freq_threshold=0): the tables' sizes below were set on that
    common = [f"workdir={workdir}", "device=cpu", "data.rows=20000", "etl.cluster=threads", "etl.freq_threshold=0",
              "progress=off", "train.batch_size=64", "train.epochs=1", "train.threads=1", "train.checkpoint_every=100"]
    run_stages(["data", "etl"], load_config(None, common))
    in_memory = run_train(load_config(None, [*common, "train.run=in-memory"]))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        cached = run_train(load_config(None, [*common, "train.run=host-cached",
                                              f"distributed.memory_per_rank_mb={BUDGET_MB}"]))
    return common, in_memory, cached, printed.getvalue()


def _weights(cfg, run: str) -> dict[str, torch.Tensor]:
    return torch.load(cfg.paths.train / run / "model.pt", weights_only=True)


def test_a_budget_far_below_the_tables_trains_the_same_model(runs):
    common, in_memory, cached, printed = runs
    cfg = load_config(None, common)
    assert cached["test"] == in_memory["test"]
    expected, got = _weights(cfg, "in-memory"), _weights(cfg, "host-cached")
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    assert "embedding_cache" not in in_memory
    stats = cached["embedding_cache"]
    assert stats == json.loads((cfg.paths.train / "host-cached" / "result.json").read_text())["embedding_cache"]
    assert len(stats) >= 4 and all(0 < s["hit_rate"] < 1 and s["evictions"] > 0 for s in stats.values())
    assert "[train] host-cached tables, in host memory behind a device cache of their hot rows: t_C3 (" in printed
    for name, s in stats.items():
        assert f"[train] device cache of {name}: {s['hit_rate']:.1%} of the training batches' rows found" in printed


def test_a_host_cached_run_resumes_into_other_cache_sizes(runs):
    common, in_memory, _, _ = runs
    # Killed after step 130 (the last checkpoint at 100), resumed with larger caches and killed after 220,
    # resumed with every table in memory: the weights of the run that never stopped.
    for budget, crash in ((BUDGET_MB, 130), ("0.5", 220), ("0", None)):
        cfg = load_config(None, [*common, "train.run=resumed", f"distributed.memory_per_rank_mb={budget}",
                                 f"train.resume={crash != 130}"])
        callbacks = [CrashAfter(crash)] if crash else []
        with pytest.raises(RuntimeError, match="stopping") if crash else contextlib.nullcontext():
            result = train(cfg.train, cfg.paths.processed, cfg.paths.train, schema=Schema.load(cfg.paths.schema),
                           seed=cfg.seed, distributed=cfg.distributed, callbacks=callbacks, progress="off")
    events = [json.loads(line) for line in (cfg.paths.train / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e.get("event") == "resume"] == [100, 200]
    assert result["test"]["auc"] == in_memory["test"]["auc"]
    expected, got = _weights(cfg, "in-memory"), _weights(cfg, "resumed")
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_the_export_of_a_host_cached_run_serves_its_trained_tables(runs):
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
    from pipeline.train.model import load_trained

    common = runs[0]
    cfg = load_config(None, [*common, "export.run=host-cached"])
    run_export(cfg)
    trained, schema = load_trained(cfg.paths.train / "in-memory")
    store = open_current(lookup_dir(cfg.paths.export) / "store")
    assert sorted(store.tables) == sorted(trained.embedding.packing.table_names)
    for name, table in store.tables.items():
        np.testing.assert_array_equal(table, trained.embedding.table_weight(name).numpy())

    rows = sample_rows(cfg, 200)
    raw = raw_columns(RawDataset.load(cfg.paths.raw), cfg.data.list_separator)
    export = cfg.paths.export
    tensors = Preprocessor.load(artifacts_dir(export))(raw.layout.tensors(rows))
    served_by = lookup_dir(export)  # the fused model: the workflow, the lookup and the dense part in one model
    lookup = EmbeddingLookup(served_by / "store", LookupConfig.load(served_by / "1" / "layout.json"))
    pooled = lookup(tensors["CATEGORICAL_IDS"], tensors.get("MULTIHOT_IDS"), tensors.get("MULTIHOT_LENGTHS"))
    served = DenseRunner(served_by / "1" / "model.pt")(tensors["DENSE"], pooled)[:, 0]
    model, _ = load_trained(cfg.paths.train / "host-cached")
    expected = InProcessModel(model, schema, Workflow.load(cfg.paths.workflow)).predict(rows)
    assert expected.std() > 0.01
    np.testing.assert_allclose(served, expected, rtol=0, atol=1e-5)


def test_a_real_server_serves_the_host_cached_run(runs):
    from export.server import server_problem
    from pipeline.stages.export import run as run_export
    from pipeline.stages.serve import run as serve

    cfg = load_config(None, [*runs[0], "export.run=host-cached"])
    problem = server_problem(cfg.serve)
    if problem:
        pytest.fail(f"the serving tests need a Triton server and the models' environment (make serve-env): {problem}")
    if not (cfg.paths.export / "export.json").is_file():
        run_export(cfg)
    served = serve(cfg, smoke=True)
    assert served["served"] and served["max_difference_from_in_process"] < 1e-5


def test_a_plan_file_host_caches_a_table_of_one_process_and_one_for_another_world_is_refused(runs, tmp_path):
    common = runs[0]
    tables = json.loads((load_config(None, common).paths.train / "in-memory" / "model.json").read_text())["tables"]
    for world in (1, 2):
        plan = ShardingPlan(world, {t["name"]: ParameterSharding.table_wise(
            t["name"], t["rows"], 0, cache_rows=200 if t["name"] == "t_C12" else 0) for t in tables})
        plan.save(tmp_path / f"plan-{world}.json")
    planned = [*common, "train.max_steps=20", f"distributed.plan_file={tmp_path / 'plan-1.json'}"]
    result = run_train(load_config(None, [*planned, "train.run=planned"]))
    assert list(result["embedding_cache"]) == ["t_C12"] and result["embedding_cache"]["t_C12"]["evictions"] > 0
    refused = [*common, "train.run=refused", f"distributed.plan_file={tmp_path / 'plan-2.json'}"]
    with pytest.raises(UserError, match=r"plan_file=.*plan-2.json: the plan is for 2 ranks, this world has 1"):
        run_train(load_config(None, refused))


@pytest.fixture(scope="module")
def multihot(tmp_path_factory):
    """A table with a multi-hot column of 6 ids a sample, drawn from 2,000 values: a batch of 32 samples has
    about 190 distinct ids of it, three times the 64 rows that two batches of one id a sample would need."""
    from pipeline.stages.cli import run_stages

    folder = tmp_path_factory.mktemp("host-cache-multihot")
    rng = np.random.default_rng(0)
    n = 2000
    pd.DataFrame({"clicked": rng.integers(0, 2, n), "price": rng.random(n),
                  "user": [f"u{u}" for u in rng.integers(0, 1000, n)],
                  "tags": ["|".join(map(str, row)) for row in rng.integers(0, 2000, (n, 6))]}).to_csv(
        folder / "tags.csv", index=False)
    common = [f"workdir={folder}", "device=cpu", "data.source=table", f"data.path={folder / 'tags.csv'}",
              "data.label=clicked", "data.continuous=[price]", "data.categorical=[user]", "data.multihot=[tags]",
              "etl.cluster=threads", "etl.freq_threshold=0",  # every one of the 2,000 tags its own row
              "progress=off", "train.batch_size=32", "train.epochs=1", "train.threads=1"]
    run_stages(["data", "etl"], load_config(None, common))
    return common


def test_a_multi_hot_host_cached_table_gets_a_cache_that_holds_its_batches(multihot):
    # Two batches of 32 samples of 6 tags: 384 rows of t_tags (0.05 MiB) at least, beside t_user's 64.
    with pytest.raises(UserError, match=r"t_tags \(1986 x 32, host-cached in a device cache of 384 rows at least"):
        run_train(load_config(None, [*multihot, "train.run=refused", "distributed.memory_per_rank_mb=0.04"]))
    result = run_train(load_config(None, [*multihot, "train.run=tight", "distributed.memory_per_rank_mb=0.06"]))
    assert "t_tags" in result["embedding_cache"] and result["embedding_cache"]["t_tags"]["evictions"] > 0


def test_a_plan_file_whose_cache_cannot_hold_two_batches_is_refused_before_training(multihot, tmp_path):
    cfg = load_config(None, multihot)
    run_train(load_config(None, [*multihot, "train.run=planned-source", "train.max_steps=2"]))
    tables = json.loads((cfg.paths.train / "planned-source" / "model.json").read_text())["tables"]
    for name, rows in (("small", 150), ("enough", 384)):  # two batches of 32 samples of 6 tags: 384
        ShardingPlan(1, {t["name"]: ParameterSharding.table_wise(t["name"], t["rows"], 0, cache_rows=rows if
                         t["name"] == "t_tags" else 0) for t in tables}).save(tmp_path / f"{name}.json")
    with pytest.raises(UserError, match=r"small.json: the device cache of t_tags holds 150 rows, but two batches of "
                                        r"train.batch_size=32 need 384: give it cache_rows of at least 384"):
        run_train(load_config(None, [*multihot, "train.run=small", f"distributed.plan_file={tmp_path / 'small.json'}"]))
    result = run_train(load_config(None, [*multihot, "train.run=enough",
                                          f"distributed.plan_file={tmp_path / 'enough.json'}"]))
    assert result["embedding_cache"]["t_tags"]["evictions"] > 0
