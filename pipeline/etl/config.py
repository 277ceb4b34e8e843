"""Settings of the ETL stage."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.errors import check_range
from pipeline.parquet import COMPRESSIONS, DEFAULT_COMPRESSION
from pipeline.schema import DYNAMIC_ROWS, MAX_BUCKETS

SHARED_GPU_WORKERS = 2
"""Worker processes a GPU when ``etl.workers_per_gpu`` is 0 (auto) and the cores allow, without MPS: the count that
did best in docs/BENCHMARKS.md, "Worker processes sharing the GPU"."""

MPS_GPU_WORKERS = 4
"""The same, with the workers clients of an MPS daemon (``etl.gpu_mps``): kernels of all of them then run on the GPU
at once, and more workers kept it busy (docs/BENCHMARKS.md, "Workers sharing a GPU through MPS")."""


@dataclass
class EtlConfig:
    """How the workflow is built and where it runs."""

    scheduler: str = field(
        default="", metadata={"help": "address of an existing Dask scheduler (tcp://host:8786); empty: start one"}
    )
    cluster: str = field(
        default="auto",
        metadata={"help": "auto | local | threads: a LocalCluster, or in-process threads "
                          "(auto: a LocalCluster from 256 MiB of raw parquet on, threads below)"},
    )
    workers: int = field(default=0, metadata={"help": "LocalCluster workers (0: one per core), or the GPUs of a "
                                                     "LocalCUDACluster (0: every GPU)"})
    workers_per_gpu: int = field(default=0, metadata={
        "help": "LocalCUDACluster worker processes on each GPU, sharing it (each with its share of the GPU's "
                "memory): one partition's host work (Python, parquet encoding) runs while the GPU computes "
                f"another's (0: {MPS_GPU_WORKERS} as clients of MPS, see etl.gpu_mps, else {SHARED_GPU_WORKERS}, or fewer where the machine has fewer cores a GPU; "
                "1: one worker a GPU, dask-cuda's way)"})
    gpu_threads: int = field(
        default=1, metadata={"help": "threads of each LocalCUDACluster worker (2: one partition is read or "
                                     "written while another is computed on the same GPU)"}
    )
    gpu_mps: str = field(default="auto", metadata={
        "help": "auto | on | off: the LocalCUDACluster's workers as clients of a CUDA MPS daemon of their own, so "
                "that the kernels and copies of workers sharing a GPU run on it together instead of in turns (auto: "
                "where workers share a GPU and nvidia-cuda-mps-control is on PATH)"})
    gpu_spill: bool = field(
        default=True, metadata={"help": "cuDF spills its buffers to host memory when a GPU fills up (false: no "
                                        "spill manager tracking every buffer, for data that fits the GPUs)"}
    )
    freq_threshold: int = field(default=2, metadata={
        "help": "Categorify: values seen fewer times map to OOV (2: a value seen once shares the out-of-vocabulary "
                "row, which then learns what a rare or new value is; at 0 that row is never trained, and every value "
                "unseen in training gets its random start)"})
    max_vocab_size: int = field(default=0, metadata={"help": "Categorify: keep at most this many values (0: all)"})
    hash_buckets: dict[str, int] = field(
        default_factory=dict, metadata={"help": "columns hashed into N buckets instead of a vocabulary"}
    )
    hash_ids: dict[str, int] = field(default_factory=dict, metadata={
        "help": "columns kept as 64-bit hashes of their values (no vocabulary), each learned by a dynamic "
                "embedding table of N rows (a multiple of 128): new values get rows as training meets them"})
    missing_indicator: bool = field(default=True, metadata={
        "help": "beside each continuous feature, a continuous feature <name>_missing: 1.0 where the value was "
                "missing (and filled with the column's median), else 0.0"})
    row_group_rows: int = field(default=262_144, metadata={"help": "parquet row group size of the output"})
    compression: str = field(default=DEFAULT_COMPRESSION, metadata={
        "help": f"compression of the output's parquet pages: {' | '.join(COMPRESSIONS)} (lz4: small files the "
                "loader decodes cheaply; none: about 2.4x the bytes for about 1.5x less decoding CPU, for a loader "
                "bound by the host)"})

    def __post_init__(self) -> None:
        if self.cluster not in ("auto", "local", "threads"):
            raise ValueError(f"etl.cluster: expected auto, local or threads, got {self.cluster!r}")
        if self.gpu_mps not in ("auto", "on", "off"):
            raise ValueError(f"etl.gpu_mps: expected auto, on or off, got {self.gpu_mps!r}")
        check_range("etl.workers", self.workers, 0)
        check_range("etl.gpu_threads", self.gpu_threads, 1)
        check_range("etl.workers_per_gpu", self.workers_per_gpu, 0)
        check_range("etl.freq_threshold", self.freq_threshold, 0)
        check_range("etl.max_vocab_size", self.max_vocab_size, 0)
        check_range("etl.row_group_rows", self.row_group_rows, 1)
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"etl.compression: expected one of {', '.join(COMPRESSIONS)}, got {self.compression!r}")
        for column, buckets in self.hash_buckets.items():
            check_range(f"etl.hash_buckets.{column}", buckets, 1, MAX_BUCKETS)
        for column, capacity in self.hash_ids.items():
            check_range(f"etl.hash_ids.{column}", capacity, DYNAMIC_ROWS)
            if capacity % DYNAMIC_ROWS:
                raise ValueError(f"etl.hash_ids.{column}: expected a multiple of {DYNAMIC_ROWS} (whole buckets of "
                                 f"the table's hash table), got {capacity}")
        both = sorted(set(self.hash_ids) & set(self.hash_buckets))
        if both:
            raise ValueError(f"etl.hash_ids and etl.hash_buckets both name {both}: a column is hashed into buckets "
                             "or kept as 64-bit ids, not both")
