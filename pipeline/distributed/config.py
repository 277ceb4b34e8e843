"""Settings of multi-rank training (the ``distributed`` section).

Example (YAML)::

    distributed:
      memory_per_rank_mb: 40000         # embedding storage budget of one rank
      sharding: {t_C3: row_wise, t_C9: data_parallel, t_C1: "table_wise:1", t_C20: host_cached}
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.errors import check_range


@dataclass
class DistributedConfig:
    """How the embedding tables are spread over the ranks (``--nproc`` / torchrun set how many)."""

    nproc: int = field(default=1, metadata={"help": "processes (GPUs) on this node; >1 starts them through torchrun"})
    memory_per_rank_mb: float = field(default=0.0, metadata={
        "help": "embedding storage budget per rank (one process too) in MiB (0: half the GPU's free memory on cuda, "
                "no limit on cpu); tables that do not fit stay in host memory behind a device cache of their hot "
                "rows, the caches taking what the budget leaves"})
    sharding: dict[str, str] = field(default_factory=dict, metadata={
        "help": "per-table overrides: table_wise[:RANK] | row_wise | data_parallel | host_cached[:RANK] (in host "
                "memory, a device cache of its rows) (others: chosen by the planner)"})
    plan_file: str = field(default="", metadata={"help": "a saved plan.json to use as is instead of planning"})
    comm_dtype: str = field(default="fp32", metadata={
        "help": "fp32 | bf16: dtype of the pooled vectors (and their gradients) sent between ranks"})
    pipeline: bool = field(default=True, metadata={
        "help": "N ranks: read the next batch and start its id exchange while this one trains (TorchRec's "
                "sparse-dist pipeline); one process with host-cached or dynamic tables: copy the next batch's rows "
                "into the device caches, or place its ids in the dynamic tables, while this one trains; the same "
                "weights as false: one batch after the other"})
    timeout_s: float = field(default=600.0, metadata={"help": "seconds a collective may wait before failing"})

    def __post_init__(self) -> None:
        check_range("distributed.nproc", self.nproc, 1)
        check_range("distributed.memory_per_rank_mb", self.memory_per_rank_mb, 0)
        check_range("distributed.timeout_s", self.timeout_s, 0, low_open=True)
        if self.comm_dtype not in ("fp32", "bf16"):
            raise ValueError(f"distributed.comm_dtype: expected fp32 or bf16, got {self.comm_dtype!r}")
        allowed = ("table_wise", "row_wise", "data_parallel", "host_cached")
        for table, value in self.sharding.items():
            kind, colon, rank = value.partition(":")
            if kind not in allowed or (colon and (kind not in ("table_wise", "host_cached") or not rank.isdigit())):
                raise ValueError(f"distributed.sharding.{table}: expected table_wise[:RANK], row_wise, data_parallel "
                                 f"or host_cached[:RANK], got {value!r}")
