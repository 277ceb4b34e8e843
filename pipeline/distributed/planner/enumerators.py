"""List every allowed placement of every table, priced by the estimators.

A table may go table-wise, row-wise, data-parallel, or host-cached: table-wise in the owner's host
memory, behind a device cache (:func:`~pipeline.distributed.planner.estimators.min_cache_rows` at
least). Constraints (from ``DistributedConfig.sharding``) narrow a table to one of these, and
``table_wise:RANK`` / ``host_cached:RANK`` pin its owner. Row-wise needs at least one row per rank;
a world of one has table-wise and host-cached only. A dynamic table goes table-wise, or row-wise in
whole buckets of 128 rows per rank, in device memory.

Example::

    EmbeddingEnumerator(topology, {"t_C3": "row_wise"}).enumerate(tables)["t_C3"]   # one option
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.distributed.planner.estimators import min_cache_rows, step_cost, storage_per_rank
from pipeline.distributed.planner.types import PlannerError, ShardingOption, Topology
from pipeline.distributed.types import ShardingType
from pipeline.schema import DYNAMIC_ROWS

HOST_CACHED = "host_cached"


def parse_constraint(table: str, value: str, world_size: int) -> tuple[ShardingType, int | None, bool]:
    """``table_wise`` | ``row_wise`` | ``data_parallel`` | ``host_cached``, the first and last with an optional
    ``:RANK`` -> (type, pinned rank, host-cached)."""
    kind, _, rank = value.partition(":")
    cached = kind == HOST_CACHED
    try:
        sharding_type = ShardingType.TABLE_WISE if cached else ShardingType(kind)
    except ValueError:
        raise ValueError(f"sharding of {table}: expected table_wise[:RANK], row_wise, data_parallel or "
                         f"host_cached[:RANK], got {value!r}") from None
    if rank and sharding_type != ShardingType.TABLE_WISE:
        raise ValueError(f"sharding of {table}: only table_wise and host_cached take a rank, got {value!r}")
    pinned = int(rank) if rank else None
    if pinned is not None and not 0 <= pinned < world_size:
        raise ValueError(f"sharding of {table}: rank {pinned} is outside 0..{world_size - 1}")
    return sharding_type, pinned, cached


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
        topology = self.topology
        out: dict[str, list[ShardingOption]] = {}
        for table in tables:
            kinds, pinned, cached = list(ShardingType), None, True
            if table.name in self.constraints:
                kind, pinned, cached = parse_constraint(table.name, self.constraints[table.name], topology.world_size)
                kinds = [] if cached else [kind]
            if topology.world_size == 1 and kinds:
                kinds = [ShardingType.TABLE_WISE]
            if table.rows < topology.world_size and ShardingType.ROW_WISE in kinds:
                if kinds == [ShardingType.ROW_WISE]:
                    raise ValueError(f"sharding of {table.name}: row-wise needs at least one row per rank, "
                                     f"the table has {table.rows} rows for {topology.world_size} ranks")
                kinds.remove(ShardingType.ROW_WISE)
            if getattr(table, "dynamic", False):
                kinds, cached = self._dynamic_kinds(table, kinds), False
            options = [
                ShardingOption(table.name, k, table.rows, table.dim, storage_per_rank(table, k, topology),
                               step_cost(table, k, topology), pinned if k == ShardingType.TABLE_WISE else None)
                for k in kinds
            ]
            if cached:
                rows = min_cache_rows(table, topology)
                options.append(ShardingOption(
                    table.name, ShardingType.TABLE_WISE, table.rows, table.dim,
                    storage_per_rank(table, ShardingType.TABLE_WISE, topology, rows),
                    step_cost(table, ShardingType.TABLE_WISE, topology, host_cached=True), pinned, rows))
            out[table.name] = options
        return out

    def _dynamic_kinds(self, table, kinds: list[ShardingType]) -> list[ShardingType]:
        """The kinds of ``kinds`` a dynamic table allows (see ``ShardingPlan.validate``); a constraint to
        another (no kind left: host_cached) is refused."""
        world = self.topology.world_size
        allowed = [k for k in kinds if k == ShardingType.TABLE_WISE
                   or (k == ShardingType.ROW_WISE and table.rows % (DYNAMIC_ROWS * world) == 0)]
        if not allowed:
            why = ("a host-cached table's rows cannot follow its ids" if not kinds
                   else "data_parallel copies would place its ids apart on each rank"
                   if kinds == [ShardingType.DATA_PARALLEL]
                   else f"row-wise needs a capacity that is a multiple of {DYNAMIC_ROWS} x {world} ranks, it has "
                        f"{table.rows}")
            raise PlannerError(f"sharding of {table.name}: the table is dynamic and {why}; place it table_wise")
        return allowed
