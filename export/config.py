"""Settings of the export and serving stages."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.errors import SettingError, check_range
from pipeline.train.config import check_run_name

DENSE_BACKENDS = ("python", "pytorch")
INSTANCE_KINDS = ("auto", "cpu", "gpu")
CACHE_POLICIES = ("lru", "lfu", "none")
FUSE = ("auto", "all", "none")
AUTO_INSTANCES_MAX = 8
"""Instances of each model that ``export.instances=0`` makes at most: each holds its own embedding cache."""
MAX_REQUEST_MB = 2047.0
"""The guard holds each request body in memory whole."""
MAX_JSON_DEPTH = 1000
"""Well below the depths that crash Triton's recursive JSON parser (a request's data nested 40,000 deep)."""


@dataclass
class ExportConfig:
    """What the Triton model repository holds, and how its models are scheduled."""

    max_batch_size: int = field(default=1024, metadata={"help": "largest batch one request may carry"})
    dense_backend: str = field(default="python", metadata={
        "help": "python (bundled server) | pytorch (Triton's libtorch backend, in a full Triton container)"})
    instance_kind: str = field(default="auto", metadata={
        "help": "auto | cpu | gpu: instance groups of embedding and dense (auto: gpu when the device is cuda)"})
    instances: int = field(default=0, metadata={
        "help": "instances of each model (of a GPU model: per GPU); 0: one per core the export may run on, at most "
                f"{AUTO_INSTANCES_MAX} (a python model's instance is one process computing one request at a time, so "
                "concurrent requests need several; each holds its own cache of hot rows)"})
    dynamic_batching: bool = field(default=True, metadata={"help": "let Triton merge concurrent requests"})
    max_queue_delay_us: int = field(default=0, metadata={
        "help": "dynamic batching: longest wait for more requests (0: none; requests that queued while the model "
                "was busy are still merged)"})
    cache_policy: str = field(default="lru", metadata={"help": "lru | lfu | none: the cache of hot embedding rows"})
    cache_fraction: float = field(default=0.25, metadata={"help": "rows of each table kept in the cache, as a fraction"})
    gpu_whole_tables_mb: float = field(default=1024.0, metadata={
        "help": "a GPU instance keeps every row of the tables in its cache when together they take at most this many "
                "MiB, and at most a quarter of the GPU's free memory as it loads (each instance holds its own copy; a batch then finds its rows without the cache's index on the "
                "host: with export.preprocess_on_gpu, one CUDA graph a batch); larger tables keep "
                "export.cache_fraction of each (0: always the fraction)"})
    cuda_graphs: bool = field(default=True, metadata={
        "help": "GPU instances run the dense part as CUDA graphs, one per batch size padded to a power of two "
                "(its few small layers are bound by kernel launches); CPU instances always run it as it is"})
    preprocess_on_gpu: bool = field(default=True, metadata={
        "help": "GPU instances of the fused model (export.fuse=all) run the workflow on their GPU, as CUDA graphs, "
                "where its operators allow (the standard workflow's; a workflow with others, and a batch whose text "
                "the GPU does not read as the CPU does, run on the CPU)"})
    pin_instances: bool = field(default=False, metadata={
        "help": "run each instance of a python model on a core of its own (the instances of a model on different "
                "cores while there are cores enough): an instance then finds its data still in that core's caches, "
                "which lowers latency where the machine serves little else"})
    dense_threads: int = field(default=1, metadata={
        "help": "torch threads of each CPU dense instance (1: small requests, cores left to the other models)"})
    fuse: str = field(default="auto", metadata={
        "help": "all | none | auto: all serves raw rows with one python model, called as 'ensemble' (the workflow, the "
                "embedding lookup and the dense part in one process: one hop); none chains preprocess -> embedding -> "
                "dense, each with its own instances (export.dense_backend=pytorch needs it); auto: all with the python "
                "dense backend (faster on CPU and GPU instances), else none"})
    update: bool = field(default=False, metadata={
        "help": "write only a new embedding store version; a running server picks it up without a restart"})
    run: str = field(default="", metadata={
        "help": "the finished training run to export, a folder name under train/ (empty: train/latest, the newest "
                "finished run; so `run all` exports the run it trained)"})

    def __post_init__(self) -> None:
        for name, allowed in (("dense_backend", DENSE_BACKENDS), ("instance_kind", INSTANCE_KINDS),
                              ("cache_policy", CACHE_POLICIES), ("fuse", FUSE)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"export.{name}: expected one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        for name in ("max_batch_size", "dense_threads"):
            check_range(f"export.{name}", getattr(self, name), 1)
        check_range("export.instances", self.instances, 0)
        check_range("export.max_queue_delay_us", self.max_queue_delay_us, 0)
        check_range("export.cache_fraction", self.cache_fraction, 0, 1)
        check_range("export.gpu_whole_tables_mb", self.gpu_whole_tables_mb, 0)
        check_run_name("export.run", self.run)


@dataclass
class ServeConfig:
    """How the Triton server is started."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to bind (loopback unless asked)"})
    http_port: int = field(default=0, metadata={
        "help": "HTTP port (0: a free one), served by a guard that forwards requests within the limits to Triton"})
    grpc_port: int = field(default=0, metadata={"help": "gRPC port (0: a free one)"})
    binary: str = field(default="", metadata={
        "help": "tritonserver executable (empty: one on PATH, else the one bundled with nvidia-pytriton)"})
    models_env: str = field(default="", metadata={
        "help": "venv the python models run in (empty: $PIPELINE_TRITON_ENV or .venv-triton; needs numpy<2)"})
    startup_timeout: float = field(default=180.0, metadata={"help": "seconds to wait for the server to be ready"})
    smoke_rows: int = field(default=8, metadata={"help": "raw test rows sent as the smoke request"})
    max_request_mb: float = field(default=64.0, metadata={
        "help": "largest HTTP request body in MiB (decompressed); larger ones get 413 and never reach Triton"})
    max_json_depth: int = field(default=64, metadata={
        "help": "deepest nesting of an HTTP request's JSON (a request of the model needs about 5; Triton crashes "
                "on tens of thousands); deeper ones get 400 and never reach Triton"})
    max_restarts: int = field(default=5, metadata={
        "help": "restarts of a tritonserver that died, within serve.restart_window_s, before serving gives up "
                "(0: never restart)"})
    restart_window_s: float = field(default=600.0, metadata={
        "help": "seconds over which serve.max_restarts is counted"})
    once: bool = field(default=False, metadata={
        "help": "stop the server after the smoke request (for scripts) instead of serving until Ctrl-C"})

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("serve.host: expected an address to bind, e.g. 127.0.0.1, got an empty text")
        if ":" in self.host:
            raise SettingError(f"serve.host={self.host}: IPv6 addresses are not served; give an IPv4 address or a host "
                               "name (0.0.0.0 binds every IPv4 interface)")
        check_range("serve.http_port", self.http_port, 0, 65535)
        check_range("serve.grpc_port", self.grpc_port, 0, 65535)
        if self.http_port and self.http_port == self.grpc_port:
            raise SettingError(f"serve.http_port and serve.grpc_port are both {self.http_port}: give each its own port "
                               "(or 0 for a free one)")
        check_range("serve.startup_timeout", self.startup_timeout, 0, low_open=True)
        check_range("serve.smoke_rows", self.smoke_rows, 1)
        check_range("serve.max_request_mb", self.max_request_mb, 0, MAX_REQUEST_MB, low_open=True)
        check_range("serve.max_json_depth", self.max_json_depth, 1, MAX_JSON_DEPTH)
        check_range("serve.max_restarts", self.max_restarts, 0)
        check_range("serve.restart_window_s", self.restart_window_s, 0, low_open=True)
