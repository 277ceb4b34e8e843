"""A fixed set of pinned host buffers, reused once the device copy out of each has finished.

Pinning memory (``cudaHostAlloc``) is slow and takes a process-wide lock, so reader threads that
pinned a new block per read spent more time pinning than decoding. Here the buffers are made once
per iteration of a loader (from torch's cache of pinned memory after the first); a reader takes
one, fills it, and the producer gives it back right after queueing the copy to the device, with an
event that says when the copy is done. A reader that finds no free buffer waits on the oldest such
event.

Example::

    pool = PinnedPool(count=8, numel=40 * 65536)
    buffer = pool.acquire(stop)                  # a flat pinned int32 tensor
    device_copy = buffer.to("cuda", non_blocking=True)
    pool.release(buffer, copied_on=torch.cuda.current_stream())
"""

from __future__ import annotations

import queue
import threading
from collections import deque

import torch


class Stopped(Exception):
    """The loader was stopped while a reader waited for a buffer."""


class PinnedPool:
    """``count`` pinned int32 buffers of ``numel`` elements, made on first use."""

    def __init__(self, count: int, numel: int) -> None:
        self.count, self.numel = count, numel
        self._buffers: list[torch.Tensor] = []
        self._free: queue.Queue[torch.Tensor] = queue.Queue()
        self._copying: deque[tuple[torch.Tensor, torch.cuda.Event]] = deque()
        self._lock = threading.Lock()

    def clear(self) -> None:
        """Let go of every buffer (call when no copy from them is in flight, e.g. after a stream sync).

        The next :meth:`acquire` makes new ones, which torch's cache of pinned memory serves without
        pinning again, so loaders that do not run at once (train, valid, test) share that memory.
        """
        with self._lock:
            self._copying.clear()
            self._free = queue.Queue()
            self._buffers.clear()

    def acquire(self, stop: threading.Event) -> torch.Tensor:
        while True:
            try:
                return self._free.get_nowait()
            except queue.Empty:
                pass
            with self._lock:
                if len(self._buffers) < self.count:
                    buffer = torch.empty(self.numel, dtype=torch.int32, pin_memory=True)
                    self._buffers.append(buffer)
                    return buffer
                oldest = self._copying.popleft() if self._copying else None
            if oldest is not None:
                oldest[1].synchronize()
                return oldest[0]
            try:
                return self._free.get(timeout=0.05)
            except queue.Empty:
                if stop.is_set():
                    raise Stopped() from None

    def release(self, buffer: torch.Tensor, copied_on: torch.cuda.Stream | None = None) -> None:
        """Give ``buffer`` back; with ``copied_on``, only once the work queued there so far is done."""
        if copied_on is None:
            self._free.put(buffer)
            return
        event = torch.cuda.Event()
        event.record(copied_on)
        with self._lock:
            self._copying.append((buffer, event))
