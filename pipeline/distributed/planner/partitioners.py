"""Assign a proposal to ranks: row-wise and data-parallel parts go everywhere, table-wise tables
largest-cost first to the least loaded rank that still has room (memory, then balance of cost).
A host-cached table is placed as a table-wise one of its least device cache; then the caches on each
rank share what its budget leaves, in proportion to their tables' sizes (without a budget: each
cache holds its whole table).

Example::

    plan = GreedyPartitioner().partition(proposal, topology)   # or PlannerError with the numbers
"""

from __future__ import annotations

from pipeline.distributed.planner.estimators import bytes_per_row
from pipeline.distributed.planner.types import MiB, PlannerError, ShardingOption, Topology
from pipeline.distributed.types import ParameterSharding, ShardingPlan, ShardingType


class GreedyPartitioner:
    def partition(self, proposal: dict[str, ShardingOption], topology: Topology) -> ShardingPlan:
        w = topology.world_size
        budget = topology.memory_per_rank
        used = [0.0] * w
        load = [0.0] * w
        placed: dict[str, ParameterSharding] = {}
        for name, o in proposal.items():
            if o.sharding_type == ShardingType.TABLE_WISE:
                continue
            for r in range(w):
                used[r] += o.storage_per_rank
                load[r] += o.cost / w
            placed[name] = (ParameterSharding.row_wise(name, o.rows, w) if o.sharding_type == ShardingType.ROW_WISE
                            else ParameterSharding.data_parallel(name, o.rows, w))
        tw = sorted((o for o in proposal.values() if o.sharding_type == ShardingType.TABLE_WISE),
                    key=lambda o: (o.rank is None, -o.cost, -o.storage_per_rank, o.table))
        for o in tw:
            if o.rank is not None:
                candidates = [o.rank]
            else:
                candidates = sorted(range(w), key=lambda r: (load[r], used[r], r))
            fits = [r for r in candidates if budget is None or used[r] + o.storage_per_rank <= budget]
            if not fits:
                needed = [used[r] + (o.storage_per_rank if r in candidates else 0) for r in range(w)]
                cached = f", host-cached in a device cache of {o.cache_rows:,} rows at least" if o.cache_rows else ""
                raise PlannerError(
                    f"table {o.table} ({o.rows} x {o.dim}{cached}, {o.storage_per_rank / MiB:.2f} MiB) fits on no rank "
                    f"{'' if o.rank is None else f'(pinned to rank {o.rank}) '}: needed per rank "
                    f"{_mib(needed)} MiB, available {budget / MiB:.2f} MiB each", needed, [budget] * w)
            r = fits[0]
            used[r] += o.storage_per_rank
            load[r] += o.cost
            placed[o.table] = ParameterSharding.table_wise(o.table, o.rows, r, o.cache_rows)
        if budget is not None and any(u > budget for u in used):
            raise PlannerError(f"row-wise and data-parallel parts alone need {_mib(used)} MiB per rank, "
                               f"available {budget / MiB:.2f} MiB each", list(used), [budget] * w)
        for r in range(w):
            self._grow_caches([o for o in tw if o.cache_rows and placed[o.table].ranks == [r]], placed,
                              None if budget is None else budget - used[r], topology)
        return ShardingPlan(w, {name: placed[name] for name in proposal})

    @staticmethod
    def _grow_caches(cached: list[ShardingOption], placed: dict[str, ParameterSharding], left: float | None,
                     topology: Topology) -> None:
        """The host-cached tables of one rank: their caches share the ``left`` bytes in proportion to their
        tables' sizes, up to the whole table (``None``: no budget, every cache the whole table)."""
        sizes = {o.table: o.rows * bytes_per_row(o.dim, topology) for o in cached}
        for o in cached:
            extra = o.rows if left is None else int(left * sizes[o.table] / sum(sizes.values()) // bytes_per_row(
                o.dim, topology))
            placed[o.table].cache_rows = min(o.rows, o.cache_rows + extra)


def _mib(values: list[float]) -> str:
    return "[" + ", ".join(f"{v / MiB:.2f}" for v in values) + "]"
