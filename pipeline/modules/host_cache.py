"""The device caches of a collection's host-cached tables: which rows their slots hold, which rows to evict.

A host-cached table (:mod:`pipeline.modules.cached_collection`) keeps every row and its optimizer state
in host memory, and ``slots`` of them, with their state, in a cache on the device. :class:`RowCache`
keeps the books of every such table of a collection at once, on the device: a row is named by its
*global row* (its table's row offset in host memory plus its id), a slot by its position among all the
caches' slots (each table's slots one range, in the order of its rows). A batch goes through three
calls, none of which reads the device from the host:

1. :meth:`RowCache.place` (changes nothing): the batch's rows sorted, its distinct ones found in the
   index (row -> slot); each missing row given a slot of its table that neither this batch nor the
   training batch before it uses, first in the eviction order (empty slots before any); the slots
   among those whose row a training batch used since it came in (dirty), to be written back; and per
   table the counts the host must see (missing rows, free slots, distinct rows, evictions, write-backs);
2. :meth:`RowCache.admit`, with those counts read on the host: :class:`CacheTooSmall` for a batch that
   does not fit, before anything changed; a training batch's counts added to each table's stats;
3. :meth:`RowCache.commit`, once the caller moved the rows (:meth:`Placement.moves`: the collection
   writes the dirty rows back to the host and copies the missing ones in): the index, the recency order,
   the dirty and spared slots updated.

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
    cache.admit(placement.counts.tolist(), training=True)    # or CacheTooSmall
    moves = placement.moves(missing, written_back)           # the totals of placement.counts
    ... copy moves.written_back_slots out, moves.missing_rows in at moves.victims ...
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
        none of them is held."""

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
        removed = torch.zeros(n, dtype=torch.int64, device=slots.device)
        removed.index_fill_(0, torch.searchsorted(self.sorted_rows, self.slot_rows[slots]), 1)
        removed_before = torch.cat([removed.new_zeros(1), torch.cumsum(removed, 0)])
        kept_at = positions - removed_before[:-1] + torch.searchsorted(rows, self.sorted_rows)
        below = torch.searchsorted(self.sorted_rows, rows)
        new_at = torch.arange(rows.numel(), device=rows.device) + below - removed_before[below]
        kept_at = torch.where(removed.bool(), n, kept_at)
        self.sorted_rows = _scatter(n, (kept_at, self.sorted_rows), (new_at, rows))
        self.sorted_slots = _scatter(n, (kept_at, self.sorted_slots), (new_at, slots))
        self.slot_rows[slots] = rows

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
    padding after them), its slot after the batch (``slot``, -1 for padding), whether it was missing, and for
    a missing one the slot it takes (``victim``) and whether that slot's row is written back (``dirty``);
    ``inverse``: each id's distinct row; ``counts``: ``[len(COUNTS), tables]``."""

    rows: torch.Tensor
    inverse: torch.Tensor
    slot: torch.Tensor
    missing: torch.Tensor
    victim: torch.Tensor
    dirty: torch.Tensor
    counts: torch.Tensor

    def moves(self, missing: int, written_back: int) -> Moves:
        """The rows moved, gathered into arrays of their sizes (``missing`` and ``written_back``, the totals of
        ``counts`` the host read)."""
        return Moves(*_compact(self.missing, missing, self.rows, self.victim),
                     *_compact(self.dirty, written_back, self.victim))


@dataclass
class Moves:
    """A batch's missing rows (sorted, by table) with the slots they take, and the slots whose rows are written
    back first (by table too)."""

    missing_rows: torch.Tensor
    victims: torch.Tensor
    written_back_slots: torch.Tensor


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
        self.stats = {t.name: CacheStats() for t in self.tables}

    def place(self, rows: torch.Tensor) -> Placement:
        """Where the rows of a batch's ids go: ``rows`` holds each id's global row, ``NO_ROW`` for an id of a
        table not cached. Changes nothing."""
        n, s = rows.numel(), self.slots
        sorted_rows, by_row = torch.sort(rows)
        first = torch.ones_like(sorted_rows, dtype=torch.bool)
        first[1:] = sorted_rows[1:] != sorted_rows[:-1]
        first &= sorted_rows != NO_ROW
        distinct_at = torch.cumsum(first, 0) - 1
        inverse = torch.empty_like(distinct_at).scatter_(0, by_row, distinct_at)
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
        rank = missing_before[:-1] - missing_before[starts[table]]
        victim = torch.where(missing, candidates[(self.first_slot[table] + rank).clamp_(max=s - 1)], -1)
        held = missing & (self.index.rows_of(victim.clamp(min=0)) >= 0)
        dirty = missing & self.dirty[victim.clamp(min=0)]
        counts = torch.stack([_segment_sums(missing_before, starts, ends), free, ends - starts,
                              _segment_sums(_counts_before(held), starts, ends),
                              _segment_sums(_counts_before(dirty), starts, ends)])
        return Placement(distinct, inverse, torch.where(missing, victim, found), missing, victim, dirty, counts)

    def admit(self, counts: list[list[int]], training: bool) -> None:
        """Raise :class:`CacheTooSmall` for a table whose missing rows outnumber its free slots; else count a
        training batch's rows in each table's stats. ``counts``: :attr:`Placement.counts` on the host."""
        by_name = dict(zip(COUNTS, counts))
        for t, table in enumerate(self.tables):
            missing, free, rows = by_name["missing"][t], by_name["free"][t], by_name["rows"][t]
            if missing > free:
                raise CacheTooSmall(
                    f"table {table.name}: a batch needs {missing:,} rows copied into its device cache of "
                    f"{table.slots:,} rows, but only {free:,} slots hold none of the batch's {rows:,} distinct rows "
                    "and none the training batch before it uses: give the table a larger cache (distributed.memory_per_rank_mb, "
                    "or its cache_rows in distributed.plan_file), or lower train.batch_size")
        if training:
            for t, table in enumerate(self.tables):
                self.stats[table.name] += CacheStats(by_name["rows"][t], by_name["rows"][t] - by_name["missing"][t],
                                                     by_name["evictions"][t], by_name["writebacks"][t])

    def commit(self, placement: Placement, moves: Moves, training: bool) -> None:
        """The batch's rows in their slots from now on, the most recently used; a row found in its slot
        protected; ``training``: its slots dirty, and spared by the next placement."""
        s = self.slots
        if moves.victims.numel():
            self.index.assign(moves.victims, moves.missing_rows)
            self.protected.index_fill_(0, moves.victims, False)  # a number written by index would wait for the device
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
        self.dirty &= ~_mask(s, moves.victims)
        if training:
            self.dirty |= used
            self.spared = used

    def dirty_slots(self) -> torch.Tensor:
        """The slots whose rows a training batch used since they came in (a read of the device: not per step)."""
        return self.dirty.nonzero().squeeze(1)

    def cleaned(self, slots: torch.Tensor) -> None:
        """``slots``' rows were written back: clean."""
        self.dirty.index_fill_(0, slots, False)

    def drop(self) -> None:
        """Forget every row held, without writing any back."""
        self.index.clear()
        self.order.copy_(torch.arange(self.slots, device=self.order.device))
        self.dirty.zero_()
        self.protected.zero_()
        self.spared.zero_()

    def extra_repr(self) -> str:
        return ", ".join(f"{t.name}: {t.slots:,} of {t.rows:,}" for t in self.tables)


def _scatter(size: int, *pairs: tuple[torch.Tensor, torch.Tensor], fill: int | None = None) -> torch.Tensor:
    """A ``size``-long array with each pair's values at its positions (position ``size``: dropped)."""
    values = pairs[0][1]
    out = values.new_empty(size + 1) if fill is None else values.new_full((size + 1,), fill)
    for at, value in pairs:
        out.scatter_(0, at, value)
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


def _compact(flags: torch.Tensor, size: int, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each of ``values`` at the ``size`` positions where ``flags`` is set, in order (``size``: their count)."""
    at = torch.where(flags, torch.cumsum(flags, 0) - 1, size)
    return tuple(_scatter(size, (at, v)) for v in values)
