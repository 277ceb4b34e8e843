"""The device cache of one host-memory table: which rows its slots hold, which to evict, the copies both ways.

A host-cached table (:mod:`pipeline.modules.cached_collection`) keeps every row and its optimizer state
in host memory, and ``slots`` of them, with their state, in a cache on the device. Before a batch is
looked up, :meth:`RowCache.prefetch` maps its row ids to slots:

1. the batch's distinct rows are found in the index (row -> slot);
2. each missing row takes a slot that neither this batch nor the training batch before it uses, the
   least recently used first (empty slots before any);
3. an evicted row that a training batch used since it came in (dirty) is written back to the host
   table with its state;
4. the missing rows and their state are copied in from the host table.

The lookup and the fused update then read and write the device tensors only, at the slots. Every
slot a training batch uses is dirty from then on. :meth:`RowCache.flush` writes the dirty rows back
(the host table is then whole); :meth:`RowCache.drop` forgets every row (after the host table was
written from elsewhere).

The training batch before is spared so that a prefetch may run one batch ahead, while that batch
still computes: a row it uses must not leave the cache before its update is done.

The index sits behind :class:`CacheIndex` (find, rows_of, assign, clear). :class:`SortedIndex` keeps the
held rows sorted and finds ids with ``torch.searchsorted``: fully associative (no set of slots can
overflow while others are free), one sort of the slots per batch with misses; a GPU hash table can
take its place.

Example::

    cache = RowCache("t_C3", slots=4096)
    slots = cache.prefetch(ids, host_views, device_views, training=True)   # ids -> slots of the cache
    cache.flush(host_views, device_views)                                  # the host table whole
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Protocol

import torch
from torch import nn

from pipeline.errors import UserError


class CacheTooSmall(UserError):
    """A batch needs more rows in a cache than it has slots to give (beside those the batch before holds)."""


class CacheIndex(Protocol):
    """Where the rows of a table sit in its cache's slots."""

    def find(self, rows: torch.Tensor) -> torch.Tensor:
        """The slot of each of ``rows``, -1 where the row is not held."""

    def rows_of(self, slots: torch.Tensor) -> torch.Tensor:
        """The row each of ``slots`` holds, -1 where it is empty."""

    def assign(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """``slots`` hold ``rows`` from now on (the rows they held are forgotten)."""

    def clear(self) -> None:
        """Every slot empty."""


class SortedIndex(nn.Module):
    """A fully associative index: the row of each slot, and the held rows sorted for ``searchsorted``."""

    def __init__(self, slots: int) -> None:
        super().__init__()
        self.register_buffer("slot_rows", torch.full((slots,), -1, dtype=torch.int64), persistent=False)
        self.register_buffer("sorted_rows", torch.empty(0, dtype=torch.int64), persistent=False)
        self.register_buffer("sorted_slots", torch.empty(0, dtype=torch.int64), persistent=False)
        self._sort()

    def _sort(self) -> None:
        self.sorted_rows, self.sorted_slots = torch.sort(self.slot_rows)

    def find(self, rows: torch.Tensor) -> torch.Tensor:
        at = torch.searchsorted(self.sorted_rows, rows).clamp_(max=self.sorted_rows.numel() - 1)
        return torch.where(self.sorted_rows[at] == rows, self.sorted_slots[at], -1)

    def rows_of(self, slots: torch.Tensor) -> torch.Tensor:
        return self.slot_rows[slots]

    def assign(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        self.slot_rows[slots] = rows
        self._sort()

    def clear(self) -> None:
        self.slot_rows.fill_(-1)
        self._sort()


@dataclass
class CacheStats:
    """What the training batches found: their distinct rows, those in the cache, and the rows evicted and
    written back to make room."""

    rows: int = 0
    hits: int = 0
    evictions: int = 0
    writebacks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.rows if self.rows else float("nan")

    def __add__(self, other: CacheStats) -> CacheStats:
        return CacheStats(*(a + b for a, b in zip(asdict(self).values(), asdict(other).values())))


class RowCache(nn.Module):
    """The device cache of table ``table``: ``slots`` rows, least recently used out, dirty rows written back.

    It holds the bookkeeping only (index, recency, dirty and spared slots, on the cache's device); the
    rows themselves come as views, keyed alike (``weight`` and each optimizer state): ``host``, the
    table's ``[rows, ...]`` tensors in host memory, and ``cache``, the ``[slots, ...]`` device ones.
    """

    def __init__(self, table: str, slots: int, index: CacheIndex | None = None) -> None:
        super().__init__()
        if slots < 1:
            raise ValueError(f"table {table}: a cache needs at least one slot, got {slots}")
        self.table, self.slots = table, slots
        self.index = index if index is not None else SortedIndex(slots)
        self.register_buffer("last_used", torch.full((slots,), -1, dtype=torch.int64), persistent=False)
        self.register_buffer("dirty", torch.zeros(slots, dtype=torch.bool), persistent=False)
        self.register_buffer("spared", torch.zeros(slots, dtype=torch.bool), persistent=False)
        self.clock = 0
        self.stats = CacheStats()

    def prefetch(self, ids: torch.Tensor, host: dict[str, torch.Tensor], cache: dict[str, torch.Tensor],
                 training: bool) -> torch.Tensor:
        """The slot of each of ``ids`` (rows of the table, on the cache's device), every one of their rows in
        the cache. ``training``: the slots turn dirty, and the next prefetch spares them.

        Raises :class:`CacheTooSmall` before changing anything when the missing rows outnumber the slots
        this batch and the training batch before it leave free."""
        rows, inverse = torch.unique(ids, return_inverse=True)
        slots = self.index.find(rows)
        miss = slots < 0
        used = torch.zeros(self.slots, dtype=torch.int64, device=slots.device)
        used.index_put_((slots.clamp(min=0),), (~miss).long(), accumulate=True)
        busy = self.spared | (used > 0)
        missing, free = torch.stack([miss.sum(), (~busy).sum()]).tolist()
        if missing > free:
            raise CacheTooSmall(
                f"table {self.table}: a batch needs {missing:,} rows copied into its device cache of {self.slots:,} "
                f"rows, but only {free:,} slots hold none of the batch's {rows.numel():,} distinct rows and none the "
                "training batch before it uses: give the table a larger cache")
        if missing:
            victims = torch.sort(self.last_used.masked_fill(busy, torch.iinfo(torch.int64).max), stable=True).indices
            victims = victims[:missing]
            self._evict(victims, host, cache, training)
            new_rows = rows[miss]
            host_rows = new_rows.cpu()
            for key, view in cache.items():
                view[victims] = host[key][host_rows].to(view.device, non_blocking=True)
            self.index.assign(victims, new_rows)
            slots = slots.masked_scatter(miss, victims)
        self.clock += 1
        self.last_used[slots] = self.clock
        if training:
            self.dirty[slots] = True
            self.spared.zero_()
            self.spared[slots] = True
            self.stats.rows += rows.numel()
            self.stats.hits += rows.numel() - missing
        return slots[inverse]

    def _evict(self, victims: torch.Tensor, host: dict[str, torch.Tensor], cache: dict[str, torch.Tensor],
               training: bool) -> None:
        """Write the dirty rows among ``victims`` back to the host table; every victim is clean after."""
        held, dirty = (self.index.rows_of(victims) >= 0).sum(), self.dirty[victims].sum()
        evicted, written = torch.stack([held, dirty]).tolist()
        if written:
            self._write_back(victims[self.dirty[victims]], host, cache)
        if training:
            self.stats.evictions += evicted
            self.stats.writebacks += written

    def _write_back(self, slots: torch.Tensor, host: dict[str, torch.Tensor], cache: dict[str, torch.Tensor]) -> None:
        rows = self.index.rows_of(slots).cpu()
        for key, view in cache.items():
            host[key][rows] = view[slots].to(host[key].device)
        self.dirty[slots] = False

    def flush(self, host: dict[str, torch.Tensor], cache: dict[str, torch.Tensor]) -> None:
        """Write every dirty row back to the host table (the rows stay in the cache, clean)."""
        slots = self.dirty.nonzero().squeeze(1)
        if slots.numel():
            self._write_back(slots, host, cache)

    def drop(self) -> None:
        """Forget every row held, without writing any back."""
        self.index.clear()
        self.last_used.fill_(-1)
        self.dirty.zero_()
        self.spared.zero_()

    def extra_repr(self) -> str:
        return f"table={self.table}, slots={self.slots}"
