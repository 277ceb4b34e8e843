"""The device caches of a collection's host-cached tables: which rows their slots hold, which rows to evict.

A host-cached table (:mod:`pipeline.modules.cached_collection`) keeps every row and its optimizer state
in host memory, and ``slots`` of them, with their state, in a cache on the device. :class:`RowCache`
keeps the books of every such table of a collection at once, on the device: a row is named by its
*global row* (its table's row offset in host memory plus its id), a slot by its position among all the
caches' slots (each table's slots one range, in the order of its rows). A batch goes through these
calls, none of which reads the device from the host:

1. :meth:`RowCache.place` (changes nothing): the batch's rows sorted, its distinct ones found in the
   index (row -> slot); each missing row given a slot of its table that neither this batch nor the
   training batch before it uses, first in the eviction order (empty slots before any); the slots
   among those whose row a training batch used since it came in (dirty), to be written back; and per
   table the counts (missing rows, free slots, distinct rows, evictions, write-backs);
2. :meth:`Placement.moves`: the rows to move, gathered at the front of arrays whose size the host knows
   without reading the device (the batch's), with where each table's part starts and ends on the device;
   or, with the totals of the counts read on the host, of exactly their sizes;
3. :meth:`RowCache.commit`, once the caller moved the rows (the dirty rows written back to the host, the
   missing ones copied in): the index, the recency order, the dirty and spared slots updated, and a training
   batch's counts added to each table's stats (on the device: :attr:`RowCache.stats` reads them).

A batch that does not fit (more missing rows in a table than it has slots free) must not change the caches:
either the host reads the counts first and :meth:`RowCache.admit` raises :class:`CacheTooSmall`, or, where the
host does not wait for the counts, :meth:`RowCache.place` gives such a table's missing rows no slot of their
own (they read its first slot) and :meth:`RowCache.commit` records the overflow, which
:meth:`RowCache.check_overflow` raises as :class:`CacheTooSmall` once the host reads it.

Each is a fixed number of whole-array operations (sort, search, prefix sums, scatters) over the batch's
ids and the caches' slots, whatever the number of tables: no per-table loop, and no operation whose
output size depends on the data (which on a GPU would wait for it).

The eviction order is a segmented LRU, an order of each table's slots kept rather than sorted: first the
rows not found in the cache since they came in, then the *protected* ones (found there at least once), each
part least recently used first, then the slots the last batch used. A batch moves the slots it used to the end
of their table's range (in slot order) and keeps the others' order, a stable partition done with prefix sums;
beyond :data:`PROTECTED` of a table's slots, its protected rows least recently used lose their protection. So a
row seen once, as most rows of a skewed table's long tail are, leaves before a row that came back, and a pass
over many such rows (an evaluation) does not push the hot rows out. The index sits behind :class:`CacheIndex`
(find, rows_of, assign, clear). :class:`SortedIndex` keeps the held rows sorted and finds rows with
``torch.searchsorted``: fully associative (no set of slots can overflow while others are free); a
batch's new rows, sorted already, are merged into it by their ranks, not sorted again. A GPU hash
table can take its place.

The training batch before is spared so that a prefetch may run one batch ahead, while that batch
still computes: a row it uses must not leave the cache before its update is done.

Example::

    cache = RowCache([CachedTable("t_C3", rows=10_000_000, slots=400_000, first_row=0)])
    placement = cache.place(rows)                            # rows: global rows of a batch's ids, NO_ROW else
    cache.admit(placement.counts.tolist())                   # or CacheTooSmall (a read of the device)
    moves = placement.moves()                                # or .moves(missing, written_back): exact sizes
    ... copy moves.written_back_slots out, moves.missing_rows in at moves.victims ...
    ... (each table's part ending at moves.missing_ends) ...
    cache.commit(placement, moves, training=True)
    placement.slot[placement.inverse]                        # each id's slot
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

import torch
from torch import nn

from pipeline.errors import UserError
from pipeline.modules.gpu_compiled import compiled_on_gpu

NO_ROW = torch.iinfo(torch.int64).max
"""The row of an id no cache holds (an id of a table kept whole on the device), and of padding: sorts last."""

PROTECTED = 0.8
"""The share of a cache's slots whose rows may be protected: found in the cache since they came in, they leave
only after the rows that were not (segmented LRU)."""

COUNTS = ("missing", "free", "rows", "evictions", "writebacks")
"""The rows of :attr:`Placement.counts`, one column per table."""


class CacheTooSmall(UserError):
    """A batch needs more rows in a cache than it has slots to give (beside those the batch before holds)."""


class CacheIndex(Protocol):
    """Where the rows of the tables sit in the caches' slots."""

    def find(self, rows: torch.Tensor) -> torch.Tensor:
        """The slot of each of ``rows``, -1 where the row is not held (``NO_ROW`` never is)."""

    def rows_of(self, slots: torch.Tensor) -> torch.Tensor:
        """The row each of ``slots`` holds, negative where it is empty."""

    def assign(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """``slots`` hold ``rows`` from now on (the rows they held are forgotten); ``rows`` are sorted and
        none of them is held; a slot of -1 (padding, its row ``NO_ROW``) is skipped."""

    def clear(self) -> None:
        """Every slot empty."""


class SortedIndex(nn.Module):
    """A fully associative index: the row of each slot, and the held rows sorted for ``searchsorted``.

    An empty slot ``s`` holds the row ``-1 - s``, so that the sorted rows stay distinct."""

    def __init__(self, slots: int) -> None:
        super().__init__()
        self.register_buffer("slot_rows", torch.empty(slots, dtype=torch.int64), persistent=False)
        self.register_buffer("sorted_rows", torch.empty(slots, dtype=torch.int64), persistent=False)
        self.register_buffer("sorted_slots", torch.empty(slots, dtype=torch.int64), persistent=False)
        self.clear()

    def find(self, rows: torch.Tensor) -> torch.Tensor:
        at = torch.searchsorted(self.sorted_rows, rows).clamp_(max=self.sorted_rows.numel() - 1)
        return torch.where(self.sorted_rows[at] == rows, self.sorted_slots[at], -1)

    def rows_of(self, slots: torch.Tensor) -> torch.Tensor:
        return self.slot_rows[slots]

    def assign(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Merge: a kept entry moves back by the entries removed before it and on by the new rows before it; a
        new row lands after the kept entries and the new rows before it."""
        n = self.sorted_rows.numel()
        positions = torch.arange(n, device=slots.device)
        valid = slots >= 0
        held = torch.searchsorted(self.sorted_rows, self.slot_rows[slots.clamp(min=0)])
        removed = _mask(n, torch.where(valid, held, n))
        removed_before = _counts_before(removed)
        kept_at = positions - removed_before[:-1] + torch.searchsorted(rows, self.sorted_rows)
        below = torch.searchsorted(self.sorted_rows, rows)
        new_at = torch.where(valid, torch.arange(rows.numel(), device=rows.device) + below - removed_before[below], n)
        kept_at = torch.where(removed, n, kept_at)
        self.sorted_rows = _scatter(n, (kept_at, self.sorted_rows), (new_at, rows))
        self.sorted_slots = _scatter(n, (kept_at, self.sorted_slots), (new_at, slots))
        self.slot_rows = _scatter(n, (positions, self.slot_rows), (torch.where(valid, slots, n), rows))

    def clear(self) -> None:
        self.slot_rows.copy_(-1 - torch.arange(self.slot_rows.numel(), device=self.slot_rows.device))
        self.sorted_rows, self.sorted_slots = torch.sort(self.slot_rows)


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


@dataclass(frozen=True)
class CachedTable:
    """A host-cached table as the caches see it: ``rows`` in host memory from global row ``first_row`` on,
    ``slots`` rows in its device cache."""

    name: str
    rows: int
    slots: int
    first_row: int


@dataclass
class Placement:
    """Where a batch's rows go (:meth:`RowCache.place`): per distinct row (``rows``, sorted, ``NO_ROW``
    padding after them), its slot after the batch (``slot``, -1 for padding), whether it moves in (``missing``:
    missing, in a table where the batch fits), and for such a row the slot it takes (``victim``) and whether
    that slot's row is written back (``dirty``); ``inverse``: each id's distinct row; ``table_ends``: where each
    table's distinct rows end; ``counts``: ``[len(COUNTS), tables]``."""

    rows: torch.Tensor
    inverse: torch.Tensor
    slot: torch.Tensor
    missing: torch.Tensor
    victim: torch.Tensor
    dirty: torch.Tensor
    table_ends: torch.Tensor
    counts: torch.Tensor

    @compiled_on_gpu(lambda placement: placement.rows)
    def moves(self, missing: int | None = None, written_back: int | None = None) -> Moves:
        """The rows moved, gathered at the front of arrays of the batch's size (slot -1 and row ``NO_ROW`` after
        them); or, given the totals of ``counts`` read on the host (``missing``, ``written_back``), of exactly those
        sizes."""
        size = self.rows.numel()
        missing_before, dirty_before = _counts_before(self.missing), _counts_before(self.dirty)
        missing_rows, victims = _compact(self.missing, missing_before, size if missing is None else missing,
                                         (self.rows, NO_ROW), (self.victim, -1))
        written_back_slots, = _compact(self.dirty, dirty_before, size if written_back is None else written_back,
                                       (self.victim, -1))
        return Moves(missing_rows, victims, written_back_slots, missing_before[self.table_ends],
                     dirty_before[self.table_ends])


@dataclass
class Moves:
    """A batch's missing rows (sorted, by table) with the slots they take, and the slots whose rows are written
    back first (by table too); ``missing_ends`` and ``written_back_ends``: where each table's part of them ends
    (on the device). Past the last table's end: padding (row ``NO_ROW``, slot -1)."""

    missing_rows: torch.Tensor
    victims: torch.Tensor
    written_back_slots: torch.Tensor
    missing_ends: torch.Tensor
    written_back_ends: torch.Tensor


class RowCache(nn.Module):
    """The device caches of ``tables`` (sorted by ``first_row``): segmented LRU out, dirty rows written back.

    It holds the bookkeeping only (index, eviction order, protected, dirty and spared slots, on the caches'
    device) and each table's :class:`CacheStats` (on the host); the rows themselves are the caller's to copy.
    """

    def __init__(self, tables: Sequence[CachedTable], index: CacheIndex | None = None) -> None:
        super().__init__()
        self.tables = sorted(tables, key=lambda t: t.first_row)
        if not self.tables:
            raise ValueError("a row cache needs at least one table")
        for t in self.tables:
            if not 1 <= t.slots <= t.rows:
                raise ValueError(f"table {t.name}: expected a cache of 1 to {t.rows} rows, got {t.slots}")
        self.names = [t.name for t in self.tables]
        bounds = [0]
        for t in self.tables:
            bounds.append(bounds[-1] + t.slots)
        self.slot_bounds = bounds
        """Where each table's slots start, then the number of slots."""
        self.slots = bounds[-1]
        self.index = index if index is not None else SortedIndex(self.slots)
        slot_table = torch.repeat_interleave(torch.arange(len(self.tables)), torch.tensor([t.slots for t in self.tables]))
        first_slot = torch.tensor(bounds[:-1])
        self.register_buffer("first_rows", torch.tensor([t.first_row for t in self.tables]), persistent=False)
        self.register_buffer("row_ends", torch.tensor([t.first_row + t.rows for t in self.tables]), persistent=False)
        self.register_buffer("first_slot", first_slot, persistent=False)
        self.register_buffer("slot_ends", torch.tensor(bounds[1:]), persistent=False)
        self.register_buffer("slot_table", slot_table, persistent=False)
        self.register_buffer("segment_start", first_slot[slot_table], persistent=False)
        self.register_buffer("order", torch.arange(self.slots), persistent=False)
        self.register_buffer("dirty", torch.zeros(self.slots, dtype=torch.bool), persistent=False)
        self.register_buffer("protected", torch.zeros(self.slots, dtype=torch.bool), persistent=False)
        self.register_buffer("protect_limit", torch.tensor([int(PROTECTED * t.slots) for t in self.tables]),
                             persistent=False)
        self.register_buffer("spared", torch.zeros(self.slots, dtype=torch.bool), persistent=False)
        tables = len(self.tables)
        self.register_buffer("totals", torch.zeros(len(COUNTS), tables, dtype=torch.int64), persistent=False)
        """The counts of the training batches so far, summed."""
        self.register_buffer("overflow", torch.zeros(1 + len(COUNTS), tables, dtype=torch.int64), persistent=False)
        """Per table, whether a batch did not fit, then that first batch's counts (:meth:`check_overflow`)."""

    @property
    def stats(self) -> dict[str, CacheStats]:
        """Each table's counts of its training batches' rows (a read of the device: not per step)."""
        by_name = dict(zip(COUNTS, self.totals.tolist()))
        return {t.name: CacheStats(by_name["rows"][i], by_name["rows"][i] - by_name["missing"][i],
                                   by_name["evictions"][i], by_name["writebacks"][i])
                for i, t in enumerate(self.tables)}

    @compiled_on_gpu(lambda cache: cache.order)
    def place(self, rows: torch.Tensor) -> Placement:
        """Where the rows of a batch's ids go: ``rows`` holds each id's global row, ``NO_ROW`` for an id of a
        table not cached. Changes nothing."""
        n, s = rows.numel(), self.slots
        sorted_rows, by_row = torch.sort(rows)
        first = torch.ones_like(sorted_rows, dtype=torch.bool)
        first[1:] = sorted_rows[1:] != sorted_rows[:-1]
        first &= sorted_rows != NO_ROW
        distinct_at = torch.cumsum(first, 0) - 1
        inverse = _scatter(n, (by_row, distinct_at))
        distinct = _scatter(n, (torch.where(first, distinct_at, n), sorted_rows), fill=NO_ROW)
        found = self.index.find(distinct)
        missing = (distinct != NO_ROW) & (found < 0)
        table = (torch.searchsorted(self.first_rows, distinct, right=True) - 1).clamp_(min=0)
        starts, ends = torch.searchsorted(distinct, self.first_rows), torch.searchsorted(distinct, self.row_ends)
        # The free slots of each table in its recency order: neither spared nor holding a row of this batch.
        free_in_order = ~(self.spared | _mask(s, torch.where(found >= 0, found, s)))[self.order]
        free_before = _counts_before(free_in_order)
        free = free_before[self.slot_ends] - free_before[self.first_slot]
        free_at = self.segment_start + free_before[:-1] - free_before[self.segment_start]
        candidates = _scatter(s, (torch.where(free_in_order, free_at, s), self.order), fill=0)
        missing_before = _counts_before(missing)
        wanted = _segment_sums(missing_before, starts, ends)
        fits = (wanted <= free)[table]  # else the table's missing rows take no slot (they read its first one)
        moved = missing & fits
        rank = missing_before[:-1] - missing_before[starts[table]]
        victim = torch.where(moved, candidates[(self.first_slot[table] + rank).clamp_(max=s - 1)], -1)
        held = moved & (self.index.rows_of(victim.clamp(min=0)) >= 0)
        dirty = moved & self.dirty[victim.clamp(min=0)]
        counts = torch.stack([wanted, free, ends - starts, _segment_sums(_counts_before(held), starts, ends),
                              _segment_sums(_counts_before(dirty), starts, ends)])
        slot = torch.where(missing, torch.where(fits, victim, self.first_slot[table]), found)
        return Placement(distinct, inverse, slot, moved, victim, dirty, ends, counts)

    def admit(self, counts: list[list[int]]) -> None:
        """Raise :class:`CacheTooSmall` for a table whose missing rows outnumber its free slots (``counts``:
        :attr:`Placement.counts` on the host), before anything changed."""
        by_name = dict(zip(COUNTS, counts))
        for t, table in enumerate(self.tables):
            if by_name["missing"][t] > by_name["free"][t]:
                raise _too_small(table, by_name["missing"][t], by_name["free"][t], by_name["rows"][t])

    def check_overflow(self, overflow: list[list[int]]) -> None:
        """Raise :class:`CacheTooSmall` for the first table a committed batch did not fit, from :attr:`overflow` read
        on the host (such a batch's missing rows read other rows: the training that follows is void)."""
        flagged, *counts = overflow
        by_name = dict(zip(COUNTS, counts))
        for t, table in enumerate(self.tables):
            if flagged[t]:
                self.overflow.zero_()
                raise _too_small(table, by_name["missing"][t], by_name["free"][t], by_name["rows"][t])

    @compiled_on_gpu(lambda cache: cache.order)
    def commit(self, placement: Placement, moves: Moves, training: bool) -> None:
        """The batch's rows in their slots from now on, the most recently used; a row found in its slot
        protected; ``training``: its slots dirty, and spared by the next placement."""
        s = self.slots
        victims = _mask(s, torch.where(moves.victims >= 0, moves.victims, s))
        if moves.victims.numel():
            self.index.assign(moves.victims, moves.missing_rows)
            self.protected &= ~victims
        found = torch.where(placement.missing | (placement.slot < 0), s, placement.slot)
        self.protected |= _mask(s, found)
        used = _mask(s, torch.where(placement.slot >= 0, placement.slot, s))
        # The new order of each table's slots: [kept, not protected] [kept, protected] [used], each part in the
        # order it had (the used ones in slot order).
        order, table = self.order, self.slot_table
        kept_in_order = ~used[order]
        safe_in_order = kept_in_order & self.protected[order]
        open_in_order = kept_in_order & ~safe_in_order
        open_before, safe_before, used_before = (_counts_before(open_in_order), _counts_before(safe_in_order),
                                                 _counts_before(used))
        opened = _segment_sums(open_before, self.first_slot, self.slot_ends)[table]
        safe = _segment_sums(safe_before, self.first_slot, self.slot_ends)[table]
        open_at = self.segment_start + open_before[:-1] - open_before[self.segment_start]
        safe_rank = safe_before[:-1] - safe_before[self.segment_start]
        used_at = self.segment_start + opened + safe + used_before[:-1] - used_before[self.segment_start]
        self.order = _scatter(s, (torch.where(open_in_order, open_at, s), order),
                              (torch.where(safe_in_order, self.segment_start + opened + safe_rank, s), order),
                              (torch.where(used, used_at, s), torch.arange(s, device=used.device)))
        # Over its limit, a table's protected rows the least recently used are protected no more: where they
        # stand, the most recent of the rows next to go.
        found = _segment_sums(_counts_before(used & self.protected), self.first_slot, self.slot_ends)
        excess = safe + (found - self.protect_limit)[table]
        self.protected &= ~_mask(s, torch.where(safe_in_order & (safe_rank < excess), order, s))
        self.dirty &= ~victims
        if training:
            self.dirty |= used
            self.spared = used
            self.totals += placement.counts
        overflow = placement.counts[0] > placement.counts[1]
        first = overflow & (self.overflow[0] == 0)
        self.overflow[1:] = torch.where(first, placement.counts, self.overflow[1:])
        self.overflow[0] |= overflow

    def dirty_slots(self) -> torch.Tensor:
        """The slots whose rows a training batch used since they came in (a read of the device: not per step)."""
        return self.dirty.nonzero().squeeze(1)

    def cleaned(self, slots: torch.Tensor) -> None:
        """``slots``' rows were written back: clean, but for the slots of the training batch placed last (spared), which
        may not have trained yet (prefetched before the step before it): its update is still to be written back."""
        self.dirty.index_fill_(0, slots, False)
        self.dirty |= self.spared

    def drop(self) -> None:
        """Forget every row held, without writing any back."""
        self.index.clear()
        self.order.copy_(torch.arange(self.slots, device=self.order.device))
        self.dirty.zero_()
        self.protected.zero_()
        self.spared.zero_()
        self.overflow.zero_()

    def extra_repr(self) -> str:
        return ", ".join(f"{t.name}: {t.slots:,} of {t.rows:,}" for t in self.tables)


def _scatter(size: int, *pairs: tuple[torch.Tensor, torch.Tensor], fill: int | None = None) -> torch.Tensor:
    """A ``size``-long array with each pair's values at its positions (position ``size``: dropped). Written as
    ``index_put_``, which Inductor compiles into its kernels on a GPU, where it leaves a ``scatter_`` of integers or
    booleans to an ATen kernel of its own (it would need atomic adds that Triton lacks for them)."""
    values = pairs[0][1]
    out = values.new_empty(size + 1) if fill is None else values.new_full((size + 1,), fill)
    for at, value in pairs:
        out.index_put_((at,), value)
    return out[:size]


def _mask(size: int, at: torch.Tensor) -> torch.Tensor:
    """A ``size``-long boolean array, True at ``at`` (position ``size``: dropped)."""
    return _scatter(size, (at, torch.ones_like(at, dtype=torch.bool)), fill=False)


def _counts_before(flags: torch.Tensor) -> torch.Tensor:
    """``out[i]``: how many of ``flags[:i]`` are set (``len(flags) + 1`` long)."""
    return torch.cat([torch.zeros(1, dtype=torch.int64, device=flags.device), torch.cumsum(flags, 0)])


def _segment_sums(before: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """How many flags are set in each range ``starts[t]:ends[t]``, from their :func:`_counts_before`."""
    return before[ends] - before[starts]


def _compact(flags: torch.Tensor, before: torch.Tensor, size: int,
             *values: tuple[torch.Tensor, int]) -> tuple[torch.Tensor, ...]:
    """Each of ``values`` (an array and its padding) at the positions where ``flags`` is set, in order, then padding
    up to ``size`` (at least their count); ``before``: the flags' :func:`_counts_before`."""
    at = torch.where(flags, before[:-1], size)
    return tuple(_scatter(size, (at, v), fill=fill) for v, fill in values)


def _too_small(table: CachedTable, missing: int, free: int, rows: int) -> CacheTooSmall:
    return CacheTooSmall(
        f"table {table.name}: a batch needs {missing:,} rows copied into its device cache of {table.slots:,} rows, but "
        f"only {free:,} slots hold none of the batch's {rows:,} distinct rows and none the training batch before it "
        "uses: give the table a larger cache (distributed.memory_per_rank_mb, or its cache_rows in "
        "distributed.plan_file), or lower train.batch_size")
