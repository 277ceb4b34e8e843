"""Caches of hot embedding rows in front of the host store, behind one small interface.

A cache *tier* serves rows of one table: ``lookup(ids) -> rows`` reads hits from its own memory and
misses from the table behind it (the memory-mapped store), inserting them and evicting by its
policy. It counts hits, misses and evictions over the *distinct* ids of each lookup (duplicates in
a batch are served once, as HugeCTR's HPS deduplicates keys before querying its cache).

Tiers are named in :data:`TIERS`, a dict of lazy ``"module:attr"`` entries imported on first use,
so a GPU tier plugs in beside the CPU ones without touching the embedding model (and torch is
imported only for one): ``register_tier(name, "module:attr")``. Here: ``lru`` and ``lfu``,
vectorized with numpy (a direct-mapped index of 4 bytes per table row, no Python loop per id),
``none``, and in :mod:`export.cache_torch` ``gpu-lru`` / ``gpu-lfu`` (the same policies on a torch device).

Example::

    cache = make_tier("lru", store_table, capacity=1000)
    rows = cache.lookup(np.array([5, 7, 5]))      # [3, dim]; 2 misses
    cache.lookup(np.array([5])); cache.stats()     # {"hits": 1, "misses": 2, "evictions": 0, ...}
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


TIERS = Registry("cache policy", {
    "lru": "export.cache:LruCache",
    "lfu": "export.cache:LfuCache",
    "none": "export.cache:NoCache",
    "gpu-lru": "export.cache_torch:gpu_lru",
    "gpu-lfu": "export.cache_torch:gpu_lfu",
})
"""Tier name -> ``"module:attr"`` of its factory: ``factory(table, capacity) -> CacheTier``."""
register_tier = TIERS.register


def make_tier(name: str, table: np.ndarray, capacity: int) -> CacheTier:
    """A new tier of policy ``name`` over ``table`` holding up to ``capacity`` rows."""
    return TIERS.load(name)(table, capacity)


class _ArrayCache:
    """Shared machinery of the LRU and LFU tiers; subclasses say how a slot's priority is kept."""

    def __init__(self, table: np.ndarray, capacity: int) -> None:
        if table.ndim != 2:
            raise ValueError(f"expected a [rows, dim] table, got shape {table.shape}")
        self.table = table
        self.capacity = int(max(0, min(capacity, table.shape[0])))
        self._slot_of = np.full(table.shape[0], -1, dtype=np.int32)
        self._id_of = np.full(self.capacity, -1, dtype=np.int64)
        self._rows = np.empty((self.capacity, table.shape[1]), dtype=table.dtype)
        self._priority = np.zeros(self.capacity, dtype=np.int64)
        self._used = 0
        self._tick = 0
        self.hits = self.misses = self.evictions = 0

    def _touch(self, slots: np.ndarray, counts: np.ndarray) -> None:
        raise NotImplementedError

    def _initial_priority(self, counts: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            return np.empty((0, self.table.shape[1]), dtype=self.table.dtype)
        self._tick += 1
        unique, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
        slots = self._slot_of[unique]
        hit = slots >= 0
        hit_slots = slots[hit]
        self._touch(hit_slots, counts[hit])
        miss = ~hit
        miss_ids = unique[miss]
        out = np.empty((unique.size, self.table.shape[1]), dtype=self.table.dtype)
        out[hit] = self._rows[hit_slots]
        if miss_ids.size:
            fetched = self.table[miss_ids]
            out[miss] = fetched
            self._insert(miss_ids, fetched, counts[miss], hit_slots)
        self.hits += int(hit_slots.size)
        self.misses += int(miss_ids.size)
        return out[inverse]

    def _insert(self, ids: np.ndarray, rows: np.ndarray, counts: np.ndarray, protected: np.ndarray) -> None:
        free = self.capacity - self._used
        room = min(ids.size, self.capacity - protected.size)
        if room <= 0:
            return
        ids, rows, counts = ids[:room], rows[:room], counts[:room]
        take_free = min(free, room)
        slots = np.arange(self._used, self._used + take_free, dtype=np.int64)
        self._used += take_free
        n_evict = room - take_free
        if n_evict:
            priority = self._priority.copy()
            priority[protected] = np.iinfo(np.int64).max
            priority[slots] = np.iinfo(np.int64).max
            victims = np.argpartition(priority, n_evict - 1)[:n_evict]
            self._slot_of[self._id_of[victims]] = -1
            self.evictions += int(n_evict)
            slots = np.concatenate([slots, victims])
        self._id_of[slots] = ids
        self._slot_of[ids] = slots.astype(np.int32)
        self._rows[slots] = rows
        self._priority[slots] = self._initial_priority(counts)

    def cached_ids(self) -> np.ndarray:
        return self._id_of[: self._used].copy()

    def refill(self, table: np.ndarray) -> None:
        if table.shape[1] != self.table.shape[1]:
            raise ValueError(f"new table has dim {table.shape[1]}, the cache holds dim {self.table.shape[1]}")
        if table.shape[0] != self.table.shape[0]:
            self.__init__(table, self.capacity)  # row count changed: start cold
            return
        self.table = table
        if self._used:
            self._rows[: self._used] = table[self._id_of[: self._used]]

    def stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                "size": self._used, "capacity": self.capacity}


class LruCache(_ArrayCache):
    """Least recently used: evicts the rows whose last lookup is oldest."""

    def _touch(self, slots, counts):
        self._priority[slots] = self._tick

    def _initial_priority(self, counts):
        return self._tick


class LfuCache(_ArrayCache):
    """Least frequently used: evicts the rows looked up the fewest times since they were cached."""

    def _touch(self, slots, counts):
        self._priority[slots] += counts

    def _initial_priority(self, counts):
        return counts


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
