"""``EmbeddingShardingPlanner``: enumerate, propose, partition; the first proposal that fits wins, unless it
host-caches tables: then each next proposal (one more table host-cached, the largest left) wins over it while the
tables it newly host-caches have more rows than the smallest device cache of the plan before. So the caches end
at a water level: the tables larger than it host-cached behind caches of about as many rows each, the smaller ones
kept whole. Under skewed ids that beats keeping some large tables whole and starving the others' caches: the
budget holds the hottest rows of every table.

Example::

    planner = EmbeddingShardingPlanner(Topology(world_size=4, memory_per_rank=40 << 30, batch_size=65536),
                                       constraints={"t_C3": "row_wise"})
    plan = planner.plan(tables)          # ShardingPlan, or PlannerError (needed vs available per rank)
    print(planner.describe(plan, tables))
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.distributed.planner.enumerators import EmbeddingEnumerator
from pipeline.distributed.planner.estimators import storage_per_rank
from pipeline.distributed.planner.partitioners import GreedyPartitioner
from pipeline.distributed.planner.proposers import GreedyProposer
from pipeline.distributed.planner.types import Enumerator, MiB, Partitioner, PlannerError, Proposer, Topology
from pipeline.distributed.types import ShardingPlan, ShardingType


class EmbeddingShardingPlanner:
    def __init__(self, topology: Topology, constraints: dict[str, str] | None = None,
                 enumerator: Enumerator | None = None, proposer: Proposer | None = None,
                 partitioner: Partitioner | None = None) -> None:
        self.topology = topology
        self.enumerator = enumerator or EmbeddingEnumerator(topology, constraints)
        self.proposer = proposer or GreedyProposer()
        self.partitioner = partitioner or GreedyPartitioner()

    def plan(self, tables: Sequence) -> ShardingPlan:
        options = self.enumerator.enumerate(tables)
        last: PlannerError | None = None
        tried = 0
        chosen: ShardingPlan | None = None
        for proposal in self.proposer.propose(options):
            tried += 1
            try:
                plan = self.partitioner.partition(proposal, self.topology)
            except PlannerError as err:
                last = err
                continue
            plan.validate(tables, self.topology.world_size)
            if chosen is not None and not _caches_more_rows(chosen, plan):
                return chosen
            chosen = plan
            if not any(p.cache_rows for p in plan.tables.values()):
                return plan
        if chosen is not None:
            return chosen
        total = sum(min(o.storage_per_rank * (self.topology.world_size if o.sharding_type != ShardingType.TABLE_WISE
                                              else 1) for o in opts) for opts in options.values())
        budget = self.topology.memory_per_rank or 0.0
        raise PlannerError(
            f"cannot place {len(options)} embedding tables on {self.topology.world_size} rank(s) with "
            f"{budget / MiB:.2f} MiB each ({tried} proposals tried, the last host-caching every table that allows "
            f"it, each with the least device cache a step needs): they need at least {total / MiB:.2f} MiB in total, "
            f"{total / self.topology.world_size / MiB:.2f} MiB per rank; last attempt: {last}; give each rank more "
            f"(distributed.memory_per_rank_mb), lower train.batch_size (a device cache holds two batches of ids), "
            f"or train on more ranks",
            last.needed if last else [], last.available if last else [])

    def storage(self, plan: ShardingPlan, tables: Sequence) -> dict[int, float]:
        """Bytes of embedding storage each rank holds under ``plan``."""
        out = {r: 0.0 for r in range(plan.world_size)}
        for t in tables:
            p = plan[t.name]
            for r in p.ranks:
                out[r] += storage_per_rank(t, p.sharding_type, self.topology, p.cache_rows_on(r))
        return out

    def describe(self, plan: ShardingPlan, tables: Sequence) -> str:
        return plan.describe(tables, self.storage(plan, tables))


def _caches_more_rows(before: ShardingPlan, after: ShardingPlan) -> bool:
    """``after`` host-caches tables ``before`` kept in device memory, each with more rows than ``before``'s
    smallest device cache (the water level, see the module) and behind a cache smaller than itself."""
    level = min(p.cache_rows for p in before.tables.values() if p.cache_rows)
    new = [p for name, p in after.tables.items() if p.cache_rows and not before[name].cache_rows]
    return bool(new) and all(level < _rows(p) and p.cache_rows < _rows(p) for p in new)


def _rows(p) -> int:
    lo, hi = p.row_ranges[0]
    return hi - lo
