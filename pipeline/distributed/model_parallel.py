"""``DistributedModelParallel``: a model's embedding collections sharded, its dense part under DDP.

Every :class:`~pipeline.modules.collection.EmbeddingCollection` inside the model is replaced by a
:class:`~pipeline.distributed.embedding.ShardedEmbeddingCollection` (this rank's rows copied from
it), and the model is wrapped in ``DistributedDataParallel`` with the sharded buffers left out of
DDP's broadcasts. The model's own code does not change: ``model.embedding(kjt)`` is now sharded.

Example (one process per GPU, under torchrun)::

    init_from_env("cuda")
    model = build_model("dlrm", schema, sizes, opt, seed=cfg.seed)       # the same on every rank
    dmp = DistributedModelParallel(model, planner=planner_for(cfg.distributed, topology_args...))
    logits = dmp(batch.dense, batch.sparse); loss.backward(); dense_optimizer.step()
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from pipeline.distributed.comm import world_of
from pipeline.distributed.config import DistributedConfig
from pipeline.distributed.embedding import ShardedEmbeddingCollection
from pipeline.distributed.planner import EmbeddingShardingPlanner, Topology
from pipeline.distributed.types import ShardingPlan
from pipeline.modules.collection import EmbeddingCollection


def make_planner(cfg: DistributedConfig, world_size: int, device: torch.device | str, batch_size: int = 2048,
                 optimizer: str = "adagrad", weight_bytes: int = 4,
                 max_ids_per_sample: dict[str, int] | None = None) -> EmbeddingShardingPlanner:
    """The planner for ``cfg``: its memory budget (or the device's), its per-table overrides;
    ``max_ids_per_sample``: the most ids a sample has per feature, where more than one (multi-hot)."""
    budget = cfg.memory_per_rank_mb * 2**20 if cfg.memory_per_rank_mb else None
    device = torch.device(device)
    if budget is None and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = 0.5 * free
    topology = Topology(world_size, budget, batch_size=batch_size, weight_bytes=weight_bytes, optimizer=optimizer,
                        max_ids_per_sample=dict(max_ids_per_sample or {}))
    return EmbeddingShardingPlanner(topology, cfg.sharding)


class DistributedModelParallel(nn.Module):
    """The model with sharded embeddings and DDP on the rest; ``plans`` maps module path -> plan."""

    def __init__(self, model: nn.Module, plans: ShardingPlan | dict[str, ShardingPlan] | None = None,
                 planner: EmbeddingShardingPlanner | None = None, device: torch.device | str | None = None,
                 process_group=None, verbose: bool = True, comm_dtype: str = "fp32", **ddp_kwargs) -> None:
        super().__init__()
        rank, world = world_of(None)
        collections = [(name, m) for name, m in model.named_modules() if isinstance(m, EmbeddingCollection)]
        if isinstance(plans, ShardingPlan):
            if len(collections) != 1:
                raise ValueError(f"one plan given for {len(collections)} embedding collections; give a dict by path")
            plans = {collections[0][0]: plans}
        plans = dict(plans or {})
        self.plans: dict[str, ShardingPlan] = {}
        device = torch.device(device) if device is not None else self._device_of(model)
        for name, ec in collections:
            plan = plans.get(name)
            if plan is None:
                planner = planner or EmbeddingShardingPlanner(Topology(world))
                plan = planner.plan(ec.tables)
            sharded = ShardedEmbeddingCollection.from_collection(ec, plan, device, process_group, comm_dtype)
            if verbose and rank == 0:
                print(f"[distributed] {name}: " + plan.describe(ec.tables), flush=True)
            _set_submodule(model, name, sharded)
            self.plans[name] = plan
        del collections
        model.to(device)
        self.model = model
        self.sharded_paths = list(self.plans)
        if world > 1 and any(p.requires_grad for p in model.parameters()):
            ignore = [f"{path}.{n}" for path in self.sharded_paths
                      for n, _ in model.get_submodule(path).named_buffers()]
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignore)
            ddp_kwargs.setdefault("broadcast_buffers", False)  # the ignored buffers are rank-local
            ddp_kwargs.setdefault("gradient_as_bucket_view", True)  # no copy between buckets and .grad
            if device.type == "cuda":
                ddp_kwargs.setdefault("device_ids", [device.index if device.index is not None else 0])
            with warnings.catch_warnings():
                # torch >= 2.12 calls broadcast_buffers deprecated, but its replacement still syncs
                # buffers at init, which would overwrite the rank-local shards' (ignored) buffers.
                warnings.simplefilter("ignore", FutureWarning)
                self.wrapped: nn.Module = DistributedDataParallel(model, **ddp_kwargs)
        else:
            self.wrapped = model

    @staticmethod
    def _device_of(model: nn.Module) -> torch.device:
        for p in model.parameters():
            return p.device
        return torch.device("cpu")

    @property
    def embedding(self) -> nn.Module:
        """The model's ``embedding`` (sharded), so a loop written for the plain model can set its lr."""
        return self.model.get_submodule("embedding")

    @property
    def module(self) -> nn.Module:
        """The model itself (its embedding collections now sharded)."""
        return self.model

    def forward(self, *args, **kwargs):
        return self.wrapped(*args, **kwargs)

    def sharded_collections(self) -> dict[str, ShardedEmbeddingCollection]:
        return {path: self.model.get_submodule(path) for path in self.sharded_paths}

    def dense_state_dict(self) -> dict[str, torch.Tensor]:
        """The state of everything but the sharded collections (the same on every rank)."""
        prefixes = tuple(f"{p}." for p in self.sharded_paths)
        return {k: v for k, v in self.model.state_dict().items() if not k.startswith(prefixes)}

    def load_dense_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        prefixes = tuple(f"{p}." for p in self.sharded_paths)
        missing = [k for k in missing if not k.startswith(prefixes)]
        if missing or unexpected:
            raise KeyError(f"dense state does not match the model: missing {missing}, unexpected {unexpected}")


def _set_submodule(model: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, leaf = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, leaf, module)

