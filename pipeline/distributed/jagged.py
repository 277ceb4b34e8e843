"""Vectorized reordering of jagged data, the bookkeeping around every all-to-all.

Ids and bag lengths travel between ranks grouped by destination; each side regroups them into the
slot-major order the embedding backends read. These helpers do it with a handful of tensor ops (no
Python loop over bags or ids), on any device.

Example::

    data = torch.tensor([1, 2, 3, 4, 5, 6])
    permute_segments(data, torch.tensor([2, 1, 3]), torch.tensor([2, 0, 1]))   # [4, 5, 6, 1, 2, 3]
"""

from __future__ import annotations

import torch


def exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(x.numel() + 1, dtype=torch.int64, device=x.device)
    torch.cumsum(x, 0, out=out[1:])
    return out


def permute_segments(data: torch.Tensor, seg_lengths: torch.Tensor, order: torch.Tensor,
                     total: int | None = None) -> torch.Tensor:
    """``data`` is consecutive segments of ``seg_lengths``; return them in the order ``order``.

    ``total`` (the output length, when known) saves a device-to-host sync.
    """
    if order.numel() == 0:
        return data[:0]
    starts = exclusive_cumsum(seg_lengths)[:-1]
    new_lengths = seg_lengths[order]
    if total is None:
        total = int(new_lengths.sum())
    new_starts = exclusive_cumsum(new_lengths)[:-1]
    shift = torch.repeat_interleave(starts[order] - new_starts, new_lengths, output_size=total)
    return data[torch.arange(total, device=data.device) + shift]


def segment_sums(lengths: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Sums of ``lengths`` over ``num_segments`` equal consecutive blocks (e.g. nnz per slot)."""
    if num_segments == 0:
        return lengths.new_zeros(0)
    return lengths.view(num_segments, -1).sum(1) if lengths.numel() else lengths.new_zeros(num_segments)


def source_major_to_slot_major(lengths: torch.Tensor, values: torch.Tensor, num_slots: int,
                               batch_sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Regroup bags received from each source rank into one slot-major batch.

    In: for each source ``s`` (in order) ``num_slots * batch_sizes[s]`` lengths, slot-major, followed
    (in ``values``) by that source's ids. Out: lengths and ids slot-major over the concatenated batch
    (samples of source 0, then source 1, ...), i.e. what an EmbeddingCollection reads.
    """
    w = len(batch_sizes)
    if w == 1 or num_slots == 0:
        return lengths, values
    device = lengths.device
    bs = torch.tensor(batch_sizes, dtype=torch.int64, device=device)
    seg_len = bs.repeat_interleave(num_slots)  # (source, slot) blocks of lengths
    order = torch.arange(w * num_slots, device=device).view(w, num_slots).t().reshape(-1)
    new_lengths = permute_segments(lengths, seg_len, order, total=lengths.numel())
    bounds = exclusive_cumsum(seg_len)
    seg_nnz = exclusive_cumsum(lengths)[bounds]
    seg_nnz = seg_nnz[1:] - seg_nnz[:-1]
    new_values = permute_segments(values, seg_nnz, order, total=values.numel())
    return new_lengths, new_values
