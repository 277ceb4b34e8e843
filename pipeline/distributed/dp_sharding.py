"""Data-parallel sharding: small tables copied on every rank, kept identical.

Lookups stay local. In backward each rank turns its gradient into per-row gradients (through the
backend's own SGD update applied to a zero buffer, so the fused kernels do the work on GPU), the
row gradients and the set of touched rows are summed over ranks in one all-reduce, and every rank
applies the collection's optimizer once to the rows touched anywhere: the same update on every copy,
the one the unsharded collection makes for the whole global batch (Adagrad and lazy Adam included).

Example::

    dp = DataParallelSharding(tables, packing, feature_names, plan, rank, world, group, make_collection)
    bags = dp.input_dist(values, lengths, nnz_by_key, batch_size, validate=True).wait().wait()   # no exchange
    [out] = dp.output_dist(dp.lookup(bags), bags).wait()   # one block: [B, dims of dp.slots]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipeline.distributed.comm import all_reduce, trigger
from pipeline.distributed.embedding_sharding import (
    EmbeddingSharding,
    LocalBags,
    MakeCollection,
    Received,
    local_tables,
    slot_key,
)
from pipeline.distributed.jagged import exclusive_cumsum, segment_sums
from pipeline.distributed.types import Awaitable, NoWait, ShardingPlan, ShardingType
from pipeline.kernels.embedding import TablePacking
from pipeline.modules.backends import resolve_backend
from pipeline.modules.configs import EmbeddingOptimizerConfig, TableConfig


class DataParallelSharding(EmbeddingSharding):
    """The data-parallel tables of a plan, replicated on every rank."""

    sharding_type = ShardingType.DATA_PARALLEL

    def __init__(self, tables: Sequence[TableConfig], packing: TablePacking, feature_names: Sequence[str],
                 plan: ShardingPlan, rank: int, world: int, group, make_collection: MakeCollection,
                 comm_dtype: torch.dtype = torch.float32) -> None:
        table_ids = self.tables_of_type(tables, plan)
        slots = [s for s in range(packing.num_slots) if packing.slot_table[s] in table_ids]
        super().__init__(packing, feature_names, slots, rank, world, group, comm_dtype)
        self.table_ids = table_ids
        self.block_slots = [self.slots]  # the output dist returns one block, [B, dims of all slots]
        self.local_features = [slot_key(packing, s) for s in self.slots]
        self.local = make_collection(local_tables(tables, packing, self.table_ids), self.local_features)
        self._fp32_backend, self._fp32_key = None, None  # the backend that sums row gradients in float32
        self._index: dict[str, torch.Tensor] = {}
        self._index_device: torch.device | None = None

    def send_bags(self, lengths: torch.Tensor, values: torch.Tensor,
                  batch_size: int) -> Awaitable[Awaitable[Received]]:
        return NoWait(NoWait((lengths, values, [batch_size])))  # every rank looks up its own batch

    def lookup(self, bags: LocalBags) -> torch.Tensor:
        values, offsets, b = bags.features.values, bags.features.offsets(), bags.batch_size
        if torch.is_grad_enabled() and self.training:
            return _DataParallelLookup.apply(trigger(values.device), self, values, offsets, b)
        ec = self.local
        return ec.backend.forward(ec.weights, ec.packing, values, offsets, b)

    def output_dist(self, pooled: torch.Tensor, bags: LocalBags) -> Awaitable[list[torch.Tensor]]:
        return NoWait([pooled])

    def synced_update(self, values: torch.Tensor, offsets: torch.Tensor, batch_size: int, grad: torch.Tensor) -> None:
        """Sum the row gradients of all ranks and apply the optimizer to every touched row, on every rank."""
        ec = self.local
        packing = ec.packing
        device = ec.weights.device
        row_grad = torch.zeros(packing.total_elements, dtype=torch.float32, device=device)
        if batch_size:
            # SGD with lr = -1 on a zero buffer leaves the summed row gradients in it.
            key = (ec.backend_name, str(device))
            if self._fp32_key != key:
                self._fp32_backend, self._fp32_key = resolve_backend(ec.backend_name, device, torch.float32), key
            self._fp32_backend.backward_update(row_grad, {}, packing, values, offsets, batch_size, grad,
                                 EmbeddingOptimizerConfig("sgd", lr=-1.0), -1.0, 1)
        touched = torch.zeros(packing.total_rows, dtype=torch.float32, device=device)
        if values.numel():
            tensors = packing.tensors(device)
            nnz = segment_sums(offsets[1:] - offsets[:-1], packing.num_slots)
            base = tensors["row_offsets"][tensors["slot_table"]]
            touched.index_fill_(0, torch.repeat_interleave(base, nnz, output_size=values.numel()) + values, 1.0)
        both = all_reduce(torch.cat([row_grad, touched]), self.group, async_op=False).wait()
        row_grad, touched = both[: packing.total_elements], both[packing.total_elements :]
        ec.step += 1
        rows = touched.nonzero().squeeze(1)  # storage rows touched on any rank, ascending
        n = rows.numel()
        if n == 0:
            return
        idx = self._storage_tables(device)
        t = idx["table_by_start"][torch.searchsorted(idx["starts"], rows, right=True) - 1]
        local = rows - idx["row_offsets"][t]
        slot = idx["first_slot"][t]
        dims = idx["dims"][t]
        # One bag per touched row, in the first slot of its table: bags slot-major, rows ascending.
        lengths = torch.zeros(packing.num_slots, n, dtype=torch.int64, device=device)
        lengths.view(-1).index_fill_(0, slot * n + torch.arange(n, device=device), 1)
        order = torch.sort(slot, stable=True).indices
        total = int(dims.sum())
        bag = torch.repeat_interleave(torch.arange(n, device=device), dims, output_size=total)
        within = torch.arange(total, device=device) - torch.repeat_interleave(exclusive_cumsum(dims)[:-1], dims,
                                                                              output_size=total)
        src = idx["weights_offsets"][t][bag] + local[bag] * dims[bag] + within
        dst = bag * packing.total_dim + idx["output_offsets"][slot][bag] + within
        grad_rows = torch.zeros(n * packing.total_dim, dtype=torch.float32, device=device)
        grad_rows[dst] = row_grad[src]
        ec.backend.backward_update(ec.weights, ec.optimizer_state(), packing, local[order],
                                   exclusive_cumsum(lengths.view(-1)), n, grad_rows.view(n, packing.total_dim),
                                   ec.optimizer, ec.lr, int(ec.step))

    def _storage_tables(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Index tensors of the local packing: tables by storage position, each table's first slot."""
        if self._index_device != device:
            packing = self.local.packing
            by_start = sorted(range(len(packing.rows)), key=lambda t: packing.row_offsets[t])
            first_slot = [packing.slot_table.index(t) for t in range(len(packing.rows))]
            values = {"table_by_start": by_start, "starts": [packing.row_offsets[t] for t in by_start],
                      "row_offsets": packing.row_offsets, "first_slot": first_slot, "dims": packing.dims,
                      "weights_offsets": packing.weights_offsets, "output_offsets": packing.output_offsets[:-1]}
            self._index = {k: torch.tensor(v, dtype=torch.int64, device=device) for k, v in values.items()}
            self._index_device = device
        return self._index


class _DataParallelLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, trig, sharding, values, offsets, batch_size):
        ctx.sharding, ctx.batch_size = sharding, batch_size
        ctx.save_for_backward(values, offsets)
        ec = sharding.local
        return ec.backend.forward(ec.weights, ec.packing, values, offsets, batch_size)

    @staticmethod
    def backward(ctx, grad):
        values, offsets = ctx.saved_tensors
        # A column slice of the collection's gradient: kernels read it as one dense [B, dims] block.
        ctx.sharding.synced_update(values, offsets, ctx.batch_size, grad.contiguous())
        return None, None, None, None, None
