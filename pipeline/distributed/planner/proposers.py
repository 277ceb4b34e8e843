"""Pick one option per table: the cheapest first, then ever more row-wise, then host-cached, until the plan fits.

The first proposal takes each table's cheapest option (data-parallel wins for tables small next to
the batch, table-wise for the rest). Each next proposal moves the largest remaining table-wise
table (or a data-parallel one, largest first, once no table-wise table is left) to row-wise, which
spreads its storage evenly, until everything that can be is row-wise; then each moves the largest
table not yet host-cached to host-cached (its rows in host memory, a device cache of them in the
budget), of the tables whose least cache is smaller than they are. The last proposal host-caches
every such table that allows it.

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
                       and not o.cache_rows and _row_wise(options[name])]
            if movable:
                tw = [o for o in movable if o.sharding_type == ShardingType.TABLE_WISE]
                pick = max(tw or movable, key=lambda o: o.storage_per_rank)
                current[pick.table] = _row_wise(options[pick.table])
            else:
                cacheable = [o for name, o in current.items() if not o.cache_rows
                             and (cached := _host_cached(options[name])) and cached.cache_rows < cached.rows]
                if not cacheable:
                    return
                pick = max(cacheable, key=lambda o: (o.rows * o.dim, o.table))
                current[pick.table] = _host_cached(options[pick.table])
            yield dict(current)


def _row_wise(options: list[ShardingOption]) -> ShardingOption | None:
    return next((o for o in options if o.sharding_type == ShardingType.ROW_WISE), None)


def _host_cached(options: list[ShardingOption]) -> ShardingOption | None:
    return next((o for o in options if o.cache_rows), None)
