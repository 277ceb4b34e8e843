"""A GPU instance's whole batch as one graph (export/device_ranker.py) answers what the usual way answers: the
preprocess, the lookup through the cache and the dense part one after the other; on the CPU here (the same code,
without graphs), on a GPU with graphs (marker ``gpu``).

The cache holds every row when each table fits its capacity; then the places of all rows are known and the batch
needs no index on the host. A cache that holds a fraction of a table has no such places, and the batch goes the usual
way; so does a batch whose text the device leaves to the host. A new store version of the same shapes is read from
the same places.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from export.dense import DenseRunner
from export.device_preprocess import DevicePreprocessor
from export.device_ranker import DeviceRanker
from export.lookup import EmbeddingLookup, LookupConfig
from export.preprocess import CATEGORICAL_IDS, DENSE, STRINGS, Preprocessor
from export.repository import raw_columns, write_repository
from export.store import open_current, write_version
from pipeline.data.raw_folder import RawDataset
from pipeline.modules.models import ModelSizes, build_model
from pipeline.schema import Schema
from pipeline.stages.config import load_config
from pipeline.stages.export import model_options
from pipeline.stages.serve import sample_rows


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("device-ranker")
    cfg = load_config(None, [f"workdir={workdir}", "data.rows=3000", "etl.cluster=threads", "device=cpu",
                             "export.instance_kind=cpu", "export.max_batch_size=256"])
    from pipeline.stages.data import run as make_data
    from pipeline.stages.etl import run as run_etl

    make_data(cfg)
    run_etl(cfg)
    schema = Schema.load(cfg.paths.schema)
    model = build_model("dlrm", schema, ModelSizes.preset("small"), seed=3).eval()
    with torch.no_grad():
        model.embedding.weights.mul_(40)  # predictions spread over (0, 1)
    export = cfg.paths.root / "export"
    options = dataclasses.replace(model_options(cfg), fused=True)
    write_repository(model, schema, cfg.paths.workflow, raw_columns(RawDataset.load(cfg.paths.raw), "|"), export,
                     options)
    return cfg, export / "ensemble"


def _parts(model_dir, cache_fraction: float, whole_mb: float = 0.0):
    version = model_dir / "1"
    host = Preprocessor.load(version / "artifacts")
    preprocess = DevicePreprocessor.plan(host, "cpu", max_batch=256)
    lookup = EmbeddingLookup(model_dir / "store", LookupConfig.load(version / "layout.json"), policy="gpu-lru",
                             cache_fraction=cache_fraction, min_cache_rows=1, device="cpu", whole_mb=whole_mb)
    runner = DenseRunner(version / "model.pt", "cpu")
    return host, preprocess, lookup, runner


def _usual(host: Preprocessor, lookup: EmbeddingLookup, runner: DenseRunner, tensors: dict) -> np.ndarray:
    features = host(tensors)
    return runner(features.get(DENSE), lookup.rows_or_pooled(features[CATEGORICAL_IDS]))


def test_a_resident_cache_answers_in_one_pass_as_the_usual_way(exported):
    cfg, model_dir = exported
    host, preprocess, lookup, runner = _parts(model_dir, cache_fraction=1.0)
    ranker = DeviceRanker(preprocess, runner)
    resident = lookup.resident()
    assert resident is not None and resident.rows.device.type == "cpu"
    rows = sample_rows(cfg, 300)
    rows.loc[0:9, "C1"] = "never-seen-before"
    rows.loc[5:14, "C7"] = None
    rows.loc[10:19, "I1"] = None
    for batch in (1, 32, 200, 7):
        tensors = host.layout.tensors(rows.iloc[:batch])
        got = ranker(tensors, resident)
        assert got is not None and got.shape == (batch, 1)
        np.testing.assert_allclose(got, _usual(host, lookup, runner, tensors), rtol=1e-6, atol=1e-7)
    assert len(np.unique(got.round(4))) > 3  # answers that differ between rows
    # a batch the device leaves to the host goes the usual way
    tensors = host.layout.tensors(rows.iloc[:20])
    tensors[STRINGS][3, 0, 0] = 0xFF
    assert ranker(tensors, resident) is None


def test_a_cache_of_part_of_a_table_has_no_resident_rows(exported):
    _, model_dir = exported
    _, _, lookup, _ = _parts(model_dir, cache_fraction=0.25)
    assert lookup.resident() is None
    tables = open_current(model_dir / "store").tables.values()
    mb = sum(t.nbytes for t in tables) / 2**20
    assert _parts(model_dir, cache_fraction=0.25, whole_mb=mb * 0.9)[2].resident() is None
    resident = _parts(model_dir, cache_fraction=0.25, whole_mb=mb)[2].resident()  # tables that fit: whole
    assert resident is not None and sorted(resident.table_rows) == sorted(t.shape[0] for t in tables)


def test_a_new_store_version_is_read_from_the_same_places(exported, tmp_path):
    cfg, model_dir = exported
    host, preprocess, lookup, runner = _parts(model_dir, cache_fraction=1.0)
    ranker = DeviceRanker(preprocess, runner)
    tensors = host.layout.tensors(sample_rows(cfg, 64))
    before = ranker(tensors, lookup.resident())
    store = model_dir / "store"
    served = open_current(store)
    write_version(store, {name: np.asarray(table) * 1.5 for name, table in served.tables.items()}, dense=served.dense)
    assert lookup.refresh()
    resident = lookup.resident()
    after = ranker(tensors, resident)
    assert not np.allclose(after, before)
    np.testing.assert_allclose(after, _usual(host, lookup, runner, tensors), rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
def test_on_the_gpu_one_graph_answers_as_the_usual_way(exported):
    cfg, model_dir = exported
    version = model_dir / "1"
    host = Preprocessor.load(version / "artifacts")
    preprocess = DevicePreprocessor.plan(host, "cuda", max_batch=256)
    lookup = EmbeddingLookup(model_dir / "store", LookupConfig.load(version / "layout.json"), policy="gpu-lru",
                             cache_fraction=1.0, min_cache_rows=1, device="cuda")
    runner = DenseRunner(version / "model.pt", "cuda", cuda_graphs=True, max_batch=256)
    ranker = DeviceRanker.of(preprocess, runner)
    assert ranker is not None
    resident = lookup.resident()
    rows = sample_rows(cfg, 300)
    rows.loc[0:9, "C1"] = "never-seen-before"
    for batch in (1, 32, 200, 7, 32, 256):
        tensors = host.layout.tensors(rows.iloc[:batch])
        np.testing.assert_allclose(ranker(tensors, resident), _usual(host, lookup, runner, tensors), rtol=1e-5,
                                   atol=1e-6)
