"""Caches of hot embedding rows in front of the host store, behind one small interface.

A cache *tier* serves rows of one table: ``lookup(ids) -> rows`` reads hits from its own memory and
misses from the table behind it (the memory-mapped store), inserting them and evicting by its
policy. It counts hits, misses and evictions over the *distinct* ids of each lookup (duplicates in
a batch are served once, as HugeCTR's HPS deduplicates keys before querying its cache).

Tiers are named in :data:`TIERS`, a dict of lazy ``"module:attr"`` entries imported on first use,
so a GPU tier plugs in beside the CPU ones without touching the embedding model (and torch is
imported only for one): ``register_tier(name, "module:attr")``. Here: ``lru`` and ``lfu``,
vectorized with numpy (a direct-mapped index of 4 bytes per table row, no Python loop per id),
``none``, and in :mod:`export.cache_torch` ``gpu-lru`` / ``gpu-lfu`` (the same policies on a torch device,
giving the same answers, counters and evictions). A full cache evicts its rows of lowest priority (the
oldest lookup, or the fewest lookups), a tie going to the lower slot, so that every tier evicts the
same rows.

The embedding lookup asks for the rows of all its tables at once (:func:`make_caches`,
:class:`TableCaches`). A tier class that can serve several tables in one step says so with a
``for_tables`` class method: ``lru`` and ``lfu`` keep every table's cache in one set of arrays (and
``gpu-lru`` / ``gpu-lfu`` in one set of tensors), so a batch's ids of all tables are deduplicated,
found and gathered by one call each, not one per table (a model has tens of small tables: at a
batch of one row, the calls per table cost far more than the rows). Each table keeps its own
capacity, evictions and counters. Other tiers are looked up table by table.

Example::

    cache = make_tier("lru", store_table, capacity=1000)
    rows = cache.lookup(np.array([5, 7, 5]))      # [3, dim]; 2 misses
    cache.lookup(np.array([5])); cache.stats()     # {"hits": 1, "misses": 2, "evictions": 0, ...}

    caches = make_caches("lru", {"t_C1": table_1, "t_C2": table_2}, {"t_C1": 1000, "t_C2": 50})
    rows = caches.lookup(["t_C1", "t_C2"], np.array([[5, 3], [7, 3]]))     # [2 rows, 2 tables, dim]
"""

from __future__ import annotations

from typing import Protocol

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


class TableCaches(Protocol):
    """The caches of several tables, looked up together."""

    def lookup(self, tables: list[str], ids: np.ndarray) -> np.ndarray:
        """``ids`` ``[n, k]``: column ``j`` holds ids of ``tables[j]`` (tables of one dim); their rows ``[n, k, dim]``."""
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


def make_caches(name: str, tables: dict[str, np.ndarray], capacities: dict[str, int]) -> TableCaches:
    """The caches of policy ``name`` over ``tables`` (``capacities``: rows per table): in one step where the
    tier class offers it (``for_tables``), else one tier per table."""
    factory = TIERS.load(name)
    for_tables = getattr(factory, "for_tables", None)
    if for_tables is not None:
        return for_tables(tables, capacities)
    return PerTable({table: factory(array, capacities[table]) for table, array in tables.items()})


class PerTable:
    """One tier per table, each looked up on its own."""

    def __init__(self, tiers: dict[str, CacheTier]) -> None:
        self.tiers = tiers

    def lookup(self, tables: list[str], ids: np.ndarray) -> np.ndarray:
        return np.stack([self.tiers[table].lookup(ids[:, j]) for j, table in enumerate(tables)], axis=1)

    def stats(self) -> dict[str, dict[str, int]]:
        return {table: tier.stats() for table, tier in self.tiers.items()}

    def cached_ids(self, table: str) -> np.ndarray:
        return self.tiers[table].cached_ids()

    def refill(self, tables: dict[str, np.ndarray]) -> None:
        for table, tier in self.tiers.items():
            tier.refill(tables[table])


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


class _ArrayCaches:
    """The LRU / LFU machinery over tables of one dim and dtype, in one set of arrays.

    A row's key is its id plus its table's first key, so the tables share one direct-mapped index
    (``key -> slot``); each table owns a segment of the slots (its capacity) and evicts within it.
    Subclasses say how a slot's priority is kept.
    """

    def __init__(self, tables: dict[str, np.ndarray], capacities: dict[str, int]) -> None:
        rows, self.capacities, self._first_key, self._first_slot = shared_layout(tables, capacities)
        self.tables = dict(tables)
        self._names = list(tables)
        self._index = {name: i for i, name in enumerate(tables)}
        slots = int(self._first_slot[-1])
        first = next(iter(tables.values()))
        self._slot_of = np.full(int(rows.sum()), -1, dtype=np.int32 if slots < 2**31 else np.int64)
        self._key_of = np.full(slots, -1, dtype=np.int64)
        self._rows = np.empty((slots, first.shape[1]), dtype=first.dtype)
        self._priority = np.zeros(slots, dtype=np.int64)
        self._occurrence = np.zeros(slots, dtype=np.int64)
        self._used = np.zeros(len(tables), dtype=np.int64)
        self._tick = 0
        self._hits = np.zeros(len(tables), dtype=np.int64)
        self._misses = np.zeros(len(tables), dtype=np.int64)
        self._evictions = np.zeros(len(tables), dtype=np.int64)

    def _touch(self, slots: np.ndarray, counts: np.ndarray) -> None:
        raise NotImplementedError

    def _initial_priority(self, counts: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def lookup(self, tables: list[str], ids: np.ndarray) -> np.ndarray:
        first_keys = self._first_key[[self._index[table] for table in tables]]
        keys = (np.asarray(ids, dtype=np.int64).reshape(-1, len(tables)) + first_keys).reshape(-1)
        return self._lookup_keys(keys).reshape(-1, len(tables), self._rows.shape[1])

    def _lookup_keys(self, keys: np.ndarray) -> np.ndarray:
        if keys.size == 0:
            return np.empty((0, self._rows.shape[1]), dtype=self._rows.dtype)
        self._tick += 1
        slots = self._slot_of[keys]
        if slots.min() >= 0:  # every row cached: read in place, nothing to insert
            self._touch_distinct(slots)
            return np.take(self._rows, slots, axis=0)
        unique, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
        slots = self._slot_of[unique]
        hit = slots >= 0
        hit_slots = slots[hit]
        self._touch(hit_slots, counts[hit])
        table_of = np.searchsorted(self._first_key, unique, side="right") - 1
        self._hits += np.bincount(table_of[hit], minlength=len(self._used))
        out = np.empty((unique.size, self._rows.shape[1]), dtype=self._rows.dtype)
        out[hit] = np.take(self._rows, hit_slots, axis=0)
        if hit_slots.size < unique.size:
            miss = ~hit
            keys, tables, counts = unique[miss], table_of[miss], counts[miss]
            self._misses += np.bincount(tables, minlength=len(self._used))
            fetched = np.empty((keys.size, self._rows.shape[1]), dtype=self._rows.dtype)
            for t in np.unique(tables).tolist():
                of_t = tables == t
                fetched[of_t] = self.tables[self._names[t]][keys[of_t] - self._first_key[t]]
                self._insert(t, keys[of_t], fetched[of_t], counts[of_t], hit_slots)
            out[miss] = fetched
        return np.take(out, inverse.reshape(-1), axis=0)

    def _touch_distinct(self, slots: np.ndarray) -> None:
        """Touch and count the distinct ``slots`` of a lookup without sorting them: each slot records the
        position of one of its occurrences, which stands for all of them."""
        positions = np.arange(slots.size)
        self._occurrence[slots] = positions
        stands_for = self._occurrence[slots]
        first = stands_for == positions
        distinct = slots[first]
        self._touch(distinct, np.bincount(stands_for, minlength=slots.size)[first])
        self._hits += np.bincount(np.searchsorted(self._first_slot, distinct, side="right") - 1,
                                  minlength=len(self._used))

    def _insert(self, t: int, keys: np.ndarray, rows: np.ndarray, counts: np.ndarray, protected: np.ndarray) -> None:
        """Cache the missed ``keys`` of table ``t``, never evicting ``protected`` (this batch's hits)."""
        start, capacity = int(self._first_slot[t]), int(self.capacities[t])
        protected = protected[(protected >= start) & (protected < start + capacity)] - start
        room = min(keys.size, capacity - protected.size)
        if room <= 0:
            return
        keys, rows, counts = keys[:room], rows[:room], counts[:room]
        used = int(self._used[t])
        take_free = min(capacity - used, room)
        slots = np.arange(used, used + take_free, dtype=np.int64)
        self._used[t] += take_free
        n_evict = room - take_free
        if n_evict:
            priority = self._priority[start: start + capacity].copy()
            priority[protected] = np.iinfo(np.int64).max
            priority[slots] = np.iinfo(np.int64).max
            victims = _lowest(priority, n_evict)
            self._slot_of[self._key_of[start + victims]] = -1
            self._evictions[t] += n_evict
            slots = np.concatenate([slots, victims])
        slots += start
        self._key_of[slots] = keys
        self._slot_of[keys] = slots
        self._rows[slots] = rows
        self._priority[slots] = self._initial_priority(counts)

    def cached_ids(self, table: str) -> np.ndarray:
        t = self._index[table]
        start = int(self._first_slot[t])
        return self._key_of[start: start + int(self._used[t])] - self._first_key[t]

    def refill(self, tables: dict[str, np.ndarray]) -> None:
        if any(tables[name].shape != table.shape for name, table in self.tables.items()):  # other shapes: start cold
            self.__init__({name: tables[name] for name in self._names}, dict(zip(self._names, self.capacities.tolist())))
            return
        self.tables = {name: tables[name] for name in self.tables}
        for name, t in self._index.items():
            start, used = int(self._first_slot[t]), int(self._used[t])
            if used:
                self._rows[start: start + used] = self.tables[name][self.cached_ids(name)]

    def stats(self) -> dict[str, dict[str, int]]:
        return {name: {"hits": int(self._hits[t]), "misses": int(self._misses[t]),
                       "evictions": int(self._evictions[t]), "size": int(self._used[t]),
                       "capacity": int(self.capacities[t])} for name, t in self._index.items()}


class _LruCaches(_ArrayCaches):
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

    def lookup(self, tables: list[str], ids: np.ndarray) -> np.ndarray:
        group = self._group_of[tables[0]]
        if any(self._group_of[table] is not group for table in tables):
            raise ValueError(f"tables {tables} differ in dim or dtype: look them up apart")
        return group.lookup(tables, ids)

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

    def lookup(self, ids: np.ndarray) -> np.ndarray:
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
