"""Export serves every schema shape training accepts: only one-hot categorical, only multi-hot,
categorical + multi-hot (no continuous feature in each), and every kind of raw column at once (integers,
floats, strings, lists; over gRPC, HTTP and HTTP with JSON tensors), with served predictions equal to
the in-process model; a schema with only continuous features is refused clearly at training time."""

from __future__ import annotations

import json
import re
import threading

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from export.client import Client, ServingError
from export.inprocess import InProcessModel
from export.pbtxt import EnsembleSpec, ModelOptions, model_configs
from export.preprocess import RawColumns
from export.repository import raw_columns, write_repository
from export.server import server_problem, start_server
from pipeline.data.raw_folder import RawDataset
from pipeline.errors import UserError
from pipeline.etl.workflow import Workflow
from pipeline.modules.models import ModelSizes, build_model
from pipeline.schema import Column, Schema
from pipeline.stages.config import load_config

ROWS = 400

SHAPES = {
    # name: (roles, model)
    "onehot": ({"categorical": ["C1", "C2"]}, "dlrm"),
    "multihot": ({"multihot": ["M1"]}, "deepfm"),
    "onehot_multihot": ({"categorical": ["C1", "C2"], "multihot": ["M1"]}, "dcnv2"),
}


def _table(rng: np.random.Generator) -> pa.Table:
    bags = [[f"m{v}" for v in rng.integers(0, 25, rng.integers(0, 5))] if i % 9 else None for i in range(ROWS)]
    return pa.table({
        "label": pa.array(rng.integers(0, 2, ROWS), pa.int8()),
        "I1": pa.array([int(v) if i % 7 else None for i, v in enumerate(rng.integers(0, 100, ROWS))], pa.int64()),
        "I2": pa.array(rng.standard_normal(ROWS)),
        "C1": pa.array([f"c{v}" if i % 11 else None for i, v in enumerate(rng.zipf(1.5, ROWS) % 40)], pa.string()),
        "C2": pa.array([f"d{v}" for v in rng.integers(0, 5, ROWS)], pa.string()),
        "M1": pa.array(bags, pa.list_(pa.string())),
    })


def _dataset(workdir, roles: dict[str, list[str]], extra: list[str] = ()):
    """A table holding only the columns of ``roles`` (and the label), through the data and ETL stages."""
    from pipeline.stages.data import run as make_data
    from pipeline.stages.etl import run as run_etl

    table = _table(np.random.default_rng(0))
    table = table.select(["label", *(c for names in roles.values() for c in names)])
    source = workdir / "table.parquet"
    pq.write_table(table, source)
    settings = [f"workdir={workdir}", "data.source=table", f"data.path={source}", "data.name=shape",
                "etl.cluster=threads", "device=cpu", *extra]
    settings += [f"data.{role}=[{','.join(roles.get(role, []))}]" for role in ("continuous", "categorical", "multihot")]
    cfg = load_config(None, settings)
    make_data(cfg)
    run_etl(cfg)
    return cfg, table


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_configs_leave_out_the_tensors_of_absent_feature_kinds(shape):
    roles, _ = SHAPES[shape]

    columns = [Column("label", "label", "float32")]
    columns += [Column(c, "categorical", "int32", cardinality=9) for c in roles.get("categorical", [])]
    columns += [Column(c, "multihot", "int32", cardinality=9, max_length=4) for c in roles.get("multihot", [])]
    raw = RawColumns({}, {c: "string" for c in roles.get("categorical", [])},
                     {c: "list<item: string>" for c in roles.get("multihot", [])})
    spec = EnsembleSpec.build(raw, Schema(columns), embedding_dim_total=16)
    for backend in ("python", "pytorch"):
        configs = model_configs(spec, ModelOptions(dense_backend=backend, fused=False))  # the tensors between models
        text = "\n".join(configs.values())
        assert "DENSE" not in text and "dims: [  ]" not in text and not re.search(r"dims: \[ [^\]]*\b0\b", text)
        assert ("CATEGORICAL_IDS" in text) == ("categorical" in roles)
        assert ("MULTIHOT_IDS" in text) == ("multihot" in roles)
    assert [t.name for t in spec.dense_inputs] == ["EMBEDDINGS"]


@pytest.mark.parametrize(("shape", "fused"), [(s, True) for s in sorted(SHAPES)] + [("onehot_multihot", False)])
def test_served_predictions_equal_in_process_without_continuous_features(shape, fused, tmp_path):
    roles, name = SHAPES[shape]
    cfg, table = _dataset(tmp_path, roles)
    problem = server_problem(cfg.serve)
    if problem:
        pytest.fail(f"the serving tests need a Triton server and the models' environment (make serve-env): {problem}")
    schema = Schema.load(cfg.paths.schema)
    assert not schema.continuous
    model = build_model(name, schema, ModelSizes.preset("small", multihot_pooling="mean"), seed=1).eval()
    with torch.no_grad():  # rows large enough that an untrained model's answers differ from row to row
        model.embedding.weights.uniform_(-10, 10, generator=torch.Generator().manual_seed(1))
    raw = raw_columns(RawDataset.load(cfg.paths.raw), cfg.data.list_separator)
    write_repository(model, schema, cfg.paths.workflow, raw, cfg.paths.export, ModelOptions(fused=fused))
    rows = table.slice(0, 150).to_pandas(types_mapper=pd.ArrowDtype)
    if "C1" in rows:
        rows.loc[0:4, "C1"] = "never-seen"
    expected = InProcessModel(model, schema, Workflow.load(cfg.paths.workflow)).predict(rows)
    assert expected.std() > 0.01
    server = start_server(cfg.paths.export, cfg.serve)
    try:
        for protocol, url in (("http", server.http_url), ("grpc", server.grpc_url)):
            with Client(url, protocol) as client:
                np.testing.assert_allclose(client.predict(rows), expected, rtol=0, atol=1e-5)
                np.testing.assert_allclose(client.predict(rows.iloc[:1]), expected[:1], rtol=0, atol=1e-5)
    finally:
        server.stop()


def _infer_as_json(url: str, tensors: dict[str, np.ndarray]) -> np.ndarray:
    """The ensemble's answer to ``tensors`` sent as JSON (tritonclient's ``binary_data=False``), checked to be
    valid JSON: no NaN, which Triton's JSON reader does not take."""
    from tritonclient import http as triton
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, array in tensors.items():
        tensor = triton.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array, binary_data=False)
        inputs.append(tensor)
    outputs = [triton.InferRequestedOutput("PREDICTION", binary_data=False)]
    body, binary_size = triton.InferenceServerClient.generate_request_body(inputs, outputs)
    assert binary_size is None
    json.loads(body, parse_constant=lambda word: pytest.fail(f"{word} in the JSON request"))
    client = triton.InferenceServerClient(url)
    try:
        return client.infer("ensemble", inputs, outputs=outputs).as_numpy("PREDICTION").reshape(-1)
    finally:
        client.close()


def test_every_kind_of_raw_column_is_served_over_grpc_http_and_json(tmp_path):
    """Integer and floating numbers, strings and lists, each with missing values, one tensor per kind: the answers
    over gRPC, HTTP and HTTP with JSON tensors (which have no NaN: a missing number travels as its mask) equal the
    in-process model's. An infinity among the floats gets its own error, also among concurrent good requests, and
    the server keeps serving."""
    cfg, table = _dataset(tmp_path, {"continuous": ["I1", "I2"], "categorical": ["C1", "C2"], "multihot": ["M1"]})
    problem = server_problem(cfg.serve)
    if problem:
        pytest.fail(f"the serving tests need a Triton server and the models' environment (make serve-env): {problem}")
    schema = Schema.load(cfg.paths.schema)
    model = build_model("dlrm", schema, ModelSizes.preset("small", multihot_pooling="mean"), seed=1).eval()
    with torch.no_grad():
        model.embedding.weights.uniform_(-10, 10, generator=torch.Generator().manual_seed(1))
    raw = raw_columns(RawDataset.load(cfg.paths.raw), cfg.data.list_separator)
    assert (raw.layout.integers, raw.layout.floats, raw.layout.lists) == (("I1",), ("I2",), ("M1",))
    write_repository(model, schema, cfg.paths.workflow, raw, cfg.paths.export, ModelOptions())
    rows = table.slice(0, 150).to_pandas(types_mapper=pd.ArrowDtype)
    rows.loc[0:4, "C1"] = "never-seen"
    rows.loc[3:9, "I2"] = None
    assert rows[["I1", "C1", "M1"]].isna().any().all()
    expected = InProcessModel(model, schema, Workflow.load(cfg.paths.workflow)).predict(rows)
    assert expected.std() > 0.01
    server = start_server(cfg.paths.export, cfg.serve)
    try:
        with Client(server.http_url, "http") as http, Client(server.grpc_url, "grpc") as grpc:
            good = grpc.tensors(rows)
            assert good["FLOATS_MISSING"][3:10].all() and not np.isnan(good["FLOATS"]).any()
            for client in (http, grpc):
                np.testing.assert_allclose(client.predict(rows), expected, rtol=0, atol=1e-5, err_msg=client.protocol)
            np.testing.assert_allclose(_infer_as_json(server.http_url, good), expected, rtol=0, atol=1e-5)
            bad = dict(good, FLOATS=good["FLOATS"].copy())
            bad["FLOATS"][[5, 20]] = np.inf  # row 5's is masked as missing: ignored
            for client, status in ((http, "400"), (grpc, "StatusCode.INVALID_ARGUMENT")):
                with pytest.raises(ServingError) as caught:
                    client.infer(bad)
                assert "input FLOATS, column I2, row 20: expected finite numbers" in str(caught.value)
                assert caught.value.status == status, client.protocol
                np.testing.assert_allclose(client.infer(good), expected, rtol=0, atol=1e-5)

        results: dict[int, object] = {}

        def send(i):
            with Client(server.grpc_url, "grpc") as own:
                try:
                    results[i] = own.infer(bad if i == 3 else good)
                except ServingError as err:
                    results[i] = err

        threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert isinstance(results[3], ServingError) and "FLOATS, column I2" in str(results[3])
        assert results[3].status == "StatusCode.INVALID_ARGUMENT"
        for i in set(range(8)) - {3}:
            np.testing.assert_allclose(results[i], expected, rtol=0, atol=1e-5)
        assert server.is_alive()
    finally:
        server.stop()


def test_training_refuses_a_schema_with_only_continuous_features_in_one_error(tmp_path):
    from pipeline.stages.train import run as train

    cfg, _ = _dataset(tmp_path, {"continuous": ["I1", "I2"]}, ["train.epochs=1", "train.batch_size=64"])
    with pytest.raises(UserError, match=r"no categorical or multi-hot feature.*data\.categorical or data\.multihot"):
        train(cfg)
