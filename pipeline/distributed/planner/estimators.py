"""Storage and time of one table under one sharding type (rough, for ranking placements).

Example::

    storage_per_rank(table, ShardingType.ROW_WISE, topology)   # bytes on each of the ranks
    step_cost(table, ShardingType.TABLE_WISE, topology)         # seconds per step, all ranks together
    min_cache_rows(table, topology)                             # the least device cache of it host-cached
"""

from __future__ import annotations

import math

from pipeline.distributed.planner.types import Topology
from pipeline.distributed.types import ShardingType


def bytes_per_row(dim: int, topology: Topology) -> float:
    """Weights plus the optimizer's state of one row (Adagrad: one fp32; Adam: two fp32 per element)."""
    state = {"sgd": 0, "adagrad": 4, "adam": 8 * dim}[topology.optimizer]
    return dim * topology.weight_bytes + state


def storage_per_rank(table, kind: ShardingType, topology: Topology, cache_rows: int = 0) -> float:
    """Device bytes on each rank holding a part: the part, or its device cache when host-cached."""
    rows = table.rows if kind != ShardingType.ROW_WISE else math.ceil(table.rows / topology.world_size)
    return (cache_rows or rows) * bytes_per_row(table.dim, topology)


def min_cache_rows(table, topology: Topology) -> int:
    """The device cache a table-wise host-cached table needs: room for the ids of two steps from every
    rank (a batch, and the one prefetched while it trains), each sample with the most ids it may have,
    at least one row and at most the whole table."""
    ids = topology.batch_size * topology.world_size * sum(topology.max_ids_per_sample.get(f, 1) for f in table.features)
    return min(table.rows, max(1, 2 * ids))


def step_cost(table, kind: ShardingType, topology: Topology, host_cached: bool = False) -> float:
    """Seconds per step over all ranks: memory traffic of lookups and updates, plus communication; host-cached,
    plus every id's row copied in and back over the host link (the worst case, all misses)."""
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
    misses = 2 * bags * pooling / len(table.features) * bytes_per_row(table.dim, topology) if host_cached else 0.0
    return lookup + cross * (ids + pooled) / topology.comm_bandwidth + misses / topology.host_bandwidth
