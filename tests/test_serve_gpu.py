"""The exported model served by a real Triton server with GPU instances, against the same model on the GPU in
process (marker ``gpu``: run on a machine with a CUDA GPU and the models' environment's torch able to use it).

Both repository shapes are served: the one fused model (served as ``ensemble``) and the chain ``preprocess`` ->
``embedding`` -> ``dense``, their embedding lookups caching hot rows in GPU memory (``gpu-lru``) and their dense parts
on the GPU. Raw rows with unseen categories and missing values go in over HTTP and gRPC; the probabilities must equal
the in-process GPU model's. A new embedding store version is picked up without a restart.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time

import numpy as np
import pytest
import torch

from export.client import Client
from export.inprocess import InProcessModel
from export.repository import cache_stats, lookup_dir, raw_columns, store_version, write_repository
from export.server import server_problem, start_server
from pipeline.data.raw_folder import RawDataset
from pipeline.etl.workflow import Workflow
from pipeline.modules.models import ModelSizes, build_model
from pipeline.schema import Schema
from pipeline.stages.config import load_config
from pipeline.stages.export import model_options
from tests.test_serve import _rows, _spread_out

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("serve-gpu")
    cfg = load_config(None, [f"workdir={workdir}", "data.rows=3000", "etl.cluster=threads", "device=cpu",
                             "export.instance_kind=gpu", "export.max_batch_size=512"])
    problem = server_problem(cfg.serve)
    if problem:
        pytest.fail(f"the serving tests need a Triton server and the models' environment: {problem}")
    from pipeline.stages.data import run as make_data
    from pipeline.stages.etl import run as run_etl

    make_data(cfg)
    run_etl(cfg)
    schema = Schema.load(cfg.paths.schema)
    model = _spread_out(build_model("dlrm", schema, ModelSizes.preset("small"), seed=3).cuda())
    reference = InProcessModel(model, schema, Workflow.load(cfg.paths.workflow))
    assert reference.device.type == "cuda"
    return cfg, model, reference


@pytest.fixture(scope="module", params=["all", "none"], ids=["fused", "chain"])
def served(prepared, request):
    cfg, model, reference = prepared
    export = cfg.paths.root / f"export-{request.param}"
    options = model_options(dataclasses.replace(cfg, export=dataclasses.replace(cfg.export, fuse=request.param)))
    assert options.instance_kind == "gpu"
    raw = raw_columns(RawDataset.load(cfg.paths.raw), cfg.data.list_separator)
    summary = write_repository(model, reference.schema, cfg.paths.workflow, raw, export, options)
    for name in summary["models"]:
        if name in (("ensemble",) if options.fused else ("embedding", "dense")):  # the preprocess runs on the CPU
            assert "KIND_GPU" in (export / name / "config.pbtxt").read_text(), name
    server = start_server(export, cfg.serve)
    try:
        yield cfg, model, reference, server, export
    finally:
        server.stop()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_gpu_instances_answer_as_the_model_on_the_gpu_in_process(served, protocol):
    cfg, _, reference, server, export = served
    rows = _rows(cfg)
    expected = reference.predict(rows)
    assert expected.std() > 0.05, "the fixture model's predictions should spread out"
    url = server.http_url if protocol == "http" else server.grpc_url
    instances = sum(int(n) for n in re.findall(r"count: (\d+)", (lookup_dir(export) / "config.pbtxt").read_text()))
    with Client(url, protocol) as client:
        got = client.predict(rows)
        # the same rows again, once more than there are instances (each caches on its own): at least one
        # instance sees them a second time and answers from its GPU cache
        again = [client.predict(rows.iloc[::-1]) for _ in range(instances)]
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
    for answer in again:
        np.testing.assert_allclose(answer, expected[::-1], rtol=0, atol=1e-5)
    deadline = time.monotonic() + 5
    stats = cache_stats(export)
    while stats["hits"] == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
        stats = cache_stats(export)
    assert stats["policy"] == "gpu-lru" and stats["hits"] > 0, stats
    if lookup_dir(export).name == "ensemble":  # the fused model: tables this small held whole, a batch in one graph
        assert stats["phases_ns"].get("graph", 0) > 0 and "preprocess" not in stats["phases_ns"], stats


def test_gpu_instances_pick_up_a_new_embedding_store_without_restart(served):
    cfg, model, reference, server, export = served
    rows = _rows(cfg).iloc[:64]
    old = reference.predict(rows)
    updated = build_model("dlrm", reference.schema, ModelSizes.preset("small"), seed=3).cuda()
    updated.load_state_dict(model.state_dict())
    with torch.no_grad():
        weights = updated.embedding.weights
        weights.copy_(torch.randn(weights.shape, generator=torch.Generator().manual_seed(7)).cuda() * weights.std())
    new = InProcessModel(updated, reference.schema, reference.workflow).predict(rows)
    assert np.abs(new - old).max() > 0.05
    version = store_version(export)
    answers, errors, stop = [], [], threading.Event()

    def keep_asking():
        with Client(server.grpc_url, "grpc") as client:
            request = client.tensors(rows)
            while not stop.is_set():
                try:
                    answers.append(client.infer(request))
                except Exception as err:  # noqa: BLE001
                    errors.append(err)

    asker = threading.Thread(target=keep_asking)
    asker.start()
    try:
        time.sleep(0.3)
        write_repository(updated, reference.schema, cfg.paths.workflow, None, export, update=True)
        assert store_version(export) == version + 1
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (answers and np.allclose(answers[-1], new, atol=1e-5)):
            time.sleep(0.05)
    finally:
        stop.set()
        asker.join(30)
    assert not errors, errors[:3]
    kinds = ["old" if np.allclose(a, old, rtol=0, atol=1e-5) else "new" if np.allclose(a, new, rtol=0, atol=1e-5)
             else "mixed" for a in answers]
    assert kinds[-1] == "new", "the new version was not picked up"
    assert "mixed" not in kinds and kinds == sorted(kinds, key=lambda k: k == "new")
