"""From decoded chunks to batches: a window of rows is copied into one host buffer per column
(pinned when the target is a GPU), moved to the device in one copy per column, and batches are cut
from it on the device: a permutation gather when shuffling, a slice otherwise.

Doing the gather on the device keeps the host's work to one ``memcpy`` per column and chunk, the
least it can be; on the CPU target the same code runs on host tensors.

Example::

    host = assemble([chunk_a, chunk_b], layout, pin=False)
    window = host.to_device(torch.device("cpu"), order=np.random.permutation(host.rows))
    batch = window.batch(0, 512)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.loader.batch import Batch
from pipeline.loader.decode import Chunk
from pipeline.sparse import KeyedJaggedTensor


@dataclass(frozen=True)
class Layout:
    """Where each sparse key's ids live: ``runs`` of consecutive one-hot rows, or a multi-hot bag."""

    keys: tuple[str, ...]
    runs: tuple[tuple[str, int, int], ...]
    """``("onehot", first_row, end_row)`` of the one-hot id matrix, or ``("bag", bag_index, 0)``."""

    @classmethod
    def of(cls, sparse: list[str], multihot: list[str]) -> "Layout":
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
        return cls(tuple(sparse), tuple(runs))


@dataclass
class HostWindow:
    """A window's columns on the host: label ``[W]``, dense ``[n_cont, W]``, one-hot ids ``[F1, W]``, bags."""

    label: torch.Tensor
    dense: torch.Tensor
    ids: torch.Tensor
    bags: list[tuple[torch.Tensor, torch.Tensor]]
    layout: Layout

    @property
    def rows(self) -> int:
        return self.label.shape[0]

    def to_device(self, device: torch.device, order: np.ndarray | None = None) -> "_Window":
        """The window on ``device``, batches cut in ``order`` (a permutation of its rows, or ``None``).

        On a GPU the copies are asynchronous (the buffers are pinned) on the current stream; on
        the CPU the window stays in numpy, whose single-threaded copies do not compete with the
        training thread's OpenMP pool.
        """
        if device.type == "cpu":
            return _NumpyWindow(self, order)
        return _TorchWindow(self, device, order)


class _Window:
    """Batches cut from a window: :meth:`batch` gives rows ``[begin, end)`` of the window's order."""

    layout: Layout
    rows: int

    def batch(self, begin: int, end: int) -> Batch:
        size = end - begin
        values, lengths = [], []
        for kind, first, last in self.layout.runs:
            if kind == "onehot":
                values.append(self._onehot(first, last, begin, end))
                lengths.append(self._ones((last - first) * size))
            else:
                bag_values, bag_lengths = self._bag_slice(first, begin, end)
                values.append(bag_values)
                lengths.append(bag_lengths)
        sparse = KeyedJaggedTensor(self.layout.keys, self._cat(values), self._cat(lengths))
        dense, label = self._rows(begin, end)
        return Batch(dense, sparse, label)


class _NumpyWindow(_Window):
    def __init__(self, host: HostWindow, order: np.ndarray | None) -> None:
        self.layout, self.rows, self._order = host.layout, host.rows, order
        label, dense, ids = host.label.numpy(), host.dense.numpy(), host.ids.numpy()
        if order is None:
            self._label, self._dense = label, np.ascontiguousarray(dense.T)
            self._ids = ids.astype(np.int64)
        else:
            self._label = label.take(order)
            self._dense = np.ascontiguousarray(dense.take(order, axis=1).T)
            self._ids = ids.take(order, axis=1).astype(np.int64, copy=False)
        self._bags = []
        for offsets, values in host.bags:
            offsets, values = offsets.numpy(), values.numpy().astype(np.int64, copy=False)
            if order is not None:
                offsets, values = _gather_bags(offsets, values, order)
            self._bags.append((offsets, values))

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
        if len(parts) == 1:
            return torch.from_numpy(np.ascontiguousarray(parts[0]).reshape(-1))
        return torch.from_numpy(np.concatenate([p.reshape(-1) for p in parts]) if parts else np.zeros(0, np.int64))


class _TorchWindow(_Window):
    def __init__(self, host: HostWindow, device: torch.device, order: np.ndarray | None) -> None:
        self.layout, self.rows, self._device = host.layout, host.rows, device
        move = _mover(device)
        self._label, self._dense = move(host.label), move(host.dense).t().contiguous()
        self._ids = move(host.ids).long()
        self._order = None if order is None else move(torch.from_numpy(order).pin_memory())
        self._bags = []
        for offsets, values in host.bags:
            host_offsets = offsets.numpy()
            if order is not None:
                host_offsets = np.zeros_like(host_offsets)
                np.cumsum(np.diff(offsets.numpy())[order], out=host_offsets[1:])
            self._bags.append((move(offsets), move(values).long(), host_offsets))

    def _index(self, begin: int, end: int) -> torch.Tensor | slice:
        return slice(begin, end) if self._order is None else self._order[begin:end]

    def _rows(self, begin: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._order is None:
            return self._dense[begin:end], self._label[begin:end]
        index = self._order[begin:end]
        return self._dense.index_select(0, index), self._label.index_select(0, index)

    def _onehot(self, first: int, last: int, begin: int, end: int) -> torch.Tensor:
        if self._order is None:
            return self._ids[first:last, begin:end]
        return self._ids[first:last].index_select(1, self._order[begin:end])

    def _bag_slice(self, index: int, begin: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        offsets, values, host_offsets = self._bags[index]
        if self._order is None:
            return values[int(host_offsets[begin]) : int(host_offsets[end])], offsets[begin + 1 : end + 1] - offsets[begin:end]
        rows = self._order[begin:end]
        total = int(host_offsets[end] - host_offsets[begin])
        lengths = offsets[rows + 1] - offsets[rows]
        out_starts = torch.cumsum(lengths, 0) - lengths
        positions = torch.repeat_interleave(offsets[rows] - out_starts, lengths, output_size=total)
        positions += torch.arange(total, device=positions.device)
        return values.index_select(0, positions), lengths

    def _ones(self, n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.int64, device=self._device)

    def _cat(self, parts: list[torch.Tensor]) -> torch.Tensor:
        if len(parts) == 1:
            return parts[0].reshape(-1)
        if not parts:
            return torch.zeros(0, dtype=torch.int64, device=self._device)
        return torch.cat([p.reshape(-1) for p in parts])


def _mover(device: torch.device):
    def move(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=t.is_pinned())

    return move


def _gather_bags(offsets: np.ndarray, values: np.ndarray, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bags reordered: bag ``i`` of the result is bag ``order[i]`` of the input."""
    lengths = np.diff(offsets).take(order)
    out = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    positions = np.repeat(offsets[:-1].take(order) - out[:-1], lengths) + np.arange(out[-1])
    return out, values.take(positions)


def assemble(pieces: list[Chunk], layout: Layout, pin: bool) -> HostWindow:
    """Copy chunks into one buffer per column (pinned when ``pin``); ``pieces`` must be non-empty."""
    rows = sum(p.rows for p in pieces)
    first = pieces[0]
    label = _empty((rows,), first.label.dtype, pin)
    dense = _empty((len(first.dense), rows), np.float32, pin)
    id_dtype = np.int64 if any(i.dtype == np.int64 for i in first.ids) else np.int32
    ids = _empty((len(first.ids), rows), id_dtype, pin)
    bag_offsets = [_empty((rows + 1,), np.int64, pin) for _ in first.bags]
    totals = [sum(int(p.bags[j][0][-1]) for p in pieces) for j in range(len(first.bags))]
    bag_values = [_empty((totals[j],), first.bags[j][1].dtype, pin) for j in range(len(first.bags))]

    label_np, dense_np, ids_np = label.numpy(), dense.numpy(), ids.numpy()
    offsets_np, values_np = [o.numpy() for o in bag_offsets], [v.numpy() for v in bag_values]
    for o in offsets_np:
        o[0] = 0
    row, nnz = 0, [0] * len(first.bags)
    for piece in pieces:
        stop = row + piece.rows
        label_np[row:stop] = piece.label
        for k, column in enumerate(piece.dense):
            dense_np[k, row:stop] = column
        for k, column in enumerate(piece.ids):
            ids_np[k, row:stop] = column
        for j, (offsets, values) in enumerate(piece.bags):
            offsets_np[j][row + 1 : stop + 1] = offsets[1:] + nnz[j]
            values_np[j][nnz[j] : nnz[j] + len(values)] = values
            nnz[j] += len(values)
        row = stop
    return HostWindow(label, dense, ids, list(zip(bag_offsets, bag_values)), layout)


def _empty(shape: tuple[int, ...], dtype, pin: bool) -> torch.Tensor:
    return torch.empty(shape, dtype=_TORCH_DTYPES[np.dtype(dtype)], pin_memory=pin)


_TORCH_DTYPES = {
    np.dtype(np.float32): torch.float32,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
}
