"""The planner's vocabulary: the topology, one candidate placement, the error, and the interfaces.

The planner is four small parts, each replaceable (torchrec's planner design):
``Enumerator`` lists the allowed :class:`ShardingOption` of every table with its cost, ``Proposer``
picks one option per table (a proposal, several in order of preference), ``Partitioner`` assigns the
options to ranks within their memory or raises :class:`PlannerError`, and the estimators
(``estimators.py``) price storage and time.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pipeline.distributed.types import ShardingPlan, ShardingType
from pipeline.errors import UserError

GiB = float(1 << 30)
MiB = float(1 << 20)


class PlannerError(UserError):
    """The tables cannot be placed on the ranks: the message gives needed and available bytes per rank."""

    def __init__(self, message: str, needed: list[float] | None = None, available: list[float] | None = None) -> None:
        super().__init__(message)
        self.needed = needed or []
        self.available = available or []


@dataclass
class Topology:
    """The ranks a plan is for, and what each can hold and move.

    ``memory_per_rank``: bytes of embedding storage (weights + optimizer state) one rank may hold in
    device memory (a host-cached table: its device cache); ``None``: no limit. ``batch_size``: samples per rank and step; ``pooling_factors``: mean ids per
    bag of each feature (1 when not given); ``max_ids_per_sample``: the most ids one sample has in each
    feature (1 when not given; a multi-hot column's longest list), what a host-cached table's least
    device cache is sized for. Bandwidths (bytes/s) only rank the options against each
    other; their defaults are an H200's memory and an NVLink-class link, and a PCIe 5 x16 link to the
    host (what the misses of host-cached tables cross).
    """

    world_size: int
    memory_per_rank: float | None = None
    batch_size: int = 2048
    weight_bytes: int = 4
    optimizer: str = "adagrad"
    pooling_factors: dict[str, float] = field(default_factory=dict)
    max_ids_per_sample: dict[str, int] = field(default_factory=dict)
    hbm_bandwidth: float = 4.0e12
    comm_bandwidth: float = 1.5e11
    host_bandwidth: float = 5.0e10

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"topology: world_size must be at least 1, got {self.world_size}")


@dataclass
class ShardingOption:
    """One way to place one table, with what it costs on each rank it touches."""

    table: str
    sharding_type: ShardingType
    rows: int
    dim: int
    storage_per_rank: float
    """Bytes on each rank holding a part (TW: the owner; RW: every rank; DP: every rank)."""
    cost: float
    """Estimated seconds per step, summed over the ranks it loads."""
    rank: int | None = None
    """TW only: the owner, once partitioned (or pinned by a constraint)."""
    cache_rows: int = 0
    """Host-cached (table-wise, in the owner's host memory): the least device cache rows it needs, what
    ``storage_per_rank`` counts (the partitioner gives it more where the budget allows); 0: not host-cached."""


class Enumerator(Protocol):
    def enumerate(self, tables: Sequence) -> dict[str, list[ShardingOption]]: ...


class Proposer(Protocol):
    def propose(self, options: dict[str, list[ShardingOption]]) -> Iterator[dict[str, ShardingOption]]: ...


class Partitioner(Protocol):
    def partition(self, proposal: dict[str, ShardingOption], topology: Topology) -> ShardingPlan: ...
