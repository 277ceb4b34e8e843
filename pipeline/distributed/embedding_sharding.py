"""The base of the sharding strategies, and the id and pooled-vector exchanges they share.

A strategy (``tw_sharding``, ``rw_sharding``, ``dp_sharding``) serves the *slots* (a slot is a
(table, feature) pair, see :mod:`pipeline.modules.collection`) of the tables the plan gives its
sharding type. It serves a batch in three calls, torchrec's split, each returning an
:class:`~pipeline.distributed.types.Awaitable` so that a caller can overlap the exchanges with
other work:

1. ``input_dist``: picks its slots' bags out of the key-major batch and sends each bag (or each id)
   to the rank holding its rows (``exchange_bags``): a tiny all-to-all of (batch size, id count) per
   destination, whose first ``wait()`` brings the counts to the host and launches one all-to-all
   of each destination's bag lengths and ids together; the second ``wait()`` gives the
   :class:`LocalBags`, slot-major over the samples of every source rank;
2. ``lookup``: the local :class:`~pipeline.modules.collection.EmbeddingCollection` pools them with
   whatever backend is registered (fused kernels on GPU); its fused optimizer updates its rows
   when the gradient comes back;
3. ``output_dist``: an all-to-all of each source's rows of the pooled output back to the source
   (``exchange_pooled``; autograd: the gradients travel the mirrored way); ``wait()`` gives blocks
   of columns ``[B, dims]``, ``block_slots`` saying which slots each holds, in order.

Example (what :class:`~pipeline.distributed.embedding.ShardedEmbeddingCollection` does)::

    bags = st.input_dist(values, lengths, nnz_by_key, batch_size, validate=True).wait().wait()
    blocks = st.output_dist(st.lookup(bags), bags).wait()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from pipeline.distributed.comm import AllToAllRows, all_to_all, exchange_counts, trigger
from pipeline.distributed.jagged import exclusive_cumsum, permute_segments, segment_sums, source_major_to_slot_major
from pipeline.distributed.types import Awaitable, ShardingPlan, ShardingType
from pipeline.errors import BadInputError
from pipeline.kernels.embedding import TablePacking
from pipeline.modules.collection import EmbeddingCollection
from pipeline.modules.configs import TableConfig
from pipeline.sparse import KeyedJaggedTensor

MakeCollection = Callable[[Sequence[TableConfig], Sequence[str]], EmbeddingCollection]
Received = tuple[torch.Tensor, torch.Tensor, list[int]]  # lengths and ids, slot-major; samples per source


def slot_key(packing: TablePacking, slot: int) -> str:
    """The feature name a slot goes by inside a local collection: ``feature@table`` (unique per slot)."""
    return f"{packing.slot_features[slot]}@{packing.table_names[packing.slot_table[slot]]}"


def local_tables(tables: Sequence[TableConfig], packing: TablePacking, table_ids: Sequence[int],
                 rows: dict[int, int] | None = None, pooling: str | None = None) -> list[TableConfig]:
    """Local copies of ``tables[table_ids]`` serving their slot keys, with ``rows`` / ``pooling`` overridden (a
    dynamic table's part keeps the whole table's init scale, since its new rows start as the whole table's do)."""
    out = []
    for t in table_ids:
        keys = [slot_key(packing, s) for s in range(packing.num_slots) if packing.slot_table[s] == t]
        table = tables[t]
        init_scale = table.init_scale if table.init_scale is not None or not table.dynamic else table.rows ** -0.5
        out.append(replace(table, rows=(rows or {}).get(t, table.rows), features=keys,
                           pooling=pooling or table.pooling, init_scale=init_scale))
    return out


@dataclass
class LocalBags:
    """One batch's bags as a strategy's lookup and output dist see them."""

    features: KeyedJaggedTensor
    """The local collection's slot keys, over the samples of every source rank (source 0's first)."""
    batch_sizes: list[int]
    """Samples from each source rank: the output dist sends each its rows back."""
    batch_size: int
    """Samples of this rank's own batch: the rows of every output block."""
    own_lengths: torch.Tensor
    """This rank's own bag lengths of the strategy's slots, slot-major (``slots * batch_size``)."""


class EmbeddingSharding(nn.Module):
    """One sharding type's part of a sharded collection: its ``slots``, its local tables, three calls.

    Subclasses set ``sharding_type``, ``table_ids`` (the tables with a part on this rank),
    ``local`` (their collection, or None), ``local_features`` (its keys), ``block_slots``, and
    implement ``send_bags``, ``lookup`` and ``output_dist``.
    """

    sharding_type: ShardingType

    def __init__(self, packing: TablePacking, feature_names: Sequence[str], slots: list[int], rank: int, world: int,
                 group, comm_dtype: torch.dtype) -> None:
        super().__init__()
        self.packing, self.slots = packing, slots
        self.rank, self.world, self.group, self.comm_dtype = rank, world, group, comm_dtype
        self.num_keys = len(feature_names)
        keys = [list(feature_names).index(packing.slot_features[s]) for s in slots]
        # Each key exactly once: the ids keep their count, so selecting them needs no device-to-host sync.
        self.keys_once = sorted(keys) == list(range(self.num_keys))
        self.register_buffer("slot_keys", torch.tensor(keys, dtype=torch.int64), persistent=False)
        self.register_buffer("slot_rows", torch.tensor([packing.rows[packing.slot_table[s]] for s in slots],
                                                       dtype=torch.int64), persistent=False)
        self.dynamic_slots: list[int] = []
        """Positions in ``slots`` of dynamic tables' slots (a subclass sets them): any int64 id, not checked."""

    @classmethod
    def tables_of_type(cls, tables: Sequence[TableConfig], plan: ShardingPlan) -> list[int]:
        return [t for t in range(len(tables)) if plan[tables[t].name].sharding_type == cls.sharding_type]

    def input_dist(self, values: torch.Tensor, lengths: torch.Tensor, nnz_by_key: torch.Tensor, batch_size: int,
                   validate: bool) -> Awaitable[Awaitable[LocalBags]]:
        """This strategy's bags out of the key-major batch (``values``, ``lengths``), sent to their rows' ranks."""
        lengths = lengths.view(self.num_keys, batch_size)[self.slot_keys].reshape(-1)
        values = permute_segments(values, nnz_by_key, self.slot_keys,
                                  total=values.numel() if self.keys_once else None)
        if validate and values.numel():
            self.check_ids(values, segment_sums(lengths, len(self.slots)))

        def bags(got: Received) -> LocalBags:
            got_lengths, got_values, batch_sizes = got
            return LocalBags(KeyedJaggedTensor(self.local_features, got_values, got_lengths), batch_sizes,
                             batch_size, lengths)

        return self.send_bags(lengths, values, batch_size).then(lambda ids: ids.then(bags))

    def send_bags(self, lengths: torch.Tensor, values: torch.Tensor,
                  batch_size: int) -> Awaitable[Awaitable[Received]]:
        """The bags of ``slots`` (slot-major) to the ranks that look them up."""
        raise NotImplementedError

    def lookup(self, bags: LocalBags) -> torch.Tensor:
        """``[sum of bags.batch_sizes, dims of the local slots]``: the local collection's pools."""
        raise NotImplementedError

    def output_dist(self, pooled: torch.Tensor, bags: LocalBags) -> Awaitable[list[torch.Tensor]]:
        """The pooled rows back to their source ranks: one ``[bags.batch_size, dims]`` block per ``block_slots``."""
        raise NotImplementedError

    def check_ids(self, values: torch.Tensor, nnz: torch.Tensor) -> None:
        limit = torch.repeat_interleave(self.slot_rows, nnz, output_size=values.numel())
        bad = (values < 0) | (values >= limit)
        if self.dynamic_slots:
            checked = torch.ones(len(self.slots), dtype=torch.bool, device=values.device)
            checked[self.dynamic_slots] = False
            bad &= torch.repeat_interleave(checked, nnz, output_size=values.numel())
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            k = int(torch.searchsorted(exclusive_cumsum(nnz)[1:], torch.tensor(i, device=nnz.device), right=True))
            s = self.slots[k]
            t = self.packing.slot_table[s]
            raise BadInputError(f"feature {self.packing.slot_features[s]}: id {int(values[i])} is outside table "
                                f"{self.packing.table_names[t]} (expected 0 <= id < {self.packing.rows[t]})")


def exchange_bags(lengths: torch.Tensor, values: torch.Tensor, nnz_by_dest: torch.Tensor, slots_by_dest: list[int],
                  recv_slots: int, batch_size: int, group) -> Awaitable[Awaitable[Received]]:
    """Send each destination its bags; in the end, the received bags, slot-major, and each source's batch size.

    ``lengths`` / ``values`` are destination-major: destination ``q`` gets the next
    ``slots_by_dest[q] * batch_size`` lengths and the next ``nnz_by_dest[q]`` ids. The first
    ``wait()`` reads the counts on the host (the split sizes) and launches the bags' all-to-all.
    """
    w = len(slots_by_dest)
    send = torch.stack([torch.full_like(nnz_by_dest, batch_size), nnz_by_dest], 1)

    def send_bags(recv: torch.Tensor) -> Awaitable[Received]:
        host = torch.cat([send, recv]).tolist()
        nnz_send = [host[q][1] for q in range(w)]
        batch_sizes = [host[w + s][0] for s in range(w)]
        nnz_recv = [host[w + s][1] for s in range(w)]
        pieces, lo, vo = [], 0, 0
        for q in range(w):
            n = slots_by_dest[q] * batch_size
            pieces += [lengths[lo : lo + n], values[vo : vo + nnz_send[q]]]
            lo, vo = lo + n, vo + nnz_send[q]
        send_splits = [slots_by_dest[q] * batch_size + nnz_send[q] for q in range(w)]
        recv_splits = [recv_slots * batch_sizes[s] + nnz_recv[s] for s in range(w)]

        def regroup(out: torch.Tensor) -> Received:
            got_lengths, got_values, off = [], [], 0
            for s in range(w):
                n = recv_slots * batch_sizes[s]
                got_lengths.append(out[off : off + n])
                got_values.append(out[off + n : off + n + nnz_recv[s]])
                off += n + nnz_recv[s]
            new_lengths, new_values = source_major_to_slot_major(torch.cat(got_lengths), torch.cat(got_values),
                                                                 recv_slots, batch_sizes)
            return new_lengths, new_values, batch_sizes

        out = values.new_empty(sum(recv_splits))
        return all_to_all(out, torch.cat(pieces), recv_splits, send_splits, group).then(regroup)

    return exchange_counts(send, group).then(send_bags)


def exchange_pooled(pooled: torch.Tensor, batch_sizes: list[int], dims_by_owner: list[int], batch_size: int,
                    group, training: bool, comm_dtype: torch.dtype = torch.float32) -> Awaitable[list[torch.Tensor]]:
    """Send each source its rows of ``pooled``; in the end, one ``[batch_size, dim]`` block per owner rank.

    ``comm_dtype`` (float32, or bfloat16 to halve the bytes) is what travels, both ways, and the
    blocks' dtype: the caller converts (in the copy it makes anyway).
    """
    send = [b * pooled.shape[1] for b in batch_sizes]
    recv = [batch_size * d for d in dims_by_owner]
    trig = trigger(pooled.device) if training else torch.empty(0, device=pooled.device)
    pending: list[Awaitable[torch.Tensor]] = []
    flat = AllToAllRows.apply(trig, pooled.reshape(-1).to(comm_dtype), send, recv, group, pending)
    return pending[0].then(lambda _: [block.view(batch_size, d) for block, d in zip(flat.split(recv), dims_by_owner)])
