"""The cache tiers on a torch device: hot rows in GPU memory, the same policies and answers as the numpy tiers.

Named ``gpu-lru`` and ``gpu-lfu`` in :data:`export.cache.TIERS` (:class:`TorchLruCache`, :class:`TorchLfuCache`);
the ``embedding`` model uses them for a ``KIND_GPU`` instance (device ``cuda:<instance device id>``). As in the
numpy ``lru`` / ``lfu``, the caches of all tables of one dim and dtype live in one set of tensors
(:class:`TorchCaches`: key -> slot over the rows of all tables, slot -> key, rows, priorities; each table owns
a segment of the slots, its capacity, and evicts within it), so one lookup serves a request's ids of every
table, waiting for the device once:

- the ids go to the device in one copy, are deduplicated there by one sort, and the hits gathered there;
- one read brings back the answer (a missed id's row left blank) with the distinct missed ids and each
  table's number of hits: the counters are kept on the host from these sizes, and nothing more is read
  when every id hit;
- the missed rows are read from the memory-mapped store tables on the host, filled into the answer,
  and go to the device in one copy, where they are cached (the victims of the tables that evict found
  by sorting their slots by table, priority and slot) while the host goes on.

``device="cpu"`` runs the same code on the CPU, which is how it is tested without a GPU.

Example::

    caches = TorchLruCache.for_tables({"t_C1": table_1, "t_C2": table_2}, {"t_C1": 1000, "t_C2": 50}, device="cuda:0")
    rows = caches.lookup(["t_C1", "t_C2"], np.array([[5, 3], [7, 3]]))     # numpy [2 rows, 2 tables, dim]
    cache = TorchLfuCache(store_table, capacity=100_000)                    # one table, on the current GPU
"""

from __future__ import annotations

import numpy as np
import torch

from export.cache import OneTableTier, shared_layout

_TOP = torch.iinfo(torch.int64).max


class TorchCaches:
    """The LRU / LFU machinery over tables of one dim and dtype on ``device``; numpy in and out.

    A row's key is its id plus its table's first key. ``_slot_of[key]`` is its slot, or the spare slot
    past the last (``_spare``) where it is not cached, so every gather and scatter runs without a mask:
    a missed key reads the spare row and touches the spare priority. Subclasses say how a slot's
    priority is kept.
    """

    def __init__(self, tables: dict[str, np.ndarray], capacities: dict[str, int],
                 device: str | torch.device = "cuda") -> None:
        rows, self.capacities, self._first_key, self._first_slot = shared_layout(tables, capacities)
        self.device = torch.device(device)
        self.tables = dict(tables)
        self._names = list(tables)
        self._index = {name: i for i, name in enumerate(tables)}
        self._spare = int(self._first_slot[-1])
        first = next(iter(tables.values()))
        self._dim, self._dtype = first.shape[1], first.dtype
        on = {"device": self.device}
        self._slot_of = torch.full((int(rows.sum()),), self._spare, dtype=torch.int64, **on)
        self._key_of = torch.full((self._spare + 1,), -1, dtype=torch.int64, **on)
        self._rows = torch.zeros((self._spare + 1, self._dim), dtype=_torch_dtype(first.dtype), **on)
        self._priority = torch.zeros(self._spare + 1, dtype=torch.int64, **on)
        self._table_of_slot = torch.from_numpy(np.repeat(np.arange(len(tables)), self.capacities)).to(self.device)
        self._first_keys = torch.from_numpy(self._first_key).to(self.device)
        self._used = np.zeros(len(tables), dtype=np.int64)
        self._tick = 0
        self._hits = np.zeros(len(tables), dtype=np.int64)
        self._misses = np.zeros(len(tables), dtype=np.int64)
        self._evictions = np.zeros(len(tables), dtype=np.int64)

    def _touch(self, slots: torch.Tensor) -> None:
        """Mark this lookup's ``slots`` (one per id, repeats included) as looked up."""
        raise NotImplementedError

    def _initial_priority(self, counts: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def lookup(self, tables: list[str], ids: np.ndarray) -> np.ndarray:
        first_keys = self._first_key[[self._index[table] for table in tables]]
        keys = (np.asarray(ids, dtype=np.int64).reshape(-1, len(tables)) + first_keys).reshape(-1)
        return self._lookup_keys(keys).reshape(-1, len(tables), self._dim)

    def _lookup_keys(self, keys: np.ndarray) -> np.ndarray:
        if keys.size == 0:
            return np.empty((0, self._dim), dtype=self._dtype)
        self._tick += 1
        keys_on_device = self._to_device(keys)
        slots = self._slot_of[keys_on_device]
        self._touch(slots)
        answer, report = self._read(self._rows[slots], self._report(keys_on_device, slots))
        self._hits += report[keys.size:]
        missed = report[: keys.size]
        missed = missed[missed >= 0]
        if missed.size == 0:
            return answer
        misses = np.bincount(np.searchsorted(self._first_key, missed, side="right") - 1, minlength=len(self._names))
        self._misses += misses
        fetched = self._fetch(missed, misses)
        at = np.minimum(np.searchsorted(missed, keys), missed.size - 1)
        was_missed = missed[at] == keys
        answer[was_missed] = fetched[at[was_missed]]
        self._insert(missed, fetched, np.bincount(at[was_missed], minlength=missed.size), misses,
                     report[keys.size:], slots)
        return answer

    def _report(self, keys: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The distinct keys not cached, in order, then -1 up to ``keys``' length; then each table's distinct hits."""
        ordered, order = torch.sort(keys)
        first = torch.ones_like(ordered, dtype=torch.bool)
        first[1:] = ordered[1:] != ordered[:-1]
        cached = slots[order] < self._spare
        table = torch.searchsorted(self._first_keys, ordered, right=True) - 1
        hits = torch.zeros(len(self._names), dtype=torch.int64, device=self.device)
        hits.index_add_(0, table, (first & cached).to(torch.int64))
        missed = first & ~cached
        report = torch.full((ordered.numel() + 1,), -1, dtype=torch.int64, device=self.device)
        report.scatter_(0, torch.where(missed, missed.cumsum(0) - 1, ordered.numel()), ordered)
        return torch.cat([report[:-1], hits])

    def _fetch(self, keys: np.ndarray, per_table: np.ndarray) -> np.ndarray:
        """The store's rows of ``keys``, grouped by table (``per_table`` of each, in table order)."""
        rows = np.empty((keys.size, self._dim), dtype=self._dtype)
        ends = np.cumsum(per_table)
        for t in np.flatnonzero(per_table).tolist():
            start = ends[t] - per_table[t]
            rows[start: ends[t]] = self.tables[self._names[t]][keys[start: ends[t]] - self._first_key[t]]
        return rows

    def _insert(self, keys: np.ndarray, rows: np.ndarray, counts: np.ndarray, misses: np.ndarray,
                hits: np.ndarray, protected: torch.Tensor) -> None:
        """Cache the missed ``keys`` (in order, with their ``rows`` and numbers of occurrences; ``misses`` and
        ``hits`` per table): each table's first keys, as many as its capacity holds beside its hits, go to its
        free slots, then to those of lowest priority, never one of ``protected`` (this lookup's slots)."""
        room = np.maximum(0, np.minimum(misses, self.capacities - hits))
        free = np.minimum(self.capacities - self._used, room)
        evict = room - free
        table = np.repeat(np.arange(len(self._names)), misses)
        rank = np.arange(keys.size) - np.repeat(np.cumsum(misses) - misses, misses)  # among its table's misses
        to_free = np.flatnonzero(rank < free[table])
        to_evict = np.flatnonzero((rank >= free[table]) & (rank < room[table]))
        free_slots = self._first_slot[table[to_free]] + self._used[table[to_free]] + rank[to_free]
        victims_at = self._first_slot[table[to_evict]] + rank[to_evict] - free[table[to_evict]]
        self._used += free
        self._evictions += evict
        new = np.concatenate([to_free, to_evict])
        if new.size == 0:
            return
        plan = self._to_device(np.concatenate([keys[new], counts[new], free_slots, victims_at]))
        new_rows = self._to_device(rows[new])
        new_keys, new_counts = plan[: new.size], plan[new.size: 2 * new.size]
        slots = plan[2 * new.size: 2 * new.size + free_slots.size]
        if to_evict.size:
            evicting = np.flatnonzero(evict)
            span = int(self._first_slot[evicting[0]]), int(self._first_slot[evicting[-1] + 1])
            victims = self._victims(plan[2 * new.size + free_slots.size:], span, protected, slots)
            self._slot_of.index_fill_(0, self._key_of[victims], self._spare)
            slots = torch.cat([slots, victims])
        self._key_of[slots] = new_keys
        self._slot_of[new_keys] = slots
        self._rows[slots] = new_rows
        self._priority[slots] = self._initial_priority(new_counts)

    def _victims(self, at: torch.Tensor, span: tuple[int, int], protected: torch.Tensor,
                taken: torch.Tensor) -> torch.Tensor:
        """The slots at positions ``at`` when the slots of ``span`` are ordered by table, priority and slot,
        ``protected`` and ``taken`` ones last in their table."""
        start, end = span
        priority = self._priority.clone()
        priority.index_fill_(0, protected, _TOP)
        priority.index_fill_(0, taken, _TOP)
        by_priority = torch.sort(priority[start:end], stable=True).indices
        order = by_priority[torch.sort(self._table_of_slot[start:end][by_priority], stable=True).indices]
        return order[at - start] + start

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor

    def _read(self, *tensors: torch.Tensor) -> list[np.ndarray]:
        """``tensors`` copied to the host, waiting for the device once."""
        copies = [tensor.to("cpu", non_blocking=True) for tensor in tensors]
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return [copy.numpy() for copy in copies]

    def cached_ids(self, table: str) -> np.ndarray:
        t = self._index[table]
        start = int(self._first_slot[t])
        return self._read(self._key_of[start: start + int(self._used[t])])[0] - self._first_key[t]

    def refill(self, tables: dict[str, np.ndarray]) -> None:
        if any(tables[name].shape != table.shape or tables[name].dtype != table.dtype
               for name, table in self.tables.items()):  # other shapes: start cold
            self.__init__({name: tables[name] for name in self._names},
                          dict(zip(self._names, self.capacities.tolist())), self.device)
            return
        self.tables = {name: tables[name] for name in self._names}
        slots = np.concatenate([np.arange(start, start + used) for start, used in zip(self._first_slot, self._used)])
        if slots.size:
            keys = self._read(self._key_of[: self._spare])[0][slots]
            self._rows[self._to_device(slots)] = self._to_device(self._fetch(keys, self._used))

    def stats(self) -> dict[str, dict[str, int]]:
        return {name: {"hits": int(self._hits[t]), "misses": int(self._misses[t]),
                       "evictions": int(self._evictions[t]), "size": int(self._used[t]),
                       "capacity": int(self.capacities[t])} for name, t in self._index.items()}


class _TorchLruCaches(TorchCaches):
    def _touch(self, slots):
        self._priority.index_fill_(0, slots, self._tick)

    def _initial_priority(self, counts):
        return torch.full_like(counts, self._tick)


class _TorchLfuCaches(TorchCaches):
    def _touch(self, slots):
        self._priority.index_add_(0, slots, torch.ones_like(slots))

    def _initial_priority(self, counts):
        return counts


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.zeros(1, dtype=dtype)).dtype


class TorchLruCache(OneTableTier):
    """The ``gpu-lru`` tier: least recently used, on ``device`` (the current CUDA device unless given)."""

    caches = _TorchLruCaches


class TorchLfuCache(OneTableTier):
    """The ``gpu-lfu`` tier: least frequently used, on ``device`` (the current CUDA device unless given)."""

    caches = _TorchLfuCaches
