"""Row-wise sharding: a table's rows split in contiguous ranges over all ranks.

Each id goes to the rank holding its row (with the row renumbered from that range's start); an id of
a dynamic table goes whole to the rank a hash of it picks
(:func:`~pipeline.modules.dynamic.owner_rank`), whose part of the table, a dynamic table of its
range's rows, places it. Every rank sum-pools the ids it got per bag, the partial pools travel back
and are summed where the sample lives. Mean pooling is applied after that sum (dividing by the
whole bag's length, ids without a row included), so the local tables always sum. Backward: the
pooled gradient is sent to every rank (the sum's gradient is the same for each part), where the
local collection's fused optimizer updates the rows it holds.

Example::

    rw = RowWiseSharding(tables, packing, feature_names, plan, rank, world, group, make_collection)
    bags = rw.input_dist(values, lengths, nnz_by_key, batch_size, validate=True).wait().wait()
    [out] = rw.output_dist(rw.lookup(bags), bags).wait()   # one block: [B, dims of rw.slots]
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
from pipeline.distributed.types import Awaitable, ShardingPlan, ShardingType
from pipeline.kernels.embedding import TablePacking
from pipeline.modules.configs import TableConfig
from pipeline.modules.dynamic import owner_rank


class RowWiseSharding(EmbeddingSharding):
    """The row-wise tables of a plan; every rank holds one row range of each."""

    sharding_type = ShardingType.ROW_WISE

    def __init__(self, tables: Sequence[TableConfig], packing: TablePacking, feature_names: Sequence[str],
                 plan: ShardingPlan, rank: int, world: int, group, make_collection: MakeCollection,
                 comm_dtype: torch.dtype = torch.float32) -> None:
        rw = self.tables_of_type(tables, plan)
        super().__init__(packing, feature_names, [s for s in range(packing.num_slots) if packing.slot_table[s] in rw],
                         rank, world, group, comm_dtype)
        self.table_ids = rw
        self.block_slots = [self.slots]  # the output dist returns one block, [B, dims of all slots]
        ranges = {t: plan[tables[t].name].row_ranges for t in rw}
        self.dynamic_slots = [i for i, s in enumerate(self.slots) if tables[packing.slot_table[s]].dynamic]
        for t in rw:
            q, rem = divmod(tables[t].rows, world)
            expected = [(r * q + min(r, rem), (r + 1) * q + min(r + 1, rem)) for r in range(world)]
            if ranges[t] != expected:
                raise ValueError(f"table {tables[t].name}: row-wise ranges {ranges[t]} are not the even split "
                                 f"{expected} this sharding computes ids with")
        self.local_features = [slot_key(packing, s) for s in self.slots]
        rows_here = {t: ranges[t][rank][1] - ranges[t][rank][0] for t in rw}
        self.local = make_collection(local_tables(tables, packing, rw, rows=rows_here, pooling="sum"),
                                     self.local_features)
        self.dim = sum(packing.slot_dims[s] for s in self.slots)
        slot_rows = [tables[packing.slot_table[s]].rows for s in self.slots]
        self.register_buffer("_q", torch.tensor([r // world for r in slot_rows], dtype=torch.int64), persistent=False)
        self.register_buffer("_rem", torch.tensor([r % world for r in slot_rows], dtype=torch.int64), persistent=False)
        dynamic = torch.zeros(len(self.slots), dtype=torch.bool)
        dynamic[self.dynamic_slots] = True
        self.register_buffer("_dynamic", dynamic, persistent=False)
        mean = [packing.slot_mean[s] for s in self.slots]
        self.has_mean = any(mean)
        self.register_buffer("_mean", torch.tensor(mean, dtype=torch.bool), persistent=False)
        self.register_buffer("_slot_of_column", torch.repeat_interleave(
            torch.arange(len(self.slots)), torch.tensor([packing.slot_dims[s] for s in self.slots], dtype=torch.int64)),
            persistent=False)

    def send_bags(self, lengths: torch.Tensor, values: torch.Tensor,
                  batch_size: int) -> Awaitable[Awaitable[Received]]:
        s, b, w = len(self.slots), batch_size, self.world
        nnz = values.numel()
        bag = torch.repeat_interleave(torch.arange(s * b, device=values.device), lengths, output_size=nnz)
        slot = torch.div(bag, max(b, 1), rounding_mode="floor")
        q, rem = self._q[slot], self._rem[slot]
        big = (q + 1) * rem
        dest = torch.where(values < big, torch.div(values, q + 1, rounding_mode="floor"),
                           rem + torch.div(values - big, q, rounding_mode="floor"))
        local_ids = values - (dest * q + torch.minimum(dest, rem))
        if self.dynamic_slots:
            dynamic = self._dynamic[slot]
            dest = torch.where(dynamic, owner_rank(values, w), dest)
            local_ids = torch.where(dynamic, values, local_ids)
        lengths_by_dest = torch.bincount(dest * (s * b) + bag, minlength=w * s * b)
        nnz_by_dest = torch.bincount(dest, minlength=w)
        order = torch.sort(dest, stable=True).indices
        return exchange_bags(lengths_by_dest, local_ids[order], nnz_by_dest, [s] * w, s, b, self.group)

    def lookup(self, bags: LocalBags) -> torch.Tensor:
        return self.local(bags.features)

    def output_dist(self, pooled: torch.Tensor, bags: LocalBags) -> Awaitable[list[torch.Tensor]]:
        blocks = exchange_pooled(pooled, bags.batch_sizes, [self.dim] * self.world, bags.batch_size, self.group,
                                 torch.is_grad_enabled() and self.training, self.comm_dtype)
        return blocks.then(lambda got: [self.combine(got, bags.own_lengths, bags.batch_size)])

    def combine(self, blocks: list[torch.Tensor], lengths: torch.Tensor, batch_size: int) -> torch.Tensor:
        """The sum of the ranks' partial pools (in float32, whatever travelled), mean slots divided."""
        out = blocks[0].float()
        for block in blocks[1:]:
            out = out + block
        if self.has_mean:
            lens = lengths.view(len(self.slots), batch_size).t().float().clamp(min=1)[:, self._slot_of_column]
            scale = torch.where(self._mean[self._slot_of_column], 1.0 / lens, torch.ones_like(lens))
            out = out * scale
        return out
