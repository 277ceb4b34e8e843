"""Table-wise sharding: each table whole on one rank; bags go to the owner, pooled vectors come back.

Example (what :class:`~pipeline.distributed.embedding.ShardedEmbeddingCollection` does)::

    tw = TableWiseSharding(tables, packing, feature_names, plan, rank, world, group, make_collection)
    bags = tw.input_dist(values, lengths, nnz_by_key, batch_size, validate=True).wait().wait()
    blocks = tw.output_dist(tw.lookup(bags), bags).wait()   # per owner rank: [B, dims of its slots]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipeline.distributed.embedding_sharding import (
    EmbeddingSharding,
    LocalBags,
    MakeCollection,
    Received,
    exchange_bags,
    exchange_pooled,
    local_tables,
    slot_key,
)
from pipeline.distributed.jagged import segment_sums
from pipeline.distributed.types import Awaitable, ShardingPlan, ShardingType
from pipeline.kernels.embedding import TablePacking
from pipeline.modules.configs import TableConfig


class TableWiseSharding(EmbeddingSharding):
    """The table-wise tables of a plan. ``slots`` (global slot ids) are grouped by owner rank."""

    sharding_type = ShardingType.TABLE_WISE

    def __init__(self, tables: Sequence[TableConfig], packing: TablePacking, feature_names: Sequence[str],
                 plan: ShardingPlan, rank: int, world: int, group, make_collection: MakeCollection,
                 comm_dtype: torch.dtype = torch.float32) -> None:
        owner = {t: plan[tables[t].name].ranks[0] for t in self.tables_of_type(tables, plan)}
        by_owner = [[s for s in range(packing.num_slots) if owner.get(packing.slot_table[s]) == q] for q in range(world)]
        super().__init__(packing, feature_names, [s for q in range(world) for s in by_owner[q]], rank, world, group,
                         comm_dtype)
        self.block_slots = by_owner  # the output dist returns one block of pooled columns per owner rank
        self.slots_by_owner = [len(x) for x in by_owner]
        self.dims_by_owner = [sum(packing.slot_dims[s] for s in x) for x in by_owner]
        self.table_ids = [t for t in owner if owner[t] == rank]
        self.dynamic_slots = [i for i, s in enumerate(self.slots) if tables[packing.slot_table[s]].dynamic]
        self.local_features = [slot_key(packing, s) for s in by_owner[rank]]
        self.local = make_collection(local_tables(tables, packing, self.table_ids), self.local_features) \
            if self.table_ids else None
        self.register_buffer("_owner_of_slot", torch.tensor(
            [q for q in range(world) for _ in by_owner[q]], dtype=torch.int64), persistent=False)

    def send_bags(self, lengths: torch.Tensor, values: torch.Tensor,
                  batch_size: int) -> Awaitable[Awaitable[Received]]:
        nnz_by_dest = torch.zeros(self.world, dtype=torch.int64, device=lengths.device)
        nnz_by_dest.index_add_(0, self._owner_of_slot, segment_sums(lengths, len(self.slots)))
        return exchange_bags(lengths, values, nnz_by_dest, self.slots_by_owner, self.slots_by_owner[self.rank],
                             batch_size, self.group)

    def lookup(self, bags: LocalBags) -> torch.Tensor:
        if self.local is None:
            return torch.empty(sum(bags.batch_sizes), 0, device=bags.own_lengths.device)
        return self.local(bags.features)

    def output_dist(self, pooled: torch.Tensor, bags: LocalBags) -> Awaitable[list[torch.Tensor]]:
        return exchange_pooled(pooled, bags.batch_sizes, self.dims_by_owner, bags.batch_size, self.group,
                               torch.is_grad_enabled() and self.training, self.comm_dtype)
