"""Model-parallel embedding training over ranks: World, planner, sharded collection, DDP wrapper, training
pipeline, checkpoints.

Launch one process per GPU with ``python -m pipeline run train --nproc N`` or
``torchrun --nproc-per-node N -m pipeline run train``; on several nodes add torchrun's rendezvous
flags (``--nnodes 2 --rdzv-backend c10d --rdzv-endpoint HOST:29500``).

Names load on first use, so ``pipeline.distributed.config`` (read by the settings) does not import torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "DistributedConfig": "pipeline.distributed.config",
    "DistributedModelParallel": "pipeline.distributed.model_parallel",
    "EmbeddingShardingPlanner": "pipeline.distributed.planner",
    "ParameterSharding": "pipeline.distributed.types",
    "PlannerError": "pipeline.distributed.planner",
    "PrefetchPipeline": "pipeline.distributed.train_pipeline",
    "ShardedEmbeddingCollection": "pipeline.distributed.embedding",
    "ShardingPlan": "pipeline.distributed.types",
    "ShardingType": "pipeline.distributed.types",
    "SparseDistPipeline": "pipeline.distributed.train_pipeline",
    "Topology": "pipeline.distributed.planner",
    "World": "pipeline.distributed.world",
    "init_from_env": "pipeline.distributed.comm",
    "load_sharded_checkpoint": "pipeline.distributed.checkpoint",
    "make_planner": "pipeline.distributed.model_parallel",
    "save_sharded_checkpoint": "pipeline.distributed.checkpoint",
}

__all__ = sorted(_EXPORTS)  # noqa: PLE0605  (the names loaded on first use, listed once above)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pipeline.distributed' has no attribute {name!r}")
