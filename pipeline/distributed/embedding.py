"""``ShardedEmbeddingCollection``: the EmbeddingCollection spread over ranks by a sharding plan.

Same contract as :class:`~pipeline.modules.collection.EmbeddingCollection`: each rank passes the
KeyedJaggedTensor of its own batch and gets ``[B, sum of slot dims]`` in the same column order; in
backward the rows are updated in place by the fused optimizer of the rank that holds them. Tables
are served by one strategy per sharding type the plan uses (``tw_sharding``, ``rw_sharding``,
``dp_sharding``), each looking up through a local EmbeddingCollection, so the local compute uses
the registered backend; a local collection holding a host-cached part of a table (the plan's
``cache_rows``) is a :class:`~pipeline.modules.cached_collection.HostCachedCollection`, whose lookup
first brings the batch's rows into the part's device cache.

A batch goes through three calls, torchrec's ``ShardedEmbeddingBagCollection`` split, so that a
training loop can overlap the next batch's id exchange with this batch's compute:
``input_dist(kjt).wait().wait()`` (ids to the ranks holding their rows; the first ``wait()`` reads
the split sizes on the host), ``compute(bags)`` (the local lookups), ``output_dist(pooled,
bags).wait()`` (pooled vectors back, assembled in column order). ``forward`` is those in a row, or,
given a :class:`StartedInputDist` (a batch whose input dist a pipelined loop started a step ahead,
see :mod:`pipeline.distributed.train_pipeline`), the wait for it and the last two.

Gradient scale: every rank's pooled gradient is divided by the world size before it leaves, the
same averaging DistributedDataParallel applies to the dense part. Training on ``W`` ranks with a
batch of ``B`` each then matches training one process on the ``W * B`` samples with a mean loss.

Example (under torchrun, one process per GPU)::

    plan = EmbeddingShardingPlanner(Topology(world_size=2, memory_per_rank=8 << 30)).plan(tables)
    sharded = ShardedEmbeddingCollection.from_collection(model.embedding, plan, device="cuda")
    pooled = sharded(batch.sparse)      # [B, sum of dims]; backward updates the owned rows
    bags = sharded.input_dist(batch.sparse).wait().wait()       # the same in three calls
    pooled = sharded.output_dist(sharded.compute(bags), bags).wait()
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from pipeline.distributed.comm import ScaleGrad, world_of
from pipeline.distributed.dp_sharding import DataParallelSharding
from pipeline.distributed.embedding_sharding import LocalBags
from pipeline.distributed.jagged import segment_sums
from pipeline.distributed.rw_sharding import RowWiseSharding
from pipeline.distributed.tw_sharding import TableWiseSharding
from pipeline.distributed.types import Awaitable, AwaitableList, ShardingPlan, ShardingType
from pipeline.errors import BadInputError
from pipeline.kernels.embedding import TablePacking
from pipeline.modules.cached_collection import HostCachedCollection
from pipeline.modules.collection import EmbeddingCollection, uniform_init
from pipeline.modules.columns import ColumnRun, assemble_columns, merge_runs
from pipeline.modules.configs import EmbeddingOptimizerConfig, TableConfig, check_features
from pipeline.modules.dynamic import DynamicTable, owner_rank
from pipeline.sparse import KeyedJaggedTensor

_STRATEGIES = (TableWiseSharding, RowWiseSharding, DataParallelSharding)
_COMM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class StartedInputDist:
    """A batch's sparse features on their way to the ranks that look them up: what a pipelined loop
    passes to the model in place of the KeyedJaggedTensor, ``collection``'s input dist of
    ``features`` started ahead. ``wait()`` (``forward`` calls it) gives the received bags."""

    def __init__(self, collection: ShardedEmbeddingCollection, features: KeyedJaggedTensor) -> None:
        self.collection, self.features = collection, features
        self.sent: Awaitable[Awaitable[list[LocalBags]]] | None = collection.input_dist(features)

    @property
    def batch_size(self) -> int:
        return self.features.batch_size

    def to(self, device: torch.device | str, non_blocking: bool = False) -> StartedInputDist:
        """Itself: the exchange runs where it was started (on the collection's device)."""
        return self

    def wait(self) -> list[LocalBags]:
        if self.sent is None:
            raise RuntimeError("this batch's input dist was waited for already")
        sent, self.sent = self.sent, None
        return sent.wait().wait()


class ShardedEmbeddingCollection(nn.Module):
    """The tables of ``plan``, this rank's part of them, and the exchanges that serve a local batch.

    ``process_group``: the group to shard over (default: a new group of every rank, so these
    exchanges never interleave with DDP's on the default group). The local tables are initialized
    like the unsharded collection's (uniform in ``±rows**-0.5``, drawn per shard from ``seed``;
    ``seed=None`` leaves them for the caller to fill); :meth:`from_collection` copies the values of
    an existing collection instead. ``comm_dtype``: ``fp32``, or ``bf16`` to send the pooled vectors
    and their gradients at half the bytes (rounded to bf16 on the way).
    """

    def __init__(self, tables: Sequence[TableConfig], feature_names: Sequence[str], plan: ShardingPlan,
                 optimizer: EmbeddingOptimizerConfig | None = None, weights_dtype: str = "fp32",
                 backend: str = "auto", device: torch.device | str = "cpu", validate_ids: bool = True,
                 process_group=None, seed: int | None = 0, comm_dtype: str = "fp32") -> None:
        super().__init__()
        import torch.distributed as dist

        if process_group is None and dist.is_initialized() and dist.get_world_size() > 1:
            process_group = dist.new_group(backend=dist.get_backend())
        self.group = process_group
        self.rank, self.world_size = world_of(process_group)
        self.tables = list(tables)
        self.feature_names = list(feature_names)
        check_features(self.tables, self.feature_names)
        self.packing = TablePacking.build(self.tables)
        plan.validate(self.tables, self.world_size)
        self.plan = plan
        self.optimizer = optimizer or EmbeddingOptimizerConfig()
        self.validate_ids = validate_ids
        self.device = torch.device(device)

        def make(local_tables, keys):
            cached = {t.name: plan[t.name].cache_rows_on(self.rank) for t in local_tables if plan[t.name].cache_rows}
            options = {"weights_dtype": weights_dtype, "backend": backend, "validate_ids": False}
            local = (HostCachedCollection(local_tables, keys, cached, self.optimizer, **options) if cached
                     else EmbeddingCollection(local_tables, keys, self.optimizer, **options))
            return local.to(self.device)

        if comm_dtype not in _COMM_DTYPES:
            raise ValueError(f"comm_dtype: expected one of {list(_COMM_DTYPES)}, got {comm_dtype!r}")
        self.comm_dtype = comm_dtype
        self.strategies = nn.ModuleList(
            cls(self.tables, self.packing, self.feature_names, plan, self.rank, self.world_size, process_group, make,
                _COMM_DTYPES[comm_dtype])
            for cls in _STRATEGIES if plan.by_type(cls.sharding_type))
        self.strategies.to(self.device)  # their index buffers; the local collections are there already
        if seed is not None:
            self._init_weights(seed)
        # Each strategy returns blocks of columns (``block_slots``: the slots of each, in order); the
        # output takes every slot's columns from its block, in slot order, in one copy.
        where: dict[int, tuple[int, int]] = {}
        block = 0
        for st in self.strategies:
            for slots in st.block_slots:
                col = 0
                for s in slots:
                    where[s] = (block, col)
                    col += self.packing.slot_dims[s]
                block += 1
        self._column_runs = merge_runs([ColumnRun(where[s][0], where[s][1], where[s][1] + self.packing.slot_dims[s])
                                        for s in range(self.packing.num_slots)])
        self._step = 0

    @classmethod
    def from_collection(cls, ec: EmbeddingCollection, plan: ShardingPlan, device: torch.device | str | None = None,
                        process_group=None, comm_dtype: str = "fp32") -> ShardedEmbeddingCollection:
        """The sharded version of ``ec``: same tables, optimizer, dtype and backend; this rank's rows copied."""
        dtype_name = {v: k for k, v in {"fp32": torch.float32, "fp16": torch.float16,
                                        "bf16": torch.bfloat16}.items()}[ec.weights.dtype]
        sharded = cls(ec.tables, ec.feature_names, plan, ec.optimizer, dtype_name, ec.backend_name,
                      device if device is not None else ec.weights.device, ec.validate_ids, process_group,
                      seed=None, comm_dtype=comm_dtype)
        sharded.set_lr(ec.lr)
        with torch.no_grad():
            for name, lo, hi, local in sharded.local_shards():
                part = sharded.dynamic_part(name)
                if part is not None:  # the ids this part owns, placed in its own slots
                    table, owned = part
                    table.seed.copy_(ec.dynamic[name].seed)
                    table.load_content(local, [ec.dynamic[name].content(ec.table_views(name))], owned)
                    continue
                for key, tensor in ec.table_views(name).items():
                    local[key].copy_(tensor[lo:hi])
            sharded.set_step(int(ec.step))
        return sharded

    @property
    def output_dim(self) -> int:
        return self.packing.total_dim

    @property
    def step(self) -> int:
        """Optimizer steps taken: counted on every rank, also on one that holds no table part."""
        return self._step

    def _count_step(self, grad: torch.Tensor) -> None:
        self._step += 1

    def set_step(self, step: int) -> None:
        self._step = int(step)
        for st in self.strategies:
            if st.local is not None:
                st.local.step.fill_(step)

    def set_lr(self, lr: float) -> None:
        for st in self.strategies:
            if st.local is not None:
                st.local.set_lr(lr)

    def local_shards(self) -> Iterator[tuple[str, int, int, dict[str, torch.Tensor]]]:
        """``(table, lo, hi, views)``: every table part on this rank with its global rows ``[lo, hi)`` (a
        host-cached part: its host tensors, its cache written back and emptied)."""
        for st in self.strategies:
            if st.local is None:
                continue
            for t in st.table_ids:
                name = self.tables[t].name
                lo, hi = self.plan[name].rows_on(self.rank)
                yield name, lo, hi, st.local.table_views(name)

    def dynamic_part(self, name: str) -> tuple[DynamicTable, Callable[[torch.Tensor], torch.Tensor] | None] | None:
        """This rank's part of dynamic table ``name`` and which ids it owns (None: all, the table is whole
        here), or None for a static table."""
        for st in self.strategies:
            if st.local is not None and st.local.dynamic is not None and name in st.local.dynamic.tables:
                if st.sharding_type == ShardingType.ROW_WISE:
                    return st.local.dynamic[name], lambda keys: owner_rank(keys, self.world_size) == self.rank
                return st.local.dynamic[name], None
        return None

    def _init_weights(self, seed: int) -> None:
        with torch.no_grad():
            parts = []
            for name, lo, hi, local in self.local_shards():
                t = self.packing.table_names.index(name)
                if self.tables[t].dynamic:  # its rows start as their ids come
                    continue
                w = torch.empty(hi - lo, self.tables[t].dim)
                parts.append((local["weight"], (w, self.tables[t].rows ** -0.5, seed * 1_000_003 + t * 7919 + lo)))
            uniform_init([fill for _, fill in parts])
            for weight, (w, _, _) in parts:
                weight.copy_(w)

    def input_dist(self, features: KeyedJaggedTensor) -> Awaitable[Awaitable[list[LocalBags]]]:
        """Every strategy's bags of ``features`` sent to the ranks that look them up (one per strategy)."""
        if features.keys != self.feature_names:
            raise BadInputError(f"expected sparse features {self.feature_names} in this order, got {features.keys}")
        b = features.batch_size
        values = features.values.to(device=self.device, dtype=torch.int64)
        lengths = features.lengths.to(device=self.device, dtype=torch.int64)
        nnz_by_key = segment_sums(lengths, len(self.feature_names))
        sent = [st.input_dist(values, lengths, nnz_by_key, b, self.validate_ids) for st in self.strategies]
        return AwaitableList(sent).then(AwaitableList)

    def compute(self, bags: list[LocalBags]) -> list[torch.Tensor]:
        """Each strategy's local lookup of the bags it received."""
        return [st.lookup(x) for st, x in zip(self.strategies, bags)]

    def output_dist(self, pooled: list[torch.Tensor], bags: list[LocalBags]) -> Awaitable[torch.Tensor]:
        """The pooled vectors back to their samples' ranks: ``[B, sum of slot dims]``, in slot order."""
        blocks = AwaitableList([st.output_dist(p, x) for st, p, x in zip(self.strategies, pooled, bags)])
        return blocks.then(self._assemble)

    def forward(self, features: KeyedJaggedTensor | StartedInputDist) -> torch.Tensor:
        if isinstance(features, StartedInputDist):
            if features.collection is not self:
                raise ValueError("this input dist was started by another sharded collection")
            bags = features.wait()
        else:
            bags = self.input_dist(features).wait().wait()
        if not bags:  # no tables
            return torch.empty(features.batch_size, 0, device=self.device)
        return self.output_dist(self.compute(bags), bags).wait()

    def _assemble(self, blocks: list[list[torch.Tensor]]) -> torch.Tensor:
        out = assemble_columns([b for per_strategy in blocks for b in per_strategy], self._column_runs, torch.float32)
        if self.world_size > 1 and torch.is_grad_enabled() and self.training:
            out = ScaleGrad.apply(out, 1.0 / self.world_size)
        if out.requires_grad:
            out.register_hook(self._count_step)
        return out

    def extra_repr(self) -> str:
        kinds = {k.value: len(self.plan.by_type(k)) for k in ShardingType}
        return f"rank={self.rank}, world_size={self.world_size}, tables={kinds}"
