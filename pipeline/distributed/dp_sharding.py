"""Data-parallel sharding: small tables copied on every rank, kept identical.

Lookups stay local. In backward each rank turns its gradient into per-row gradients (through the
backend's own SGD update applied to a zero buffer, so the fused kernels do the work on GPU), the
row gradients and the set of touched rows are summed over ranks in one all-reduce, and every rank
applies the collection's optimizer once to the rows touched anywhere: the same update on every copy,
the one the unsharded collection makes for the whole global batch (Adagrad and lazy Adam included).

Example::

    dp = DataParallelSharding(tables, layout, plan, rank, world, group, make_collection)
    out = dp(lengths, values, batch_size)   # [B, dims of dp.slots]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pipeline.distributed.comm import all_reduce, trigger
from pipeline.distributed.embedding_sharding import MakeCollection, local_tables, slot_key
from pipeline.distributed.jagged import exclusive_cumsum, segment_sums
from pipeline.distributed.types import ShardingPlan, ShardingType
from pipeline.modules.embedding import EmbeddingOptimizerConfig, TableConfig, TableLayout, resolve_backend


class DataParallelSharding(nn.Module):
    """The data-parallel tables of a plan, replicated on every rank."""

    sharding_type = ShardingType.DATA_PARALLEL

    def __init__(self, tables: Sequence[TableConfig], layout: TableLayout, plan: ShardingPlan, rank: int, world: int,
                 group, make_collection: MakeCollection) -> None:
        super().__init__()
        self.rank, self.world, self.group = rank, world, group
        self.table_ids = [t for t in range(len(tables)) if plan[tables[t].name].sharding_type == self.sharding_type]
        self.slots = [s for s in range(layout.num_slots) if layout.slot_table[s] in self.table_ids]
        self.input_slots = self.slots
        self.local_features = [slot_key(layout, s) for s in self.slots]
        self.local = make_collection(local_tables(tables, layout, self.table_ids), self.local_features) \
            if self.table_ids else None

    def forward(self, lengths: torch.Tensor, values: torch.Tensor, batch_size: int) -> torch.Tensor:
        offsets = exclusive_cumsum(lengths)
        if torch.is_grad_enabled() and self.training:
            return _DataParallelLookup.apply(trigger(values.device), self, values, offsets, batch_size)
        ec = self.local
        return ec.backend.forward(ec.weights, ec.layout, values, offsets, batch_size)

    def synced_update(self, values: torch.Tensor, offsets: torch.Tensor, batch_size: int, grad: torch.Tensor) -> None:
        """Sum the row gradients of all ranks and apply the optimizer to every touched row, on every rank."""
        ec = self.local
        layout = ec.layout
        device = ec.weights.device
        row_grad = torch.zeros(layout.total_elements, dtype=torch.float32, device=device)
        if batch_size:
            # SGD with lr = -1 on a zero buffer leaves the summed row gradients in it.
            fp32 = resolve_backend(ec.backend_name, device, torch.float32)
            fp32.backward_update(row_grad, {}, layout, values, offsets, batch_size, grad,
                                 EmbeddingOptimizerConfig("sgd", lr=-1.0), -1.0, 1)
        touched = torch.zeros(layout.total_rows, dtype=torch.float32, device=device)
        if values.numel():
            tensors = layout.tensors(device)
            nnz = segment_sums(offsets[1:] - offsets[:-1], layout.num_slots)
            base = tensors["row_offsets"][tensors["slot_table"]]
            touched[torch.repeat_interleave(base, nnz, output_size=values.numel()) + values] = 1.0
        both = all_reduce(torch.cat([row_grad, touched]), self.group)
        row_grad, touched = both[: layout.total_elements], both[layout.total_elements :]
        ec.step += 1
        first_slot = {}
        for s, t in enumerate(layout.slot_table):
            first_slot.setdefault(t, s)
        rows = {}
        for t, s in first_slot.items():
            lo = layout.row_offsets[t]
            rows[s] = touched[lo : lo + layout.rows[t]].nonzero().squeeze(1)
        b = max((r.numel() for r in rows.values()), default=0)
        if b == 0:
            return
        lengths = torch.zeros(layout.num_slots, b, dtype=torch.int64, device=device)
        grad_rows = torch.zeros(b, layout.total_dim, dtype=torch.float32, device=device)
        for s, r in rows.items():
            t = layout.slot_table[s]
            n = r.numel()
            lengths[s, :n] = 1
            start = layout.weights_offsets[t]
            table_grad = row_grad[start : start + layout.rows[t] * layout.dims[t]].view(layout.rows[t], layout.dims[t])
            grad_rows[:n, layout.output_offsets[s] : layout.output_offsets[s + 1]] = table_grad.index_select(0, r)
        indices = torch.cat([rows[s] for s in sorted(rows)])
        ec.backend.backward_update(ec.weights, ec.optimizer_state(), layout, indices, exclusive_cumsum(lengths.view(-1)),
                                   b, grad_rows, ec.optimizer, ec.lr, int(ec.step))


class _DataParallelLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, trig, sharding, values, offsets, batch_size):
        ctx.sharding, ctx.batch_size = sharding, batch_size
        ctx.save_for_backward(values, offsets)
        ec = sharding.local
        return ec.backend.forward(ec.weights, ec.layout, values, offsets, batch_size)

    @staticmethod
    def backward(ctx, grad):
        values, offsets = ctx.saved_tensors
        ctx.sharding.synced_update(values, offsets, ctx.batch_size, grad)
        return None, None, None, None, None
