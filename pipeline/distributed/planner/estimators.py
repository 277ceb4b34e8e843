"""Storage and time of one table under one sharding type (rough, for ranking placements).

Example::

    storage_per_rank(table, ShardingType.ROW_WISE, topology)   # bytes on each of the ranks
    step_cost(table, ShardingType.TABLE_WISE, topology)         # seconds per step, all ranks together
"""

from __future__ import annotations

import math

from pipeline.distributed.planner.types import Topology
from pipeline.distributed.types import ShardingType


def bytes_per_row(dim: int, topology: Topology) -> float:
    """Weights plus the optimizer's state of one row (Adagrad: one fp32; Adam: two fp32 per element)."""
    state = {"sgd": 0, "adagrad": 4, "adam": 8 * dim}[topology.optimizer]
    return dim * topology.weight_bytes + state


def storage_per_rank(table, kind: ShardingType, topology: Topology) -> float:
    rows = table.rows if kind != ShardingType.ROW_WISE else math.ceil(table.rows / topology.world_size)
    return rows * bytes_per_row(table.dim, topology)


def step_cost(table, kind: ShardingType, topology: Topology) -> float:
    """Seconds per step over all ranks: memory traffic of lookups and updates, plus communication."""
    w = topology.world_size
    pooling = sum(topology.pooling_factors.get(f, 1.0) for f in table.features)
    bags = topology.batch_size * w * len(table.features)
    lookup = 3 * bags * pooling / len(table.features) * table.dim * topology.weight_bytes / topology.hbm_bandwidth
    cross = (w - 1) / w
    if kind == ShardingType.DATA_PARALLEL:
        allreduce = 2 * cross * table.rows * table.dim * 4 * w
        return lookup + allreduce / topology.comm_bandwidth
    ids = bags * pooling / len(table.features) * 8
    pooled = 2 * bags * table.dim * 4 * (w if kind == ShardingType.ROW_WISE else 1)
    return lookup + cross * (ids + pooled) / topology.comm_bandwidth
