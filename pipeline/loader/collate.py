"""From decoded chunks to batches.

A window is a run of rows (pieces of consecutive chunks) shuffled together. It is built on the
target device, permuted once, and batches are then cut from it as slices:

* on a GPU, each chunk's pinned block goes to the device in one asynchronous copy (the reader
  threads already packed it; the cudf reader made it on the device already), the window is joined
  and permuted there, and a batch costs a few small kernels; the host thread only issues work;
* on the CPU, the window is joined and permuted with numpy, whose single-threaded copies do not
  compete with the training thread's OpenMP pool (torch's CPU copies would).

Example::

    window = make_window([Piece(chunk, 0, chunk.rows)], placement, torch.device("cpu"), order=None)
    batch = window.batch(0, 512)
"""

from __future__ import annotations

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

    @classmethod
    def of(cls, sparse: list[str], multihot: list[str], continuous: int) -> SparsePlacement:
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
        return cls(tuple(sparse), continuous, tuple(runs))


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, stop)`` of a chunk."""

    chunk: Chunk
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


def make_window(pieces: list[Piece], placement: SparsePlacement, device: torch.device,
                order: np.ndarray | None) -> _Window:
    """The window of ``pieces`` on ``device``, its rows in ``order`` (a permutation, or ``None``)."""
    if device.type == "cpu":
        return _NumpyWindow(pieces, placement, order)
    return _TorchWindow(pieces, placement, device, order)


class _Window:
    """Batches cut from a permuted window: :meth:`batch` gives rows ``[begin, end)``."""

    placement: SparsePlacement

    def batch(self, begin: int, end: int) -> Batch:
        size = end - begin
        values, lengths = [], []
        for kind, first, last in self.placement.runs:
            if kind == "onehot":
                values.append(self._onehot(first, last, begin, end))
                lengths.append(self._ones((last - first) * size))
            else:
                bag_values, bag_lengths = self._bag_slice(first, begin, end)
                values.append(bag_values)
                lengths.append(bag_lengths)
        sparse = KeyedJaggedTensor(self.placement.keys, self._cat(values), self._cat(lengths))
        dense, label = self._rows(begin, end)
        return Batch(dense, sparse, label)


class _NumpyWindow(_Window):
    def __init__(self, pieces: list[Piece], placement: SparsePlacement, order: np.ndarray | None) -> None:
        self.placement = placement
        parts = [np.asarray(p.chunk.block[:, p.start : p.stop]) for p in pieces]
        block = np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
        if order is not None:
            block = block.take(order, axis=1)
        n = placement.continuous
        self._label = np.ascontiguousarray(block[0]).view(np.float32)
        self._dense = np.ascontiguousarray(block[1 : 1 + n].T).view(np.float32)
        self._ids = block[1 + n :].astype(np.int64)
        self._bags = []
        for index in range(len(pieces[0].chunk.bags)):
            offsets, values = _join_bags([p.chunk.bag_slice(index, p.start, p.stop) for p in pieces])
            if order is not None:
                offsets, values = _gather_bags(offsets, values, order)
            self._bags.append((offsets, values.astype(np.int64, copy=False)))

    def _rows(self, begin: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(self._dense[begin:end]), torch.from_numpy(self._label[begin:end])

    def _onehot(self, first: int, last: int, begin: int, end: int) -> np.ndarray:
        return self._ids[first:last, begin:end]

    def _bag_slice(self, index: int, begin: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        offsets, values = self._bags[index]
        return values[offsets[begin] : offsets[end]], np.diff(offsets[begin : end + 1])

    @staticmethod
    def _ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.int64)

    @staticmethod
    def _cat(parts: list[np.ndarray]) -> torch.Tensor:
        if not parts:
            return torch.zeros(0, dtype=torch.int64)
        if len(parts) == 1:
            return torch.from_numpy(np.ascontiguousarray(parts[0]).reshape(-1))
        return torch.from_numpy(np.concatenate([p.reshape(-1) for p in parts]))


class _TorchWindow(_Window):
    def __init__(self, pieces: list[Piece], placement: SparsePlacement, device: torch.device,
                 order: np.ndarray | None) -> None:
        self.placement, self._device = placement, device
        parts = [_device_block(p.chunk, device)[:, p.start : p.stop] for p in pieces]
        block = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        index = None if order is None else _to(torch.from_numpy(order), device)
        if index is not None:
            block = block.index_select(1, index)
        n = placement.continuous
        self._label = block[0].contiguous().view(torch.float32)
        self._dense = block[1 : 1 + n].t().contiguous().view(torch.float32)
        self._ids = block[1 + n :].long()
        self._bags = []
        for bag in range(len(pieces[0].chunk.bags)):
            offsets, values = _join_bags([p.chunk.bag_slice(bag, p.start, p.stop) for p in pieces])
            host_offsets = offsets
            if order is not None:
                host_offsets = np.zeros_like(offsets)
                np.cumsum(np.diff(offsets).take(order), out=host_offsets[1:])
            offsets_t, values_t = _to(torch.from_numpy(offsets), device), _to(torch.from_numpy(values), device).long()
            if index is not None:
                lengths = offsets_t[1:].index_select(0, index) - offsets_t[:-1].index_select(0, index)
                new_offsets = _to(torch.from_numpy(host_offsets), device)
                positions = torch.repeat_interleave(
                    offsets_t[:-1].index_select(0, index) - new_offsets[:-1], lengths, output_size=len(values)
                )
                positions += torch.arange(len(values), device=device)
                offsets_t, values_t = new_offsets, values_t.index_select(0, positions)
            self._bags.append((offsets_t, values_t, host_offsets))

    def _rows(self, begin: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._dense[begin:end], self._label[begin:end]

    def _onehot(self, first: int, last: int, begin: int, end: int) -> torch.Tensor:
        return self._ids[first:last, begin:end]

    def _bag_slice(self, index: int, begin: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        offsets, values, host_offsets = self._bags[index]
        lengths = offsets[begin + 1 : end + 1] - offsets[begin:end]
        return values[int(host_offsets[begin]) : int(host_offsets[end])], lengths

    def _ones(self, n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.int64, device=self._device)

    def _cat(self, parts: list[torch.Tensor]) -> torch.Tensor:
        if not parts:
            return torch.zeros(0, dtype=torch.int64, device=self._device)
        if len(parts) == 1:
            return parts[0].reshape(-1)
        return torch.cat([p.reshape(-1) for p in parts])


def upload(chunk: Chunk, device: torch.device, pool: PinnedPool | None = None) -> None:
    """Queue the copy of the chunk's block to ``device`` and give its pinned buffer back to ``pool``.

    A block a reader thread already made on the device (the cudf reader) is not copied: the current
    stream waits for it, and the caching allocator is told that this stream uses its memory.
    """
    if chunk.ready is not None:
        stream = torch.cuda.current_stream(device)
        stream.wait_event(chunk.ready)
        chunk.on_device.record_stream(stream)
        chunk.ready = None
    if chunk.on_device is not None:
        return
    chunk.on_device = _to(chunk.pinned if chunk.pinned is not None else torch.from_numpy(chunk.block), device)
    if chunk.buffer is not None and pool is not None:
        pool.release(chunk.buffer, copied_on=torch.cuda.current_stream(device))
        chunk.buffer = chunk.pinned = None


def _device_block(chunk: Chunk, device: torch.device) -> torch.Tensor:
    upload(chunk, device)
    return chunk.on_device


def _to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host to device, asynchronously when the memory is pinned (small arrays are pinned first)."""
    if not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def _join_bags(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    if len(parts) == 1:
        return parts[0]
    lengths = np.concatenate([np.diff(offsets) for offsets, _ in parts])
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets, np.concatenate([values for _, values in parts])


def _gather_bags(offsets: np.ndarray, values: np.ndarray, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bags reordered: bag ``i`` of the result is bag ``order[i]`` of the input."""
    lengths = np.diff(offsets).take(order)
    out = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    positions = np.repeat(offsets[:-1].take(order) - out[:-1], lengths) + np.arange(out[-1])
    return out, values.take(positions)
