"""The cudf reader: a window's row groups read by cuDF straight into GPU memory and packed there.

``Loader(..., device="cuda", reader="cudf")`` reads windows with :func:`read_window` in place of
the pyarrow one: one ``cudf.read_parquet(paths, columns=..., row_groups=[[i, j, ...], ...])`` call
decodes all the row groups of a window on the GPU (the files' pages decompressed and decoded there,
a call per window rather than per row group, which is what makes the GPU's decoding pay), and the
window's int32 block (label and continuous float32 bits, one-hot ids, laid out as
:class:`~pipeline.loader.decode.Chunk` says) is filled on the device from the columns through DLPack:
no host copy, no pinned buffer. Rows of a row group outside the window (a window or shard boundary
inside it) are left out by one gather. The checks (nulls, 0/1 labels, finite continuous values, ids within
their table) run
there, vectorized, at one device sync per window; a failure is located afterwards, segment by segment
in the window's order, and named with the pyarrow reader's messages, so the first bad value named is
the one the pyarrow reader names. Multi-hot columns come from cuDF's list lengths and leaves and, as
with the pyarrow reader, are kept on the host (windows shuffle bags with host offsets), where their ids
are checked. Windows, shuffling, sharding, resuming and batches are shared.

cuDF is imported only by :func:`check` (after a usable GPU was found) and when reading.

Example::

    check("cuda")      # ReaderError naming what is missing (the device, a GPU, cuDF), else None
    chunk = read_window(split, [segment], validate=True, device=torch.device("cuda", 0))
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence

import numpy as np
import torch

from pipeline.errors import UserError
from pipeline.loader.decode import (
    Chunk,
    RowPosition,
    Split,
    check_ids,
    finite_error,
    id_error,
    label_error,
    null_error,
    null_items_error,
)
from pipeline.loader.plan import Segment
from pipeline.schema import Column

READERS = ("auto", "pyarrow", "cudf")


class ReaderError(UserError):
    """The chosen reader cannot be used here."""


def choose(reader: str, device: str | torch.device) -> str:
    """The reader to use: ``"auto"`` is ``"cudf"`` on a usable GPU where cuDF imports, else ``"pyarrow"``; an
    explicit ``"cudf"`` is checked (:func:`check`)."""
    if reader == "cudf":
        check(device)
    if reader != "auto":
        return reader
    if torch.device(device).type != "cuda":
        return "pyarrow"
    try:
        check(device)
    except ReaderError:
        return "pyarrow"
    return "cudf"


def check(device: str | torch.device) -> None:
    """Raise :class:`ReaderError` unless ``device`` is a CUDA device, the GPU is usable and cuDF imports."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ReaderError(
            f"reader='cudf' reads into GPU memory, so it needs device='cuda' (got {str(device)!r}); "
            "use reader='pyarrow'"
        )
    from pipeline.device import gpu_problem

    problem = gpu_problem()
    if problem:
        raise ReaderError(f"reader='cudf' needs a usable CUDA GPU, but {problem}; use reader='pyarrow'")
    problem = cudf_problem()
    if problem:
        raise ReaderError(
            f"reader='cudf' needs cuDF, but {problem}: install RAPIDS (environment.yml, or the [gpu] extra) "
            "or use reader='pyarrow'"
        )


def cudf_problem() -> str | None:
    """``None`` when cuDF imports, else why not (any error: a cuDF without a CUDA driver raises others)."""
    try:
        import cudf  # noqa: F401
    except Exception as err:  # noqa: BLE001 - the message is what the user needs
        return f"cudf is not importable ({type(err).__name__}: {err})"
    return None


def read_window(split: Split, segments: Sequence[Segment], validate: bool, device: torch.device) -> Chunk:
    """Read and pack the rows of ``segments``, in their order, on ``device`` (thread-safe)."""
    import cudf

    cuda = device.type == "cuda"
    with torch.cuda.device(device) if cuda else contextlib.nullcontext():
        if cuda:
            _stream_ordered_memory(device)
        sources = _sources(split, segments)
        frame = cudf.read_parquet([path for path, _ in sources], columns=split.columns,
                                  row_groups=[groups for _, groups in sources])
        schema = split.schema
        columns = {name: _tensor(frame[name]) for name in [schema.label, *schema.continuous, *split.onehot]}
        placed = _Placed(segments, columns[schema.label].device)
        bags = {name: _frame_bag(frame[name]) for name in schema.multihot}
        block = _block(columns, split, placed, device)
        if validate:
            if _valid(frame, columns, split):
                for segment, (lo, hi) in zip(placed.segments, placed.ranges):
                    _check_bags(bags, split, segment, lo, hi)
            else:
                _raise_first(frame, columns, bags, split, placed)
        ready = None
        if cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
    return Chunk(block, [placed.bag(*bags[name]) for name in schema.multihot], ready=ready)


_memory_lock = threading.Lock()
_memory_set: set[int] = set()


def _stream_ordered_memory(device: torch.device) -> None:
    """Have RMM (cuDF's allocator) take memory from CUDA's stream-ordered pool on ``device`` when it still uses its
    default, plain ``cudaMalloc`` and ``cudaFree``: every such free waits for the whole device, the training's
    kernels included, and each window's frame is freed (docs/BENCHMARKS.md, "The cudf reader a window at a time").
    A resource the user set is left alone."""
    with _memory_lock:
        if device.index in _memory_set:
            return
        import rmm

        if type(rmm.mr.get_current_device_resource()) is rmm.mr.CudaMemoryResource:
            rmm.mr.set_current_device_resource(rmm.mr.CudaAsyncMemoryResource())
        _memory_set.add(device.index)


def _sources(split: Split, segments: Sequence[Segment]) -> list[tuple[str, list[int]]]:
    """The files to read and each one's row groups, in the segments' order: consecutive segments of one file
    whose row groups come in ascending order make one source."""
    sources: list[tuple[str, list[int]]] = []
    last = None
    for segment in segments:
        group = segment.group
        if last is not None and group.file == last.file and group.index > last.index:
            sources[-1][1].append(group.index)
        else:
            sources.append((str(split.files[group.file]), [group.index]))
        last = group
    return sources


class _Placed:
    """Where each segment's rows lie in the frame of the window's row groups read whole, one after another."""

    def __init__(self, segments: Sequence[Segment], device: torch.device) -> None:
        self.segments = list(segments)
        firsts = np.cumsum([0] + [s.group.rows for s in self.segments])
        self.ranges = [(int(first) + s.start, int(first) + s.stop) for first, s in zip(firsts, self.segments)]
        rows = sum(s.rows for s in self.segments)
        self.index = None  # every row of the frame, in order
        if rows != int(firsts[-1]):
            self.index = torch.cat([torch.arange(lo, hi, device=device) for lo, hi in self.ranges])

    def take(self, values: torch.Tensor) -> torch.Tensor:
        """The window's rows of a column of the frame."""
        return values if self.index is None else values[self.index]

    def bag(self, offsets: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The window's lists of a multi-hot column of the frame (offsets from 0, values)."""
        if self.index is None:
            return offsets, values
        return _join_bags([(offsets[lo : hi + 1] - offsets[lo], values[offsets[lo] : offsets[hi]])
                           for lo, hi in self.ranges])


def _tensor(series) -> torch.Tensor:
    """A column as a tensor sharing its (device) memory where it has no nulls."""
    if series.null_count:  # outside the window (checked), or not checked: filled, as cuDF refuses nulls here
        series = series.fillna(0)
    return torch.from_dlpack(series.values)


def _frame_bag(series) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, values) of a list column, on the host, from its list lengths and leaves (a null item filled: outside
    the window, or refused by the checks)."""
    lengths = series.list.len().fillna(0).to_numpy()
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    leaves = series.list.leaves
    return offsets, (leaves.fillna(0) if leaves.null_count else leaves).to_numpy()


def _block(columns: dict[str, torch.Tensor], split: Split, placed: _Placed, device: torch.device) -> torch.Tensor:
    schema = split.schema
    continuous = len(schema.continuous)
    rows = sum(s.rows for s in placed.segments)
    block = torch.empty((split.block_rows, rows), dtype=torch.int32, device=device)
    block[0] = placed.take(columns[schema.label]).view(torch.int32)
    for row, name in enumerate(schema.continuous, start=1):
        block[row] = placed.take(columns[name]).view(torch.int32)
    for row, name in enumerate(split.onehot, start=1 + continuous):
        block[row] = placed.take(columns[name])  # int64 ids are checked before the narrowing matters
    for row, name in enumerate(split.wide, start=1 + continuous + len(split.onehot)):
        halves = placed.take(columns[name]).contiguous().view(torch.int32).view(-1, 2)
        block[1 + continuous + split.onehot.index(name)] = halves[:, 0]
        block[row] = halves[:, 1]
    return block


def _checked(columns: dict[str, torch.Tensor], split: Split) -> list[tuple[Column | None, torch.Tensor]]:
    """The columns whose values are checked on the device, in the order they are named: the label (no table),
    then the one-hot ids within their tables."""
    schema = split.schema
    return [(None, columns[schema.label])] + [(schema.column(name), columns[name]) for name in split.onehot
                                              if name not in split.wide]


def _bad(column: Column | None, values: torch.Tensor) -> torch.Tensor:
    if column is None:
        return (values != 0) & (values != 1)
    return (values < 0) | (values >= column.cardinality)


def _valid(frame, columns: dict[str, torch.Tensor], split: Split) -> bool:
    """Whether the frame has no nulls (nor null list items) and every label, continuous value and one-hot id passes
    its check (one device sync); rows of its row groups outside the window count too, so False only says where to
    look."""
    if any(frame[name].null_count for name in split.columns) or any(
            frame[name].list.leaves.null_count for name in split.schema.multihot):
        return False
    bad = [_bad(column, values).any() for column, values in _checked(columns, split)]
    bad += [~torch.isfinite(columns[name]).all() for name in split.schema.continuous]
    return not any(torch.stack(bad).tolist())


def _check_bags(bags: dict[str, tuple[np.ndarray, np.ndarray]], split: Split, segment: Segment, lo: int,
                hi: int) -> None:
    """Raise for a multi-hot id of the segment (frame rows ``[lo, hi)``) outside its table, naming its row."""
    where = RowPosition(split.files[segment.group.file], segment.group, segment.start)
    for name, (offsets, values) in bags.items():
        column = split.schema.column(name)
        if not column.dynamic:
            check_ids(values[offsets[lo] : offsets[hi]], column, where, rows=offsets[lo : hi + 1] - offsets[lo])


def _raise_first(frame, columns: dict[str, torch.Tensor], bags: dict[str, tuple[np.ndarray, np.ndarray]],
                 split: Split, placed: _Placed) -> None:
    """Raise for the window's first bad value, as the pyarrow reader names it: segment by segment, in each column
    by column (the label, the continuous, the one-hot, the multi-hot columns), its nulls, then its values."""
    schema = split.schema
    nulls = {name: frame[name].isna().to_numpy() for name in split.columns if frame[name].null_count}
    # the row of each null list item, by column
    null_items = {name: np.searchsorted(bags[name][0], np.flatnonzero(frame[name].list.leaves.isna().to_numpy()),
                                        side="right") - 1
                  for name in schema.multihot if frame[name].list.leaves.null_count}
    checked = {column.name if column else schema.label: (column, values)
               for column, values in _checked(columns, split)}
    for segment, (lo, hi) in zip(placed.segments, placed.ranges):
        where = RowPosition(split.files[segment.group.file], segment.group, segment.start)
        for name in [schema.label, *schema.continuous, *split.onehot, *schema.multihot]:
            if name in nulls and nulls[name][lo:hi].any():
                raise null_error(name, nulls[name][lo:hi], where)
            rows = null_items.get(name, np.empty(0, dtype=np.int64))
            rows = rows[(rows >= lo) & (rows < hi)]
            if len(rows):
                raise null_items_error(name, len(rows), where, int(rows[0]) - lo)
            if name in schema.dynamic:
                continue
            if name in schema.continuous:
                bad = ~torch.isfinite(columns[name][lo:hi])
                if bool(bad.any()):
                    first = int(bad.nonzero()[0, 0])
                    raise finite_error(name, _scalar(columns[name][lo:hi], first), where, first)
            elif name in checked:
                column, values = checked[name]
                bad = _bad(column, values[lo:hi])
                if bool(bad.any()):
                    first = int(bad.nonzero()[0, 0])
                    value = _scalar(values[lo:hi], first)
                    if column is None:
                        raise label_error(schema.label, value, where, first)
                    raise id_error(column, value, where, first)
        _check_bags(bags, split, segment, lo, hi)


def _join_bags(parts: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    if len(parts) == 1:
        return parts[0]
    lengths = np.concatenate([np.diff(offsets) for offsets, _ in parts])
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets, np.concatenate([values for _, values in parts])


def _scalar(values: torch.Tensor, index: int) -> np.generic:
    """``values[index]`` as a numpy scalar of its type (printed as the pyarrow reader prints it)."""
    return values[index : index + 1].cpu().numpy()[0]
