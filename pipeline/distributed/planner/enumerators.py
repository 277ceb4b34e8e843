"""List every allowed placement of every table, priced by the estimators.

Constraints (from ``DistributedConfig.sharding``) narrow a table to one sharding type, and
``table_wise:RANK`` pins its owner. Row-wise needs at least one row per rank.

Example::

    EmbeddingEnumerator(topology, {"t_C3": "row_wise"}).enumerate(tables)["t_C3"]   # one option
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.distributed.planner.estimators import step_cost, storage_per_rank
from pipeline.distributed.planner.types import ShardingOption, Topology
from pipeline.distributed.types import ShardingType


def parse_constraint(table: str, value: str, world_size: int) -> tuple[ShardingType, int | None]:
    """``table_wise`` | ``table_wise:RANK`` | ``row_wise`` | ``data_parallel`` -> (type, pinned rank)."""
    kind, _, rank = value.partition(":")
    try:
        sharding_type = ShardingType(kind)
    except ValueError:
        raise ValueError(f"sharding of {table}: expected table_wise[:RANK], row_wise or data_parallel, "
                         f"got {value!r}") from None
    if rank and sharding_type != ShardingType.TABLE_WISE:
        raise ValueError(f"sharding of {table}: only table_wise takes a rank, got {value!r}")
    pinned = int(rank) if rank else None
    if pinned is not None and not 0 <= pinned < world_size:
        raise ValueError(f"sharding of {table}: rank {pinned} is outside 0..{world_size - 1}")
    return sharding_type, pinned


class EmbeddingEnumerator:
    def __init__(self, topology: Topology, constraints: dict[str, str] | None = None) -> None:
        self.topology = topology
        self.constraints = dict(constraints or {})

    def enumerate(self, tables: Sequence) -> dict[str, list[ShardingOption]]:
        names = {t.name for t in tables}
        unknown = sorted(set(self.constraints) - names)
        if unknown:
            raise ValueError(f"sharding overrides name tables {unknown} that the model does not have; "
                             f"it has {sorted(names)}")
        out: dict[str, list[ShardingOption]] = {}
        for table in tables:
            kinds = list(ShardingType)
            pinned = None
            if table.name in self.constraints:
                kind, pinned = parse_constraint(table.name, self.constraints[table.name], self.topology.world_size)
                kinds = [kind]
            if self.topology.world_size == 1:
                kinds = [ShardingType.TABLE_WISE]
            if table.rows < self.topology.world_size and ShardingType.ROW_WISE in kinds:
                if kinds == [ShardingType.ROW_WISE]:
                    raise ValueError(f"sharding of {table.name}: row-wise needs at least one row per rank, "
                                     f"the table has {table.rows} rows for {self.topology.world_size} ranks")
                kinds.remove(ShardingType.ROW_WISE)
            out[table.name] = [
                ShardingOption(table.name, k, table.rows, table.dim, storage_per_rank(table, k, self.topology),
                               step_cost(table, k, self.topology), pinned if k == ShardingType.TABLE_WISE else None)
                for k in kinds
            ]
        return out
