"""Row-wise sharding: a table's rows split in contiguous ranges over all ranks.

Each id goes to the rank holding its row (with the row renumbered from that range's start); every
rank sum-pools the ids it got per bag, the partial pools travel back and are summed where the sample
lives. Mean pooling is applied after that sum (dividing by the whole bag's length), so the local
tables always sum. Backward: the pooled gradient is sent to every rank (the sum's gradient is the
same for each part), where the local collection's fused optimizer updates the rows it holds.

Example::

    rw = RowWiseSharding(tables, layout, plan, rank, world, group, make_collection)
    [out] = rw(lengths, values, batch_size)   # one block: [B, dims of rw.slots]
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
from pipeline.distributed.types import ShardingPlan, ShardingType
from pipeline.kernels.embedding import TablePacking
from pipeline.modules.configs import TableConfig
from pipeline.sparse import KeyedJaggedTensor


class RowWiseSharding(nn.Module):
    """The row-wise tables of a plan; every rank holds one row range of each."""

    sharding_type = ShardingType.ROW_WISE

    def __init__(self, tables: Sequence[TableConfig], layout: TablePacking, plan: ShardingPlan, rank: int, world: int,
                 group, make_collection: MakeCollection) -> None:
        super().__init__()
        self.rank, self.world, self.group = rank, world, group
        self.comm_dtype = torch.float32
        rw = [t for t in range(len(tables)) if plan[tables[t].name].sharding_type == self.sharding_type]
        self.table_ids = rw
        self.slots = [s for s in range(layout.num_slots) if layout.slot_table[s] in rw]
        self.input_slots = self.slots
        self.block_slots = [self.slots]  # forward returns one block, [B, dims of all slots]
        self.ranges = {t: plan[tables[t].name].row_ranges for t in rw}
        for t in rw:
            q, rem = divmod(tables[t].rows, world)
            expected = [(r * q + min(r, rem), (r + 1) * q + min(r + 1, rem)) for r in range(world)]
            if self.ranges[t] != expected:
                raise ValueError(f"table {tables[t].name}: row-wise ranges {self.ranges[t]} are not the even split "
                                 f"{expected} this sharding computes ids with")
        self.local_features = [slot_key(layout, s) for s in self.slots]
        rows_here = {t: self.ranges[t][rank][1] - self.ranges[t][rank][0] for t in rw}
        self.local = make_collection(local_tables(tables, layout, rw, rows=rows_here, pooling="sum"),
                                     self.local_features) if rw else None
        self.dim = sum(layout.slot_dims[s] for s in self.slots)
        slot_rows = [tables[layout.slot_table[s]].rows for s in self.slots]
        self.register_buffer("_q", torch.tensor([r // world for r in slot_rows], dtype=torch.int64), persistent=False)
        self.register_buffer("_rem", torch.tensor([r % world for r in slot_rows], dtype=torch.int64), persistent=False)
        mean = [layout.slot_mean[s] for s in self.slots]
        self.has_mean = any(mean)
        self.register_buffer("_mean", torch.tensor(mean, dtype=torch.bool), persistent=False)
        self.register_buffer("_slot_of_column", torch.repeat_interleave(
            torch.arange(len(self.slots)), torch.tensor([layout.slot_dims[s] for s in self.slots], dtype=torch.int64)),
            persistent=False)

    def forward(self, lengths: torch.Tensor, values: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
        s, b, w = len(self.slots), batch_size, self.world
        nnz = values.numel()
        bag = torch.repeat_interleave(torch.arange(s * b, device=values.device), lengths, output_size=nnz)
        slot = torch.div(bag, max(b, 1), rounding_mode="floor")
        q, rem = self._q[slot], self._rem[slot]
        big = (q + 1) * rem
        dest = torch.where(values < big, torch.div(values, q + 1, rounding_mode="floor"),
                           rem + torch.div(values - big, q, rounding_mode="floor"))
        local_ids = values - (dest * q + torch.minimum(dest, rem))
        lengths_by_dest = torch.bincount(dest * (s * b) + bag, minlength=w * s * b)
        nnz_by_dest = torch.bincount(dest, minlength=w)
        order = torch.sort(dest, stable=True).indices
        got_lengths, got_values, batch_sizes = exchange_bags(lengths_by_dest, local_ids[order], nnz_by_dest, [s] * w,
                                                             s, b, self.group)
        training = torch.is_grad_enabled() and self.training
        pooled = self.local(KeyedJaggedTensor(self.local_features, got_values, got_lengths))
        blocks = exchange_pooled(pooled, batch_sizes, [self.dim] * w, b, self.group, training,
                                 self.comm_dtype)
        out = blocks[0].float()  # the partial pools are added in float32, whatever travelled
        for block in blocks[1:]:
            out = out + block
        if self.has_mean:
            lens = lengths.view(s, b).t().float().clamp(min=1)[:, self._slot_of_column]
            scale = torch.where(self._mean[self._slot_of_column], 1.0 / lens, torch.ones_like(lens))
            out = out * scale
        return [out]
