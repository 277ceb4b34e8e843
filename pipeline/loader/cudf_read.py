"""The cudf reader: each row group read by cuDF straight into GPU memory and packed there.

``Loader(..., device="cuda", reader="cudf")`` reads windows with :func:`read_window` in place of
the pyarrow one: for each of the window's segments, ``cudf.read_parquet(path, columns=...,
row_groups=[i])`` decodes the row group on the GPU, and its part of the window's int32 block (label
and continuous float32 bits, one-hot ids, laid out as :class:`~pipeline.loader.decode.Chunk` says)
is filled on the device from the columns through DLPack: no host copy, no pinned buffer. The checks (nulls, 0/1 labels, ids within their table) run
there, vectorized, at one device sync per row group; a failure is located afterwards and named
with the pyarrow reader's messages. Multi-hot columns come from cuDF's list lengths and leaves and,
as with the pyarrow reader, are kept on the host (windows shuffle bags with host offsets), where
their ids are checked. Segments are checked in order, so the first bad value named is the one the
pyarrow reader names. Windows, shuffling, sharding, resuming and batches are shared.

cuDF is imported only by :func:`check` (after a usable GPU was found) and when reading.

Example::

    check("cuda")      # ReaderError naming what is missing (the device, a GPU, cuDF), else None
    chunk = read_window(split, [segment], validate=True, device=torch.device("cuda", 0))
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
import torch

from pipeline.errors import UserError
from pipeline.loader.decode import Chunk, RowPosition, Split, check_ids, id_error, label_error, null_error
from pipeline.loader.plan import Segment

READERS = ("pyarrow", "cudf")


class ReaderError(UserError):
    """The chosen reader cannot be used here."""


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
        blocks, bags = [], []
        for segment in segments:
            group = segment.group
            path = split.files[group.file]
            where = RowPosition(path, group, segment.start)
            frame = cudf.read_parquet(str(path), columns=split.columns, row_groups=[group.index])
            if validate:
                _check_nulls(frame, split.columns, segment, where)
            blocks.append(_block(frame, split, segment, device, where, validate))
            bags.append([_bag(frame[name], split, name, segment, where, validate) for name in split.schema.multihot])
        block = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)
        ready = None
        if cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
    return Chunk(block, [_join_bags(parts) for parts in zip(*bags)], ready=ready)


def _tensor(series, segment: Segment) -> torch.Tensor:
    """The segment's rows of a column, as a tensor sharing its (device) memory where it has no nulls."""
    if series.null_count:  # outside the segment (checked), or not checked: filled, as cuDF refuses nulls here
        series = series.fillna(0)
    return torch.from_dlpack(series.values)[segment.start : segment.stop]


def _check_nulls(frame, columns: list[str], segment: Segment, where: RowPosition) -> None:
    for name in columns:
        series = frame[name]
        if series.null_count:  # the row group's nulls; only the segment's rows count
            is_null = series.isna().to_numpy()[segment.start : segment.stop]
            if is_null.any():
                raise null_error(name, is_null, where)


def _block(frame, split: Split, segment: Segment, device: torch.device, where: RowPosition,
           validate: bool) -> torch.Tensor:
    schema = split.schema
    continuous = len(schema.continuous)
    block = torch.empty((split.block_rows, segment.rows), dtype=torch.int32, device=device)
    label = _tensor(frame[schema.label], segment)
    block[0] = label.view(torch.int32)
    for row, name in enumerate(schema.continuous, start=1):
        block[row] = _tensor(frame[name], segment).view(torch.int32)
    ids = [_tensor(frame[name], segment) for name in split.onehot]
    for row, values in enumerate(ids, start=1 + continuous):
        block[row] = values  # int64 ids are checked below before the narrowing matters
    for row, name in enumerate(split.wide, start=1 + continuous + len(split.onehot)):
        halves = ids[split.onehot.index(name)].contiguous().view(torch.int32).view(-1, 2)
        block[1 + continuous + split.onehot.index(name)] = halves[:, 0]
        block[row] = halves[:, 1]
    if validate:
        ids = [values for name, values in zip(split.onehot, ids) if name not in split.wide]
        columns = [schema.column(name) for name in split.onehot if name not in split.wide]
        bad = [(label != 0) & (label != 1)]
        bad += [(values < 0) | (values >= column.cardinality) for values, column in zip(ids, columns)]
        flags = torch.stack([b.any() for b in bad]).tolist()  # the one device sync of the checks
        if any(flags):
            k = flags.index(True)
            first = int(bad[k].nonzero()[0, 0])
            if k == 0:
                raise label_error(schema.label, _scalar(label, first), where, first)
            raise id_error(columns[k - 1], _scalar(ids[k - 1], first), where, first)
    return block


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


def _bag(series, split: Split, name: str, segment: Segment, where: RowPosition, validate: bool):
    """(offsets, values) of the segment's lists, on the host, from the row group's list lengths and leaves."""
    lengths = series.list.len().fillna(0).to_numpy()
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    lo, hi = offsets[segment.start], offsets[segment.stop]
    values = series.list.leaves.to_numpy()[lo:hi]
    offsets = offsets[segment.start : segment.stop + 1] - lo
    if validate and not split.schema.column(name).dynamic:
        check_ids(values, split.schema.column(name), where, rows=offsets)
    return offsets, values
