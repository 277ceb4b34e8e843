"""The ETL on cuDF equals the ETL on pandas: same statistics, same codes, same floats to tolerance.

GPU tests (``@pytest.mark.gpu``) are skipped without a usable GPU, with the reason. The data size
comes from ``PIPELINE_ETL_GPU_ROWS`` (default 2,000,000 training rows; set it small for a quick
look, e.g. ``PIPELINE_ETL_GPU_ROWS=50000``). On the GPU machine::

    PIPELINE_ETL_GPU_ROWS=3000000 python -m pytest -q -rs tests/test_etl_gpu.py

The tests at the end need no GPU and run everywhere: the device and backend choice, and the
cuDF branches' logic run on a small pandas-backed stand-in for cuDF and CuPy (only where the real
cuDF is absent, so it never shadows it), with either way libcudf folds a one-column murmur3.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.etl import (
    Categorify,
    Clip,
    FillMissing,
    HashBucket,
    HashedCross,
    LogOp,
    MissingIndicator,
    Normalize,
    Workflow,
)
from pipeline.etl.frame_library import FrameLibraryError, choose_frame_library, read_parquet
from pipeline.etl.ops import Cast, HashIds
from pipeline.etl.ops.hashing import murmur3_column
from pipeline.etl.ops.murmur import combine_row_hashes
from pipeline.etl.output import cudf_row_group_rows
from pipeline.schema import DYNAMIC_ROWS
from tests.test_etl_keyed import categorical_rows

ROWS = int(os.environ.get("PIPELINE_ETL_GPU_ROWS", "2000000"))
FILES = 4
CONTINUOUS = ["I1", "I2", "F1"]
CATEGORICAL = ["C1", "C2", "C3"]


def _raw_table(rng: np.random.Generator, n: int, unseen: bool) -> pa.Table:
    """Criteo-like columns with nulls: int counts, floats with NaN, strings (zipf), integer categories, lists."""
    def masked(values, rate):
        return pa.array(values, mask=rng.random(n) < rate)

    shift = 5000 if unseen else 0  # the valid split also holds values never seen at fit
    strings = np.array([f"s{v}" for v in (rng.zipf(1.2, n) % 20000) + rng.integers(0, 2, n) * shift])
    lists = [[f"t{j}" for j in rng.integers(0, 50 + (10 if unseen else 0), k)] for k in rng.integers(0, 4, min(n, 200_000))]
    lists = (lists * (n // len(lists) + 1))[:n]
    return pa.table({
        "label": pa.array(rng.integers(0, 2, n).astype(np.int64)),
        "I1": masked(rng.lognormal(2, 2, n).astype(np.int64), 0.2),
        "I2": masked(rng.integers(-5, 1000, n), 0.05),
        "F1": pa.array(np.where(rng.random(n) < 0.1, np.nan, rng.normal(3, 10, n))),
        "C1": masked(strings, 0.1),
        "C2": masked((rng.zipf(1.5, n) % 3000 + rng.integers(0, 2, n) * shift).astype(np.int64), 0.15),
        "C3": masked(rng.choice(np.array(["a", "b", "c", "dé"]), n), 0.3),
        "H": masked(strings, 0.05),
        "K": masked(rng.integers(0, 10**12, n), 0.05),
        "M": pa.array(lists, pa.list_(pa.string())),
    })


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    folder = tmp_path_factory.mktemp("etl-gpu-raw")
    rng = np.random.default_rng(7)
    splits = {}
    for split, unseen in (("train", False), ("valid", True)):
        (folder / split).mkdir()
        rows = ROWS if split == "train" else max(ROWS // 4, 1000)
        for i, n in enumerate(np.diff(np.linspace(0, rows, FILES + 1).astype(int))):
            pq.write_table(_raw_table(rng, int(n), unseen), folder / split / f"part-{i:05d}.parquet",
                           row_group_size=250_000)
        splits[split] = sorted((folder / split).glob("part-*.parquet"))
    return splits


def _workflow(backend: str) -> Workflow:
    features = (
        (["label"] >> Cast("float32"))
        + (CONTINUOUS >> FillMissing(0.0) >> LogOp(signed=True) >> Normalize())
        + (CONTINUOUS >> MissingIndicator())
        + (CATEGORICAL >> Categorify(freq_threshold=2))
        + (["M"] >> Categorify())
        + (["H", "K"] >> HashBucket(100_003))
        + (["C1", "C2"] >> HashedCross(5_000))
    )
    return Workflow(features, library=backend)


def _fit_and_write(backend: str, raw, out, cluster: str = "threads", **etl):
    from pipeline.etl.cluster import etl_client
    from pipeline.etl.config import EtlConfig
    from pipeline.etl.output import transform_split

    workflow = _workflow(backend)
    with etl_client(EtlConfig(cluster=cluster, **etl), library=backend):
        workflow.fit(read_parquet(raw["train"], workflow.input_columns, backend))
        rows = transform_split(workflow, raw["valid"], out, 65_536, backend, progress=False)
    table = pa.concat_tables([pq.read_table(p) for p in sorted(out.glob("part-*.parquet"))])
    assert table.num_rows == rows
    return workflow, table


@pytest.fixture(scope="module")
def pandas_run(raw, tmp_path_factory):
    return _fit_and_write("pandas", raw, tmp_path_factory.mktemp("out-pandas"))


def _assert_same_statistics(gpu: Workflow, cpu: Workflow) -> None:
    for (op_gpu, cols), (op_cpu, _) in zip(gpu.operators(), cpu.operators()):
        assert type(op_gpu) is type(op_cpu), cols
        if isinstance(op_cpu, Categorify):
            for name in cols:
                assert op_gpu.vocabularies[name].equals(op_cpu.vocabularies[name]), name
                np.testing.assert_array_equal(op_gpu.counts[name], op_cpu.counts[name], err_msg=name)
            assert op_gpu.multihot == op_cpu.multihot and op_gpu.max_lengths == op_cpu.max_lengths
        if isinstance(op_cpu, Normalize):
            for name in cols:
                # float64 sums in a different order on the GPU: equal to about 1e-12 relative.
                assert op_gpu.means[name] == pytest.approx(op_cpu.means[name], rel=1e-9), name
                assert op_gpu.stds[name] == pytest.approx(op_cpu.stds[name], rel=1e-9), name
        if isinstance(op_cpu, HashBucket):
            assert op_gpu.multihot == op_cpu.multihot


def _assert_same_output(gpu: pa.Table, cpu: pa.Table) -> None:
    assert gpu.schema.equals(cpu.schema), f"\n{gpu.schema}\n!=\n{cpu.schema}"
    assert gpu.num_rows == cpu.num_rows
    for name in cpu.column_names:
        mine, theirs = gpu[name].combine_chunks(), cpu[name].combine_chunks()
        if pa.types.is_floating(theirs.type):
            np.testing.assert_array_equal(mine.is_null().to_numpy(zero_copy_only=False),
                                          theirs.is_null().to_numpy(zero_copy_only=False), err_msg=name)
            # float32 outputs from float64 arithmetic done in another order: a few float32 ulps.
            np.testing.assert_allclose(mine.to_numpy(zero_copy_only=False), theirs.to_numpy(zero_copy_only=False),
                                       rtol=1e-5, atol=1e-6, equal_nan=True, err_msg=name)
        else:
            assert mine.equals(theirs), f"{name}: first differences at {_first_differences(mine, theirs)}"


def _first_differences(a: pa.Array, b: pa.Array, k: int = 5) -> list:
    left, right = a.to_pylist(), b.to_pylist()
    return [(i, x, y) for i, (x, y) in enumerate(zip(left, right)) if x != y][:k]


@pytest.mark.gpu
def test_cudf_fit_and_transform_equal_pandas(raw, pandas_run, tmp_path):
    cpu_workflow, cpu_table = pandas_run
    gpu_workflow, gpu_table = _fit_and_write("cudf", raw, tmp_path / "out-cudf")
    _assert_same_statistics(gpu_workflow, cpu_workflow)
    _assert_same_output(gpu_table, cpu_table)
    assert (cpu_table["C1"].to_numpy() == 1).any(), "the valid split should hold unseen values (OOV)"
    # cuDF's writer options (output.cudf_writer_options): the stage's row groups, no statistics
    metadata = pq.ParquetFile(min((tmp_path / "out-cudf").glob("part-*.parquet"))).metadata
    assert metadata.row_group(0).num_rows == min(cudf_row_group_rows(65_536), metadata.num_rows)
    columns = [metadata.row_group(0).column(i) for i in range(metadata.num_columns)]
    assert not any(c.is_stats_set and c.statistics.has_min_max for c in columns), "no min/max statistics"


@pytest.mark.gpu
def test_cudf_on_a_local_cuda_cluster_equals_pandas(raw, pandas_run, tmp_path):
    cpu_workflow, cpu_table = pandas_run
    gpu_workflow, gpu_table = _fit_and_write("cudf", raw, tmp_path / "out-cluster", cluster="local")
    _assert_same_statistics(gpu_workflow, cpu_workflow)
    _assert_same_output(gpu_table, cpu_table)


@pytest.mark.gpu
def test_cudf_on_workers_sharing_a_gpu_equals_pandas(raw, pandas_run, tmp_path):
    from distributed import Client

    from pipeline.etl.cluster import _local_cluster

    with _local_cluster(1, "cudf", workers_per_gpu=2) as cluster, Client(cluster) as client:
        names = sorted(worker["name"] for worker in client.scheduler_info()["workers"].values())
        gpus = client.run(lambda: os.environ["CUDA_VISIBLE_DEVICES"].split(",")[0])
    assert names == ["0-0", "0-1"] and len(gpus) == 2 and len(set(gpus.values())) == 1, (names, gpus)
    cpu_workflow, cpu_table = pandas_run
    gpu_workflow, gpu_table = _fit_and_write("cudf", raw, tmp_path / "out-shared", cluster="local", workers=1,
                                             workers_per_gpu=2)
    _assert_same_statistics(gpu_workflow, cpu_workflow)
    _assert_same_output(gpu_table, cpu_table)


@pytest.mark.gpu
def test_workers_sharing_a_gpu_are_clients_of_an_mps_daemon_that_ends_with_the_cluster():
    """etl.gpu_mps=on: every worker's CUDA context is a client of the cluster's own MPS server; this process is not
    given the daemon's pipe, and the daemon and its folder are gone once the cluster is closed."""
    import shutil
    import subprocess

    from distributed import Client

    from pipeline.etl.cluster import _local_cluster
    from pipeline.etl.mps import CONTROL

    def ask(command: str, environ: dict) -> list[str]:
        return subprocess.run([shutil.which(CONTROL)], input=command + "\n", env={**os.environ, **environ},
                              capture_output=True, text=True, timeout=30, check=True).stdout.split()

    with _local_cluster(1, "cudf", workers_per_gpu=2, gpu_mps="on") as cluster, Client(cluster) as client:
        assert cluster.mps and "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
        pipes = client.run(lambda: {k: os.environ[k] for k in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")})
        totals = client.run(lambda: int(__import__("cudf").Series([1, 2, 3]).sum()))
        (environ,) = {tuple(sorted(p.items())) for p in pipes.values()}
        environ = dict(environ)
        worker_pids = set(client.run(os.getpid).values())
        servers = ask("get_server_list", environ)
        clients = {pid for server in servers for pid in ask(f"get_client_list {server}", environ)}
    assert set(totals.values()) == {6} and len(worker_pids) == 2
    assert len(servers) == 1 and {str(pid) for pid in worker_pids} <= clients, (servers, clients, worker_pids)
    assert not Path(environ["CUDA_MPS_PIPE_DIRECTORY"]).exists()


@pytest.mark.gpu
def test_the_scheduler_knows_the_size_of_the_partitions_read_on_a_local_cuda_cluster(raw):
    """The scheduler places tasks by the sizes of their inputs: a worker that took a cuDF partition for 48 bytes
    (Dask's size of an object it does not know) had it moved to another worker for a dict of statistics."""
    from distributed import Client, futures_of, wait

    from pipeline.etl.cluster import _local_cluster

    with _local_cluster(1, "cudf", workers_per_gpu=2) as cluster, Client(cluster) as client:
        kept = client.persist(read_parquet(raw["train"], None, "cudf"))
        wait(kept)
        futures = futures_of(kept)
        sizes = client.run_on_scheduler(lambda dask_scheduler, keys: [dask_scheduler.tasks[k].nbytes for k in keys],
                                        keys=[f.key for f in futures])
        used = client.gather(client.map(lambda part: int(part.memory_usage(deep=True).sum()), futures))
    assert len(sizes) == len(used) >= 1
    for size, bytes_used in zip(sizes, used):
        assert size >= bytes_used > 0, (sizes, used)


@pytest.mark.gpu
def test_local_cuda_cluster_workers_start_with_the_allocator_keeping_freed_memory():
    from distributed import Client

    from pipeline.etl.cluster import GPU_WORKER_MALLOC, _local_cluster

    with _local_cluster(1, "cudf") as cluster, Client(cluster) as client:
        starts = list(client.run(lambda: open("/proc/self/environ", "rb").read()).values())
    assert starts
    for start in starts:
        assert {f"{k}={v}".encode() for k, v in GPU_WORKER_MALLOC.items()} <= set(start.split(b"\0"))


@pytest.mark.gpu
def test_hash_bucket_on_cudf_equals_the_numpy_murmur_path():
    import cudf

    rng = np.random.default_rng(3)
    n = 100_000
    frame = pd.DataFrame({
        "s": pd.array([None if i % 17 == 0 else f"v{i % 5000}é" for i in range(n)], dtype="string"),
        "i64": pd.array(rng.integers(-(2**62), 2**62, n), dtype="Int64"),
        "i32": rng.integers(-(2**31), 2**31 - 1, n, dtype=np.int32),
        "f": np.where(rng.random(n) < 0.1, np.nan, rng.integers(0, 10**6, n).astype(np.float64)),
    })
    frame.loc[::13, "i64"] = pd.NA
    for columns in (["s"], ["i64"], ["i32"], ["f"]):
        workflow = Workflow(columns >> HashBucket(1_000_003)).fit(frame)
        cpu = workflow.transform(frame)
        gpu = workflow.transform(cudf.from_pandas(frame)).to_pandas()
        np.testing.assert_array_equal(gpu[columns[0]].to_numpy(), cpu[columns[0]].to_numpy(), err_msg=str(columns))
    cross = Workflow(["s", "i64", "i32"] >> HashedCross(65_537))
    cpu = cross.transform(frame)["s_i64_i32"].to_numpy()
    np.testing.assert_array_equal(cross.transform(cudf.from_pandas(frame))["s_i64_i32"].to_numpy(), cpu)
    # The oracle spelled out: numpy murmur3 per column, folded with hash_combine from seed 0.
    hashes = [murmur3_column(pa.array(frame[c].astype(object).where(frame[c].notna(), None).tolist(),
                                       pa.string() if c == "s" else pa.int64()), c) for c in ("s", "i64", "i32")]
    expected = (combine_row_hashes(hashes) % np.uint32(65_537)).astype(np.int64) + 1
    missing = frame[["s", "i64", "i32"]].isna().any(axis=1).to_numpy()
    np.testing.assert_array_equal(cpu, np.where(missing, 0, expected))


@pytest.mark.gpu
def test_hash_ids_and_multihot_buckets_on_cudf_equal_pandas():
    """HashIds (one-hot and multi-hot) and HashBucket of a multi-hot column on cuDF, hashed by libcudf with both seeds
    and put back into lists on the GPU, give what the pandas path gives, missing lists and values included."""
    frame = categorical_rows(20_000, seed=7)
    rng = np.random.default_rng(7)
    frame["f"] = np.where(rng.random(len(frame)) < 0.1, np.nan, rng.integers(0, 10**6, len(frame)).astype(np.float64))
    for features in (["s", "i", "f", "M"] >> HashIds(8 * DYNAMIC_ROWS), ["M"] >> HashBucket(1009)):
        workflow = Workflow(features).fit(frame)
        want = pa.Table.from_pandas(workflow.transform(frame), preserve_index=False)
        got = workflow.transform(_to_cudf(frame)).to_arrow(preserve_index=False)
        assert want.column_names == got.column_names
        for name in want.column_names:
            assert got[name].to_pylist() == want[name].to_pylist(), name
        if "M" in want.column_names:
            assert [] in got["M"].to_pylist() and got["M"].null_count == 0


@pytest.mark.gpu
def test_cudf_fill_missing_median_and_bucketize_match_pandas():
    import cudf

    from pipeline.etl import Bucketize

    rng = np.random.default_rng(5)
    frame = pd.DataFrame({"x": np.where(rng.random(20_000) < 0.2, np.nan, rng.normal(0, 10, 20_000))})
    cpu = Workflow(["x"] >> FillMissing(strategy="median")).fit(frame)
    gpu = Workflow(["x"] >> FillMissing(strategy="median"))
    gpu.fit(_dask_cudf(cudf.from_pandas(frame)))
    assert gpu.operators()[0][0].fill_values["x"] == cpu.operators()[0][0].fill_values["x"] == np.nanmedian(frame["x"])
    buckets = Workflow(["x"] >> Bucketize([-10.0, 0.0, 3.5, 20.0]))
    np.testing.assert_array_equal(buckets.transform(cudf.from_pandas(frame))["x"].to_numpy(),
                                  buckets.transform(frame)["x"].to_numpy())


@pytest.mark.gpu
def test_cudf_float_rows_and_sorted_rows_equal_numpy():
    """cuDF columns of several dtypes, with nulls, NaN of either sign and zeros of either sign, as one float64
    matrix and its rows sorted (a radix sort a row on the GPU), as numpy has them; a one-column matrix is a copy."""
    import cudf
    import cupy

    from pipeline.etl.frames import float_rows
    from pipeline.etl.ops import median

    rng = np.random.default_rng(7)
    n = 50_000
    negative_nan = np.array([0xFFF8000000000000], dtype=np.uint64).view(np.float64)[0]
    floats = rng.normal(0, 5, n)
    for rate, value in ((0.1, np.nan), (0.05, negative_nan), (0.05, -0.0), (0.05, 0.0)):
        floats[rng.random(n) < rate] = value
    ints = pd.array(np.where(rng.random(n) < 0.2, None, rng.integers(-50, 50, n)), dtype="Int64")
    small = rng.integers(0, 9, n).astype(np.int32)
    cpu = pd.DataFrame({"i": ints, "f": floats, "s": small, "j": ints})
    gpu = cudf.DataFrame({"i": cudf.from_pandas(cpu["i"]), "f": cudf.Series(cupy.asarray(floats)),
                          "s": cudf.Series(cupy.asarray(small)), "j": cudf.from_pandas(cpu["j"])})
    assert bool(cupy.isnan(gpu["f"].values).any()), "NaN kept as values, not nulls"
    for names in (["i", "f", "s"], ["i", "j"], ["f"], ["s"]):
        np.testing.assert_array_equal(float_rows(gpu, names).get(), float_rows(cpu, names), err_msg=str(names))
        np.testing.assert_array_equal(median._sorted_rows(gpu, names).get(), median._sorted_rows(cpu, names),
                                      err_msg=str(names))
    single = float_rows(gpu, ["f"])
    single[:] = 1.0
    np.testing.assert_array_equal(gpu["f"].values.get(), floats)


@pytest.mark.gpu
def test_cudf_frames_and_the_output_frame_make_every_nan_a_null_and_keep_the_rest():
    """Frames built from CuPy arrays and the frame written: a NaN becomes a null wherever it is (an array with NaN,
    a float Series with NaN and nulls, a cast to float32), the other values stay as they are."""
    import cudf
    import cupy

    from pipeline.etl.frames import cudf_frame
    from pipeline.etl.output import cudf_output_frame

    with_nan = cupy.asarray([1.5, np.nan, -2.0, np.nan])
    plain = cupy.asarray([0.25, 1.0, 2.0, 3.0])
    frame = cudf_frame({"a": with_nan, "b": plain, "c": cupy.asarray([1, 2, 3, 4], dtype=cupy.int32)})
    assert frame["a"].null_count == 2 and frame["b"].null_count == 0 and frame["c"].dtype == np.int32
    assert frame["b"].to_arrow().to_pylist() == [0.25, 1.0, 2.0, 3.0]
    mixed = cudf.Series(cupy.asarray([np.nan, 1.0, 2.0, 3.0]), nan_as_null=False)
    mixed[2] = None
    source = cudf.DataFrame({"a": cudf.Series(with_nan, nan_as_null=False), "b": cudf.Series(plain), "m": mixed,
                             "c": cudf.Series([1, 2, 3, 4], dtype="int64")})
    schema = pa.schema([("a", pa.float32()), ("b", pa.float32()), ("m", pa.float32()), ("c", pa.int32())])
    out = cudf_output_frame(source, schema)
    assert out.to_arrow(preserve_index=False).to_pydict() == {
        "a": [1.5, None, -2.0, None], "b": [0.25, 1.0, 2.0, 3.0], "m": [None, 1.0, None, 3.0], "c": [1, 2, 3, 4]}


@pytest.mark.gpu
def test_cudf_matrix_rows_handed_to_operators_that_take_series_transform_like_pandas():
    """A numeric chain's CuPy matrix going on to an operator that takes cuDF Series, and a union of a matrix with
    Series going into a numeric operator."""
    import cudf

    from pipeline.etl import Bucketize

    rng = np.random.default_rng(6)
    n = 20_000
    frame = pd.DataFrame({"x": np.where(rng.random(n) < 0.2, np.nan, rng.normal(0, 10, n)),
                          "f": rng.integers(0, 50, n).astype(np.float64),
                          "y": np.where(rng.random(n) < 0.1, np.nan, rng.normal(20, 30, n)),
                          "g": rng.integers(-5, 30, n).astype(np.float64)})
    workflow = Workflow((((["x"] >> FillMissing() >> Clip(min_value=0)) + ["f"]) >> LogOp())
                        + (["y"] >> FillMissing() >> Clip(min_value=0) >> Bucketize([0.0, 10.0, 50.0]))
                        + (["g"] >> Clip(min_value=0) >> Categorify())).fit(frame)
    want = workflow.transform(frame)
    got = workflow.transform(cudf.from_pandas(frame)).to_pandas()
    assert list(got.columns) == list(want.columns)
    for name in want.columns:
        np.testing.assert_allclose(got[name].to_numpy(float), want[name].to_numpy(float), rtol=1e-12, equal_nan=True,
                                   err_msg=name)


@pytest.mark.gpu
def test_cudf_partition_with_repeated_index_labels_transforms_like_pandas():
    """Partitions put together from several files repeat index labels: cuDF must not align on them."""
    import cudf

    rng = np.random.default_rng(11)
    n = 10_000
    frame = pd.DataFrame({
        "s": pd.array([None if i % 7 == 0 else f"v{i % 50}" for i in range(n)], dtype="string"),
        "x": np.where(rng.random(n) < 0.2, np.nan, rng.normal(0, 10, n)),
    }, index=np.arange(n) % 1000)
    workflow = Workflow((["s"] >> Categorify()) + (["x"] >> FillMissing() >> Clip(min_value=0) >> LogOp()
                                                   >> Normalize())).fit(frame.reset_index(drop=True))
    want = workflow.transform(frame)
    got = workflow.transform(cudf.from_pandas(frame)).to_pandas()
    np.testing.assert_array_equal(got.index.to_numpy(), frame.index.to_numpy())
    np.testing.assert_array_equal(got["s"].to_numpy(), want["s"].to_numpy())
    np.testing.assert_allclose(got["x"].to_numpy(float), want["x"].to_numpy(float), rtol=1e-6)


def _to_cudf(frame: pd.DataFrame):
    import cudf

    return cudf.DataFrame.from_arrow(pa.Table.from_pandas(frame, preserve_index=False))


@pytest.mark.gpu
def test_keyed_counts_and_look_ups_on_cudf_equal_pandas():
    """The pieces of the keyed Categorify on cuDF and CuPy (libcudf's xxHash64, one sort of all columns, the
    search of a vocabulary's keys) give what the same code gives on pandas."""
    from pipeline.etl.ops import keyed
    from pipeline.etl.ops.categorify import _flat_strings, _plain_strings

    cpu = categorical_rows(20_000, seed=4)
    gpu = _to_cudf(cpu)
    take = {"s": _plain_strings, "i": _plain_strings, "M": _flat_strings}
    cpu_columns = [take[name](cpu[name]) for name in take]
    gpu_columns = [take[name](gpu[name]) for name in take]
    keys = keyed.string_keys(gpu_columns[0])
    assert str(keys.dtype) == "uint64" and len(keys) == len(cpu)
    for got, want in zip(keyed.count_columns(gpu_columns), keyed.count_columns(cpu_columns)):
        got = got.to_pandas()
        assert dict(zip(got["value"], got["count"])) == dict(zip(want["value"], want["count"]))
        values = _to_cudf(got[["value"]])["value"]
        assert (got["key"].to_numpy() == keyed.string_keys(values).get()).all()
        assert (got["check"].to_numpy() == keyed.string_keys(values, keyed.CHECK_SEED).get()).all()
    vocabulary = sorted(set(cpu["s"].dropna()))[::2]
    table = keyed.key_table(_to_cudf(pd.DataFrame({"v": vocabulary}))["v"])
    assert table.exact
    np.testing.assert_array_equal(keyed.look_up(table, gpu_columns[0]).get(),
                                  keyed.look_up(keyed.key_table(pd.Series(vocabulary)), cpu_columns[0]))
    codes = keyed.look_up_codes(table, gpu_columns[0], 2, 1, 0)  # CuPy: one kernel after the search
    assert str(codes.dtype) == "int32"
    np.testing.assert_array_equal(codes.get(), keyed.look_up_codes(keyed.key_table(pd.Series(vocabulary)),
                                                                   cpu_columns[0], 2, 1, 0))
    assert {0, 1} <= set(codes.get().tolist()) and (codes.get() >= 2).any(), "missing, absent and found values"
    empty = keyed.key_table(_to_cudf(pd.DataFrame({"v": pd.Series([], dtype=str)}))["v"])
    np.testing.assert_array_equal(keyed.look_up_codes(empty, gpu_columns[0], 2, 1, 0).get(),
                                  np.where(cpu_columns[0].isna(), 0, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("collide", [False, True], ids=["xxhash64", "colliding keys"])
def test_cudf_categorify_equals_pandas_with_colliding_keys_and_missing_lists(monkeypatch, collide):
    """Categorify on cuDF with a key function that gives every string of one length the same key: the
    partitions' counts, their merges and the look-ups must still tell the values apart by their check keys (and the multi-hot
    column's missing lists become empty lists, missing elements 0, built on the GPU)."""
    import dask

    from pipeline.etl.ops import keyed

    if collide:  # weak keys, real check keys
        strong = keyed.string_keys
        monkeypatch.setattr(keyed, "string_keys", lambda s, seed=0: strong(s, seed) if seed else
                            s.str.len().fillna(0).astype("uint64").values)

    def features():
        return (["s", "i"] >> Categorify(freq_threshold=2)) + (["M"] >> Categorify(max_vocab_size=30))

    train, valid = categorical_rows(30_000, seed=5), categorical_rows(5_000, seed=6, unseen=True)
    cpu = Workflow(features()).fit(train)
    gpu = Workflow(features())
    with dask.config.set(scheduler="sync"):  # in this process, where the key function is replaced
        gpu.fit(_dask_cudf(_to_cudf(train), npartitions=4))
    _assert_same_statistics(gpu, cpu)
    got = gpu.transform(_to_cudf(valid)).to_arrow(preserve_index=False)
    want = pa.Table.from_pandas(cpu.transform(valid), preserve_index=False)
    for name in ("s", "i"):
        np.testing.assert_array_equal(got[name].to_numpy(), want[name].to_numpy(), err_msg=name)
    assert got["M"].to_pylist() == want["M"].to_pylist()
    assert got["M"].null_count == 0 and [] in got["M"].to_pylist()


def _dask_cudf(frame, npartitions: int = 1):
    import dask.dataframe as dd

    try:
        import dask_cudf

        return dask_cudf.from_cudf(frame, npartitions=npartitions)
    except (ImportError, AttributeError):
        return dd.from_pandas(frame, npartitions=npartitions)


# Device and backend choice: no GPU needed.

def test_auto_without_a_gpu_is_pandas_and_never_imports_cudf(monkeypatch):
    import sys

    from pipeline import device

    monkeypatch.setattr(device, "gpu_problem", lambda: "torch sees no CUDA device (no GPU, or no driver)")
    monkeypatch.setitem(sys.modules, "cudf", None)  # importing it would raise
    backend, reason = choose_frame_library("auto")
    assert backend == "pandas" and "no usable GPU" in reason


def test_auto_with_a_gpu_but_no_cudf_is_pandas_and_says_why(monkeypatch):
    import sys

    from pipeline import device

    monkeypatch.setattr(device, "gpu_problem", lambda: None)
    monkeypatch.setitem(sys.modules, "cudf", None)
    backend, reason = choose_frame_library("auto")
    assert backend == "pandas" and "cudf is not importable" in reason


def test_cuda_without_a_gpu_or_without_cudf_is_an_error_naming_it(monkeypatch):
    import sys

    from pipeline import device

    monkeypatch.setattr(device, "gpu_problem", lambda: "torch sees no CUDA device (no GPU, or no driver)")
    with pytest.raises(device.DeviceError, match="no CUDA device"):
        choose_frame_library("cuda")
    monkeypatch.setattr(device, "gpu_problem", lambda: None)
    monkeypatch.setitem(sys.modules, "cudf", None)
    with pytest.raises(FrameLibraryError, match="cudf is not importable"):
        choose_frame_library("cuda")


def test_a_cudf_that_fails_at_import_is_reported_not_raised(monkeypatch):
    """cuDF installed on a machine without a driver raises at import, and not always ImportError."""
    import builtins

    from pipeline import device

    real_import = builtins.__import__

    def failing(name, *args, **kwargs):
        if name == "cudf":
            raise RuntimeError("CUDA driver not found")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(device, "gpu_problem", lambda: None)
    monkeypatch.setattr(builtins, "__import__", failing)
    backend, reason = choose_frame_library("auto")
    assert backend == "pandas" and "CUDA driver not found" in reason


# The cuDF branches on a pandas-backed stand-in (CPU machines only).

def _stand_in_modules(folds: bool) -> dict:
    """Modules ``cudf`` / ``cupy`` / ``dask_cudf`` with just what the cuDF branches call, backed by pandas/numpy.

    ``hash_values`` is MurmurHash3 with the seed for one column (as in libcudf 26.10), or that folded into a row
    hash starting from the seed with ``folds`` (as in older libcudf). Integer and text casts of columns with nulls
    keep the nulls, as in cuDF.
    """
    import types

    from pipeline.etl.ops.murmur import hash_combine, murmur3_int64, murmur3_strings

    cudf = types.ModuleType("cudf")

    class Series(pd.Series):
        @property
        def _constructor(self):
            return Series

        @property
        def _constructor_expanddim(self):
            return DataFrame

        def nans_to_nulls(self):
            return self

        def to_pandas(self):
            return pd.Series(self)

        def astype(self, dtype, *args, **kwargs):
            if str(dtype) in ("int64", "int32") and self.isna().any():
                dtype = str(dtype).capitalize()
            if str(dtype) == "str":
                dtype = "string"
            return pd.Series.astype(self, dtype, *args, **kwargs)

        @property
        def values(self):
            return pd.Series.to_numpy(self)

        def to_arrow(self):
            return pa.array(self, from_pandas=True)

        @classmethod
        def from_arrow(cls, arrow):
            def mapper(kind):
                if kind == pa.string():
                    return pd.StringDtype("pyarrow", na_value=np.nan)
                return pd.ArrowDtype(kind) if pa.types.is_list(kind) else None

            return cls(arrow.to_pandas(types_mapper=mapper))

        def hash_values(self, method="murmur3", seed=0):
            if method == "xxhash64":  # any 64-bit hash of the values serves the keyed Categorify
                return Series(pd.util.hash_pandas_object(pd.Series(self), index=False).to_numpy(), index=self.index)
            if self.dtype.kind in "iu":
                h = murmur3_int64(self.fillna(0).to_numpy().astype(np.int64), seed)
            else:
                h = murmur3_strings(pa.array(self.astype(object).where(self.notna(), None).tolist(), pa.string()), seed)
            if folds:
                h = hash_combine(np.full(len(h), seed, dtype=np.uint32), h)
            return Series(h, index=self.index)

    class DataFrame(pd.DataFrame):
        @property
        def _constructor(self):
            return DataFrame

        @property
        def _constructor_sliced(self):
            return Series

        def to_arrow(self, preserve_index=None):
            return pa.Table.from_pandas(pd.DataFrame(self), preserve_index=False)

        def to_pandas(self):
            return pd.DataFrame(self)

    Series.__module__ = "cudf.core.series"
    DataFrame.__module__ = "cudf.core.dataframe"
    cudf.Series, cudf.DataFrame = Series, DataFrame
    cudf.concat = lambda objs, ignore_index=False: (Series if isinstance(objs[0], pd.Series) else DataFrame)(
        pd.concat(objs, ignore_index=ignore_index))

    def read_parquet(paths, columns=None, row_groups=None):
        paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
        tables = [pq.ParquetFile(path).read_row_groups(groups, columns=columns) if row_groups is not None
                  else pq.read_table(path, columns=columns) for path, groups in zip(paths, row_groups or paths)]
        table = pa.concat_tables(tables)
        return DataFrame({name: Series.from_arrow(table[name]) for name in table.column_names})

    cudf.read_parquet = read_parquet
    cupy = types.ModuleType("cupy")
    for name in ("arange", "empty", "full", "where", "zeros", "uint32", "uint64", "int32", "int64", "float64", "log1p",
                 "digitize", "asarray"):
        setattr(cupy, name, getattr(np, name))
    cupy.ndarray = type("ndarray", (), {})  # dask registers cupy.ndarray as a chunk type
    dask_cudf = types.ModuleType("dask_cudf")
    dask_cudf.backends = types.ModuleType("dask_cudf.backends")
    return {"cudf": cudf, "cupy": cupy, "dask_cudf": dask_cudf, "dask_cudf.backends": dask_cudf.backends}


@pytest.fixture(params=[False, True], ids=["libcudf-26.10", "older-libcudf"])
def stand_in(request, monkeypatch):
    import importlib.util
    import sys

    from pipeline.etl.ops import hashing

    if "cudf" in sys.modules or importlib.util.find_spec("cudf") is not None:
        pytest.skip("the real cuDF is installed: the GPU tests above cover it")
    for name, module in _stand_in_modules(request.param).items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(hashing, "_FOLDS", [])
    return sys.modules["cudf"]


def test_cudf_branches_on_a_stand_in_equal_the_pandas_path(stand_in):
    """Multi-hot columns on cuDF build list columns through pylibcudf, which has no stand-in: the GPU tests
    above cover them."""
    import dask
    import dask.dataframe as dd

    from pipeline.etl import Bucketize

    rng = np.random.default_rng(0)
    n = 4000
    frame = pd.DataFrame({
        "s": pd.array([None if i % 17 == 0 else f"v{i % 300}é" for i in range(n)], dtype="string"),
        "i": pd.array(rng.integers(0, 500, n), dtype="Int64"),
        "f": np.where(rng.random(n) < 0.1, np.nan, rng.integers(0, 50, n).astype(np.float64)),
        "x": np.where(rng.random(n) < 0.2, np.nan, rng.normal(0, 10, n)),
        "y": pd.array(rng.integers(-5, 100, n), dtype="Int64"),
    })
    frame.loc[::13, "i"] = pd.NA

    def features():  # each side fits operators of its own
        return ((["s", "i", "f"] >> Categorify(freq_threshold=2))
                + (["x", "y"] >> FillMissing() >> Clip(min_value=0) >> LogOp() >> Normalize())
                + (["s", "i"] >> HashedCross(4099)))

    cpu = Workflow(features()).fit(frame)
    gpu_frame = stand_in.DataFrame(frame)
    parts = dd.from_map(lambda i: gpu_frame.iloc[i * 1500:(i + 1) * 1500], range(3), meta=gpu_frame.iloc[:0],
                        enforce_metadata=False)
    with dask.config.set(scheduler="sync"):
        fitted = Workflow(features()).fit(parts)
    assert fitted.operators()[0][0] is not cpu.operators()[0][0]
    for (op_gpu, cols), (op_cpu, _) in zip(fitted.operators(), cpu.operators()):
        if isinstance(op_cpu, Categorify):
            assert all(op_gpu.vocabularies[c].equals(op_cpu.vocabularies[c]) for c in cols)
            assert all(np.array_equal(op_gpu.counts[c], op_cpu.counts[c]) for c in cols)
        if isinstance(op_cpu, Normalize):
            assert all(op_gpu.means[c] == pytest.approx(op_cpu.means[c]) for c in cols)
            assert all(op_gpu.stds[c] == pytest.approx(op_cpu.stds[c]) for c in cols)
    extra = (["s", "i", "f"] >> HashBucket(100_003)) + (["x"] >> Bucketize([-10.0, 0.0, 3.5]))
    extra = Workflow(extra).fit(frame)
    # a numeric operator's matrix handed to one that takes Series, and a union of a matrix and Series
    mixed = Workflow((((["x"] >> FillMissing() >> Clip(min_value=0)) + ["f"]) >> LogOp())
                     + (["y"] >> Clip(min_value=0) >> Bucketize([0.0, 10.0, 50.0]))).fit(frame)
    ids = Workflow(["s", "i", "f"] >> HashIds(DYNAMIC_ROWS)).fit(frame)
    for workflow in (cpu, extra, mixed, ids):
        want = workflow.transform(frame)
        got = Workflow.transform_partition(gpu_frame, workflow.output)
        assert type(got).__module__.startswith("cudf")
        got = pd.DataFrame(got)
        for name in want.columns:
            if want[name].dtype.kind == "f":
                np.testing.assert_allclose(got[name].to_numpy(float), want[name].to_numpy(float), rtol=1e-6,
                                           equal_nan=True, err_msg=name)
            else:
                np.testing.assert_array_equal(got[name].to_numpy(), want[name].to_numpy(), err_msg=name)


@pytest.mark.parametrize("dask_cudf_there", [True, False], ids=["dask_cudf", "a worker without dask_cudf"])
def test_cudf_reader_on_a_stand_in_reads_every_row_once_in_order(stand_in, tmp_path, monkeypatch, dask_cudf_there):
    import sys

    import dask

    if not dask_cudf_there:  # a worker of another cluster: its partitions' sizes unknown to Dask, but read
        monkeypatch.setitem(sys.modules, "dask_cudf.backends", None)

    table = pa.table({"C": pa.array([f"v{i % 7}" if i % 5 else None for i in range(300)]),
                      "I": pa.array(range(300)), "X": pa.array([i / 3 for i in range(300)])})
    pq.write_table(table, tmp_path / "part-00000.parquet", row_group_size=100)
    pq.write_table(table.slice(0, 40), tmp_path / "part-00001.parquet")
    pq.write_table(table.slice(0, 0), tmp_path / "part-00002.parquet")
    ddf = read_parquet(tmp_path, ["I", "C"], "cudf")
    assert list(ddf.columns) == ["I", "C"] and type(ddf._meta).__module__.startswith("cudf")
    with dask.config.set(scheduler="sync"):
        got = pd.DataFrame(ddf.compute())
    assert got["I"].tolist() == list(range(300)) + list(range(40))
    assert got["C"].astype(object).where(got["C"].notna(), None).tolist() == table["C"].to_pylist() + \
        table["C"].to_pylist()[:40]


@pytest.mark.parametrize("points", [65_536, 50])
def test_cudf_median_and_missing_indicator_on_a_stand_in_equal_the_pandas_path(stand_in, monkeypatch, points):
    import dask
    import dask.dataframe as dd

    from pipeline.etl import MissingIndicator
    from pipeline.etl.ops import median

    monkeypatch.setattr(median, "SUMMARY_POINTS", points)  # 50: compressed on the "GPU", then a second pass
    rng = np.random.default_rng(2)
    n = 4500
    frame = pd.DataFrame({"x": np.where(rng.random(n) < 0.2, np.nan, rng.normal(0, 10, n)),
                          "y": np.where(rng.random(n) < 0.3, np.nan, np.floor(rng.lognormal(2, 1.5, n)))})

    def features():
        return (["x", "y"] >> FillMissing(strategy="median")) + (["x", "y"] >> MissingIndicator())

    cpu = Workflow(features()).fit(frame)
    gpu_frame = stand_in.DataFrame(frame)
    parts = dd.from_map(lambda i: gpu_frame.iloc[i * 1500:(i + 1) * 1500], range(3), meta=gpu_frame.iloc[:0],
                        enforce_metadata=False)
    with dask.config.set(scheduler="sync"):
        gpu = Workflow(features()).fit(parts)
    medians = {name: np.nanmedian(frame[name]) for name in ("x", "y")}
    assert gpu.operators()[0][0].fill_values == cpu.operators()[0][0].fill_values == medians
    got = pd.DataFrame(Workflow.transform_partition(gpu_frame, gpu.output))
    want = cpu.transform(frame)
    assert list(got.columns) == list(want.columns) == ["x", "y", "x_missing", "y_missing"]
    for name in want.columns:
        np.testing.assert_array_equal(got[name].to_numpy(float), want[name].to_numpy(float), err_msg=name)
    np.testing.assert_array_equal(want["y_missing"].to_numpy(), frame["y"].isna().to_numpy().astype(np.float32))
