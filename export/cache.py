"""Caches of hot embedding rows in front of the host store, behind one small interface.

A cache *tier* serves rows of one table: ``lookup(ids) -> rows`` reads hits from its own memory and
misses from the table behind it (the memory-mapped store), inserting them and evicting by its
policy. It counts hits, misses and evictions over the *distinct* ids of each lookup (duplicates in
a batch are served once, as HugeCTR's HPS deduplicates keys before querying its cache).

Tiers are named in :data:`TIERS`, a dict of lazy ``"module:attr"`` entries imported on first use,
so a GPU tier plugs in beside the CPU ones without touching the embedding model (and torch is
imported only for one): ``register_tier(name, "module:attr")``. Here: ``lru`` and ``lfu``,
vectorized with numpy (a direct-mapped index of 4 bytes per table row, no Python loop per id),
``none``, and in :mod:`export.cache_torch` ``gpu-lru`` / ``gpu-lfu`` (the same policies with their rows on a
torch device, answering with a tensor there: the same answers, counters and evictions). A full cache evicts
its rows of lowest priority (the oldest lookup, or the fewest lookups), a tie going to the lower slot, so that
every tier evicts the same rows.

The embedding lookup asks for the rows of all its tables at once (:func:`make_caches`,
:class:`TableCaches`): ``lookup_parts`` takes the one-hot ids of many tables and the values of multi-hot bags
together. A tier class that can serve several tables in one step says so with a ``for_tables`` class method:
``lru``, ``lfu`` and their ``gpu-`` forms keep every table's cache in one index and one array of rows, so a
request's ids of all tables are deduplicated, found and gathered by one call each, not one per table (a model
has tens of small tables: at a batch of one row, the calls per table cost far more than the rows). Each table
keeps its own capacity, evictions and counters. Other tiers are looked up table by table.

Their index (key -> slot, slot -> key, priorities) is numpy on the host; their rows are in a *row store*:
:class:`HostRows` (numpy, the ``lru`` / ``lfu`` tiers') or :class:`export.cache_torch.DeviceRows` (a torch
device's memory). A lookup finds every id's slot on the host, so a tier on a GPU never waits for its device: it
sends the slots, with any missed rows read from the store and where they go, in one copy, and gathers there.

Example::

    cache = make_tier("lru", store_table, capacity=1000)
    rows = cache.lookup(np.array([5, 7, 5]))      # [3, dim]; 2 misses
    cache.lookup(np.array([5])); cache.stats()     # {"hits": 1, "misses": 2, "evictions": 0, ...}

    caches = make_caches("lru", {"t_C1": table_1, "t_C2": table_2}, {"t_C1": 1000, "t_C2": 50})
    rows = caches.lookup(["t_C1", "t_C2"], np.array([[5, 3], [7, 3]]))     # [2 rows, 2 tables, dim]
    onehot, bag = caches.lookup_parts([(["t_C1", "t_C2"], ids), (["t_C1"], bag_ids[:, None])])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from pipeline.registry import Registry


class CacheTier(Protocol):
    """What every tier implements."""

    capacity: int

    def lookup(self, ids: np.ndarray) -> np.ndarray: ...

    def stats(self) -> dict[str, int]: ...

    def cached_ids(self) -> np.ndarray: ...

    def refill(self, table: np.ndarray) -> None:
        """Serve ``table`` from now on, keeping the same ids hot (their rows re-read from it)."""
        ...


Rows = Any
"""What a tier answers with: a numpy array, or a tensor on the device of a tier whose rows are there."""


class TableCaches(Protocol):
    """The caches of several tables, looked up together."""

    def lookup(self, tables: list[str], ids: np.ndarray) -> Rows:
        """``ids`` ``[n, k]``: column ``j`` holds ids of ``tables[j]`` (tables of one dim); their rows ``[n, k, dim]``."""
        ...

    def lookup_parts(self, parts: list[tuple[list[str], np.ndarray]]) -> list[Rows]:
        """The rows of several ``(tables, ids)`` parts, each as :meth:`lookup` takes it, all looked up in one step
        (a part's ids are counted with the others': an id in two parts is one distinct id)."""
        ...

    def stats(self) -> dict[str, dict[str, int]]:
        """Each table's counters, as :meth:`CacheTier.stats`."""
        ...

    def cached_ids(self, table: str) -> np.ndarray: ...

    def refill(self, tables: dict[str, np.ndarray]) -> None:
        """Serve ``tables`` from now on (every table by name), keeping the same ids hot."""
        ...


TIERS = Registry("cache policy", {
    "lru": "export.cache:LruCache",
    "lfu": "export.cache:LfuCache",
    "none": "export.cache:NoCache",
    "gpu-lru": "export.cache_torch:TorchLruCache",
    "gpu-lfu": "export.cache_torch:TorchLfuCache",
})
"""Tier name -> ``"module:attr"`` of its factory: ``factory(table, capacity) -> CacheTier``."""
register_tier = TIERS.register


def make_tier(name: str, table: np.ndarray, capacity: int) -> CacheTier:
    """A new tier of policy ``name`` over ``table`` holding up to ``capacity`` rows."""
    return TIERS.load(name)(table, capacity)


def make_caches(name: str, tables: dict[str, np.ndarray], capacities: dict[str, int], **options) -> TableCaches:
    """The caches of policy ``name`` over ``tables`` (``capacities``: rows per table; ``options``: the tier's own,
    such as the ``device`` of a ``gpu-`` tier): in one step where the tier class offers it (``for_tables``), else
    one tier per table."""
    factory = TIERS.load(name)
    for_tables = getattr(factory, "for_tables", None)
    if for_tables is not None:
        return for_tables(tables, capacities, **options)
    return PerTable({table: factory(array, capacities[table], **options) for table, array in tables.items()})


class PerTable:
    """One tier per table, each looked up on its own."""

    def __init__(self, tiers: dict[str, CacheTier]) -> None:
        self.tiers = tiers

    def lookup(self, tables: list[str], ids: np.ndarray) -> Rows:
        return _stacked([self.tiers[table].lookup(ids[:, j]) for j, table in enumerate(tables)])

    def lookup_parts(self, parts: list[tuple[list[str], np.ndarray]]) -> list[Rows]:
        return [self.lookup(tables, ids) for tables, ids in parts]

    def stats(self) -> dict[str, dict[str, int]]:
        return {table: tier.stats() for table, tier in self.tiers.items()}

    def cached_ids(self, table: str) -> np.ndarray:
        return self.tiers[table].cached_ids()

    def refill(self, tables: dict[str, np.ndarray]) -> None:
        for table, tier in self.tiers.items():
            tier.refill(tables[table])


def _stacked(columns: list[Rows]) -> Rows:
    """``[n, dim]`` rows of each table side by side: ``[n, tables, dim]`` (numpy, or torch for tensors)."""
    if isinstance(columns[0], np.ndarray):
        return np.stack(columns, axis=1)
    import torch

    return torch.stack(columns, dim=1)


def shared_layout(tables: dict[str, np.ndarray], capacities: dict[str, int]
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(rows, capacities, first keys, first slots) of ``[rows, dim]`` tables that share one key space (a row's
    key is its id plus its table's first key) and one array of slots (each table a segment of its capacity,
    at most its rows)."""
    for name, table in tables.items():
        if table.ndim != 2:
            raise ValueError(f"table {name}: expected a [rows, dim] table, got shape {table.shape}")
    rows = np.array([t.shape[0] for t in tables.values()], dtype=np.int64)
    kept = np.array([int(max(0, min(capacities[n], t.shape[0]))) for n, t in tables.items()], dtype=np.int64)
    first_key = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64)
    first_slot = np.concatenate([[0], np.cumsum(kept)]).astype(np.int64)
    return rows, kept, first_key, first_slot


class HostRows:
    """The cached rows of a set of caches in host memory (numpy): the ``lru`` / ``lfu`` tiers' row store.

    A row store holds ``slots`` rows of ``dim`` values of ``dtype`` and answers a lookup from the slots the
    index found: :meth:`take` when every id hit, else :meth:`serve`, which has the store's rows of the missed ids
    read where it needs them.
    """

    def __init__(self, slots: int, dim: int, dtype: np.dtype) -> None:
        self.rows = np.empty((slots, dim), dtype=dtype)

    def empty(self) -> np.ndarray:
        return self.rows[:0]

    def take(self, slots: np.ndarray) -> np.ndarray:
        """The rows of ``slots`` (every one cached)."""
        return np.take(self.rows, slots, axis=0)

    def serve(self, unique_slots: np.ndarray, hit: np.ndarray, inverse: np.ndarray, new_slots: np.ndarray,
              cached: np.ndarray, fetch: Callable[[np.ndarray], None], gather: bool = True) -> np.ndarray:
        """The answer of a lookup with misses: ``unique_slots`` of its distinct ids (``hit`` where they were
        cached), ``inverse`` each id's distinct one. ``fetch(out)`` reads the store's rows of the missed ones, in
        their order, into ``out``; those at ``cached`` go to ``new_slots``. (Rows on the host are always gathered:
        ``gather`` is for a store on a device, :class:`export.cache_torch.DeviceRows`.)"""
        out = np.empty((unique_slots.size, self.rows.shape[1]), dtype=self.rows.dtype)
        out[hit] = np.take(self.rows, unique_slots[hit], axis=0)
        fetched = np.empty((unique_slots.size - int(np.count_nonzero(hit)), self.rows.shape[1]), dtype=self.rows.dtype)
        fetch(fetched)
        out[~hit] = fetched
        self.rows[new_slots] = fetched[cached]
        return np.take(out, inverse.reshape(-1), axis=0)

    def write(self, slots: np.ndarray, rows: np.ndarray) -> None:
        """Put ``rows`` in ``slots`` (a new store version's rows of the cached ids)."""
        self.rows[slots] = rows


class _ArrayCaches:
    """The LRU / LFU machinery over tables of one dim and dtype: one index (numpy, on the host) and one row store.

    A row's key is its id plus its table's first key, so the tables share one direct-mapped index
    (``key -> slot``); each table owns a segment of the slots (its capacity) and evicts within it.
    Subclasses say how a slot's priority is kept, and where the rows are (:attr:`row_store`, made with
    ``row_options``).
    """

    row_store: type = HostRows

    def __init__(self, tables: dict[str, np.ndarray], capacities: dict[str, int], **row_options) -> None:
        rows, self.capacities, self._first_key, self._first_slot = shared_layout(tables, capacities)
        self.tables = dict(tables)
        self._names = list(tables)
        self._index = {name: i for i, name in enumerate(tables)}
        self._row_options = row_options
        slots = int(self._first_slot[-1])
        first = next(iter(tables.values()))
        self._dim = first.shape[1]
        self._slot_of = np.full(int(rows.sum()), -1, dtype=np.int32 if slots < 2**31 else np.int64)
        self._key_of = np.full(slots, -1, dtype=np.int64)
        self._rows = self.row_store(slots, first.shape[1], first.dtype, **row_options)
        self._priority = np.zeros(slots, dtype=np.int64)
        self._occurrence = np.zeros(slots, dtype=np.int64)
        self._table_of_slot = np.repeat(np.arange(len(tables), dtype=np.int32), self.capacities)
        self._used = np.zeros(len(tables), dtype=np.int64)
        self._tick = 0
        self._hits = np.zeros(len(tables), dtype=np.int64)
        self._misses = np.zeros(len(tables), dtype=np.int64)
        self._evictions = np.zeros(len(tables), dtype=np.int64)
        self._first_keys_of: dict[tuple[str, ...], np.ndarray] = {}

    _counts_touches = True
    """Whether :meth:`_touch` reads how often each slot was looked up (else it is given None when that costs)."""

    def _touch(self, slots: np.ndarray, counts: np.ndarray | None) -> None:
        raise NotImplementedError

    def _initial_priority(self, counts: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def lookup(self, tables: list[str], ids: np.ndarray) -> Rows:
        return self.lookup_parts([(tables, ids)])[0]

    def lookup_parts(self, parts: list[tuple[list[str], np.ndarray]]) -> list[Rows]:
        keys = [self._keys(tables, ids) for tables, ids in parts]
        if len(keys) == 1:
            return [self._lookup_keys(keys[0]).reshape(-1, len(parts[0][0]), self._dim)]
        rows = self._lookup_keys(np.concatenate(keys))
        ends = np.cumsum([k.size for k in keys]).tolist()
        return [rows[end - k.size: end].reshape(-1, len(tables), self._dim)
                for (tables, _), k, end in zip(parts, keys, ends)]

    def _first_keys(self, tables: list[str]) -> np.ndarray:
        """The first key of each of ``tables`` (kept per list of tables: a server asks for the same ones)."""
        names = tuple(tables)
        first = self._first_keys_of.get(names)
        if first is None:
            first = self._first_keys_of[names] = self._first_key[[self._index[table] for table in names]]
        return first

    def _keys(self, tables: list[str], ids: np.ndarray) -> np.ndarray:
        return (np.asarray(ids, dtype=np.int64).reshape(-1, len(tables)) + self._first_keys(tables)).reshape(-1)

    def _lookup_keys(self, keys: np.ndarray, gather: bool = True) -> Rows | np.ndarray:
        """The rows of ``keys``; with ``gather=False``, each key's slot once every row is cached (the missed ones
        fetched into their new slots), or the rows where a missed row found no room."""
        if keys.size == 0:
            return self._rows.empty() if gather else np.zeros(0, dtype=np.int64)
        self._tick += 1
        slots = self._slot_of[keys]
        if slots.min() >= 0:  # every row cached: read in place, nothing to insert
            self._touch_distinct(slots)
            return self._rows.take(slots) if gather else slots.astype(np.int64)
        unique, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
        slots = self._slot_of[unique]
        hit = slots >= 0
        self._touch(slots[hit], counts[hit])
        table_of = np.searchsorted(self._first_key, unique, side="right") - 1
        hits = np.bincount(table_of[hit], minlength=len(self._used))
        self._hits += hits
        miss = ~hit
        keys, tables, counts = unique[miss], table_of[miss], counts[miss]
        misses = np.bincount(tables, minlength=len(self._used))
        self._misses += misses
        cached, new_slots = self._insert(keys, tables, counts, misses, hits, slots[hit])
        return self._rows.serve(slots, hit, inverse, new_slots, cached, lambda out: self._fetch(keys, misses, out),
                                gather)

    def _fetch(self, keys: np.ndarray, per_table: np.ndarray, out: np.ndarray) -> None:
        """The store's rows of ``keys`` (grouped by table, ``per_table`` of each in table order) into ``out``."""
        ends = np.cumsum(per_table)
        for t in np.flatnonzero(per_table).tolist():
            start = int(ends[t] - per_table[t])
            np.take(self.tables[self._names[t]], keys[start: ends[t]] - self._first_key[t], axis=0,
                    out=out[start: ends[t]])

    def _touch_distinct(self, slots: np.ndarray) -> None:
        """Touch and count the distinct ``slots`` of a lookup without sorting them: each slot records the
        position of one of its occurrences, which stands for all of them."""
        positions = np.arange(slots.size)
        self._occurrence[slots] = positions
        stands_for = self._occurrence[slots]
        first = stands_for == positions
        distinct = slots[first]
        self._touch(distinct, np.bincount(stands_for, minlength=slots.size)[first] if self._counts_touches else None)
        self._hits += np.bincount(self._table_of_slot[distinct], minlength=len(self._used))

    def _insert(self, keys: np.ndarray, tables: np.ndarray, counts: np.ndarray, misses: np.ndarray,
                hits: np.ndarray, hit_slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Cache the missed ``keys`` (ascending, so grouped by table: ``tables``, ``misses`` of each; ``counts``
        their occurrences; ``hits``: each table's distinct hits, at ``hit_slots``). Each table's
        first keys, as many as its capacity holds beside its hits, go to its free slots, then to its slots of
        lowest priority, never one of this lookup's. Returns the positions in ``keys`` of the cached ones and
        their slots."""
        room = np.maximum(0, np.minimum(misses, self.capacities - hits))
        free = np.minimum(self.capacities - self._used, room)
        evict = room - free
        rank = np.arange(keys.size) - np.repeat(np.cumsum(misses) - misses, misses)  # among its table's misses
        cached = np.flatnonzero(rank < room[tables])
        slots = self._first_slot[tables[cached]] + self._used[tables[cached]] + rank[cached]
        for t in np.flatnonzero(evict).tolist():  # the evicting tables: their free slots are all taken
            start, capacity = int(self._first_slot[t]), int(self.capacities[t])
            priority = self._priority[start: start + capacity].copy()
            priority[hit_slots[(hit_slots >= start) & (hit_slots < start + capacity)] - start] = np.iinfo(np.int64).max
            priority[int(self._used[t]):] = np.iinfo(np.int64).max  # the free slots, taken by this lookup
            evicting = cached[tables[cached] == t][free[t]:]
            victims = start + _lowest(priority, int(evict[t]))
            self._slot_of[self._key_of[victims]] = -1
            slots[np.searchsorted(cached, evicting)] = victims
        self._used += free
        self._evictions += evict
        keys = keys[cached]
        self._key_of[slots] = keys
        self._slot_of[keys] = slots
        self._priority[slots] = self._initial_priority(counts[cached])
        return cached, slots

    def count_hits(self, tables: list[str], each: int) -> None:
        """Lookups answered without this index (from rows placed beforehand): ``each`` hits of each of ``tables``."""
        np.add.at(self._hits, [self._index[table] for table in tables], each)

    def cached_ids(self, table: str) -> np.ndarray:
        t = self._index[table]
        start = int(self._first_slot[t])
        return self._key_of[start: start + int(self._used[t])] - self._first_key[t]

    def refill(self, tables: dict[str, np.ndarray]) -> None:
        if any(tables[name].shape != table.shape or tables[name].dtype != table.dtype
               for name, table in self.tables.items()):  # other shapes: start cold
            self.__init__({name: tables[name] for name in self._names},
                          dict(zip(self._names, self.capacities.tolist())), **self._row_options)
            return
        self.tables = {name: tables[name] for name in self._names}
        slots = np.concatenate([np.arange(start, start + used) for start, used in zip(self._first_slot, self._used)])
        if slots.size:
            rows = np.empty((slots.size, self._dim), dtype=self.tables[self._names[0]].dtype)
            self._fetch(self._key_of[slots], self._used, rows)
            self._rows.write(slots, rows)

    def stats(self) -> dict[str, dict[str, int]]:
        return {name: {"hits": int(self._hits[t]), "misses": int(self._misses[t]),
                       "evictions": int(self._evictions[t]), "size": int(self._used[t]),
                       "capacity": int(self.capacities[t])} for name, t in self._index.items()}


class _LruCaches(_ArrayCaches):
    _counts_touches = False

    def _touch(self, slots, counts):
        self._priority[slots] = self._tick

    def _initial_priority(self, counts):
        return self._tick


class _LfuCaches(_ArrayCaches):
    def _touch(self, slots, counts):
        self._priority[slots] += counts

    def _initial_priority(self, counts):
        return counts


def _lowest(priority: np.ndarray, n: int) -> np.ndarray:
    """The positions of the ``n`` lowest ``priority`` values in their order, a tie going to the lower position."""
    kth = np.partition(priority, n - 1)[n - 1]
    below = np.flatnonzero(priority < kth)
    below = below[np.argsort(priority[below], kind="stable")]
    return np.concatenate([below, np.flatnonzero(priority == kth)[: n - below.size]])


class _ByDim:
    """Caches of tables of several dims or dtypes: one set of arrays per kind, each request sent to its own."""

    def __init__(self, groups: list) -> None:
        self.groups = groups
        self._group_of = {name: group for group in groups for name in group.tables}

    def lookup(self, tables: list[str], ids: np.ndarray) -> Rows:
        return self.lookup_parts([(tables, ids)])[0]

    def lookup_parts(self, parts: list[tuple[list[str], np.ndarray]]) -> list[Rows]:
        group = self._group_of[parts[0][0][0]]
        if any(self._group_of[table] is not group for tables, _ in parts for table in tables):
            raise ValueError(f"tables {[t for tables, _ in parts for t in tables]} differ in dim or dtype: "
                             "look them up apart")
        return group.lookup_parts(parts)

    def stats(self) -> dict[str, dict[str, int]]:
        return {name: stats for group in self.groups for name, stats in group.stats().items()}

    def cached_ids(self, table: str) -> np.ndarray:
        return self._group_of[table].cached_ids(table)

    def refill(self, tables: dict[str, np.ndarray]) -> None:
        for group in self.groups:
            group.refill({name: tables[name] for name in group.tables})


class OneTableTier:
    """One table's tier, on the multi-table caches of :attr:`caches` (``options``: their settings beyond the tables)."""

    caches: type
    _TABLE = "table"

    def __init__(self, table: np.ndarray, capacity: int, **options) -> None:
        self._caches = self.caches({self._TABLE: table}, {self._TABLE: capacity}, **options)
        self.capacity = int(self._caches.capacities[0])

    @property
    def table(self) -> np.ndarray:
        return self._caches.tables[self._TABLE]

    def lookup(self, ids: np.ndarray) -> Rows:
        return self._caches.lookup([self._TABLE], np.asarray(ids).reshape(-1, 1))[:, 0]

    def stats(self) -> dict[str, int]:
        return self._caches.stats()[self._TABLE]

    def cached_ids(self) -> np.ndarray:
        return self._caches.cached_ids(self._TABLE)

    def refill(self, table: np.ndarray) -> None:
        if table.shape[1] != self.table.shape[1]:
            raise ValueError(f"new table has dim {table.shape[1]}, the cache holds dim {self.table.shape[1]}")
        self._caches.refill({self._TABLE: table})

    @classmethod
    def for_tables(cls, tables: dict[str, np.ndarray], capacities: dict[str, int], **options) -> TableCaches:
        """The caches of ``tables`` in one set of arrays per dim and dtype."""
        kinds: dict[tuple, dict[str, np.ndarray]] = {}
        for name, table in tables.items():
            kinds.setdefault((table.shape[1:], table.dtype.str), {})[name] = table
        groups = [cls.caches(group, capacities, **options) for group in kinds.values()]
        return groups[0] if len(groups) == 1 else _ByDim(groups)


class LruCache(OneTableTier):
    """Least recently used: evicts the rows whose last lookup is oldest."""

    caches = _LruCaches


class LfuCache(OneTableTier):
    """Least frequently used: evicts the rows looked up the fewest times since they were cached."""

    caches = _LfuCaches


class NoCache:
    """Every lookup goes to the store (capacity 0): the baseline the cache is measured against."""

    def __init__(self, table: np.ndarray, capacity: int = 0) -> None:
        self.table = table
        self.capacity = 0
        self.misses = 0

    def lookup(self, ids):
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        self.misses += int(np.unique(ids).size)
        return self.table[ids]

    def stats(self):
        return {"hits": 0, "misses": self.misses, "evictions": 0, "size": 0, "capacity": 0}

    def cached_ids(self):
        return np.empty(0, dtype=np.int64)

    def refill(self, table):
        self.table = table
