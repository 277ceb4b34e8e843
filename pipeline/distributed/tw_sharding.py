"""Table-wise sharding: each table whole on one rank; bags go to the owner, pooled vectors come back.

Example (what :class:`~pipeline.distributed.embedding.ShardedEmbeddingCollection` does)::

    tw = TableWiseSharding(tables, layout, plan, rank, world, group, make_collection)
    blocks = tw(lengths, values, batch_size)  # per owner rank: [B, dims of its slots], in tw.block_slots order
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pipeline.distributed.embedding_sharding import (
    MakeCollection,
    exchange_bags,
    exchange_pooled,
    local_tables,
    slot_key,
)
from pipeline.distributed.jagged import segment_sums
from pipeline.distributed.types import ShardingPlan, ShardingType
from pipeline.kernels.embedding import TablePacking
from pipeline.modules.configs import TableConfig
from pipeline.sparse import KeyedJaggedTensor


class TableWiseSharding(nn.Module):
    """The table-wise tables of a plan. ``slots`` (global slot ids) are grouped by owner rank."""

    sharding_type = ShardingType.TABLE_WISE

    def __init__(self, tables: Sequence[TableConfig], layout: TablePacking, plan: ShardingPlan, rank: int, world: int,
                 group, make_collection: MakeCollection) -> None:
        super().__init__()
        self.rank, self.world, self.group = rank, world, group
        self.comm_dtype = torch.float32
        owner = {t: plan[tables[t].name].ranks[0] for t in range(len(tables))
                 if plan[tables[t].name].sharding_type == self.sharding_type}
        by_owner = [[s for s in range(layout.num_slots) if owner.get(layout.slot_table[s]) == q] for q in range(world)]
        self.slots = [s for q in range(world) for s in by_owner[q]]
        self.block_slots = by_owner  # forward returns one block of pooled columns per owner rank
        self.input_slots = self.slots
        self.slots_by_owner = [len(x) for x in by_owner]
        self.dims_by_owner = [sum(layout.slot_dims[s] for s in x) for x in by_owner]
        self.table_ids = [t for t in range(len(tables)) if owner.get(t) == rank]
        self.local_features = [slot_key(layout, s) for s in by_owner[rank]]
        self.local = make_collection(local_tables(tables, layout, self.table_ids), self.local_features) \
            if self.table_ids else None
        self.register_buffer("_owner_of_input_slot", torch.tensor(
            [q for q in range(world) for _ in by_owner[q]], dtype=torch.int64), persistent=False)

    def forward(self, lengths: torch.Tensor, values: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
        nnz_by_slot = segment_sums(lengths, len(self.input_slots))
        nnz_by_dest = torch.zeros(self.world, dtype=torch.int64, device=lengths.device)
        nnz_by_dest.index_add_(0, self._owner_of_input_slot, nnz_by_slot)
        my_slots = self.slots_by_owner[self.rank]
        got_lengths, got_values, batch_sizes = exchange_bags(lengths, values, nnz_by_dest, self.slots_by_owner,
                                                             my_slots, batch_size, self.group)
        training = torch.is_grad_enabled() and self.training
        if self.local is not None:
            pooled = self.local(KeyedJaggedTensor(self.local_features, got_values, got_lengths))
        else:
            pooled = torch.empty(sum(batch_sizes), 0, device=lengths.device)
        return exchange_pooled(pooled, batch_sizes, self.dims_by_owner, batch_size, self.group, training,
                               self.comm_dtype)
