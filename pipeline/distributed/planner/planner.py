"""``EmbeddingShardingPlanner``: enumerate, propose, partition; the first proposal that fits wins.

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
        for proposal in self.proposer.propose(options):
            tried += 1
            try:
                plan = self.partitioner.partition(proposal, self.topology)
            except PlannerError as err:
                last = err
                continue
            plan.validate(tables, self.topology.world_size)
            return plan
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
