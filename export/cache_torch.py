"""The cache tier on a torch device: hot rows in GPU memory, the same policies as the numpy tiers.

Named ``gpu-lru`` and ``gpu-lfu`` in :data:`export.cache.TIERS` (``make_tier("gpu-lru", table, capacity)``); the
``embedding`` model uses them for a ``KIND_GPU`` instance (device ``cuda:<instance device id>``).
Bookkeeping (the id -> slot index, priorities, eviction by ``topk``) runs on the device too; only
the missing rows travel from the host store. ``device="cpu"`` runs the same code on the CPU, which
is how it is tested without a GPU; custom kernels can replace its body later without changing the
interface.

Example::

    cache = TorchCache(store_table, capacity=100_000, device="cuda:0", policy="lru")
    rows = cache.lookup(np.array([5, 7, 5]))       # numpy [3, dim], gathered on the GPU
"""

from __future__ import annotations

import numpy as np
import torch


class TorchCache:
    """LRU or LFU cache of ``table``'s rows on ``device``; ``lookup`` takes and returns numpy."""

    def __init__(self, table: np.ndarray, capacity: int, device: str | torch.device = "cuda",
                 policy: str = "lru") -> None:
        if policy not in ("lru", "lfu"):
            raise ValueError(f"policy: expected lru or lfu, got {policy!r}")
        if table.ndim != 2:
            raise ValueError(f"expected a [rows, dim] table, got shape {table.shape}")
        self.device = torch.device(device)
        self.policy = policy
        self.table = table
        self.capacity = int(max(0, min(capacity, table.shape[0])))
        self._slot_of = torch.full((table.shape[0],), -1, dtype=torch.int64, device=self.device)
        self._id_of = torch.full((self.capacity,), -1, dtype=torch.int64, device=self.device)
        self._rows = torch.empty((self.capacity, table.shape[1]), dtype=_torch_dtype(table.dtype), device=self.device)
        self._priority = torch.zeros(self.capacity, dtype=torch.int64, device=self.device)
        self._used = 0
        self._tick = 0
        self.hits = self.misses = self.evictions = 0

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        ids_t = torch.as_tensor(np.asarray(ids, dtype=np.int64).reshape(-1), device=self.device)
        if ids_t.numel() == 0:
            return np.empty((0, self.table.shape[1]), dtype=self.table.dtype)
        self._tick += 1
        unique, inverse, counts = torch.unique(ids_t, return_inverse=True, return_counts=True)
        slots = self._slot_of[unique]
        hit = slots >= 0
        hit_slots = slots[hit]
        if self.policy == "lru":
            self._priority[hit_slots] = self._tick
        else:
            self._priority[hit_slots] += counts[hit]
        out = torch.empty((unique.numel(), self.table.shape[1]), dtype=self._rows.dtype, device=self.device)
        out[hit] = self._rows[hit_slots]
        miss = ~hit
        miss_ids = unique[miss]
        if miss_ids.numel():
            fetched = torch.from_numpy(np.ascontiguousarray(self.table[miss_ids.cpu().numpy()])).to(self.device)
            out[miss] = fetched
            self._insert(miss_ids, fetched, counts[miss], hit_slots)
        self.hits += int(hit_slots.numel())
        self.misses += int(miss_ids.numel())
        return out[inverse].cpu().numpy()

    def _insert(self, ids, rows, counts, protected) -> None:
        room = min(ids.numel(), self.capacity - protected.numel())
        if room <= 0:
            return
        ids, rows, counts = ids[:room], rows[:room], counts[:room]
        take_free = min(self.capacity - self._used, room)
        slots = torch.arange(self._used, self._used + take_free, device=self.device)
        self._used += take_free
        n_evict = room - take_free
        if n_evict:
            priority = self._priority.clone()
            top = torch.iinfo(torch.int64).max
            priority[protected] = top
            priority[slots] = top
            victims = torch.topk(priority, n_evict, largest=False).indices
            self._slot_of[self._id_of[victims]] = -1
            self.evictions += int(n_evict)
            slots = torch.cat([slots, victims])
        self._id_of[slots] = ids
        self._slot_of[ids] = slots
        self._rows[slots] = rows
        self._priority[slots] = self._tick if self.policy == "lru" else counts

    def cached_ids(self) -> np.ndarray:
        return self._id_of[: self._used].cpu().numpy()

    def refill(self, table: np.ndarray) -> None:
        if table.shape != self.table.shape:
            self.__init__(table, self.capacity, self.device, self.policy)
            return
        self.table = table
        if self._used:
            ids = self._id_of[: self._used].cpu().numpy()
            self._rows[: self._used] = torch.from_numpy(np.ascontiguousarray(table[ids])).to(self.device)

    def stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                "size": self._used, "capacity": self.capacity}


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.zeros(1, dtype=dtype)).dtype


def gpu_lru(table: np.ndarray, capacity: int) -> TorchCache:
    """The ``gpu-lru`` tier: LRU on the current CUDA device."""
    return TorchCache(table, capacity, "cuda", "lru")


def gpu_lfu(table: np.ndarray, capacity: int) -> TorchCache:
    """The ``gpu-lfu`` tier: LFU on the current CUDA device."""
    return TorchCache(table, capacity, "cuda", "lfu")
