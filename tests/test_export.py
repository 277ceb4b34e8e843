"""Export without a server: generated configs agree with each other, and the served path's parts
(preprocess -> embedding lookup -> dense) equal the in-process model, multi-hot features included;
text travels at a fixed width and reads back whole."""

from __future__ import annotations

import json
import os
import re
from decimal import Decimal
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from export.dense import DenseRunner, save_dense
from export.environment import find_models_env
from export.inprocess import InProcessModel
from export.instance import live_stats, process_identity
from export.lookup import EmbeddingLookup, LookupConfig
from export.pbtxt import EnsembleSpec, ModelOptions, instance_groups, model_configs, regrouped
from export.preprocess import Preprocessor, RawColumns
from export.repository import cache_stats, write_repository
from export.request import RequestLayout, TooWide, text_values
from pipeline.errors import BadInputError, UserError
from pipeline.etl.workflow import Workflow
from pipeline.modules.models import ModelSizes, build_model
from pipeline.schema import Column, Schema
from pipeline.stages.config import ConfigError, load_config

REPO = Path(__file__).resolve().parent.parent


def _schema(multihot: bool = True) -> Schema:
    columns = [Column("label", "label", "float32"), Column("I1", "continuous", "float32"),
               Column("I2", "continuous", "float32"), Column("C1", "categorical", "int32", cardinality=50),
               Column("C2", "categorical", "int32", cardinality=7)]
    if multihot:
        columns.append(Column("M1", "multihot", "int32", cardinality=30, max_length=5))
    return Schema(columns)


def _raw(multihot: bool = True) -> RawColumns:
    return RawColumns({"I1": "int64", "I2": "double"}, {"C1": "string", "C2": "string"},
                      {"M1": "list<item: string>"} if multihot else {}, label={"label": "int8"})


def _tensors(config: str) -> dict[str, tuple[str, str]]:
    found = re.findall(r'name: "(\w+)" data_type: TYPE_(\w+) dims: \[ ([-\d, ]+) \]', config)
    return {name: (dtype, dims) for name, dtype, dims in found}


@pytest.mark.parametrize("dense_backend", ["python", "pytorch"])
def test_every_ensemble_step_maps_tensors_the_models_declare_alike(dense_backend):
    spec = EnsembleSpec.build(_raw(), _schema(), embedding_dim_total=48)
    configs = model_configs(spec, ModelOptions(max_batch_size=64, dense_backend=dense_backend, fused=False))
    ensemble = configs["ensemble"]
    ensemble_tensors = _tensors(ensemble.split("ensemble_scheduling")[0])
    wired = dict(ensemble_tensors)
    steps = re.findall(r'model_name: "(\w+)"(.*?)\n    \}', ensemble, re.DOTALL)
    assert [s[0] for s in steps] == ["preprocess", "embedding", "dense"]
    for model, body in steps:
        declared = _tensors(configs[model])
        assert "max_batch_size: 64" in configs[model]
        for key, value in re.findall(r'input_map \{ key: "(\w+)" value: "(\w+)" \}', body):
            assert wired[value] == declared[key], f"{model} input {key}"
        for key, value in re.findall(r'output_map \{ key: "(\w+)" value: "(\w+)" \}', body):
            wired[value] = declared[key]
    assert wired["PREDICTION"] == ("FP32", "1")
    assert wired["EMBEDDINGS"] == ("FP32", "48")
    assert ensemble_tensors == {"INTEGERS": ("INT64", "1"), "INTEGERS_MISSING": ("BOOL", "1"), "FLOATS": ("FP64", "1"),
                                "FLOATS_MISSING": ("BOOL", "1"), "STRINGS": ("UINT8", "2, -1"),
                                "LISTS": ("UINT8", "1, -1"),
                                "PREDICTION": ("FP32", "1")}
    if dense_backend == "pytorch":
        assert 'platform: "pytorch_libtorch"' in configs["dense"]


def test_the_ensemble_declares_the_request_layout_clients_read():
    """The columns of each request tensor, in order, as a parameter of the ensemble's config: parsed by protobuf's
    own text-format reader, names with quotes, backslashes and other scripts come back as they were."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from export.request import RequestLayout

    odd = {'I"1': "int64", "I\\2": "double", "I3": "int64", "prix €": "double"}
    raw = RawColumns(odd, {"C1": "string", 'C"\\n': "string"}, {"M1": "list<item: string>"}, list_separator="\t",
                     label={"label": "int8"})
    spec = EnsembleSpec.build(raw, _schema(), embedding_dim_total=48)
    for options in (ModelOptions(), ModelOptions(fused=False)):
        config = text_format.Parse(model_configs(spec, options)["ensemble"], model_config_pb2.ModelConfig())
        layout = RequestLayout.from_json(config.parameters["layout"].string_value)
        assert layout == raw.layout
        assert (layout.integers, layout.floats) == (('I"1', "I3"), ("I\\2", "prix €"))
        assert (layout.strings, layout.lists, layout.list_separator, layout.label) == (
            ("C1", 'C"\\n'), ("M1",), "\t", "label")
        assert [(t.name, list(t.dims)) for t in config.input] == [
            ("INTEGERS", [2]), ("INTEGERS_MISSING", [2]), ("FLOATS", [2]), ("FLOATS_MISSING", [2]),
            ("STRINGS", [2, -1]), ("LISTS", [1, -1])]
    with pytest.raises(UserError, match="raw_columns.json: the continuous column I1 has type float.*int64 or double"):
        _ = RawColumns({"I1": "float"}, {"C1": "string"}).layout


def test_request_tensors_are_built_by_column_name_from_every_kind_of_rows():
    """A DataFrame, a dict of columns, a list of dicts and TSV lines give the same tensors: each value as it is
    (int64's extremes too), a missing one 0 (JSON has no NaN) and marked in its mask, an absent column missing."""
    from export.request import RequestLayout, text_values

    layout = RequestLayout(integers=("I1", "I2"), floats=("F1",), strings=("C1", "C2"), lists=("M1",),
                           list_separator="|", label="clicked")
    frame = pd.DataFrame({
        "clicked": [1, 0, 1],
        "I1": pd.array([2**63 - 1, None, -(2**63)], dtype=pd.ArrowDtype(pa.int64())),
        "F1": pd.array([-0.0, None, 2.5], dtype=pd.ArrowDtype(pa.float64())),
        "C2": pd.array(["é", None, ""], dtype=pd.ArrowDtype(pa.string())),
        "C1": ["68fd1e64", None, "x"],
        "M1": pd.array([["a", "b"], None, []], dtype=pd.ArrowDtype(pa.list_(pa.string()))),
    })
    records = [{k: v for k, v in r.items() if v is not None} for r in
               [{"I1": 2**63 - 1, "F1": -0.0, "C1": "68fd1e64", "C2": "é", "M1": ["a", "b"]},
                {"I1": None, "F1": float("nan"), "C1": None, "C2": None, "M1": None, "clicked": 0},
                {"I1": -(2**63), "F1": 2.5, "C1": "x", "C2": "", "M1": []}]]
    lines = ["1\t9223372036854775807\t\t-0.0\t68fd1e64\té\ta|b", "0\t\t\t\t\t\t", "-9223372036854775808\t\t2.5\tx\t\t"]
    columns = {"M1": [["a", "b"], None, []], "C1": ["68fd1e64", None, "x"], "C2": ["é", None, ""],
               "I1": [2**63 - 1, None, -(2**63)], "F1": np.array([-0.0, np.nan, 2.5])}
    expected = layout.tensors(frame)
    assert expected["INTEGERS"].tolist() == [[2**63 - 1, 0], [0, 0], [-(2**63), 0]]
    assert expected["INTEGERS_MISSING"].tolist() == [[False, True], [True, True], [False, True]]
    assert np.array_equal(expected["FLOATS"], [[-0.0], [0.0], [2.5]]) and np.signbit(expected["FLOATS"][0, 0])
    assert expected["FLOATS_MISSING"].tolist() == [[False], [True], [False]]
    assert text_values(expected["STRINGS"]).tolist() == [[b"68fd1e64", "é".encode()], [b"", b""], [b"x", b""]]
    assert text_values(expected["LISTS"]).tolist() == [[b"a|b"], [b""], [b""]]
    for rows in (records, lines, "\n".join(lines), columns):
        got = layout.tensors(rows)
        assert list(got) == list(expected)
        for name, values in expected.items():
            assert got[name].dtype == values.dtype and got[name].tolist() == values.tolist(), (name, rows)
    got = layout.tensors({"I1": np.array([2**63 - 1, 7, -(2**63)])})  # a numpy array of int64: missing nothing
    assert got["INTEGERS"][:, 0].tolist() == [2**63 - 1, 7, -(2**63)] and not got["INTEGERS_MISSING"][:, 0].any()


def test_a_frame_of_numpy_columns_gives_the_tensors_of_its_arrow_typed_twin():
    """pandas' own dtypes (an int column with missing values read as float64 with NaN, text as objects) and Arrow's
    give the same request: the numpy float columns are read together."""
    table = pa.table({"I1": pa.array([2**53, None, -7], pa.int64()), "I2": pa.array([None, None, 0], pa.int64()),
                      "F1": pa.array([0.5, None, -0.0]), "C1": pa.array(["a", None, "é"])})
    layout = RequestLayout(integers=("I1", "I2"), floats=("F1",), strings=("C1",))
    numpy_frame, arrow_frame = table.to_pandas(), table.to_pandas(types_mapper=pd.ArrowDtype)
    assert numpy_frame["I1"].dtype == np.float64
    expected, got = layout.tensors(arrow_frame), layout.tensors(numpy_frame)
    assert got["INTEGERS"].tolist() == [[2**53, 0], [0, 0], [-7, 0]] == expected["INTEGERS"].tolist()
    for name, values in expected.items():
        assert got[name].dtype == values.dtype and np.array_equal(got[name], values), name


@pytest.mark.parametrize(("rows", "message"), [
    ({"I1": [1, 2.5]}, ("column I1, row 1: the raw column is int64, expected a whole number from -9223372036854775808 "
                        "to 9223372036854775807 or missing, got 2.5")),
    ({"I1": np.array([1.0, 1e19])}, "column I1, row 1: .* got 1e\\+19"),
    ({"I1": np.array([np.nan, 2.5])}, "column I1, row 1: .* got 2.5"),
    ({"I1": np.array([np.nan, -np.inf], np.float32)}, "column I1, row 1: .* got -inf"),
    ({"I1": np.array([2**63], dtype=np.uint64)}, "column I1, row 0: .* got 9223372036854775808"),
    ({"I1": [2**63]}, "column I1, row 0: .* got 9223372036854775808"),
    ({"I1": ["seven"]}, "column I1, row 0: expected a whole number or missing, got 'seven'"),
    ({"I1": [Decimal(7), Decimal("2.5")]}, "column I1, row 1: .* got Decimal\\('2.5'\\)"),
    ({"F1": [1.0, float("inf")]}, "column F1, row 1: expected a finite number or missing, got inf"),
    ({"F1": np.array([-np.inf])}, "column F1, row 0: expected a finite number or missing, got -inf"),
    ({"F1": ["1,5"]}, "column F1, row 0: expected a number or missing, got '1,5'"),
    ({"I1": [1, 2], "C1": ["a"]}, "every column needs the same number of rows, got \\{'I1': 2, 'C1': 1\\}"),
    ([{"I01": 3}], "unknown columns \\['I01'\\]; the model takes \\['I1', 'F1', 'C1'\\]"),
    (["1\t2"], "TSV line 1: expected 3 fields \\(or 4 with the label first\\), found 2"),
    ([{"I1": 1}, 7], "rows: expected a DataFrame, a dict of columns, a list of dicts or TSV lines, got a list of int"),
])
def test_request_tensors_name_the_column_and_row_of_a_value_they_cannot_carry(rows, message):
    from export.request import RequestLayout

    with pytest.raises(BadInputError, match=message):
        RequestLayout(integers=("I1",), floats=("F1",), strings=("C1",)).tensors(rows)


def test_fused_export_is_one_python_model_called_as_the_ensemble():
    """Fused, the entry clients call is the one python model itself (no Triton ensemble in front of it: a hop), with
    the raw columns in and PREDICTION out as the chain's ensemble has them (and its layout: the test above)."""
    spec = EnsembleSpec.build(_raw(), _schema(), embedding_dim_total=48)
    configs = model_configs(spec, ModelOptions())
    assert sorted(configs) == ["ensemble"]
    assert 'backend: "python"' in configs["ensemble"] and "ensemble_scheduling" not in configs["ensemble"]
    chain = model_configs(spec, ModelOptions(fused=False))["ensemble"]
    fused = _tensors(configs["ensemble"])
    assert fused == _tensors(chain.split("ensemble_scheduling")[0])  # raw columns in, PREDICTION out
    assert fused["PREDICTION"] == ("FP32", "1") and 'key: "intra_op_threads"' in configs["ensemble"]
    assert "preprocess" in model_configs(spec, ModelOptions(dense_backend="pytorch"))  # auto: the chain
    assert "preprocess" not in model_configs(spec, ModelOptions(instance_kind="gpu"))  # auto: one model on GPUs too
    with pytest.raises(UserError, match="fuse=all .* needs export.dense_backend=python"):
        model_configs(spec, ModelOptions(dense_backend="pytorch", fused=True))


@pytest.mark.parametrize(("settings", "fused"), [([], True), (["export.fuse=none"], False),
                                                  (["export.dense_backend=pytorch"], False),
                                                  (["export.fuse=all", "export.instance_kind=cpu"], True)])
def test_fuse_auto_serves_one_model_with_the_python_dense_backend(settings, fused):
    from pipeline.stages.export import model_options

    assert model_options(load_config(None, ["device=cpu", *settings])).fused == fused


def test_instance_groups_and_dynamic_batching_are_options():
    spec = EnsembleSpec.build(_raw(False), _schema(False), embedding_dim_total=32)
    gpu = model_configs(spec, ModelOptions(instance_kind="gpu", instances=2, dynamic_batching=False, fused=False))
    assert instance_groups("gpu", 2) in gpu["dense"] and instance_groups("gpu", 2) in gpu["embedding"]
    assert "kind: KIND_CPU" in gpu["preprocess"]  # pandas runs on the CPU whatever the device
    assert "dynamic_batching" not in gpu["dense"]
    cpu = model_configs(spec, ModelOptions(max_queue_delay_us=250, fused=False))
    assert "max_queue_delay_microseconds: 250" in cpu["embedding"]
    assert "MULTIHOT" not in cpu["preprocess"]
    fused = model_configs(spec, ModelOptions(instances=3))
    assert instance_groups("cpu", 3) in fused["ensemble"]
    assert "max_queue_delay_microseconds: 0" in fused["ensemble"]  # no wait: a lone request runs at once
    # the GPU dense model takes the pooled embeddings where the GPU embedding model leaves them
    keep_on_gpu = 'parameters { key: "FORCE_CPU_ONLY_INPUT_TENSORS" value: { string_value: "no" } }'
    assert keep_on_gpu in gpu["dense"] and keep_on_gpu not in model_configs(spec, ModelOptions(fused=False))["dense"]


@pytest.mark.parametrize("count", [1, 2, 8, 12])
def test_each_instance_is_a_group_of_its_own_its_priority_twenty_times_the_one_before(count):
    """Read by protobuf's own text-format reader as Triton reads it: ``count`` instances of the kind, the k-th of
    rate-limiter priority 20**k up to Triton's 32 bits (one instance: no priority)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    spec = EnsembleSpec.build(_raw(False), _schema(False), embedding_dim_total=32)
    for kind in ("cpu", "gpu"):
        text = model_configs(spec, ModelOptions(instance_kind=kind, instances=count))["ensemble"]
        config = text_format.Parse(text, model_config_pb2.ModelConfig())
        assert sum(group.count for group in config.instance_group) == count
        assert {group.kind for group in config.instance_group} == {getattr(model_config_pb2.ModelInstanceGroup,
                                                                           f"KIND_{kind.upper()}")}
        priorities = [group.rate_limiter.priority for group in config.instance_group]
        assert priorities == ([0] if count == 1 else [min(20**k, 2**31) for k in range(count)])


def test_a_config_regrouped_keeps_its_kind_and_all_else():
    """``regrouped`` (the profiling tools' other layouts): the count asked, by priority as the export writes them or
    in one group; the kind, the warm-up and every other line of the config as they were."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    spec = EnsembleSpec.build(_raw(False), _schema(False), embedding_dim_total=32)
    for kind in ("cpu", "gpu"):
        text = model_configs(spec, ModelOptions(instance_kind=kind, instances=8))["ensemble"]
        for count, by_priority in ((3, True), (3, False), (1, True)):
            config = text_format.Parse(regrouped(text, count, by_priority), model_config_pb2.ModelConfig())
            original = text_format.Parse(text, model_config_pb2.ModelConfig())
            assert [group.count for group in config.instance_group] == ([1] * count if by_priority else [count])
            assert {group.kind for group in config.instance_group} == {original.instance_group[0].kind}
            config.ClearField("instance_group")
            original.ClearField("instance_group")
            assert config == original


@pytest.mark.parametrize("max_batch", [1, 100, 1024])
def test_gpu_instances_warm_up_every_graph_size_with_a_request_of_zeros(max_batch):
    """Each GPU model with a dense part gets Triton's model_warmup: a request of zeros at each batch size a CUDA graph
    serves (what padded_batch pads to), every input there (its any-length dims 1); CPU models and a GPU model without
    graphs (cuda_graphs off, or the embedding lookup) get none."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from export.dense import padded_batch

    spec = EnsembleSpec.build(_raw(True), _schema(True), embedding_dim_total=48)
    sizes = sorted({padded_batch(rows, max_batch) for rows in range(1, max_batch + 1)})
    for fused in (True, False):
        gpu = model_configs(spec, ModelOptions(instance_kind="gpu", instances=2, max_batch_size=max_batch, fused=fused))
        for name in ("ensemble",) if fused else ("dense",):
            config = text_format.Parse(gpu[name], model_config_pb2.ModelConfig())
            assert [w.batch_size for w in config.model_warmup] == sizes
            for warm in config.model_warmup:
                assert sorted(warm.inputs) == sorted(i.name for i in config.input)
                for tensor in config.input:
                    given = warm.inputs[tensor.name]
                    assert given.zero_data and given.data_type == tensor.data_type
                    assert list(given.dims) == [d if d > 0 else 1 for d in tensor.dims]
        assert "model_warmup" not in gpu.get("embedding", "") + gpu.get("preprocess", "")
        off = model_configs(spec, ModelOptions(instance_kind="gpu", max_batch_size=max_batch, fused=fused,
                                               cuda_graphs=False))
        cpu = model_configs(spec, ModelOptions(max_batch_size=max_batch, fused=fused))
        assert "model_warmup" not in "".join(off.values()) + "".join(cpu.values())


def test_instances_default_to_one_per_core_up_to_a_limit(monkeypatch):
    from export.config import AUTO_INSTANCES_MAX
    from pipeline.stages.export import model_options

    for cores, expected in ((1, 1), (2, 2), (64, AUTO_INSTANCES_MAX)):
        monkeypatch.setattr("os.sched_getaffinity", lambda pid, cores=cores: set(range(cores)))
        assert model_options(load_config(None, ["device=cpu"])).instances == expected
    assert model_options(load_config(None, ["device=cpu", "export.instances=3"])).instances == 3
    with pytest.raises(ConfigError, match="export.instances"):
        load_config(None, ["export.instances=-1"])


def test_instances_default_to_the_cores_this_process_may_run_on():
    """A process confined to one core (taskset, a container's cpuset) gets one instance, not one per core of the host."""
    import shutil
    import subprocess
    import sys

    if shutil.which("taskset") is None:
        pytest.skip("needs taskset (util-linux)")
    command = ["taskset", "-c", "0", sys.executable, "-c",
               "from pipeline.stages.export import auto_instances; print(auto_instances('cpu'))"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "1"

@pytest.mark.parametrize("max_batch", [1, 7, 64, 1000])
def test_a_batch_is_padded_to_the_smallest_graph_batch_that_holds_it(max_batch):
    from export.dense import padded_batch

    sizes = sorted({1 << k for k in range(max_batch.bit_length()) if 1 << k <= max_batch} | {max_batch})
    for rows in range(max_batch + 3):
        expected = next((size for size in sizes if size >= rows), None)
        assert padded_batch(rows, max_batch) == expected, rows


def test_cuda_graphs_are_a_dense_parameter_and_cpu_runners_run_the_module_as_it_is(tmp_path):
    from export.dense import DenseRunner

    spec = EnsembleSpec.build(_raw(False), _schema(False), embedding_dim_total=32)
    assert 'key: "cuda_graphs" value: { string_value: "true" }' in model_configs(spec, ModelOptions())["ensemble"]
    chain = model_configs(spec, ModelOptions(fused=False, cuda_graphs=False))
    assert 'key: "cuda_graphs" value: { string_value: "false" }' in chain["dense"]
    model = build_model("dlrm", _schema(False), ModelSizes.preset("small"), seed=0).eval()
    path = save_dense(model, tmp_path / "model.pt")
    runner = DenseRunner(path, cuda_graphs=True)
    assert not runner.cuda_graphs
    rng = np.random.default_rng(0)
    dense, pooled = rng.normal(size=(5, model.num_dense)), rng.normal(size=(5, model.embedding.output_dim))
    assert np.array_equal(runner(dense, pooled), DenseRunner(path)(dense, pooled))
    # pooled embeddings that a cache left as a tensor on its device are taken as they are
    on_device = torch.from_numpy(pooled.astype(np.float32))
    assert np.array_equal(runner(dense, on_device), runner(dense, pooled))
    # and the rows where a cache holds them are gathered first
    from export.cache_torch import CachedRows

    rows = torch.from_numpy(rng.normal(size=(7, model.embedding.output_dim // 2)).astype(np.float32))
    slots = rng.integers(0, 7, (5, 2))
    gathered = rows.numpy()[slots].reshape(5, -1)
    assert np.array_equal(runner(dense, CachedRows(rows, slots)), runner(dense, gathered))


def test_pinned_instances_run_every_thread_on_a_core_of_their_own_by_index():
    """``export.pin_instances``: every python model's config asks its instances to keep to a core; an instance pins
    all its process's threads, those started before too, to the core its index picks (from the last one)."""
    import subprocess
    import sys

    spec = EnsembleSpec.build(_raw(False), _schema(False), embedding_dim_total=32)
    for fused in (True, False):
        configs = model_configs(spec, ModelOptions(fused=fused, pin_instances=True))
        python = [name for name, text in configs.items() if 'backend: "python"' in text]
        assert python and all('key: "pin_cores" value: { string_value: "true" }' in configs[n] for n in python)
    assert "pin_cores" not in "".join(model_configs(spec, ModelOptions()).values())

    code = """
import json, os, sys, threading
from pathlib import Path
from export.instance import pin_to_core
stop = threading.Event()
started = threading.Thread(target=stop.wait)
started.start()
core = pin_to_core({"model_instance_name": sys.argv[1]}, {"pin_cores": sys.argv[2]})
cores = {int(t.name): sorted(os.sched_getaffinity(int(t.name))) for t in Path("/proc/self/task").iterdir()}
stop.set()
print(json.dumps([core, sorted(os.sched_getaffinity(0)), list(cores.values())]))
"""
    usable = sorted(os.sched_getaffinity(0))
    for name, pin, expected in (("ranker_0_0", "true", usable[-1]), ("ranker_0_1", "true", usable[-2 % len(usable)]),
                                ("ranker_1_0", "true", usable[-2 % len(usable)]), ("wide_deep_2_0", "true",
                                                                                 usable[-3 % len(usable)]),
                                (f"dense_0_{len(usable)}", "true", usable[-1]), ("ranker_0_0", "false", None)):
        out = subprocess.run([sys.executable, "-c", code, name, pin], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).resolve().parents[1]).stdout
        core, _main, threads = json.loads(out)
        assert core == expected
        assert len(threads) >= 2 and all(t == ([expected] if pin == "true" else usable) for t in threads), threads


def test_export_settings_are_checked():
    with pytest.raises(ConfigError, match="export.cache_policy: expected one of lru, lfu, none, got 'fifo'"):
        load_config(None, ["export.cache_policy=fifo"])
    with pytest.raises(ConfigError, match="export.dense_backend"):
        load_config(None, ["export.dense_backend=onnx"])


@pytest.mark.parametrize("name", ["dlrm", "dcnv2", "deepfm", "wide_deep"])
def test_traced_dense_part_equals_the_model_at_any_batch_size(tmp_path, name):
    model = build_model(name, _schema(), ModelSizes.preset("small")).eval()
    runner = DenseRunner(save_dense(model, tmp_path / "model.pt"))
    for batch in (1, 5, 130):
        dense = torch.randn(batch, 2)
        pooled = torch.randn(batch, model.embedding.output_dim)
        with torch.no_grad():
            expected = torch.sigmoid(model.dense_forward(dense, pooled)).numpy()
        got = runner(dense.numpy(), pooled.numpy())
        assert got.shape == (batch, 1)
        np.testing.assert_allclose(got[:, 0], expected, rtol=0, atol=1e-6)


def test_saving_the_dense_part_leaves_the_model_as_it_was_and_saves_no_table(tmp_path):
    schema = Schema([Column("label", "label", "float32"), Column("I1", "continuous", "float32"),
                     Column("C1", "categorical", "int32", cardinality=200_000)])
    model = build_model("dlrm", schema, ModelSizes.preset("small")).train()
    weights = model.embedding.weights
    path = save_dense(model, tmp_path / "model.pt")
    assert all(m.training for m in model.modules()), "the model's mode was changed"
    assert model.embedding.weights is weights and model.embedding is not None
    table_bytes = weights.numel() * weights.element_size()
    dense_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("embedding"))
    assert path.stat().st_size < dense_bytes + table_bytes / 2, "the embedding tables were saved with the dense part"


def test_the_models_environment_must_have_numpy_below_2():
    with pytest.raises(UserError, match="numpy 2.*expected numpy<2"):
        find_models_env(REPO / ".venv")
    with pytest.raises(UserError, match="make serve-env"):
        find_models_env(REPO / "no-such-venv")


def test_a_pythonpath_holding_numpy_2_does_not_fail_a_sound_models_environment(monkeypatch):
    """The python-backend stub does not read PYTHONPATH: the served models see the models' environment alone (its
    numpy 1.x), so the check of that environment must not read it either. A PYTHONPATH reaching numpy 2 (a GPU
    machine's packages, a container's) failed the check, and its advice (rebuild the environment) could not help."""
    from export.environment import _inspect, server_env

    monkeypatch.setenv("PYTHONPATH", str(Path(np.__file__).resolve().parent.parent))  # this Python's numpy 2
    _inspect.cache_clear()
    try:
        env = find_models_env()
    finally:
        _inspect.cache_clear()
    assert "PYTHONPATH" not in server_env(env)


def test_a_models_environment_without_this_project_is_refused(tmp_path):
    """The served models import this project from their environment; one that has numpy 1.x but not the project
    fails at the check, on one line, not at the server's start."""
    import venv

    from export.environment import _inspect

    sound = find_models_env()
    venv.create(tmp_path / "partial", with_pip=False)
    purelib = next((tmp_path / "partial" / "lib").glob("python3*/site-packages"))
    # the sound environment's packages, without processing its .pth files: numpy imports, this project does not
    (purelib / "packages.pth").write_text(str(next((sound.path / "lib").glob("python3*/site-packages"))) + "\n")
    try:
        with pytest.raises(UserError) as caught:
            find_models_env(tmp_path / "partial")
    finally:
        _inspect.cache_clear()
    message = str(caught.value)
    assert "cannot import this project" in message and "No module named 'export'" in message, message
    assert "make serve-env" in message and "\n" not in message


def test_the_request_layout_takes_the_datasets_separator_and_label_not_the_commands(tmp_path):
    """An export naming the dataset alone cut multi-hot cells at the default "|" where the data was read with ";",
    and a client refused the table's own label column (data.label=clicked) as unknown."""
    from export.repository import raw_columns
    from pipeline.data.raw_folder import RawDataset
    from pipeline.stages.data import run as make_data

    (tmp_path / "t.csv").write_text("clicked,price,tags,item,code\n" + "".join(
        f"{i % 2},{i / 3},a;b{i % 4},{i % 9 if i % 5 else ''},{i % 7}.0\n" for i in range(60)))
    made = load_config(None, [f"workdir={tmp_path}", "data.source=table", f"data.path={tmp_path / 't.csv'}",
                              "data.label=clicked", "data.continuous=[price]", "data.multihot=[tags]",
                              "data.categorical=[item,code]", "data.list_separator=;", "data.name=t", "progress=off"])
    make_data(made)
    later = load_config(None, [f"workdir={tmp_path}", "data.name=t"])  # e.g. `run export data.name=t`
    raw = RawDataset.load(later.paths.raw)
    layout = raw_columns(raw, later.data.list_separator).layout
    assert (layout.list_separator, layout.label, layout.table_label) == (";", "label", "clicked")
    assert layout.integer_text == ("item",)  # "code" was written 3.0, 4.0, ...: as floats
    # pandas reads the integer column with blanks as floats: its ids are sent as the training rows wrote them
    rows = pd.read_csv(tmp_path / "t.csv").iloc[:20]
    assert rows["item"].dtype == np.float64
    trained = pd.read_csv(tmp_path / "t.csv", dtype=str, keep_default_na=False).iloc[:20]
    got, want = layout.tensors(rows), layout.tensors(trained.replace("", None))
    assert text_values(got["STRINGS"]).tolist() == text_values(want["STRINGS"]).tolist()
    assert text_values(got["STRINGS"])[1].tolist() == [b"1", b"1.0"] and got["LISTS"].shape[:2] == (20, 1)


@pytest.mark.parametrize("time_is_a_feature", [False, True])
def test_rows_of_the_users_table_are_taken_with_its_time_and_ignored_columns(tmp_path, time_is_a_feature):
    """A client sending rows as read from the table (its time column and a column of data.ignore in them) was
    refused: "unknown columns ['session', 'ts']". A misspelt column still is."""
    from export.repository import raw_columns
    from pipeline.data.raw_folder import RawDataset
    from pipeline.stages.data import run as make_data

    (tmp_path / "t.csv").write_text("ts,clicked,price,item,session\n" + "".join(
        f"{1_700_000_000 + i},{i % 2},{i / 3},{i % 9},s{i}\n" for i in range(60)))
    roles = [f"data.continuous=[price{',ts' if time_is_a_feature else ''}]", "data.categorical=[item]"]
    cfg = load_config(None, [f"workdir={tmp_path}", "data.source=table", f"data.path={tmp_path / 't.csv'}",
                             "data.label=clicked", *roles, "data.ignore=[session]", "data.time_column=ts",
                             "progress=off"])
    make_data(cfg)
    layout = raw_columns(RawDataset.load(cfg.paths.raw), cfg.data.list_separator).layout
    assert layout.unread == (("session",) if time_is_a_feature else ("ts", "session"))
    rows = pd.read_csv(tmp_path / "t.csv").iloc[:10]
    got, want = layout.tensors(rows), layout.tensors(rows[list(layout.columns)])
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in got)
    with pytest.raises(BadInputError, match=r"unknown columns \['prise'\]"):
        layout.tensors(rows.rename(columns={"price": "prise"}))


@pytest.fixture(scope="module")
def multihot_pipeline(tmp_path_factory):
    """A table with a multi-hot column, through the data and ETL stages, and a model on it."""
    workdir = tmp_path_factory.mktemp("multihot")
    rng = np.random.default_rng(0)
    n = 600
    bags = [[f"m{v}" for v in rng.integers(0, 25, rng.integers(0, 5))] if i % 9 else None for i in range(n)]
    table = pa.table({
        "label": pa.array(rng.integers(0, 2, n), pa.int8()),
        "I1": pa.array([int(v) if i % 7 else None for i, v in enumerate(rng.integers(0, 100, n))], pa.int64()),
        "I2": pa.array(rng.standard_normal(n)),
        "C1": pa.array([f"c{v}" if i % 11 else None for i, v in enumerate(rng.zipf(1.5, n) % 40)], pa.string()),
        "C2": pa.array([f"d{v}" for v in rng.integers(0, 5, n)], pa.string()),
        "M1": pa.array(bags, pa.list_(pa.string())),
    })
    source = workdir / "table.parquet"
    pq.write_table(table, source)
    cfg = load_config(None, [f"workdir={workdir}", "data.source=table", f"data.path={source}", "data.name=mh",
                             "data.continuous=[I1,I2]", "data.categorical=[C1,C2]", "data.multihot=[M1]",
                             "etl.cluster=threads", "device=cpu"])
    from export.repository import raw_columns
    from pipeline.data.raw_folder import RawDataset
    from pipeline.stages.data import run as make_data
    from pipeline.stages.etl import run as run_etl
    from pipeline.stages.export import model_options

    make_data(cfg)
    run_etl(cfg)
    schema = Schema.load(cfg.paths.schema)
    model = build_model("deepfm", schema, ModelSizes.preset("small", multihot_pooling="mean"), seed=1).eval()
    with torch.no_grad():
        model.embedding.weights.mul_(30)
    raw = raw_columns(RawDataset.load(cfg.paths.raw), cfg.data.list_separator)
    write_repository(model, schema, cfg.paths.workflow, raw, cfg.paths.export, model_options(cfg))
    rows = pq.read_table(source).slice(0, 200).to_pandas(types_mapper=pd.ArrowDtype)
    return cfg, model, schema, raw, rows


def test_served_parts_equal_in_process_with_multihot_unseen_and_missing(multihot_pipeline):
    cfg, model, schema, raw, rows = multihot_pipeline
    rows = rows.copy()
    rows.loc[0:4, "C1"] = "never-seen"
    rows.loc[3:8, "M1"] = pd.Series([["m1", "unseen-item"]] * 6, index=range(3, 9), dtype=rows["M1"].dtype)
    export = Path(cfg.paths.export)
    expected = InProcessModel(model, schema, Workflow.load(cfg.paths.workflow)).predict(rows)
    assert expected.std() > 0.05

    fused = export / "ensemble"  # the preprocess, lookup and dense parts of the one served model
    preprocess = Preprocessor.load(fused / "1" / "artifacts")
    lookup = EmbeddingLookup(fused / "store", LookupConfig.load(fused / "1" / "layout.json"))
    dense = DenseRunner(fused / "1" / "model.pt")
    tensors = preprocess(raw.layout.tensors(rows))
    assert tensors["MULTIHOT_LENGTHS"].shape == (len(rows), 1)
    pooled = lookup(tensors["CATEGORICAL_IDS"], tensors["MULTIHOT_IDS"], tensors["MULTIHOT_LENGTHS"])
    np.testing.assert_allclose(dense(tensors["DENSE"], pooled)[:, 0], expected, rtol=0, atol=1e-5)


def test_preprocess_names_what_is_wrong_with_a_request(multihot_pipeline):
    cfg, _, _, raw, rows = multihot_pipeline
    preprocess = Preprocessor.load(Path(cfg.paths.export) / "ensemble" / "1" / "artifacts")
    good = raw.layout.tensors(rows.iloc[:3])
    assert sorted(good) == ["FLOATS", "FLOATS_MISSING", "INTEGERS", "INTEGERS_MISSING", "LISTS", "STRINGS"]
    cases = [
        ({k: v for k, v in good.items() if k != "STRINGS"}, r"missing input STRINGS; expected \['INTEGERS', "),
        ({k: v[:0] for k, v in good.items()}, "empty batch"),
        (dict(good, FLOATS=np.zeros((5, 1))), r"every input needs the same number of rows, got \{.*'FLOATS': 5"),
        (dict(good, STRINGS=good["STRINGS"][:, :1]),
         r"input STRINGS: expected the shape \[rows, 2, width\] \(columns C1, C2\), got \[3, 1, [0-9]+\]"),
        (dict(good, LISTS=good["LISTS"].reshape(-1)),
         r"input LISTS: expected the shape \[rows, 1, width\] \(columns M1\), got \[[0-9]+\]"),
        (dict(good, STRINGS=text_values(good["STRINGS"])[:, :1]),
         r"input STRINGS: expected the shape \[rows, 2, width\] \(columns C1, C2\), got \[3, 1\]"),
        (dict(good, INTEGERS=good["INTEGERS"].astype(np.float64)),
         "input INTEGERS: expected INT64, got the numpy dtype float64"),
        (dict(good, INTEGERS_MISSING=good["INTEGERS_MISSING"].astype(np.int8)),
         "input INTEGERS_MISSING: expected BOOL, got the numpy dtype int8"),
        (dict(good, STRINGS=np.zeros((3, 2, 4))),
         r"input STRINGS: expected UINT8 \[rows, 2, width\] \(text at a fixed width\), got the numpy dtype float64"),
        (dict(good, FLOATS=np.array([[1.0], [-np.inf], [np.inf]])),
         r"input FLOATS, column I2, row 1: expected finite numbers \(missing: FLOATS_MISSING\), got -inf"),
    ]
    for request, message in cases:
        with pytest.raises(BadInputError, match=message):
            preprocess(request)


def test_a_missing_number_is_its_mask_or_a_nan_and_a_masked_value_is_ignored(multihot_pipeline):
    cfg, _, _, raw, rows = multihot_pipeline
    rows = rows.iloc[:6].reset_index(drop=True)
    preprocess = Preprocessor.load(Path(cfg.paths.export) / "ensemble" / "1" / "artifacts")
    missing = rows.assign(I1=pd.Series([None] * 6, dtype=rows["I1"].dtype),
                          I2=pd.Series([None] * 6, dtype=rows["I2"].dtype))
    expected = preprocess(raw.layout.tensors(missing))
    offline = preprocess.tensors(Workflow.load(cfg.paths.workflow).transform(missing))
    assert np.array_equal(expected["DENSE"], offline["DENSE"]) and np.isin(offline["DENSE"][:, 2:], 1.0).all()
    good = raw.layout.tensors(rows)
    everywhere = np.ones((6, 1), bool)
    for request in (dict(good, INTEGERS_MISSING=everywhere, FLOATS_MISSING=everywhere),
                    dict(good, INTEGERS_MISSING=everywhere, FLOATS=np.full((6, 1), np.nan)),
                    dict(good, INTEGERS_MISSING=everywhere, FLOATS_MISSING=everywhere, FLOATS=np.full((6, 1), np.inf))):
        assert np.array_equal(preprocess(request)["DENSE"], expected["DENSE"])


def test_a_number_written_as_text_is_missing_where_the_data_stage_reads_it_so():
    """A client that sends a table's rows as text (TSV lines, strings) gets the data stage's reading of its numbers:
    ``nan``, ``NA``, ``NULL``... are missing (the training rows had the median there), not 0.0 and not an error."""
    layout = RequestLayout(integers=(), floats=("price",), strings=("user",), lists=())
    words = ["nan", "NaN", "NA", "N/A", "NULL", "null", "None", "<NA>", "#N/A", "nAn", " nan "]
    tensors = layout.tensors([{"price": word, "user": "NA"} for word in words] + [{"price": "2.5", "user": "b"}])
    assert tensors["FLOATS_MISSING"].ravel().tolist() == [True] * len(words) + [False]
    assert tensors["FLOATS"].ravel().tolist() == [0.0] * len(words) + [2.5]
    assert text_values(tensors["STRINGS"])[0, 0] == b"NA"  # a category's text stays as written
    tsv = layout.tensors(["nan\tx", "\ty", "3\tz"])
    assert tsv["FLOATS_MISSING"].ravel().tolist() == [True, True, False]
    with pytest.raises(BadInputError, match=r"column price, row 0: expected a number or missing, got 'NAN2'"):
        layout.tensors([{"price": "NAN2", "user": "a"}])



def test_an_empty_field_of_a_number_column_is_missing_in_dict_rows_as_in_tsv_lines():
    """``csv.DictReader`` gives an empty field as "": refused in a number column, where a TSV line's was missing."""
    import csv
    import io

    layout = RequestLayout(integers=("count",), floats=("price",), strings=("user",), lists=())
    text = "count,price,user\n3,,a\n,2.5,b\n"
    tensors = layout.tensors(list(csv.DictReader(io.StringIO(text))))
    assert tensors["INTEGERS_MISSING"].ravel().tolist() == [False, True]
    assert tensors["FLOATS_MISSING"].ravel().tolist() == [True, False]
    assert tensors["INTEGERS"].ravel().tolist() == [3, 0] and tensors["FLOATS"].ravel().tolist() == [0.0, 2.5]


def test_an_update_over_a_damaged_store_or_record_repairs_it_or_names_the_file(multihot_pipeline, tmp_path):
    import shutil

    from export.store import current_version
    from pipeline.errors import UserError

    cfg, model, schema, _, _ = multihot_pipeline
    export = tmp_path / "export"
    shutil.copytree(cfg.paths.export, export)
    current = export / "ensemble" / "store" / "CURRENT"
    for garbage in (b"garbage\n", b"", b"\xff\xfe"):
        current.write_bytes(garbage)
        with pytest.raises(UserError, match="CURRENT holds .*, not a store version such as v000001"):
            current_version(current.parent)
        summary = write_repository(model, schema, cfg.paths.workflow, None, export, update=True)
        assert current_version(current.parent) == summary["store_version"]  # a new version replaces it
    record = export / "export.json"
    for damaged in ("{", "[]", "{}"):
        record.write_text(damaged)
        with pytest.raises(UserError, match="export.json cannot be read .*: export with export.update=false"):
            write_repository(model, schema, cfg.paths.workflow, None, export, update=True)


@pytest.mark.parametrize("batch", [1, 32, 1000])
def test_preprocess_equals_the_workflow_column_by_column_on_the_raw_rows(multihot_pipeline, batch):
    """The request's tensors (the continuous columns in one matrix, each operator's columns computed together)
    equal, bit for bit, those of the ETL's own path: the raw rows as its reader gives them (arrow-backed, the raw
    parquet's types) through every operator column by column (``Workflow.transform_partition``)."""
    cfg, _, _, raw, rows = multihot_pipeline
    rng = np.random.default_rng(batch)
    frame = rows.iloc[rng.integers(0, len(rows), batch)].reset_index(drop=True)
    unseen, missing = rng.random((2, batch)) < 0.2
    frame.loc[unseen, "C1"] = "never-seen"
    frame.loc[missing, "C2"] = None  # an empty string in the request
    frame.loc[unseen, "I1"] = 10**12
    frame.loc[0, "C2"] = "x" * 3000  # one long value: the request's text 3,000 bytes wide
    frame.loc[missing, "I1"] = np.where(np.arange(batch)[missing] % 2, 2**63 - 1, -(2**63))  # int64's extremes
    frame.loc[missing, "I2"] = None
    frame.loc[unseen & ~missing, "I2"] = -0.0
    bags = [["m1", "unseen-item", "m1"] if u else None if m else v for u, m, v in zip(unseen, missing, frame["M1"])]
    frame["M1"] = pd.Series(bags, dtype=frame["M1"].dtype)
    preprocess = Preprocessor.load(Path(cfg.paths.export) / "ensemble" / "1" / "artifacts")
    workflow = Workflow.load(cfg.paths.workflow)
    expected = preprocess.tensors(Workflow.transform_partition(frame, workflow.output))
    request = raw.layout.tensors(frame)  # text at a fixed width; below, also as fixed-width bytes
    assert request["STRINGS"].shape == (batch, 2, 3000) and request["STRINGS"].dtype == np.uint8
    read = {name: text_values(values) if name in ("STRINGS", "LISTS") else values for name, values in request.items()}
    assert request["INTEGERS"][missing, 0].tolist() == frame["I1"][missing].tolist()
    for got in (preprocess(request), preprocess(read)):
        assert sorted(got) == ["CATEGORICAL_IDS", "DENSE", "MULTIHOT_IDS", "MULTIHOT_LENGTHS"]
        for name, values in expected.items():
            assert got[name].dtype == values.dtype and got[name].shape == values.shape, name
            assert got[name].flags.c_contiguous, name
            bits = f"u{values.itemsize}"
            assert (got[name].view(bits) == values.view(bits)).all(), name


def test_text_travels_at_a_fixed_width_and_reads_back_whole():
    """Each value's UTF-8 bytes, zero-padded to the widest value: read back as they were sent (text that is not
    ASCII, bytes that are not UTF-8, NUL bytes inside a value, values of other types as their text); missing values
    are empty; multi-hot cells are their values joined."""
    layout = RequestLayout(strings=("C1", "C2"), lists=("M1",), list_separator="|")
    c1 = [b"68fd1e64", "é", None, b"ab\x00c", b"\x00\x01", 5, float("nan"), b"\xff\xfe", "x" * 300]
    c2 = ["", "0c1885c5", "19e54d61", None, pd.NA, b"a", "b", "c", "d"]
    m1 = [["a", "bc"], [], None, ["é"], ["x"], ["y", "z"], None, ["q"], ["w"]]
    tensors = layout.tensors({"C1": c1, "C2": c2, "M1": m1})
    assert tensors["STRINGS"].dtype == np.uint8 and tensors["STRINGS"].shape == (9, 2, 300)
    assert text_values(tensors["STRINGS"]).tolist() == [
        [b"68fd1e64", b""], ["é".encode(), b"0c1885c5"], [b"", b"19e54d61"], [b"ab\x00c", b""], [b"\x00\x01", b""],
        [b"5", b"a"], [b"", b"b"], [b"\xff\xfe", b"c"], [b"x" * 300, b"d"]]
    assert tensors["LISTS"].shape == (9, 1, 4)
    assert text_values(tensors["LISTS"]).reshape(-1).tolist() == [b"a|bc", b"", b"", "é".encode(), b"x", b"y|z", b"",
                                                                  b"q", b"w"]
    empty = layout.tensors({"C1": [None, ""]})  # nothing to send: one byte wide
    assert empty["STRINGS"].shape == (2, 2, 1) and not empty["STRINGS"].any()
    assert text_values(np.zeros((3, 2, 0), np.uint8)).tolist() == [[b"", b""]] * 3


def test_a_value_ending_in_a_zero_byte_is_refused_by_name():
    """The padding is zero bytes: such a value would arrive without its last bytes, so it is not sent."""
    layout = RequestLayout(strings=("C1", "C2"))
    with pytest.raises(BadInputError, match=r"column C2, row 1: the value b'ab\\x00' ends in a zero byte"):
        layout.tensors({"C1": ["a", "b"], "C2": [b"", b"ab\x00"]})


def test_a_list_item_holding_the_separator_is_refused_by_name():
    """The request joins a cell's items by the separator: "b|c" would be served as the two items b and c."""
    layout = RequestLayout(lists=("T",), list_separator="|")
    for cells in ([["a"], ["b|c", "d"]], pd.Series([["a"], ["b|c", "d"]]),
                  pa.array([["a"], ["b|c", "d"]], pa.list_(pa.string()))):
        with pytest.raises(BadInputError, match=r"column T, row 1: an item of \['b\|c', 'd'\] holds the list "
                                                r"separator '\|'"):
            layout.tensors({"T": cells})
    assert text_values(layout.tensors({"T": [["a", "b"], "c|d"]})["LISTS"]).reshape(-1).tolist() == [b"a|b", b"c|d"]


def test_rows_whose_text_would_be_mostly_padding_are_sent_in_parts():
    """One long value among many short ones: one request would be that wide for every value; the rows go in parts,
    in order, the long value in a small one, each part's text read back whole."""
    layout = RequestLayout(integers=("I1",), strings=("C1", "C2"))
    rows = 1000
    c1 = [b"%x" % i for i in range(rows)]
    c1[700] = b"x" * (1 << 20)
    columns = {"I1": list(range(rows)), "C1": c1, "C2": ["v"] * rows}
    with pytest.raises(TooWide, match="STRINGS: its widest value has 1048576 bytes"):
        layout.tensors(columns)
    parts = layout.requests(columns)
    assert len(parts) > 1
    assert np.concatenate([p["INTEGERS"][:, 0] for p in parts]).tolist() == list(range(rows))
    assert [v for p in parts for v in text_values(p["STRINGS"])[:, 0].tolist()] == c1
    assert max(p["STRINGS"].nbytes for p in parts) <= 2 * 4 * (1 << 20) + (16 << 20)
    assert min(len(p["INTEGERS"]) for p in parts if p["STRINGS"].shape[2] == 1 << 20) <= 8
    assert len(layout.requests(dict(columns, C1=[b"x" * 300] + [b"y"] * (rows - 1)))) == 1  # a few times: one part


def test_gpu_instances_need_torch_with_cuda_in_the_models_environment():
    from export.environment import cuda_problem
    from pipeline.stages.export import model_options

    if cuda_problem(find_models_env()) is None:
        pytest.skip("the models' torch can use a GPU here")
    with pytest.raises(UserError, match="export.instance_kind=gpu, but torch in .* sees no CUDA GPU"):
        model_options(load_config(None, ["export.instance_kind=gpu", "device=cpu"]))
    assert model_options(load_config(None, ["device=cpu"])).instance_kind == "cpu"


def test_update_refuses_a_changed_workflow(multihot_pipeline, tmp_path):
    import shutil

    cfg, model, schema, raw, _ = multihot_pipeline
    changed = tmp_path / "workflow"
    shutil.copytree(cfg.paths.workflow, changed)
    (changed / "workflow.json").write_text((changed / "workflow.json").read_text() + "\n")
    with pytest.raises(UserError, match="the ETL workflow changed since the export"):
        write_repository(model, schema, changed, raw, cfg.paths.export, update=True)
    summary = write_repository(model, schema, cfg.paths.workflow, raw, cfg.paths.export, update=True)
    assert summary["updated"] and summary["store_version"] == 2


@pytest.mark.parametrize("model", ["dlrm", "wide_deep"])
def test_a_row_with_every_continuous_value_missing_gets_an_unsaturated_prediction(tmp_path, model):
    """Continuous values far from 0 (a day count, a price), rarely or never missing in training: a missing
    value filled with 0 became an extreme input after Normalize (thousands of standard deviations), and a
    model's prediction for such a row saturated at 0 or 1."""
    from pipeline.stages.train import run as run_train
    from pipeline.train.model import load_trained
    from tests.test_train import SMALL

    rng = np.random.default_rng(3)
    n = 4000
    days, price, shop = rng.normal(10_000, 30, n).round(), rng.normal(1_000, 5, n), rng.integers(0, 20, n)
    click = rng.random(n) < 1 / (1 + np.exp(-((days - 10_000) / 30 + (price - 1_000) / 10 + shop % 3 - 1)))
    table = pa.table({
        "label": pa.array(click.astype(np.int8)),
        "days": pa.array(days.astype(np.int64)),
        "price": pa.array(price, mask=rng.random(n) < 0.02),
        "shop": pa.array([f"s{v}" for v in shop]),
    })
    pq.write_table(table, tmp_path / "clicks.parquet")
    cfg = load_config(None, [f"workdir={tmp_path}", "data.source=table", f"data.path={tmp_path / 'clicks.parquet'}",
                             "data.continuous=[days,price]", "data.categorical=[shop]", "etl.cluster=threads",
                             *SMALL, "train.epochs=2", f"train.model={model}"])
    run_train(cfg)
    model, schema = load_trained(cfg.paths.train / "latest")
    assert schema.continuous == ["days", "price", "days_missing", "price_missing"]
    rows = table.slice(0, 20).to_pandas(types_mapper=pd.ArrowDtype)
    for name in ("days", "price"):
        rows[name] = pd.Series([None] * len(rows), dtype=rows[name].dtype)
    predictions = InProcessModel(model, schema, Workflow.load(cfg.paths.workflow)).predict(rows)
    assert ((predictions > 0.001) & (predictions < 0.999)).all(), predictions


def test_the_server_keeps_its_memory_settings_over_a_dask_parents_environment(monkeypatch, tmp_path):
    """A process that started a local Dask cluster has MALLOC_TRIM_THRESHOLD_=65536 in its environment (the
    nanny's pre-spawn settings): the server and its models must still get the thresholds that keep buffers."""
    from export.environment import MALLOC, ModelsEnv, server_env

    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "65536")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    env = server_env(ModelsEnv(tmp_path, "3.11", str(tmp_path / "lib")))
    assert {k: env[k] for k in MALLOC} == MALLOC
    assert env["PATH"].startswith(str(tmp_path / "bin"))


def test_a_process_that_ended_runs_no_more_before_it_is_reaped():
    """A killed server's stubs stay zombies until their new parent collects them: their stats files are not an
    instance's then, and the restarted instances prune them."""
    import subprocess
    import time

    child = subprocess.Popen(["sleep", "30"])
    try:
        assert process_identity(child.pid) is not None
        child.kill()
        state = lambda: Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and state() != "Z":
            time.sleep(0.01)
        assert state() == "Z"
        assert process_identity(child.pid) is None  # ended, not reaped yet (this test has not waited for it)
    finally:
        child.wait()


def test_cache_stats_count_only_files_whose_own_process_runs(tmp_path):
    """A stats file whose pid now belongs to another process (a recycled pid: here this test's own), whether it
    records another start of that pid or is of the older format without one, is not an instance's; the file of a
    process that runs is. Pruning removes the others, and the half-written files a killed instance left, but not
those of a process that runs (it may be writing)."""
    import json
    import os

    stats_dir = tmp_path / "embedding" / "stats"
    stats_dir.mkdir(parents=True)
    counters = {"hits": 5, "misses": 5, "evictions": 0, "version": 1, "policy": "lru"}
    me = process_identity(os.getpid())
    boot, pid, start = me.rsplit(":", 2)
    (stats_dir / f"instance-{pid}.json").write_text(json.dumps({**counters, "hits": 1000}))
    (stats_dir / f"instance-{pid}-{int(start) - 1}.json").write_text(json.dumps(
        {**counters, "hits": 1000, "pid": os.getpid(), "process": f"{boot}:{pid}:{int(start) - 1}"}))
    (stats_dir / f"instance-{pid}-{start}.json").write_text(json.dumps({**counters, "pid": os.getpid(), "process": me}))
    mine = json.loads((stats_dir / f"instance-{pid}-{start}.json").read_text())
    (stats_dir / f"instance-{pid}-{start}.json").write_text(json.dumps(
        {**mine, "batches": 4, "phases_ns": {"inputs": 400, "lookup": 4000}}))
    stats = cache_stats(tmp_path)
    assert (stats["model"], stats["instances"], stats["hits"], stats["hit_rate"]) == ("embedding", 1, 5, 0.5)
    assert (stats["batches"], stats["phases_ns"]) == (4, {"inputs": 400, "lookup": 4000})
    (stats_dir / f"instance-{pid}-{int(start) - 1}.json.tmp").write_text('{"hits": 10')
    (stats_dir / f"instance-{pid}-{start}.json.tmp").write_text('{"hits": 10')
    assert len(live_stats(tmp_path / "embedding", prune=True)) == 1
    assert sorted(p.name for p in stats_dir.iterdir()) == [f"instance-{pid}-{start}.json",
                                                           f"instance-{pid}-{start}.json.tmp"]


@pytest.mark.parametrize("row", [{"user": "u12"}, {"user": b"u12", "price": 1.0}, {"price": np.float64(2.0)},
                                 {"price": np.array(2.0)}])
def test_a_dict_of_one_row_s_values_is_refused_not_read_as_columns(row):
    """A dict is columns by name: one row given as a dict of its values had its text read as a column of characters
    (``{"user": "u12"}`` was served as three rows, ``u``, ``1`` and ``2``, without a word), and a number failed with
    "object of type 'float' has no len()"."""
    layout = RequestLayout(integers=(), floats=("price",), strings=("user",), lists=())
    with pytest.raises(BadInputError, match=r"a dict is read as columns by name, each a list of values, and '(user|price)' "
                                            r"holds one value .*: give one row as a list of one dict"):
        layout.tensors(row)
    assert text_values(layout.tensors({"user": ["u12"]})["STRINGS"])[:, 0].tolist() == [b"u12"]


@pytest.mark.parametrize("rows", [[{"user": ["u12"]}], {"user": pd.Series([None, ["a", "b"]])},
                                  [{"user": "u1"}, {"user": np.array(["u2"])}]])
def test_a_list_in_a_column_of_single_values_is_refused(rows):
    """A categorical column given a list: it was sent as the list's items joined by the separator (``['u12']`` as
    ``u12``, ``['a', 'b']`` as ``a|b``), a value the model does not know, without a word."""
    layout = RequestLayout(integers=(), floats=(), strings=("user",), lists=("tags",))
    with pytest.raises(BadInputError, match=r"column user, row [01]: a list \(.*\) in a column of single values: give "
                                            r"the value itself \(a column of lists is a multi-hot one"):
        layout.tensors(rows)
    tags = layout.tensors([{"user": "u1", "tags": ["a", "b"]}, {"user": None, "tags": None}])["LISTS"]
    assert text_values(tags)[:, 0].tolist() == [b"a|b", b""]
    for cell in ([["a"], ["b"]], {"a": 1}):  # sent as "['a']|['b']" and as "a"
        with pytest.raises(BadInputError, match=r"column tags, row 0: .* is no list of values"):
            layout.tensors([{"user": "u1", "tags": cell}])


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_client_without_a_server_says_so_and_takes_a_url_with_its_scheme(protocol):
    """HTTP to no server raised a bare ConnectionRefusedError (gRPC's was a ServingError naming the model and url), and
    ``http://host:port`` failed with "url should not include the scheme" and a traceback from the client's cleanup."""
    import socket

    from export.client import Client, ServingError

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    for url in (f"127.0.0.1:{port}", f"{protocol}://127.0.0.1:{port}"):
        with Client(url, protocol, timeout_s=5) as client, pytest.raises(ServingError, match=rf"ensemble at 127.0.0.1:{port} "
                                                                                           rf"\({protocol}\): .*refused"):
            client.predict([{"user": "u1"}])
    with pytest.raises(ValueError, match="the server speaks plain HTTP and gRPC, not https: give host:port"):
        Client(f"https://127.0.0.1:{port}", protocol)


def test_a_series_is_refused_as_rows():
    """A frame's row as a Series (``frame.iloc[0]``): its values were read as rows, and the error spoke of a list of
    bool."""
    layout = RequestLayout(integers=(), floats=("price",), strings=("user",), lists=())
    frame = pd.DataFrame({"user": ["u1", "u2"], "price": [1.0, 2.0]})
    with pytest.raises(BadInputError, match=r"a pandas Series is one row or one column.*frame.iloc\[\[i\]\]"):
        layout.tensors(frame.iloc[0])
    assert text_values(layout.tensors(frame.iloc[[0]])["STRINGS"]).tolist() == [[b"u1"]]


def test_rows_a_request_cannot_carry_as_given_are_refused_naming_why():
    """A None item of a list was sent as the text "None"; a dict of Series with other indexes paired rows by position;
    a frame with a column twice failed with a bare KeyError."""
    layout = RequestLayout(integers=(), floats=("price",), strings=("user",), lists=("tags",))
    with pytest.raises(BadInputError, match=r"column tags, row 1: the list \['a', None\] holds a missing item"):
        layout.tensors({"price": [1.0, 2.0], "user": ["u", "v"], "tags": [["a"], ["a", None]]})
    price = pd.Series([1.0, 2.0], index=[0, 1])
    with pytest.raises(BadInputError, match="different indexes"):
        layout.tensors({"price": price, "user": pd.Series(["u", "v"], index=[1, 0]), "tags": [[], []]})
    aligned = layout.tensors({"price": price, "user": pd.Series(["u", "v"], index=[0, 1]), "tags": [[], []]})
    assert text_values(aligned["STRINGS"])[:, 0].tolist() == [b"u", b"v"]
    twice = pd.DataFrame([[1.0, "u", 2.0]], columns=["price", "user", "price"])
    with pytest.raises(BadInputError, match=r"\['price'\] appear more than once"):
        layout.tensors(twice)
