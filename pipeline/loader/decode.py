"""Reading the ETL's parquet files into numpy columns, with cheap checks of what was read.

:func:`open_split` reads every file's footer once: the row groups (for the plan) and the column
types (checked against the schema before any row is read). :func:`read_segment` reads one row
group with pyarrow, keeps the rows a segment needs and turns each column into a numpy array
without per-row Python; it checks, vectorized, that there are no nulls, that labels are 0/1 and
that ids are within their table's cardinality, and names the file, column, row and value when not.

Example::

    split = open_split(find_files("data/synthetic/processed/train"), schema)
    chunk = read_segment(split, Segment(split.groups[0], 0, 100))
    chunk.block[0].view("float32")[:5]     # the first 5 labels
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.errors import BadInputError
from pipeline.loader.plan import RowGroup, Segment
from pipeline.schema import Column, Schema

if TYPE_CHECKING:
    import torch

    from pipeline.loader.pinned import PinnedPool


@dataclass
class Split:
    """The files of one split, their row groups and footers, and what to read from them."""

    files: list[Path]
    metadata: list[pq.FileMetaData]
    groups: list[RowGroup]
    schema: Schema

    @property
    def rows(self) -> int:
        return sum(g.rows for g in self.groups)

    @property
    def onehot(self) -> list[str]:
        return [c for c in self.schema.sparse if c not in set(self.schema.multihot)]

    @property
    def columns(self) -> list[str]:
        return [self.schema.label, *self.schema.continuous, *self.schema.sparse]


@dataclass
class Chunk:
    """Decoded rows, packed for copying: ``block`` is int32 ``[1 + n_cont + n_onehot, rows]`` holding the
    label and the continuous columns (float32 bits) and the one-hot ids; ``bags`` the multi-hot columns."""

    block: np.ndarray | torch.Tensor
    """A numpy array, or (the cudf reader) a tensor already on the target device."""
    bags: list[tuple[np.ndarray, np.ndarray]]
    """Per multi-hot feature: (offsets int64 of length rows + 1 starting at 0, values)."""
    pinned: torch.Tensor | None = None
    """The pinned tensor whose memory ``block`` is (GPU targets), for asynchronous copies."""
    buffer: torch.Tensor | None = None
    """The pool buffer holding ``pinned``, to give back once the copy to the device is queued."""
    on_device: torch.Tensor | None = None
    """``block`` on the GPU once copied there (the chunk may feed two windows)."""
    ready: torch.cuda.Event | None = None
    """Set when a reader thread made ``on_device`` on its own stream: the producer's stream waits on it."""

    @property
    def rows(self) -> int:
        return self.block.shape[1]

    def bag_slice(self, index: int, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        offsets, values = self.bags[index]
        return offsets[start : stop + 1] - offsets[start], values[offsets[start] : offsets[stop]]


def find_files(data: str | Path | Sequence[str | Path]) -> list[Path]:
    """The parquet files of a split: a folder's ``part-*.parquet`` in natural order, or the files given."""
    if isinstance(data, (str, Path)):
        path = Path(data)
        if path.is_dir():
            files = sorted(path.glob("part-*.parquet"), key=_natural_key)
            if not files:
                raise BadInputError(f"{path}: expected part-*.parquet files (the ETL's output), found none")
            return files
        if not path.is_file():
            raise BadInputError(f"{path}: no such file or folder (expected a split folder of part-*.parquet files)")
        return [path]
    files = [Path(f) for f in data]
    if not files:
        raise BadInputError("expected at least one parquet file, got an empty list")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise BadInputError(f"parquet files not found: {', '.join(missing)}")
    return files


def open_split(files: list[Path], schema: Schema) -> Split:
    """Read the footers of a split's files and check their columns against ``schema``."""
    metadata, groups = [], []
    for i, path in enumerate(files):
        try:
            pf = pq.ParquetFile(path)
        except (pa.ArrowInvalid, OSError) as err:
            raise BadInputError(f"{path}: not a readable parquet file ({err})") from err
        _check_types(path, pf.schema_arrow, schema)
        md = pf.metadata
        metadata.append(md)
        first = 0
        for j in range(md.num_row_groups):
            rows = md.row_group(j).num_rows
            if rows:
                groups.append(RowGroup(i, j, first, rows))
            first += rows
    split = Split(files, metadata, groups, schema)
    if not split.rows:
        raise BadInputError(f"{files[0].parent}: the parquet files hold no rows")
    return split


def expected_type(column: Column) -> pa.DataType:
    """The parquet column type the ETL contract gives a schema column."""
    if column.role in ("label", "continuous"):
        return pa.float32()
    ids = pa.int64() if "int64" in column.dtype else pa.int32()
    return pa.list_(ids) if column.role == "multihot" else ids


def read_segment(
    split: Split,
    segment: Segment,
    validate: bool = True,
    buffers: PinnedPool | None = None,
    stop: threading.Event | None = None,
) -> Chunk:
    """Read and decode the rows of one segment (thread-safe: each call opens its own reader).

    With ``buffers`` the block is packed into one of the pool's pinned buffers, ready for an
    asynchronous copy to a GPU; ``chunk.buffer`` must then go back to the pool once copied.
    """
    group = segment.group
    path = split.files[group.file]
    with pq.ParquetFile(path, metadata=split.metadata[group.file], memory_map=True) as pf:
        table = pf.read_row_group(group.index, columns=split.columns, use_threads=False)
    if segment.start or segment.stop != group.rows:
        table = table.slice(segment.start, segment.rows)
    shape = (1 + len(split.schema.continuous) + len(split.onehot), segment.rows)
    if buffers is None:
        return _decode(split, table, RowPosition(path, group, segment.start), validate, np.empty(shape, dtype=np.int32))
    buffer = buffers.acquire(stop or threading.Event())
    try:
        pinned = buffer[: shape[0] * shape[1]].view(shape)
        chunk = _decode(split, table, RowPosition(path, group, segment.start), validate, pinned.numpy())
    except BaseException:
        buffers.release(buffer)
        raise
    chunk.pinned, chunk.buffer = pinned, buffer
    return chunk


def _decode(split: Split, table: pa.Table, where: RowPosition, validate: bool, block: np.ndarray) -> Chunk:
    schema = split.schema
    onehot = split.onehot
    label = _numpy(table, schema.label, where, validate)
    if validate:
        _check_label(label, schema.label, where)
    block[0] = label.view(np.int32)
    for row, name in enumerate(schema.continuous, start=1):
        block[row] = _numpy(table, name, where, validate).view(np.int32)
    for row, name in enumerate(onehot, start=1 + len(schema.continuous)):
        values = _numpy(table, name, where, validate)
        if validate:
            check_ids(values, schema.column(name), where)
        block[row] = values
    bags = [_bag(table, schema.column(name), where, validate) for name in schema.multihot]
    return Chunk(block, bags)


@dataclass(frozen=True)
class RowPosition:
    """Where a decoded block starts (file, row group, first row), for error messages."""

    path: Path
    group: RowGroup
    start: int

    def row(self, offset: int) -> str:
        return f"row {self.group.first_row + self.start + offset} (row group {self.group.index})"


def _natural_key(path: Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


def _check_types(path: Path, arrow_schema: pa.Schema, schema: Schema) -> None:
    names = set(arrow_schema.names)
    for column in schema.columns:
        if column.name not in names:
            raise BadInputError(
                f"{path}: column {column.name!r} of the schema ({column.role}) is missing; "
                f"the file has {arrow_schema.names}"
            )
        if column.cardinality > np.iinfo(np.int32).max:
            raise BadInputError(f"column {column.name!r}: cardinality {column.cardinality} does not fit int32 ids")
        want, got = expected_type(column), arrow_schema.field(column.name).type
        if column.role == "multihot" and pa.types.is_large_list(got):
            got = pa.list_(got.value_type)
        if not got.equals(want) and not (
            pa.types.is_list(got) and pa.types.is_list(want) and got.value_type == want.value_type
        ):
            raise BadInputError(f"{path}: column {column.name!r} ({column.role}) should be {want}, found {got}")


def _array(table: pa.Table, name: str, where: RowPosition, validate: bool) -> pa.Array:
    column = table.column(name)
    array = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    if validate and array.null_count:
        raise null_error(name, array.is_null().to_numpy(zero_copy_only=False), where)
    return array


def _numpy(table: pa.Table, name: str, where: RowPosition, validate: bool) -> np.ndarray:
    return _array(table, name, where, validate).to_numpy(zero_copy_only=False)


def _check_label(label: np.ndarray, name: str, where: RowPosition) -> None:
    bad = (label != 0) & (label != 1)
    if bad.any():
        first = int(bad.argmax())
        raise label_error(name, label[first], where, first)


def check_ids(values: np.ndarray, column: Column, where: RowPosition, rows: np.ndarray | None = None) -> None:
    """Raise when an id of ``column`` is outside its table (``0 <= id < cardinality``), naming the row."""
    if not len(values):
        return
    low, high = values.min(), values.max()
    if low >= 0 and high < column.cardinality:
        return
    first = int(((values < 0) | (values >= column.cardinality)).argmax())
    row = first if rows is None else int(np.searchsorted(rows, first, side="right") - 1)
    raise id_error(column, values[first], where, row)


# The messages of bad values, shared by both readers (``value`` a numpy scalar of the column's type).


def null_error(name: str, is_null: np.ndarray, where: RowPosition) -> BadInputError:
    """Column ``name`` has nulls where ``is_null`` (a bool array over the segment's rows) is set."""
    first = int(np.flatnonzero(is_null)[0])
    return BadInputError(
        f"{where.path}: column {name!r} has {int(is_null.sum())} null values, the first at {where.row(first)}; "
        "expected none (the ETL fills missing values)"
    )


def label_error(name: str, value: np.generic, where: RowPosition, row: int) -> BadInputError:
    return BadInputError(f"{where.path}: label column {name!r} should hold 0 or 1, found {value} at {where.row(row)}")


def id_error(column: Column, value: np.generic, where: RowPosition, row: int) -> BadInputError:
    return BadInputError(
        f"{where.path}: column {column.name!r} holds id {value} at {where.row(row)}, outside its table "
        f"[0, {column.cardinality}) (cardinality {column.cardinality} in schema.json)"
    )


def _bag(table: pa.Table, column: Column, where: RowPosition, validate: bool) -> tuple[np.ndarray, np.ndarray]:
    array = _array(table, column.name, where, validate)
    offsets = array.offsets.to_numpy().astype(np.int64)
    values = pc.list_flatten(array).to_numpy(zero_copy_only=False)
    offsets -= offsets[0]
    if validate:
        check_ids(values, column, where, rows=offsets)
    return offsets, values
