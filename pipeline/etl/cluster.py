"""Where the ETL runs: an existing Dask scheduler, a LocalCluster, or threads in this process.

``etl_client`` is a context manager that starts what is needed and closes what it started:

- ``etl.scheduler = "tcp://host:8786"``: connect to that scheduler (its workers are left alone);
- ``etl.cluster = "local"``: a ``distributed.LocalCluster`` with ``etl.workers`` single-threaded
  worker processes (0: one per core), or on the cudf backend a ``dask_cuda.LocalCUDACluster``:
  ``etl.workers_per_gpu`` worker processes on each GPU (0: :func:`auto_workers_per_gpu`; on ``etl.workers`` GPUs if
  set) with ``etl.gpu_threads`` threads, each with an RMM pool of :data:`RMM_POOL_FRACTION` of its share of the GPU's
  memory and, with ``etl.gpu_spill``, cuDF's own spilling to host memory, its host allocator keeping freed memory
  (:data:`GPU_WORKER_MALLOC`), and workers sharing a GPU clients of a CUDA MPS daemon of their own
  (``etl.gpu_mps``, :mod:`pipeline.etl.mps`);
- ``etl.cluster = "threads"``: Dask's threaded scheduler in this process, no cluster at all;
- ``etl.cluster = "auto"``: a LocalCluster when the input is at least :data:`AUTO_LOCAL_BYTES` of
  parquet (starting worker processes costs about a second and pays off on large inputs only),
  threads otherwise.

Example::

    with etl_client(cfg.etl, input_bytes=raw_bytes, library="pandas") as where:
        print(where)          # "LocalCluster(2 workers)" or "threads" or "scheduler tcp://..."
        workflow.fit(ddf)
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

from pipeline.errors import UserError
from pipeline.etl.config import MPS_GPU_WORKERS, SHARED_GPU_WORKERS, EtlConfig
from pipeline.etl.mps import mps_daemon, mps_wanted

AUTO_LOCAL_BYTES = 256 * 2**20
"""cluster=auto starts a LocalCluster from this much input parquet on (256 MiB, about 4-5M Criteo rows)."""

RMM_POOL_FRACTION = 0.5
"""Initial RMM pool of a LocalCUDACluster worker alone on its GPU, as a fraction of the GPU's memory (the pool may
grow); workers sharing a GPU (``etl.workers_per_gpu``) take that share of this each."""

DEVICE_SPILL_FRACTION = 0.8
"""Workers sharing a GPU: each spills to host memory from its share of this fraction of the GPU's memory
(dask-cuda's default for a worker alone on its GPU)."""

RMM_MAXIMUM_FRACTION = 0.9
"""Workers sharing a GPU: the largest each one's RMM pool may grow, its share of this fraction of the GPU's memory
(one worker's pool must not starve the others of the device)."""


def choose_cluster(etl: EtlConfig, input_bytes: int) -> str:
    """``"scheduler"``, ``"local"`` or ``"threads"`` for these settings and this much input."""
    if etl.scheduler:
        return "scheduler"
    if etl.cluster == "auto":
        return "local" if input_bytes >= AUTO_LOCAL_BYTES else "threads"
    return etl.cluster


@contextlib.contextmanager
def etl_client(etl: EtlConfig, input_bytes: int = 0, library: str = "pandas",
               connect_timeout: str = "10s") -> Iterator[str]:
    """Run the enclosed Dask work on the chosen cluster; yields a description of where it runs."""
    import dask

    kind = choose_cluster(etl, input_bytes)
    if kind == "threads":
        workers = etl.workers or os.cpu_count() or 1
        with dask.config.set(scheduler="threads", num_workers=workers):
            yield f"threads ({workers} in this process)"
        return

    from distributed import Client

    if kind == "scheduler":
        from concurrent.futures import CancelledError

        from distributed.comm.core import CommClosedError

        with _quiet_reconnects(), _closing(_connect(etl.scheduler, connect_timeout)) as client:
            try:
                _check_package_there(client, etl.scheduler)
                workers = len(client.scheduler_info()["workers"])
            except OSError as err:  # the connection, lost (CommClosedError) or not made again
                raise _scheduler_gone(etl.scheduler, err) from None
            try:
                with _workers_that_died(f"give each worker more memory (`dask worker {etl.scheduler} "
                                        "--memory-limit ...`, or fewer workers a machine)"):
                    yield f"scheduler {etl.scheduler} ({workers} workers)"
            except (CancelledError, CommClosedError) as err:
                raise _scheduler_gone(etl.scheduler, err) from None
        return

    with _local_cluster(etl.workers, library, etl.gpu_threads, etl.gpu_spill, etl.workers_per_gpu,
                        etl.gpu_mps) as cluster, Client(cluster) as client:
        per_gpu = getattr(cluster, "workers_per_gpu", 1)
        shared = (f", {per_gpu} a GPU" if per_gpu > 1 else "") + (", MPS" if getattr(cluster, "mps", False) else "")
        count = len(client.scheduler_info()["workers"])
        with _workers_that_died(_more_memory_a_worker(library, count, per_gpu, etl.gpu_spill)):
            yield f"{type(cluster).__name__}({count} workers{shared})"


def _scheduler_gone(address: str, err: BaseException) -> UserError:
    """The error of an ETL whose scheduler went away, with the cancelled futures' reason or the error's first line (a
    closed connection is named only: its text is the connection's repr)."""
    from distributed.comm.core import CommClosedError

    reason = getattr(err, "reason", None) or ("" if isinstance(err, CommClosedError) else
                                              (str(err).strip().splitlines() or [""])[0].rstrip(":"))
    return UserError(f"the Dask scheduler at {address} stopped the ETL ({type(err).__name__}"
                     f"{': ' + reason if reason else ''}): it or its workers went away; start them again, then rerun "
                     "the ETL")


def _more_memory_a_worker(library: str, workers: int, per_gpu: int, gpu_spill: bool) -> str:
    """What gives each worker of a local cluster more memory, its settings being these."""
    if library != "cudf":
        return f"set etl.workers below {workers} (each worker may use the machine's memory / etl.workers)"
    if per_gpu > 1:
        return f"set etl.workers_per_gpu below {per_gpu} (the workers sharing a GPU share its memory)"
    return "set etl.gpu_spill=true (cuDF then spills to host memory)" if not gpu_spill else "use a machine with more memory"


@contextlib.contextmanager
def _workers_that_died(advice: str) -> Iterator[None]:
    """Dask's KilledWorker (every worker that ran a task died running it) as one error line: what died, its most
    common cause, and ``advice``."""
    from dask.utils import key_split
    from distributed.scheduler import KilledWorker

    try:
        yield
    except KilledWorker as err:
        last = getattr(err.last_worker, "address", err.last_worker)
        raise UserError(f"the ETL's Dask workers died running its task {key_split(err.task)} ({err.allowed_failures + 1} "
                        f"tried it, the last {last}): a worker most often dies of memory, stopped at its memory limit "
                        f"by its nanny or by the system; {advice}, or see the workers' log") from None


@contextlib.contextmanager
def _quiet_reconnects() -> Iterator[None]:
    """Dask's client logs each failed try to reconnect to a scheduler that went away with a traceback; the ETL says
    that it went away in one error line instead. Only those records are left out: the client's other logs pass."""
    logger = logging.getLogger("distributed.client")
    quiet = _LostConnectionRecords()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


@contextlib.contextmanager
def _closing(client: Any) -> Iterator[Any]:
    """Close ``client`` after the enclosed work. After work that failed, the close's own failure and its log are left
    out: closing a client whose scheduler went away can fail inside Dask (its connection pool cancels a reconnection
    whose timeout is expiring: RuntimeError "Cannot change state of expiring Timeout"), and the work's error is the one
    that says what happened."""
    try:
        yield client
    except BaseException:
        logger = logging.getLogger("distributed.client")
        logger.addFilter(_no_record)
        try:
            client.close()
        except Exception:  # noqa: BLE001, S110 (the work's error follows)
            pass
        finally:
            logger.removeFilter(_no_record)
        raise
    client.close()


def _no_record(record: logging.LogRecord) -> bool:
    return False


class _LostConnectionRecords(logging.Filter):
    """False for the client's records of a lost connection: a connection error (an OSError, Dask's CommClosedError
    among them, with its traceback) or its giving up."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else record.msg
        return not isinstance(error, OSError) and not str(record.msg).startswith("Failed to reconnect")


def _connect(address: str, timeout: str) -> Any:
    """A ``distributed.Client`` of the scheduler at ``address``, or a UserError naming it. The client's own timeout
    covers the connection, not the handshake: a port that accepts and never answers (another server) held it for
    good, and one that answers with other bytes was a traceback."""
    from dask.utils import parse_timedelta
    from distributed import Client

    seconds = parse_timedelta(timeout) + 10
    made: dict[str, Any] = {}

    def connect() -> None:
        try:
            made["client"] = Client(address, timeout=timeout)
        except Exception as err:  # noqa: BLE001 (anything it says is that no scheduler answered)
            # its text only: the error's traceback holds the half-made client, whose collection later, in another
            # thread, would close a loop a new client starts
            made["error"] = f"{type(err).__name__}: {err}"

    thread = threading.Thread(target=connect, name="dask-connect", daemon=True)
    thread.start()
    thread.join(seconds)
    if "client" in made:
        return made["client"]
    why = made.get("error", f"no answer in {seconds:g} s")
    raise UserError(f"etl.scheduler={address}: no Dask scheduler answered there ({why}); start one "
                    "(`dask scheduler`), or leave etl.scheduler empty for a cluster of this machine")


PACKAGE_CHECK = "import pipeline.etl.workflow"
"""What the scheduler and every worker of an existing cluster run before the ETL: the tasks name this package's code."""


def _check_package_there(client: Any, address: str) -> None:
    """Refuse a cluster whose scheduler or workers cannot import this package, naming them: a scheduler without it
    failed the first computation with Dask's "Error during deserialization of the task graph" traceback, and each
    worker without it died on the first task it was sent, so that the ETL waited for workers for good."""
    advice = ("start {} where this project's `pipeline` package imports (its environment, `pip install -e` of this "
              "project), then rerun the ETL")
    try:
        client.run_on_scheduler(exec, PACKAGE_CHECK)
    except ImportError as err:
        raise UserError(f"etl.scheduler={address}: the Dask scheduler there cannot import this project "
                        f"({type(err).__name__}: {err}); {advice.format('it')}") from None
    failed = {worker: error for worker, error in client.run(exec, PACKAGE_CHECK, on_error="return").items()
              if isinstance(error, ImportError)}  # not a worker that went away meanwhile
    if failed:
        worker, error = next(iter(failed.items()))
        more = f" and {len(failed) - 1} more" if len(failed) > 1 else ""
        raise UserError(f"etl.scheduler={address}: {len(failed)} of its Dask workers cannot import this project "
                        f"({worker}{more}: {type(error).__name__}: {error}); {advice.format('them')}")


WORKER_SETUP = "pipeline.etl.worker_setup"
"""The module each local worker process runs first (:mod:`pipeline.etl.worker_setup`)."""


GPU_WORKER_MALLOC = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_THRESHOLD_": str(2**30),
    "MALLOC_TRIM_THRESHOLD_": str(4 * 2**30),
    "MALLOC_TOP_PAD_": str(64 * 2**20),
}
"""glibc's allocator settings of a LocalCUDACluster worker process: freed host memory kept for reuse.

Dask's nanny starts every worker with ``MALLOC_TRIM_THRESHOLD_=65536`` (``distributed.nanny.pre-spawn-environ``),
which also fixes glibc's threshold for ``mmap`` at 128 KiB, and a task thread's allocations above 64 MiB are
mapped whatever the threshold (they do not fit a thread's arena): each of cuDF's host buffers (the parquet writer's
pages and its output, a frame copied to host memory) was then fresh memory, faulted in a page at a time
(docs/BENCHMARKS.md, "Where cuDF's parquet write spends its time"). Here every thread takes the main arena,
allocations up to 1 GiB come from it, and up to 4 GiB of freed memory stays in the process. A CPU worker keeps
Dask's settings: its data lives in host memory, and Dask's memory limits count on freed memory going back to the
system; a GPU worker's data lives on the device.
"""


@contextlib.contextmanager
def _worker_environment(environ: dict[str, str], workers_only: dict[str, str] | None = None) -> Iterator[None]:
    """Start the enclosed cluster's worker processes with ``environ`` set from their first instruction (Dask's
    pre-spawn environment), and ``workers_only`` set as they start, before any CUDA call (Dask's worker
    environment); this process's own values come back after.

    The nanny sets the pre-spawn environment in this process too, and takes a value found there over its
    configuration: an earlier cluster of this process would have left Dask's own trim threshold to win. So
    ``environ`` wins here. ``workers_only`` stays out of this process (an MPS daemon's pipe: this process's own CUDA
    context must not depend on a daemon that ends with the cluster).
    """
    import dask

    before = {name: os.environ.pop(name, None) for name in environ}
    spawn = {**dask.config.get("distributed.nanny.pre-spawn-environ", {}), **environ}
    started = {**dask.config.get("distributed.nanny.environ", {}), **(workers_only or {})}
    try:
        with dask.config.set({"distributed.nanny.pre-spawn-environ": spawn, "distributed.nanny.environ": started}):
            yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _local_cluster(workers: int, library: str, gpu_threads: int = 1, gpu_spill: bool = True,
                   workers_per_gpu: int = 0, gpu_mps: str = "auto") -> Iterator[Any]:
    if library == "cudf":
        try:
            from dask_cuda import LocalCUDACluster
        except Exception as err:
            raise UserError(f"the cudf backend needs dask-cuda for its cluster ({type(err).__name__}: {err}): "
                            "install it or use --device cpu") from err
        gpus = gpus_used(workers, _gpu_count())
        workers_per_gpu = workers_per_gpu or auto_workers_per_gpu(gpus, mps=mps_wanted(gpu_mps, shared=True))
        cluster_class = LocalCUDACluster if workers_per_gpu == 1 else _shared_gpu_cluster(LocalCUDACluster)
        shared = {} if workers_per_gpu == 1 else {
            "n_workers": gpus * workers_per_gpu, "workers_per_gpu": workers_per_gpu,
            "device_memory_limit": DEVICE_SPILL_FRACTION / workers_per_gpu,
            "rmm_maximum_pool_size": _device_bytes(RMM_MAXIMUM_FRACTION / workers_per_gpu)}
        # enable_cudf_spill: cuDF spills its own buffers to host memory when the GPU fills up, which
        # the dask-cuda docs advise for Dask cuDF ETL (finer than spilling whole task outputs); its spill
        # manager tracks every buffer, which data that fits the GPU can do without (etl.gpu_spill=false).
        options = {"n_workers": workers or None, "threads_per_worker": gpu_threads, "dashboard_address": None,
                   "rmm_pool_size": _device_bytes(RMM_POOL_FRACTION / workers_per_gpu),
                   "enable_cudf_spill": gpu_spill, "preload": [WORKER_SETUP], **shared}
        with mps_daemon(gpu_mps, shared=workers_per_gpu > 1) as mps, _worker_environment(GPU_WORKER_MALLOC, mps), \
                cluster_class(**options) as cluster:
            cluster.mps = bool(mps)
            yield cluster
        return
    from distributed import LocalCluster

    check_worker_processes(workers)
    with LocalCluster(n_workers=workers or os.cpu_count() or 1, threads_per_worker=1, processes=True,
                      dashboard_address=None, preload=[WORKER_SETUP]) as cluster:
        yield cluster


MAX_WORKERS_A_CORE = 4
"""LocalCluster worker processes a core that ``etl.workers`` may ask for: each is a Python process of its own, with
its own imports and memory limit (the machine's memory over the workers)."""


def check_worker_processes(workers: int, cores: int | None = None) -> None:
    """Refuse more local worker processes than :data:`MAX_WORKERS_A_CORE` a core (a typo such as ``etl.workers=160``
    for 16 started them all, and the machine ran out of memory before the ETL began)."""
    cores = cores or os.cpu_count() or 1
    if workers > MAX_WORKERS_A_CORE * cores:
        raise UserError(f"etl.workers={workers}: {workers / cores:.3g} worker processes a core ({cores} here), each a "
                        f"Python process with its share of the memory; set etl.workers to at most "
                        f"{MAX_WORKERS_A_CORE * cores} (0: one a core)")


def _shared_gpu_cluster(local_cuda_cluster: type) -> type:
    """A LocalCUDACluster class that starts ``workers_per_gpu`` worker processes on each GPU, one after the other.

    dask-cuda names each worker after its GPU and so starts one a GPU: a worker process's host work (Python, the
    parquet writer's encoding in libcudf, the copies it waits for) leaves its GPU idle most of a partition's time
    (docs/BENCHMARKS.md, "Where cuDF's parquet write spends its time"), and threads of one process share one
    interpreter lock. Here the ``k``-th worker takes GPU ``k // workers_per_gpu`` and the name ``"<gpu>-<k>"``.
    """

    class SharedGPUCluster(local_cuda_cluster):
        def __init__(self, *args: Any, workers_per_gpu: int, **kwargs: Any) -> None:
            self.workers_per_gpu = workers_per_gpu
            super().__init__(*args, **kwargs)

        def new_worker_spec(self) -> dict[str, Any]:
            devices = self.cuda_visible_devices
            places = ((k, devices[k // self.workers_per_gpu % len(devices)]) for k in itertools.count())
            # the first free place, also after a scale down
            count, device = next((k, gpu) for k, gpu in places if f"{gpu}-{k}" not in self.worker_spec)
            taken = self.worker_spec
            # dask-cuda's own spec of a worker on `device`: the one GPU not yet taken, as it sees it
            self.worker_spec = {other: None for other in devices if other != device}
            try:
                ((_, spec),) = super().new_worker_spec().items()
            finally:
                self.worker_spec = taken
            return {f"{device}-{count}": spec}

    return SharedGPUCluster


def gpus_used(workers: int, visible: int) -> int:
    """The GPUs a LocalCUDACluster takes for ``etl.workers`` (0: every visible one); more than are visible is refused
    here with what to do (dask-cuda's own refusal is a ValueError about scaling)."""
    if workers > visible:
        raise UserError(f"etl.workers={workers}: the cudf backend starts its workers on GPUs and {visible} "
                        f"{'is' if visible == 1 else 'are'} visible here; set etl.workers to {visible} or fewer (0: "
                        "every GPU), and etl.workers_per_gpu for more workers on each")
    return workers or visible


def auto_workers_per_gpu(gpus: int, cores: int | None = None, mps: bool = False) -> int:
    """``etl.workers_per_gpu=0``: :data:`MPS_GPU_WORKERS` a GPU with MPS, else :data:`SHARED_GPU_WORKERS`, where the
    machine has at least that many cores a GPU; else the most it has cores for, at least 1 (each worker's host work
    wants a core of its own)."""
    cores = cores or os.cpu_count() or 1
    wanted = MPS_GPU_WORKERS if mps else SHARED_GPU_WORKERS
    return max(1, min(wanted, cores // max(gpus, 1)))


def _gpu_count() -> int:
    from dask_cuda.utils import get_n_gpus

    return get_n_gpus()


def _device_bytes(fraction: float) -> int | None:
    """``fraction`` of GPU 0's memory in bytes (a multiple of 256), or None (no limit, no pool) if NVML can't say.

    Bytes rather than a fraction: every dask-cuda version parses a byte count, not all parse fractions.
    NVML is used, not torch, so this process does not create a CUDA context for nothing.
    """
    try:
        import pynvml

        pynvml.nvmlInit()
        total = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total
    except Exception:  # noqa: BLE001 - no NVML binding: the workers use RMM's default allocator
        return None
    return int(total * fraction) // 256 * 256
