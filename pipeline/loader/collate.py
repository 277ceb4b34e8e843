"""From a window's packed block to batches.

A window is built once on the target device from its chunk (:class:`~pipeline.loader.decode.Chunk`),
permuted once, and its batches are then views of it:

* on a GPU, the block goes to the device in one asynchronous copy from its pinned buffer (the
  cudf reader made it there already), its rows are permuted there by an order computed there,
  the continuous columns are transposed to ``[rows, n_cont]`` and the one-hot ids widened to int64
  in a batch-major layout ``[batches, n_onehot, batch_size]`` (a wide column's two 32-bit halves
  joined there): a few kernels per window. A batch is
  then slices of those tensors (its sparse values and lengths too): no copy, no kernel, no host
  work but making the Python objects;
* on the CPU the same with numpy, whose single-threaded copies do not compete with the training
  thread's OpenMP pool (torch's CPU copies would).

Multi-hot bags are the slower path: they are permuted on the host (with the same order), copied
on their own, and a batch joins its keys' values with one concatenation.

Example::

    window = make_window(chunk, placement, torch.device("cpu"), batch_size=512, order=None)
    batch = window.batch(0, 512)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.loader.batch import Batch
from pipeline.loader.decode import Chunk
from pipeline.loader.pinned import PinnedPool
from pipeline.sparse import KeyedJaggedTensor


@dataclass(frozen=True)
class SparsePlacement:
    """Where each sparse key's ids live: ``runs`` of consecutive one-hot rows, or a multi-hot bag."""

    keys: tuple[str, ...]
    continuous: int
    runs: tuple[tuple[str, int, int], ...]
    """``("onehot", first_row, end_row)`` of the one-hot id matrix, or ``("bag", bag_index, 0)``."""
    wide: tuple[int, ...] = ()
    """The rows of the one-hot id matrix that hold raw 64-bit ids, whose high halves follow the matrix."""

    @classmethod
    def of(cls, sparse: list[str], multihot: list[str], continuous: int,
           dynamic: Sequence[str] = ()) -> SparsePlacement:
        runs: list[tuple[str, int, int]] = []
        onehot_row = bag = 0
        for key in sparse:
            if key in multihot:
                runs.append(("bag", bag, 0))
                bag += 1
            elif runs and runs[-1][0] == "onehot":
                runs[-1] = ("onehot", runs[-1][1], onehot_row + 1)
                onehot_row += 1
            else:
                runs.append(("onehot", onehot_row, onehot_row + 1))
                onehot_row += 1
        onehot = [key for key in sparse if key not in multihot]
        return cls(tuple(sparse), continuous, tuple(runs), tuple(onehot.index(key) for key in onehot if key in dynamic))

    @property
    def onehot(self) -> int:
        return sum(last - first for kind, first, last in self.runs if kind == "onehot")


@dataclass
class Bag:
    """A multi-hot feature of a window, permuted: ``host_offsets`` cut ``values`` without a device sync."""

    host_offsets: np.ndarray
    values: torch.Tensor
    lengths: torch.Tensor


class Window:
    """A permuted window's tensors; :meth:`batch` gives rows ``[begin, end)`` (``begin`` a multiple of the batch size)."""

    def __init__(self, placement: SparsePlacement, batch_size: int, label: torch.Tensor, dense: torch.Tensor,
                 ids: torch.Tensor, tail: torch.Tensor, ones: torch.Tensor, bags: list[Bag]) -> None:
        self.placement, self.batch_size = placement, batch_size
        self.label, self.dense = label, dense
        self.ids, self.tail = ids, tail
        """``ids[k]``: batch ``k``'s one-hot ids ``[n_onehot, batch_size]``; ``tail``: those of a last short batch."""
        self.ones, self.bags = ones, bags

    def batch(self, begin: int, end: int) -> Batch:
        size = end - begin
        k = begin // self.batch_size
        slab = self.ids[k] if k < len(self.ids) else self.tail
        values, lengths, per_key = [], [], []
        for kind, first, last in self.placement.runs:
            if kind == "onehot":
                values.append(slab[first:last].reshape(-1))
                lengths.append(self.ones[: (last - first) * size])
                per_key += [size] * (last - first)
            else:
                bag = self.bags[first]
                lo, hi = int(bag.host_offsets[begin]), int(bag.host_offsets[end])
                values.append(bag.values[lo:hi])
                lengths.append(bag.lengths[begin:end])
                per_key.append(hi - lo)
        sparse = KeyedJaggedTensor(self.placement.keys, _cat(values, self.ones), _cat(lengths, self.ones), per_key)
        return Batch(self.dense[begin:end], sparse, self.label[begin:end])

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Mark the window's tensors (every batch is a view of them) as used on ``stream``."""
        for tensor in (self.label, self.dense, self.ids, self.tail, self.ones):
            tensor.record_stream(stream)
        for bag in self.bags:
            bag.values.record_stream(stream)
            bag.lengths.record_stream(stream)


def make_window(chunk: Chunk, placement: SparsePlacement, device: torch.device, batch_size: int,
                order: np.ndarray | torch.Tensor | None, pool: PinnedPool | None = None) -> Window:
    """The window of ``chunk`` on ``device``, its rows in ``order`` (a permutation, or ``None``).

    On a GPU this queues work on the current stream; ``order`` may be on the device or the host
    (a host order is needed with multi-hot bags, which are permuted on the host).
    """
    if device.type == "cpu":
        return _numpy_window(chunk, placement, batch_size, order)
    return _device_window(chunk, placement, device, batch_size, order, pool)


def _numpy_window(chunk: Chunk, placement: SparsePlacement, batch_size: int, order: np.ndarray | None) -> Window:
    block = chunk.block.numpy() if isinstance(chunk.block, torch.Tensor) else chunk.block
    if order is not None:
        permuted = np.empty_like(block)
        for row, out in zip(block, permuted):  # row by row: each gather stays within one column's cache lines
            np.take(row, order, out=out)
        block = permuted
    n = placement.continuous
    label = block[0].view(np.float32).copy()
    dense = np.ascontiguousarray(block[1 : 1 + n].T).view(np.float32)
    ids = block[1 + n : 1 + n + placement.onehot]
    full = ids.shape[1] // batch_size
    batches = np.empty((full, ids.shape[0], batch_size), dtype=np.int64)
    batches[...] = ids[:, : full * batch_size].reshape(ids.shape[0], full, batch_size).transpose(1, 0, 2)
    tail = ids[:, full * batch_size :].astype(np.int64)
    if placement.wide:
        wide, high = list(placement.wide), block[1 + n + placement.onehot :].astype(np.int64) << 32
        batches[:, wide] = (batches[:, wide] & 0xFFFFFFFF) | high[:, : full * batch_size].reshape(
            len(wide), full, batch_size).transpose(1, 0, 2)
        tail[wide] = (tail[wide] & 0xFFFFFFFF) | high[:, full * batch_size :]
    bags = []
    for offsets, values in chunk.bags:
        if order is not None:
            offsets, values = _gather_bags(offsets, values, order)
        # int64 values read straight from arrow are its read-only buffer: copied, as torch tensors are writable
        bags.append(Bag(offsets, torch.from_numpy(values.astype(np.int64, copy=not values.flags.writeable)),
                        torch.from_numpy(np.diff(offsets))))
    ones = torch.ones(placement.onehot * batch_size, dtype=torch.int64)
    return Window(placement, batch_size, torch.from_numpy(label), torch.from_numpy(dense), torch.from_numpy(batches),
                  torch.from_numpy(tail), ones, bags)


def _device_window(chunk: Chunk, placement: SparsePlacement, device: torch.device, batch_size: int,
                   order: np.ndarray | torch.Tensor | None, pool: PinnedPool | None) -> Window:
    block = upload(chunk, device, pool)
    index = None
    if order is not None:
        index = order if isinstance(order, torch.Tensor) else _to(order, device)
        block = block.index_select(1, index)
    n = placement.continuous
    label = block[0].view(torch.float32).clone()
    dense = block[1 : 1 + n].t().contiguous().view(torch.float32)
    ids = block[1 + n : 1 + n + placement.onehot]
    full = ids.shape[1] // batch_size
    batches = torch.empty((full, ids.shape[0], batch_size), dtype=torch.int64, device=device)
    batches.copy_(ids[:, : full * batch_size].reshape(ids.shape[0], full, batch_size).transpose(0, 1))
    tail = ids[:, full * batch_size :].to(torch.int64).contiguous()
    if placement.wide:
        wide = list(placement.wide)
        high = block[1 + n + placement.onehot :].to(torch.int64) << 32
        batches[:, wide] = (batches[:, wide] & 0xFFFFFFFF) | high[:, : full * batch_size].reshape(
            len(wide), full, batch_size).transpose(0, 1)
        tail[wide] = (tail[wide] & 0xFFFFFFFF) | high[:, full * batch_size :]
    bags = []
    for offsets, values in chunk.bags:
        if order is not None:
            offsets, values = _gather_bags(offsets, values, order)
        offsets_t = _to(offsets, device)
        bags.append(Bag(offsets, _to(values, device).long(), offsets_t[1:] - offsets_t[:-1]))
    ones = torch.ones(placement.onehot * batch_size, dtype=torch.int64, device=device)
    return Window(placement, batch_size, label, dense, batches, tail, ones, bags)


def upload(chunk: Chunk, device: torch.device, pool: PinnedPool | None = None) -> torch.Tensor:
    """The chunk's block on ``device``: one asynchronous copy, its pinned buffer given back to ``pool`` after it.

    A block a reader thread already made on the device (the cudf reader) is not copied: the current
    stream waits for it, and the caching allocator is told that this stream uses its memory.
    """
    stream = torch.cuda.current_stream(device)
    if chunk.ready is not None:
        stream.wait_event(chunk.ready)
        chunk.block.record_stream(stream)
        return chunk.block
    if chunk.buffer is None:
        return _to(chunk.block, device)
    block = chunk.pinned().to(device, non_blocking=True)
    if pool is not None:
        pool.release(chunk.buffer, copied_on=stream)
    chunk.buffer = None
    return block


def _cat(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    if not parts:
        return torch.zeros(0, dtype=torch.int64, device=like.device)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on ``device``, asynchronously, through pinned memory. An array over arrow's read-only buffers
    (a multi-hot column's values as read) is copied into the pinned buffer by numpy: a tensor over memory it may
    not write is one torch warns about."""
    if array.flags.writeable:
        pinned = torch.from_numpy(array).pin_memory()
    else:
        pinned = torch.empty(array.shape, dtype=torch.from_numpy(np.empty(0, array.dtype)).dtype, pin_memory=True)
        pinned.numpy()[...] = array
    return pinned.to(device, non_blocking=True)


def _gather_bags(offsets: np.ndarray, values: np.ndarray, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bags reordered: bag ``i`` of the result is bag ``order[i]`` of the input."""
    lengths = np.diff(offsets).take(order)
    out = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    positions = np.repeat(offsets[:-1].take(order) - out[:-1], lengths) + np.arange(out[-1])
    return out, values.take(positions)
