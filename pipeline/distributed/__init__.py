"""Model-parallel embedding training over ranks: planner, sharded collection, DDP wrapper, checkpoints.

Launch one process per GPU with ``python -m pipeline run train --nproc N`` or
``torchrun --nproc-per-node N -m pipeline run train``; on several nodes add torchrun's rendezvous
flags (``--nnodes 2 --rdzv-backend c10d --rdzv-endpoint HOST:29500``).
"""

from pipeline.distributed.checkpoint import load_sharded_checkpoint, save_sharded_checkpoint
from pipeline.distributed.comm import init_from_env
from pipeline.distributed.config import DistributedConfig
from pipeline.distributed.embedding import ShardedEmbeddingCollection
from pipeline.distributed.model_parallel import DistributedModelParallel, make_planner
from pipeline.distributed.planner import EmbeddingShardingPlanner, PlannerError, Topology
from pipeline.distributed.types import ParameterSharding, ShardingPlan, ShardingType

__all__ = [
    "DistributedConfig",
    "DistributedModelParallel",
    "EmbeddingShardingPlanner",
    "ParameterSharding",
    "PlannerError",
    "ShardedEmbeddingCollection",
    "ShardingPlan",
    "ShardingType",
    "Topology",
    "init_from_env",
    "load_sharded_checkpoint",
    "make_planner",
    "save_sharded_checkpoint",
]
