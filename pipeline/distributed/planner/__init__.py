"""The embedding sharding planner: enumerate, propose, partition, estimate (see ``planner.py``)."""

from pipeline.distributed.planner.planner import EmbeddingShardingPlanner
from pipeline.distributed.planner.types import PlannerError, ShardingOption, Topology

__all__ = ["EmbeddingShardingPlanner", "PlannerError", "ShardingOption", "Topology"]
