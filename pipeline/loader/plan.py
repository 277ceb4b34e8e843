"""Which rows a rank reads in an epoch, in which order, and how they are cut into batches.

Everything here is decided from parquet metadata alone (row counts per row group), so a rank
can jump to any batch of any epoch without reading the rows before it: that is what makes
resuming mid-epoch exact and free.

The order of an epoch:

1. the row groups of all files, in file order, or shuffled by ``(seed, epoch)`` (the same on
   every rank);
2. that sequence of ``N`` rows is cut into ``world_size`` contiguous shards of ``S`` rows each:
   ``S = ceil(N / world_size)`` when ``drop_last`` is false, the last shards padded with rows
   taken again from the start of the sequence (fewer than ``world_size`` rows in all, always at
   the end of the shard); ``S = N // world_size`` when it is true (the remainder is dropped);
3. a shard is read in windows of ``window_rows`` rows (a multiple of the batch size); with
   shuffling, the real rows of each window are permuted by ``(seed, epoch, rank, window)``: they
   are sorted by a keyed hash of their position (:func:`window_order`), integer arithmetic that
   gives the same permutation computed with numpy on the host or with torch on a GPU;
4. batches are cut in order from the windows: ``ceil(S / B)`` of them, the last one short, or
   ``S // B`` with ``drop_last`` (the last short batch dropped).

Example::

    groups = [RowGroup(file=0, index=i, first_row=0, rows=100) for i in range(3)]
    shard = plan_shard(groups, rank=1, world_size=2, batch_size=32, drop_last=False)
    shard.rows, shard.batches, shard.padding   # (150, 5, 0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class RowGroup:
    """One parquet row group: ``file`` indexes the loader's file list."""

    file: int
    index: int
    first_row: int
    """Row number of its first row within its file (for error messages)."""
    rows: int


@dataclass(frozen=True)
class Segment:
    """Rows ``[start, stop)`` of one row group; ``padding`` rows repeat rows of another shard."""

    group: RowGroup
    start: int
    stop: int
    padding: bool = False

    @property
    def rows(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Shard:
    """What one rank reads in one epoch: its segments in order, and how many batches they give."""

    segments: tuple[Segment, ...]
    rows: int
    padding: int
    batches: int


@dataclass(frozen=True)
class Window:
    """Rows ``[start, stop)`` of a shard, read and shuffled together; batches ``first_batch`` onwards."""

    index: int
    start: int
    stop: int
    first_batch: int
    batch_bounds: tuple[tuple[int, int], ...]
    """Each batch's rows as ``[begin, end)`` offsets inside the window."""


def group_order(groups: list[RowGroup], shuffle: bool, seed: int, epoch: int) -> list[RowGroup]:
    """The epoch's row-group order: file order, or a permutation seeded by ``(seed, epoch)``."""
    if not shuffle:
        return list(groups)
    perm = np.random.default_rng([seed, epoch]).permutation(len(groups))
    return [groups[i] for i in perm]


def shard_rows(total: int, world_size: int, drop_last: bool) -> int:
    """Rows per rank: every rank gets the same number."""
    return total // world_size if drop_last else -(-total // world_size)


def plan_shard(groups: list[RowGroup], rank: int, world_size: int, batch_size: int, drop_last: bool) -> Shard:
    """Rank ``rank``'s contiguous part of ``groups`` (already in epoch order)."""
    total = sum(g.rows for g in groups)
    size = shard_rows(total, world_size, drop_last)
    begin, end = rank * size, (rank + 1) * size
    segments = _segments(groups, begin, min(end, total))
    padding = max(0, end - max(begin, total))
    position = max(begin, total)
    while position < end:
        # Padding wraps around to the start of the sequence (more than once only when N < world_size).
        lo = position % total
        hi = min(total, lo + end - position)
        segments += [Segment(s.group, s.start, s.stop, padding=True) for s in _segments(groups, lo, hi)]
        position += hi - lo
    batches = size // batch_size if drop_last else math.ceil(size / batch_size)
    return Shard(tuple(segments), size, padding, batches)


def windows(shard: Shard, window_rows: int, batch_size: int, start_batch: int = 0) -> list[Window]:
    """The shard's windows from the one holding batch ``start_batch``, each with its batch bounds."""
    if window_rows % batch_size:
        raise ValueError(f"window_rows ({window_rows}) must be a multiple of batch_size ({batch_size})")
    per_window = window_rows // batch_size
    out = []
    for index in range(start_batch // per_window, math.ceil(shard.rows / window_rows)):
        start, stop = index * window_rows, min((index + 1) * window_rows, shard.rows)
        first = max(index * per_window, start_batch)
        last = min((index + 1) * per_window, shard.batches)
        bounds = tuple(
            (k * batch_size - start, min((k + 1) * batch_size, shard.rows) - start) for k in range(first, last)
        )
        if bounds:
            out.append(Window(index, start, stop, first, bounds))
    return out


def window_order(
    rows: int, real_rows: int, shuffle: bool, seed: int, epoch: int, rank: int, index: int,
    device: torch.device | str = "cpu",
) -> np.ndarray | torch.Tensor | None:
    """The permutation of a window's rows (``None``: keep the order); padding rows stay last.

    int64 positions: a numpy array for the CPU, a tensor made on ``device`` (no host work but a
    few kernel launches) otherwise. The real rows are sorted by ``hash(position)``, a bijection of
    32-bit integers keyed by ``(seed, epoch, rank, index)``: the keys are distinct, so the sorted
    order is unique, whatever sort and device computed it.
    """
    if not shuffle:
        return None
    keys = np.random.SeedSequence([seed, epoch, rank, index]).generate_state(ROUNDS)
    device = torch.device(device)
    if device.type == "cpu":
        x = np.arange(real_rows, dtype=np.int64)
        tail = np.arange(real_rows, rows, dtype=np.int64)
    else:
        x = torch.arange(real_rows, dtype=torch.int64, device=device)
        tail = torch.arange(real_rows, rows, dtype=torch.int64, device=device)
    for key in keys:
        x = _hash32(x ^ int(key))
    perm = x.astype(np.uint32).argsort() if device.type == "cpu" else x.argsort()
    if real_rows == rows:
        return perm
    return np.concatenate([perm, tail]) if device.type == "cpu" else torch.cat([perm, tail])


ROUNDS = 3
"""Keyed rounds of the position hash of :func:`window_order`."""


def _hash32(x):
    """A bijection of 32-bit integers held in int64 (numpy or torch): lowbias32 (xorshift-multiply)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _mul32(x, c: int):
    """``x * c mod 2**32`` for ``0 <= x < 2**32``, in 16-bit halves so that no int64 product overflows."""
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & 0xFFFFFFFF


def window_segments(shard: Shard, start: int, stop: int) -> list[Segment]:
    """The shard's segments covering its rows ``[start, stop)``, the first and last cut to fit."""
    out, position = [], 0
    for seg in shard.segments:
        lo, hi = max(start, position), min(stop, position + seg.rows)
        if lo < hi:
            begin = seg.start + lo - position
            out.append(Segment(seg.group, begin, begin + hi - lo, seg.padding))
        position += seg.rows
        if position >= stop:
            break
    return out


def window_parts(segments: list[Segment], count: int) -> list[list[Segment]]:
    """A window's segments as up to ``count`` consecutive runs of about equal rows, for reader threads to read side
    by side; cut only between segments (a row group is decoded whole however few of its rows are read)."""
    total = sum(s.rows for s in segments)
    runs: list[list[Segment]] = []
    current: list[Segment] = []
    done = 0
    for seg in segments:
        current.append(seg)
        done += seg.rows
        if len(runs) < count - 1 and done * count >= total * (len(runs) + 1):
            runs.append(current)
            current = []
    return runs + [current] if current else runs


def _segments(groups: list[RowGroup], lo: int, hi: int) -> list[Segment]:
    """Segments covering positions ``[lo, hi)`` of the concatenated row groups."""
    out, position = [], 0
    for g in groups:
        a, b = max(lo, position), min(hi, position + g.rows)
        if a < b:
            out.append(Segment(g, a - position, b - position))
        position += g.rows
        if position >= hi:
            break
    return out
