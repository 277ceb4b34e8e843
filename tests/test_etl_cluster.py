"""Where the ETL runs: a real 2-worker LocalCluster gives the same output as threads; an existing scheduler."""

from __future__ import annotations

import contextlib
import gc
import logging
import time

import numpy as np
import pyarrow as pa
import pytest
from distributed import Client, LocalCluster

from pipeline.errors import UserError
from pipeline.etl.cluster import AUTO_LOCAL_BYTES, choose_cluster, etl_client
from pipeline.etl.config import EtlConfig
from pipeline.etl.defaults import default_workflow
from pipeline.etl.frame_library import read_parquet
from pipeline.etl.output import transform_split


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    """Three parquet parts with categorical, continuous and multi-hot columns."""
    folder = tmp_path_factory.mktemp("raw")
    rng = np.random.default_rng(0)
    for i in range(3):
        n = 3000
        cats = pa.array([f"k{v}" for v in rng.zipf(1.3, n) % 500])
        cats = pa.compute.if_else(pa.array(rng.random(n) < 0.1), pa.scalar(None, pa.string()), cats)
        lists = pa.array([[f"t{j}" for j in rng.integers(0, 30, k)] for k in rng.integers(0, 4, n)])
        counts = pa.array(rng.lognormal(1, 2, n).astype(np.int64), mask=rng.random(n) < 0.2)
        table = pa.table({"label": rng.integers(0, 2, n).astype(np.int8), "I1": counts, "C1": cats,
                          "C2": pa.array(rng.choice(["a", "b"], n)), "M": lists})
        pa.parquet.write_table(table, folder / f"part-{i:05d}.parquet")
    return sorted(folder.glob("part-*.parquet"))


ROLES = {"label": "label", "continuous": ["I1"], "categorical": ["C1", "C2"], "multihot": ["M"]}


def _run(raw, etl: EtlConfig, out):
    workflow = default_workflow(ROLES, etl)
    with etl_client(etl) as where:
        workflow.fit(read_parquet(raw, workflow.input_columns, "pandas"), progress=True)
        rows = transform_split(workflow, raw, out, 1000, "pandas", progress=True)
    table = pa.concat_tables([pa.parquet.read_table(p) for p in sorted(out.glob("part-*.parquet"))])
    return where, workflow, rows, table


def test_two_worker_local_cluster_equals_threads(raw, tmp_path):
    where_local, local, rows_local, out_local = _run(raw, EtlConfig(cluster="local", workers=2), tmp_path / "local")
    where_threads, threads, rows_threads, out_threads = _run(raw, EtlConfig(cluster="threads"), tmp_path / "threads")
    assert where_local == "LocalCluster(2 workers)" and where_threads.startswith("threads")
    assert rows_local == rows_threads == 9000
    assert out_local.equals(out_threads)
    for op, names in local.operators():
        for name in names if hasattr(op, "vocabularies") else []:
            other = next(o for o, cols in threads.operators() if name in cols)
            assert op.vocabularies[name].equals(other.vocabularies[name])


def test_existing_scheduler_is_used_and_left_running(raw, tmp_path):
    with LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=None) as cluster:
        where, _, rows, _ = _run(raw, EtlConfig(scheduler=cluster.scheduler_address), tmp_path / "out")
        assert where == f"scheduler {cluster.scheduler_address} (1 workers)" and rows == 9000
        with Client(cluster) as client:  # still up after the ETL closed its client
            assert len(client.scheduler_info()["workers"]) == 1


def test_cluster_choice():
    assert choose_cluster(EtlConfig(), AUTO_LOCAL_BYTES - 1) == "threads"
    assert choose_cluster(EtlConfig(), AUTO_LOCAL_BYTES) == "local"
    assert choose_cluster(EtlConfig(cluster="threads"), 10 * AUTO_LOCAL_BYTES) == "threads"
    assert choose_cluster(EtlConfig(scheduler="tcp://x:1", cluster="threads"), 0) == "scheduler"
    with pytest.raises(ValueError, match="expected auto, local or threads, got 'gpu'"):
        EtlConfig(cluster="gpu")


def test_a_scheduler_that_goes_away_mid_etl_is_one_clear_error():
    """Its workers gone, the futures of the ETL were cancelled: a FutureCancelledError traceback."""
    import dask

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as cluster:
        address = cluster.scheduler_address
        with pytest.raises(UserError, match=rf"the Dask scheduler at {address} stopped the ETL \(.*went away"), \
                etl_client(EtlConfig(scheduler=address)):
            work = dask.delayed(time.sleep)(30).persist()
            cluster.close()
            work.compute()


def test_a_cluster_without_workers_is_said_while_the_etl_waits_for_one(monkeypatch, capsys):
    """Every worker of an existing scheduler gone: the ETL waited for one without a word, for good."""
    import threading

    import dask.array as da

    from pipeline.etl import progress

    monkeypatch.setattr(progress, "WORKERS_CHECK_S", 0.5)
    with LocalCluster(n_workers=0, processes=False, dashboard_address=None) as cluster, \
            etl_client(EtlConfig(scheduler=cluster.scheduler_address)):
        threading.Timer(2.0, lambda: cluster.scale(1)).start()
        for mode in ("off", "plain"):
            assert progress.compute(da.ones(10, chunks=5).sum(), desc="fit", progress=mode) == (10.0,)
            cluster.scale(0)
            threading.Timer(1.5, lambda: cluster.scale(1)).start()
    said = capsys.readouterr().out
    assert f"[etl] fit: the Dask cluster at {cluster.scheduler_address} has no workers, waiting" in said
    assert f"start workers (`dask worker {cluster.scheduler_address}`)" in said


def test_unreachable_scheduler_is_a_clear_error():
    client = etl_client(EtlConfig(scheduler="tcp://127.0.0.1:1"), connect_timeout="1s")
    with pytest.raises(UserError, match="etl.scheduler=tcp://127.0.0.1:1: no Dask scheduler answered there"), client:
        pass


@pytest.mark.parametrize("answer", [b"", b"HTTP/1.1 200 OK\r\n\r\n" + b"\xff" * 64])
def test_a_port_of_another_server_is_a_clear_error(answer):
    """A server that never answered held the ETL for good; one that answered other bytes was a traceback (its
    first bytes read as a length: "Unable to allocate 3.07 EiB")."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    held = []

    def serve():
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                held.append(conn)
                conn.sendall(answer)  # and then holds the connection, saying nothing more

    threading.Thread(target=serve, daemon=True).start()
    start = time.monotonic()
    client = etl_client(EtlConfig(scheduler=f"tcp://127.0.0.1:{port}"), connect_timeout="2s")
    with pytest.raises(UserError, match=rf"etl.scheduler=tcp://127.0.0.1:{port}: no Dask scheduler answered"), client:
        pass
    assert time.monotonic() - start < 30
    listener.close()
    for conn in held:  # the attempt left waiting ends, and with it its thread, which the next clients would wait on
        conn.close()
    for thread in threading.enumerate():
        if thread.name == "dask-connect":
            thread.join(30)
    gc.collect()  # the half-made client, now, not while the next test's cluster starts its loop


def test_cudf_backend_without_cudf_is_a_clear_error():
    try:
        import cudf  # noqa: F401
        pytest.skip("cudf is installed here")
    except ImportError:
        pass
    from pipeline.etl.frame_library import FrameLibraryError, check_frame_library

    with pytest.raises(FrameLibraryError, match="the cudf backend was chosen .* not importable"):
        check_frame_library("cudf")


def test_local_workers_ignore_ctrl_c():
    """A terminal's Ctrl-C reaches the workers too: each printed a traceback (70 lines for one interrupt), where the
    pipeline's process ends the cluster and says `interrupted`."""
    import os
    import signal

    from pipeline.etl.cluster import _local_cluster

    with _local_cluster(1, "pandas") as cluster, Client(cluster) as client:
        (pid,) = client.run(os.getpid).values()
        os.kill(pid, signal.SIGINT)
        time.sleep(0.5)
        assert list(client.run(os.getpid).values()) == [pid]


def test_worker_environment_reaches_the_workers_from_their_start_and_leaves_this_process_as_it_was(monkeypatch):
    """glibc reads its allocator settings once, at a process's start: they must be in the worker's environment when
    it is spawned (Dask's nanny would otherwise start it with its own trim threshold), and the nanny's copy of them
    in this process must not outlive the cluster (the stages after the ETL start processes of their own). The values
    an earlier cluster left in this process's environment (Dask's own) do not win over them."""
    import os

    from pipeline.etl.cluster import GPU_WORKER_MALLOC, _worker_environment

    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "65536")
    monkeypatch.setenv("MALLOC_TOP_PAD_", "12345")
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    with _worker_environment(GPU_WORKER_MALLOC), LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                                                              dashboard_address=None) as cluster, Client(cluster) as client:
        (seen,) = client.run(lambda: {name: os.environ.get(name) for name in GPU_WORKER_MALLOC}).values()
        (start,) = client.run(lambda: open("/proc/self/environ", "rb").read()).values()
    assert seen == GPU_WORKER_MALLOC
    for name, value in GPU_WORKER_MALLOC.items():  # in the environment the process started with
        assert f"{name}={value}".encode() in start.split(b"\0")
    assert os.environ["MALLOC_TOP_PAD_"] == "12345" and os.environ["MALLOC_TRIM_THRESHOLD_"] == "65536"
    assert "MALLOC_ARENA_MAX" not in os.environ


def test_workers_sharing_a_gpu_take_each_gpu_in_turn_under_names_of_their_own():
    """dask-cuda starts one worker a GPU, named after it (its rule, as below); etl.workers_per_gpu puts that many on
    each GPU, every one with dask-cuda's own spec of a worker on that GPU."""
    from pipeline.etl.cluster import _shared_gpu_cluster

    class OneWorkerAGpu:  # LocalCUDACluster's rule: the lowest GPU without a worker, the worker named after it
        def __init__(self, n_workers: int) -> None:
            self.cuda_visible_devices, self.worker_spec = [0, 1], {}
            for _ in range(n_workers):
                self.worker_spec.update(self.new_worker_spec())

        def new_worker_spec(self) -> dict:
            name = min(set(self.cuda_visible_devices) - set(self.worker_spec))
            return {name: {"env": {"CUDA_VISIBLE_DEVICES": ",".join(map(str, [name, 1 - name]))}}}

    cluster = _shared_gpu_cluster(OneWorkerAGpu)(n_workers=6, workers_per_gpu=3)
    assert {name: spec["env"]["CUDA_VISIBLE_DEVICES"] for name, spec in cluster.worker_spec.items()} == {
        "0-0": "0,1", "0-1": "0,1", "0-2": "0,1", "1-3": "1,0", "1-4": "1,0", "1-5": "1,0"}
    del cluster.worker_spec["0-1"]  # scaled down by one, then up again: the free place, not a name taken twice
    cluster.worker_spec.update(cluster.new_worker_spec())
    assert sorted(cluster.worker_spec) == ["0-0", "0-1", "0-2", "1-3", "1-4", "1-5"]


def test_workers_a_gpu_by_default_are_two_where_the_cores_allow():
    """etl.workers_per_gpu=0: two processes a GPU need two cores a GPU, or they wait for each other's host work."""
    from pipeline.etl.cluster import SHARED_GPU_WORKERS, auto_workers_per_gpu
    from pipeline.etl.config import EtlConfig

    assert EtlConfig().workers_per_gpu == 0 and SHARED_GPU_WORKERS > 1
    assert auto_workers_per_gpu(1, cores=16) == SHARED_GPU_WORKERS
    assert auto_workers_per_gpu(8, cores=8 * SHARED_GPU_WORKERS) == SHARED_GPU_WORKERS
    assert auto_workers_per_gpu(8, cores=8 * SHARED_GPU_WORKERS - 1) == 1 and auto_workers_per_gpu(1, cores=1) == 1


def test_workers_a_gpu_by_default_with_mps_are_more_where_the_cores_allow():
    """With MPS the workers' kernels run on the GPU at once: more of them a GPU, as many as the cores allow."""
    from pipeline.etl.cluster import MPS_GPU_WORKERS, SHARED_GPU_WORKERS, auto_workers_per_gpu

    assert MPS_GPU_WORKERS > SHARED_GPU_WORKERS
    assert auto_workers_per_gpu(1, cores=16, mps=True) == MPS_GPU_WORKERS
    assert auto_workers_per_gpu(4, cores=4 * MPS_GPU_WORKERS, mps=True) == MPS_GPU_WORKERS
    assert auto_workers_per_gpu(4, cores=4 * MPS_GPU_WORKERS - 1, mps=True) == MPS_GPU_WORKERS - 1
    assert auto_workers_per_gpu(8, cores=8, mps=True) == 1


def test_more_gpu_workers_than_gpus_is_one_error_line_naming_the_setting():
    from pipeline.errors import UserError
    from pipeline.etl.cluster import gpus_used

    assert gpus_used(0, 2) == 2 and gpus_used(1, 2) == 1
    with pytest.raises(UserError, match=r"etl.workers=4: .* 1 is visible here; set etl.workers to 1 or fewer"):
        gpus_used(4, 1)


def test_an_existing_clusters_workers_get_whole_paths_whatever_folder_they_run_in(tmp_path, monkeypatch):
    """With a relative workdir (the default, `data`), the workers of an existing scheduler, started in another folder,
    looked for the raw files in theirs: "Failed to open local file 'data/.../part-00000.parquet'"."""
    from pipeline.stages.cli import run_stages
    from pipeline.stages.config import load_config

    (tmp_path / "workers").mkdir()
    (tmp_path / "user").mkdir()
    monkeypatch.chdir(tmp_path / "workers")
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        monkeypatch.chdir(tmp_path / "user")
        cfg = load_config(None, ["workdir=relative", "data.rows=3000", "progress=off", "device=cpu",
                                 f"etl.scheduler={cluster.scheduler_address}"])
        run_stages(["data", "etl"], cfg)
    assert (tmp_path / "user" / "relative" / "synthetic" / "processed" / "schema.json").is_file()
    assert not (tmp_path / "workers" / "relative").exists()


@contextlib.contextmanager
def _processes_of_a_cluster(tmp_path, hide_from: str = ""):
    """A `dask scheduler` and a `dask worker` started as a user starts them, the one named by ``hide_from``
    in an environment where this project's package does not import; yields the address and the two processes."""
    import os
    import socket
    import subprocess
    import sys

    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "sitecustomize.py").write_text("import sys\nsys.modules['pipeline'] = None\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"

    def start(role: str, *args: str) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": str(hidden)} if role == hide_from else dict(os.environ)
        return subprocess.Popen([sys.executable, "-m", f"distributed.cli.dask_{role}", *args, "--no-dashboard"],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)

    started = [start("scheduler", "--host", "127.0.0.1", "--port", str(port))]
    try:
        started.append(start("worker", address, "--nthreads", "1"))
        with Client(address, timeout="60s") as client:
            client.wait_for_workers(1, timeout=60)
        yield address, started
    finally:
        for process in reversed(started):
            process.terminate()
            process.wait(30)


@pytest.mark.parametrize("hide_from", ["worker", "scheduler"])
def test_a_cluster_whose_scheduler_or_workers_lack_this_package_is_refused_naming_them(raw, tmp_path, hide_from):
    """A worker without the package died on its first task and the ETL waited for workers for good; a scheduler
    without it failed the first computation with Dask's "Error during deserialization of the task graph" traceback."""
    with _processes_of_a_cluster(tmp_path, hide_from) as (address, _):
        started = time.monotonic()
        with pytest.raises(UserError) as refused:
            _run(raw, EtlConfig(scheduler=address), tmp_path / "out")
        assert time.monotonic() - started < 30
    said = str(refused.value)
    assert said.startswith(f"etl.scheduler={address}: ")
    assert ("the Dask scheduler there cannot import this project" if hide_from == "scheduler"
            else "1 of its Dask workers cannot import this project (tcp://127.0.0.1:") in said
    assert "ModuleNotFoundError" in said and "`pip install -e` of this project" in said
    assert not (tmp_path / "out").exists()


def test_workers_dying_on_a_task_are_one_error_with_what_to_do():
    """Dask's KilledWorker (a worker stopped at its memory limit, or by the system) was a traceback."""
    import os

    import dask

    with dask.config.set({"distributed.scheduler.allowed-failures": 0}), \
            pytest.raises(UserError) as refused, etl_client(EtlConfig(cluster="local", workers=2)):
        dask.delayed(os._exit)(1).compute()
    said = str(refused.value)
    assert said.startswith("the ETL's Dask workers died running its task exit (1 tried it, the last tcp://")
    assert "dies of memory" in said and "set etl.workers below 2" in said


def test_a_scheduler_killed_mid_etl_is_one_short_error_line(tmp_path, capfd):
    """The error held Dask's list of every cancelled future, after the client's log of each failed reconnect with
    its traceback."""
    import threading

    import dask

    from pipeline.etl.progress import compute

    with _processes_of_a_cluster(tmp_path) as (address, (scheduler, _)), pytest.raises(UserError) as refused, \
            etl_client(EtlConfig(scheduler=address)):
        threading.Timer(2.0, scheduler.kill).start()
        compute(*[dask.delayed(time.sleep)(20 + i / 100) for i in range(8)], progress="plain")
    assert str(refused.value) == (f"the Dask scheduler at {address} stopped the ETL (FutureCancelledError: "
                                  "scheduler-connection-lost): it or its workers went away; start them again, then "
                                  "rerun the ETL")
    assert "Traceback" not in "".join(capfd.readouterr())


def test_a_scheduler_gone_while_its_workers_are_checked_is_one_short_error_line(tmp_path, capfd, monkeypatch):
    """Gone between the connection and the check that its workers import this package: the check's broadcast was a
    traceback."""
    from pipeline.etl import cluster

    check = cluster._check_package_there
    with _processes_of_a_cluster(tmp_path) as (address, (scheduler, _)):
        def gone_first(client, where):
            scheduler.kill()
            scheduler.wait()
            check(client, where)

        monkeypatch.setattr(cluster, "_check_package_there", gone_first)
        with pytest.raises(UserError) as refused, etl_client(EtlConfig(scheduler=address), connect_timeout="2s"):
            pass
    assert str(refused.value).startswith(f"the Dask scheduler at {address} stopped the ETL (")
    assert str(refused.value).endswith("): it or its workers went away; start them again, then rerun the ETL")
    assert "Traceback" not in "".join(capfd.readouterr())


class _ClientWhoseCloseFails:
    """Dask's client of a scheduler gone, whose close fails in its connection pool (a race of the reconnection's
    timeout that no test can bring about at will), logging the failure with its traceback as Dask does."""

    closed = False

    def close(self):
        self.closed = True
        try:
            raise RuntimeError("Cannot change state of expiring Timeout")
        except RuntimeError:
            logging.getLogger("distributed.client").exception("Cannot change state of expiring Timeout")
            raise


def test_a_failing_close_of_the_client_after_a_failed_etl_leaves_the_etl_error_alone(caplog):
    """The close's RuntimeError replaced the scheduler-gone error line (a failure of CI, one run in many)."""
    from pipeline.etl.cluster import _closing

    client = _ClientWhoseCloseFails()
    with caplog.at_level("DEBUG", logger="distributed.client"), pytest.raises(UserError, match="went away"), \
            _closing(client):
        raise UserError("the scheduler went away")
    assert client.closed and not caplog.records
    assert logging.getLogger("distributed.client").filters == []


def test_a_failing_close_of_the_client_after_work_that_succeeded_is_not_hidden():
    from pipeline.etl.cluster import _closing

    with pytest.raises(RuntimeError, match="expiring Timeout"), _closing(_ClientWhoseCloseFails()):
        pass


def test_a_cluster_whose_workers_are_all_paused_is_said_while_the_etl_waits(monkeypatch, capsys):
    """A worker paused at its memory limit ran nothing and the ETL waited without a word."""
    import threading

    import dask

    from pipeline.etl import progress

    monkeypatch.setattr(progress, "WORKERS_CHECK_S", 0.5)
    # the worker runs in this process, whose memory is far above 1 MB: it pauses at once (no nanny to stop it)
    with LocalCluster(n_workers=1, processes=False, memory_limit="1MB", dashboard_address=None) as cluster, \
            etl_client(EtlConfig(scheduler=cluster.scheduler_address)):
        (worker,) = cluster.workers.values()
        deadline = time.monotonic() + 30
        while worker.status.name != "paused" and time.monotonic() < deadline:
            time.sleep(0.1)

        def unpause():
            worker.memory_manager.memory_limit = None  # as if memory freed: the worker runs again
            worker.memory_manager.memory_pause_fraction = False
            worker.status = type(worker.status).running

        threading.Timer(2.0, unpause).start()
        assert progress.compute(dask.delayed(sum)([1, 2]), desc="fit", progress="off") == (3,)
    said = capsys.readouterr().out
    assert f"[etl] fit: every worker of the Dask cluster at {cluster.scheduler_address} is paused, its memory past " \
           "its share that Dask pauses at (distributed.worker.memory.pause); waiting" in said


def test_more_local_worker_processes_than_the_cores_can_hold_are_refused():
    """etl.workers=160 on a 16-core machine started 160 processes and ran the machine out of memory."""
    from pipeline.etl.cluster import check_worker_processes

    check_worker_processes(64, cores=16)
    with pytest.raises(UserError, match=r"^etl.workers=160: 10 worker processes a core \(16 here\), each a Python "
                                        r"process with its share of the memory; set etl.workers to at most 64 "):
        check_worker_processes(160, cores=16)
    with pytest.raises(UserError, match=r"etl.workers=100000: .* set etl.workers to at most"), \
            etl_client(EtlConfig(cluster="local", workers=100_000)):
        pass


def test_a_computation_longer_than_the_workers_check_leaves_no_task_held(monkeypatch):
    """distributed.wait's timeout raised, and its exception kept the futures in a reference cycle: the scheduler held a
    computation's tasks until the next garbage collection, and a second fit of the same data took the first one's
    results (a fit of 20M rows in 0.2 s)."""
    import gc

    import dask

    from pipeline.etl import progress

    monkeypatch.setattr(progress, "WORKERS_CHECK_S", 0.2)
    gc.disable()
    try:
        with LocalCluster(n_workers=2, processes=False, dashboard_address=None) as cluster, Client(cluster) as client:
            parts = [dask.delayed(time.sleep)(1.0, dask_key_name=f"slow-{i}") for i in range(4)]
            assert progress.compute(*parts, desc="fit", progress="off") == (None,) * 4
            deadline = time.monotonic() + 10
            while (held := client.run_on_scheduler(_tasks)) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert held == 0
    finally:
        gc.enable()


def _tasks(dask_scheduler) -> int:
    return len(dask_scheduler.tasks)


def _refuse(value):
    from pipeline.errors import BadInputError

    raise BadInputError(f"column 'x': refused {value}")


def test_a_task_refusing_its_input_is_said_once_without_the_workers_log(capfd):
    """A local worker logged Dask's "Compute Failed" block (the task, its traceback) before the pipeline's own
    error line; a failure that is not a refusal is still logged."""
    import dask

    with etl_client(EtlConfig(cluster="local", workers=1)):
        with pytest.raises(UserError, match="column 'x': refused 7"):
            dask.delayed(_refuse)(7).compute()
        time.sleep(1)  # the worker's log reaches the terminal
        refused = "".join(capfd.readouterr())
        with pytest.raises(ZeroDivisionError):
            dask.delayed(lambda: 1 / 0)().compute()
        time.sleep(1)
        failed = "".join(capfd.readouterr())
    assert "Compute Failed" not in refused and "Compute Failed" in failed
