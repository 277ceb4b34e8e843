"""Pick one option per table: the cheapest first, then ever more row-wise until the plan fits.

The first proposal takes each table's cheapest option (data-parallel wins for tables small next to
the batch, table-wise for the rest). Each next proposal moves the largest remaining table-wise
table (or a data-parallel one, largest first, once no table-wise table is left) to row-wise, which
spreads its storage evenly; the last proposal is "everything row-wise that can be".

Example::

    for proposal in GreedyProposer().propose(options): ...
"""

from __future__ import annotations

from collections.abc import Iterator

from pipeline.distributed.planner.types import ShardingOption
from pipeline.distributed.types import ShardingType


class GreedyProposer:
    def propose(self, options: dict[str, list[ShardingOption]]) -> Iterator[dict[str, ShardingOption]]:
        current = {name: min(opts, key=lambda o: (o.cost, o.storage_per_rank)) for name, opts in options.items()}
        yield dict(current)
        while True:
            movable = [o for name, o in current.items() if o.sharding_type != ShardingType.ROW_WISE
                       and any(x.sharding_type == ShardingType.ROW_WISE for x in options[name])]
            if not movable:
                return
            tw = [o for o in movable if o.sharding_type == ShardingType.TABLE_WISE]
            pick = max(tw or movable, key=lambda o: o.storage_per_rank)
            current[pick.table] = next(x for x in options[pick.table] if x.sharding_type == ShardingType.ROW_WISE)
            yield dict(current)
