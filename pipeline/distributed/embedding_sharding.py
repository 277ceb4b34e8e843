"""What the sharding strategies share: local tables, the id exchange and the pooled-vector exchange.

A strategy (``tw_sharding``, ``rw_sharding``, ``dp_sharding``) serves some *slots* of the global
collection (a slot is a (table, feature) pair, see :mod:`pipeline.modules.collection`). It gets the
bags of its slots for the local batch, slot-major, and returns ``[B, sum of its slots' dims]`` with
its slots' columns in ``strategy.slots`` order. The model-parallel strategies (table-wise and
row-wise) move ids to the ranks owning the rows and pooled vectors back:

1. ``exchange_bags``: a tiny all-to-all of (batch size, id count) per destination, then one
   all-to-all carrying each destination's bag lengths and ids together; the receiver regroups what
   came from every source into one slot-major batch of ``sum of the sources' batch sizes`` samples.
2. the local :class:`~pipeline.modules.collection.EmbeddingCollection` pools that batch with whatever
   backend is registered (fused kernels on GPU), and its fused optimizer updates its rows when the
   gradient comes back;
3. ``exchange_pooled``: an all-to-all of each source's rows of the pooled output back to the source
   (autograd: the gradients travel the mirrored way).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pipeline.distributed.comm import AllToAllRows, all_to_all, exchange_counts, trigger
from pipeline.distributed.jagged import source_major_to_slot_major
from pipeline.kernels.embedding import TablePacking
from pipeline.modules.collection import EmbeddingCollection
from pipeline.modules.configs import TableConfig

MakeCollection = Callable[[Sequence[TableConfig], Sequence[str]], EmbeddingCollection]


def slot_key(layout: TablePacking, slot: int) -> str:
    """The feature name a slot goes by inside a local collection: ``feature@table`` (unique per slot)."""
    return f"{layout.slot_features[slot]}@{layout.table_names[layout.slot_table[slot]]}"


def local_tables(tables: Sequence[TableConfig], layout: TablePacking, table_ids: Sequence[int],
                 rows: dict[int, int] | None = None, pooling: str | None = None) -> list[TableConfig]:
    """Local copies of ``tables[table_ids]`` serving their slot keys, with ``rows`` / ``pooling`` overridden."""
    out = []
    for t in table_ids:
        keys = [slot_key(layout, s) for s in range(layout.num_slots) if layout.slot_table[s] == t]
        table = tables[t]
        out.append(TableConfig(table.name, (rows or {}).get(t, table.rows), table.dim, keys,
                               pooling or table.pooling))
    return out


def exchange_bags(lengths: torch.Tensor, values: torch.Tensor, nnz_by_dest: torch.Tensor, slots_by_dest: list[int],
                  recv_slots: int, batch_size: int, group) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Send each destination its bags; return the received bags, slot-major, and each source's batch size.

    ``lengths`` / ``values`` are destination-major: destination ``q`` gets the next
    ``slots_by_dest[q] * batch_size`` lengths and the next ``nnz_by_dest[q]`` ids.
    """
    w = len(slots_by_dest)
    send = torch.stack([torch.full_like(nnz_by_dest, batch_size), nnz_by_dest], 1)
    recv = exchange_counts(send, group)
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
    out = values.new_empty(sum(recv_splits))
    all_to_all(out, torch.cat(pieces), recv_splits, send_splits, group)
    got_lengths, got_values, off = [], [], 0
    for s in range(w):
        n = recv_slots * batch_sizes[s]
        got_lengths.append(out[off : off + n])
        got_values.append(out[off + n : off + n + nnz_recv[s]])
        off += n + nnz_recv[s]
    new_lengths, new_values = source_major_to_slot_major(torch.cat(got_lengths), torch.cat(got_values), recv_slots,
                                                         batch_sizes)
    return new_lengths, new_values, batch_sizes


def exchange_pooled(pooled: torch.Tensor, batch_sizes: list[int], dims_by_owner: list[int], batch_size: int,
                    group, training: bool, comm_dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Send each source its rows of ``pooled``; return one ``[batch_size, dim]`` block per owner rank.

    ``comm_dtype`` (float32, or bfloat16 to halve the bytes) is what travels, both ways, and the
    blocks' dtype: the caller converts (in the copy it makes anyway).
    """
    send = [b * pooled.shape[1] for b in batch_sizes]
    recv = [batch_size * d for d in dims_by_owner]
    trig = trigger(pooled.device) if training else torch.empty(0, device=pooled.device)
    flat = AllToAllRows.apply(trig, pooled.reshape(-1).to(comm_dtype), send, recv, group)
    return [block.view(batch_size, d) for block, d in zip(flat.split(recv), dims_by_owner)]
