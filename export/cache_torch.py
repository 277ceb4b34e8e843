"""The cache tiers whose rows live on a torch device: hot rows in GPU memory, the answer a tensor there.

Named ``gpu-lru`` and ``gpu-lfu`` in :data:`export.cache.TIERS` (:class:`TorchLruCache`, :class:`TorchLfuCache`);
the embedding lookup uses them for a ``KIND_GPU`` instance (device ``cuda:<instance device id>``). They are the
numpy ``lru`` / ``lfu`` caches (one index on the host for all tables of one dim and dtype, each table a segment
of the slots with its own capacity and evictions: the same answers, counters and evictions) with their rows in
a :class:`DeviceRows` store, so a lookup never waits for the device:

- the index finds every id's slot on the host;
- every id hit: the slots go to the device in one copy and the rows are gathered there;
- some missed: their rows are read from the memory-mapped store tables on the host straight into a page-locked
  buffer beside the slots and where each missed row goes (its new slot, or its place in the answer when its
  table's cache has no room), all of it goes to the device in one copy, and the rows are cached and filled in
  there.

The answer is a tensor on the device, computed on its current stream: the dense part takes it as it is, and the
first read of a result on the host (the probabilities) waits for it.

``device="cpu"`` runs the same code on the CPU (the page-locked buffer is then plain memory and nothing is
copied), which is how it is tested without a GPU.

Example::

    caches = TorchLruCache.for_tables({"t_C1": table_1, "t_C2": table_2}, {"t_C1": 1000, "t_C2": 50}, device="cuda:0")
    rows = caches.lookup(["t_C1", "t_C2"], np.array([[5, 3], [7, 3]]))     # tensor [2 rows, 2 tables, dim] on cuda:0
    cache = TorchLfuCache(store_table, capacity=100_000)                    # one table, on the current GPU
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from export.cache import OneTableTier, _LfuCaches, _LruCaches

_ALIGN = 64
"""Each array in a staging buffer starts at a multiple of this many bytes (any dtype's alignment)."""


def aligned_spans(specs: list[tuple[tuple[int, ...], np.dtype]]) -> tuple[list[tuple[int, int]], int]:
    """Where each array of ``specs`` (shape, dtype) starts in one buffer (at a multiple of :data:`_ALIGN` bytes) and
    its size in bytes, and where the last ends."""
    spans, end = [], 0
    for shape, dtype in specs:
        size = math.prod(shape) * np.dtype(dtype).itemsize
        spans.append((end, size))
        end += -(-size // _ALIGN) * _ALIGN
    return spans, end


class _Staging:
    """Arrays for a device, written into one page-locked host buffer and sent with one copy.

    The buffers are kept and grown: :meth:`reserve` hands out views of the host buffer (waiting, when the copy
    of the last :meth:`send` has not run yet, for that copy alone), :meth:`send` copies the bytes reserved and
    returns the same views of the device buffer. On the CPU the two buffers are one and nothing is copied.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._sent = torch.cuda.Event() if self._cuda else None
        self._pending = False
        self._layout: list[tuple[int, tuple[int, ...], np.dtype]] = []
        self._end = 0
        self._allocate(0)

    def _allocate(self, size: int) -> None:
        if self._cuda:
            self._host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            self._host_bytes = self._host.numpy()
            self._on_device = torch.empty(size, dtype=torch.uint8, device=self.device)
        else:
            self._host_bytes = np.empty(size, dtype=np.uint8)
            self._host = self._on_device = torch.from_numpy(self._host_bytes)

    def reserve(self, specs: list[tuple[tuple[int, ...], np.dtype]]) -> list[np.ndarray]:
        """Host views of the given shapes and dtypes to fill before :meth:`send`."""
        spans, end = aligned_spans(specs)
        self._layout = [(start, size, tuple(shape), np.dtype(dtype)) for (start, size), (shape, dtype) in zip(spans, specs)]
        self._end = end
        if self._pending:
            self._sent.synchronize()
            self._pending = False
        if end > self._host.numel():
            self._allocate(max(end, 2 * self._host.numel(), 1 << 16))
        return [self._host_bytes[start: start + size].view(dtype).reshape(shape)
                for start, size, shape, dtype in self._layout]

    def send(self) -> list[torch.Tensor]:
        """The reserved arrays on the device (one copy), as views of its buffer, valid until the next send."""
        if self._cuda:
            self._on_device[: self._end].copy_(self._host[: self._end], non_blocking=True)
            self._sent.record(torch.cuda.current_stream(self.device))
            self._pending = True
        return [self._on_device[start: start + size].view(torch_dtype(dtype)).view(shape)
                for start, size, shape, dtype in self._layout]


class DeviceRows:
    """The cached rows of a set of caches on a torch device (the row store of :class:`export.cache.HostRows`'s
    interface), plus one spare row that an id whose row is not cached reads before its row is filled in."""

    def __init__(self, slots: int, dim: int, dtype: np.dtype, device: str | torch.device = "cuda") -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.rows = torch.zeros((slots + 1, dim), dtype=torch_dtype(dtype), device=self.device)
        self._dtype = np.dtype(dtype)
        self._spare = slots
        self._staging = _Staging(self.device)

    def empty(self) -> torch.Tensor:
        return self.rows[:0]

    def take(self, slots: np.ndarray) -> torch.Tensor:
        (host,) = self._staging.reserve([(slots.shape, np.int64)])
        host[...] = slots
        (on_device,) = self._staging.send()
        return self.rows.index_select(0, on_device)

    def serve(self, unique_slots: np.ndarray, hit: np.ndarray, inverse: np.ndarray, new_slots: np.ndarray,
              cached: np.ndarray, fetch: Callable[[np.ndarray], None], gather: bool = True) -> torch.Tensor | np.ndarray:
        """As :meth:`export.cache.HostRows.serve`; with ``gather=False``, when every missed row found a slot, the
        rows are only filled in (queued on the current stream) and the answer is each id's slot, on the host."""
        inverse = inverse.reshape(-1)
        missed = np.flatnonzero(~hit)
        after = unique_slots.astype(np.int64)
        after[missed[cached]] = new_slots
        slots = after[inverse]
        uncached = np.flatnonzero(slots < 0)  # a missed id whose table's cache had no room: filled in below
        slots[uncached] = self._spare
        ints = (slots, new_slots, cached, uncached, (np.cumsum(~hit) - 1)[inverse[uncached]])
        host = self._staging.reserve([((missed.size, self.rows.shape[1]), self._dtype)]
                                     + [(a.shape, np.int64) for a in ints])
        fetch(host[0])
        for view, values in zip(host[1:], ints):
            view[...] = values
        placed = slots if not gather and not len(uncached) else None
        fetched, slots, new_slots, cached, uncached, source = self._staging.send()
        if len(new_slots):
            self.rows[new_slots] = fetched[cached]
        if placed is not None:
            return placed
        answer = self.rows.index_select(0, slots)
        if len(uncached):
            answer[uncached] = fetched[source]
        return answer

    def write(self, slots: np.ndarray, rows: np.ndarray) -> None:
        host_rows, host_slots = self._staging.reserve([(rows.shape, self._dtype), (slots.shape, np.int64)])
        host_rows[...] = rows
        host_slots[...] = slots
        rows, slots = self._staging.send()
        self.rows[slots] = rows


_TORCH_DTYPES: dict[np.dtype, torch.dtype] = {}


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    found = _TORCH_DTYPES.get(dtype)
    if found is None:
        found = _TORCH_DTYPES[dtype] = torch.from_numpy(np.zeros(1, dtype=dtype)).dtype
    return found


class CachedRows(NamedTuple):
    """A batch's rows where a device cache holds them: ``rows[slots[b, c]]`` is column ``c``'s row for batch row
    ``b``. A consumer that gathers them itself (the dense part's CUDA graph) takes them so, with no gather of its own
    beforehand; :meth:`gathered` is the pooled answer ``[B, columns * dim]`` float32 on the device."""

    rows: torch.Tensor
    slots: np.ndarray

    def __len__(self) -> int:
        return len(self.slots)

    def gathered(self) -> torch.Tensor:
        slots = torch.from_numpy(np.ascontiguousarray(self.slots, dtype=np.int64).reshape(-1))
        rows = self.rows.index_select(0, slots.to(self.rows.device, non_blocking=True))
        return rows.view(len(self.slots), -1).float()


class _OnDevice:
    row_store = DeviceRows

    @property
    def device(self) -> torch.device:
        return self._rows.device

    def rows_or_lookup(self, tables: list[str], ids: np.ndarray) -> CachedRows | torch.Tensor:
        """A lookup of ``ids`` (as :meth:`lookup` takes them, counted as one) without its gather: the rows where
        this cache holds them and each id's slot, the missed rows fetched into the cache first; the rows as
        :meth:`lookup` answers them when a missed row found no room in its table's cache (a batch with more
        distinct ids of a table than its capacity)."""
        found = self._lookup_keys(self._keys(tables, ids), gather=False)
        return found if isinstance(found, torch.Tensor) else CachedRows(self._rows.rows, found.reshape(-1, len(tables)))


class _TorchLruCaches(_OnDevice, _LruCaches):
    pass


class _TorchLfuCaches(_OnDevice, _LfuCaches):
    pass


class TorchLruCache(OneTableTier):
    """The ``gpu-lru`` tier: least recently used, its rows on ``device`` (the current CUDA device unless given)."""

    caches = _TorchLruCaches


class TorchLfuCache(OneTableTier):
    """The ``gpu-lfu`` tier: least frequently used, its rows on ``device`` (the current CUDA device unless given)."""

    caches = _TorchLfuCaches
