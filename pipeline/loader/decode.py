"""Reading the ETL's parquet files into one packed block per window, with cheap checks of what was read.

:func:`open_split` reads every file's footer once: the row groups (for the plan) and the column
types (checked against the schema before any row is read). :func:`read_window` reads the rows of
a window (a few segments of row groups) with pyarrow: one ``read_row_groups`` call per file, its
columns decoded on pyarrow's threads, and each column's chunks copied straight into its row of one
int32 block, so the Python work (and the GIL held) per window is a few hundred short calls,
whatever its rows. It checks that there are no nulls (from arrow's counts), then, with numpy over
the packed block, that labels are 0/1 and that ids are within their table's cardinality (not those
of dynamic columns: raw 64-bit ids, any value); when a check fails, the window's segments are
checked one by one to name the file, column, row and value of the first bad one.

Example::

    split = open_split(find_files("data/synthetic/processed/train"), schema)
    chunk = read_window(split, [Segment(split.groups[0], 0, 100)])
    chunk.block[0].view("float32")[:5]     # the first 5 labels
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

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
    def wide(self) -> list[str]:
        """The one-hot columns of raw 64-bit ids (dynamic): each takes a second row of the block."""
        dynamic = set(self.schema.dynamic)
        return [c for c in self.onehot if c in dynamic]

    @property
    def columns(self) -> list[str]:
        return [self.schema.label, *self.schema.continuous, *self.schema.sparse]

    @property
    def block_rows(self) -> int:
        """Rows of a packed block: the label, the continuous columns, the one-hot columns, and the high
        halves of the wide ones."""
        return 1 + len(self.schema.continuous) + len(self.onehot) + len(self.wide)


@dataclass
class Chunk:
    """A window's decoded rows, packed for one copy: ``block`` is int32 ``[1 + n_cont + n_onehot + n_wide,
    rows]`` holding the label and the continuous columns (float32 bits), the one-hot ids (the low 32 bits
    of a wide column's), then the high 32 bits of each wide column (:attr:`Split.wide`); ``bags`` the
    multi-hot columns."""

    block: np.ndarray | torch.Tensor
    """A numpy array, or (the cudf reader) a tensor already on the target device."""
    bags: list[tuple[np.ndarray, np.ndarray]]
    """Per multi-hot feature: (offsets int64 of length rows + 1 starting at 0, values)."""
    buffer: torch.Tensor | None = None
    """The pinned pool buffer whose memory ``block`` is (GPU targets): the source of the copy to the
    device, given back to the pool once that copy is queued."""
    ready: torch.cuda.Event | None = None
    """Set when a reader thread made ``block`` on the device on its own stream: the producer's stream waits on it."""

    @property
    def rows(self) -> int:
        return self.block.shape[1]

    def pinned(self) -> torch.Tensor:
        """The block as a tensor over its pinned buffer."""
        return self.buffer[: self.block.size].view(self.block.shape)


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


def read_window(
    split: Split,
    segments: Sequence[Segment],
    validate: bool = True,
    buffers: PinnedPool | None = None,
    stop: threading.Event | None = None,
) -> Chunk:
    """Read, check and pack the rows of ``segments``, in their order (thread-safe: each call opens its own readers).

    With ``buffers`` the block is packed into one of the pool's pinned buffers, ready for one
    asynchronous copy to a GPU; ``chunk.buffer`` must then go back to the pool once that copy is queued.
    Nulls are always refused (they cannot be packed); ``validate`` adds the checks of labels and ids.
    """
    block, buffer = new_block(split, sum(s.rows for s in segments), buffers, stop)
    try:
        bags = read_into(split, segments, block, validate)
    except BaseException:
        if buffer is not None:
            buffers.release(buffer)
        raise
    return Chunk(block, bags, buffer)


def new_block(split: Split, rows: int, buffers: PinnedPool | None = None,
              stop: threading.Event | None = None) -> tuple[np.ndarray, torch.Tensor | None]:
    """An empty packed block of ``rows`` rows, and with ``buffers`` the pinned pool buffer it lies in."""
    shape = (split.block_rows, rows)
    if buffers is None:
        return np.empty(shape, dtype=np.int32), None
    buffer = buffers.acquire(stop or threading.Event())
    return buffer[: shape[0] * shape[1]].numpy().reshape(shape), buffer


def read_into(split: Split, segments: Sequence[Segment], block: np.ndarray, validate: bool = True
              ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Read, check and pack the rows of ``segments`` into ``block`` (``[block_rows, their rows]``, or such a view of a
    larger block: reader threads fill parts of one window side by side); returns their multi-hot bags."""
    table = _read_rows(split, segments)
    if any(_nulls(table.column(name)) for name in split.columns) or not _wide_ids_fit(split, table, validate):
        _raise_first_problem(split, table, segments, validate)
    _pack(split, table, block)
    if validate and not _block_passes_checks(split, block):
        _raise_first_problem(split, table, segments, validate)
    bags = [_bag(table.column(name)) for name in split.schema.multihot]
    if validate and not all(_ids_fit(values, split.schema.column(name)) for name, (_, values) in
                            zip(split.schema.multihot, bags) if not split.schema.column(name).dynamic):
        _raise_first_problem(split, table, segments, validate)
    return bags


def join_bags(parts: Sequence[list[tuple[np.ndarray, np.ndarray]]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """The multi-hot bags of consecutive parts of a window as one window's (offsets from 0, values)."""
    if len(parts) == 1:
        return parts[0]
    joined = []
    for bags in zip(*parts):
        ends = np.cumsum([0] + [offsets[-1] for offsets, _ in bags])
        offsets = np.concatenate([o[:-1] + end for (o, _), end in zip(bags, ends)] + [ends[-1:]])
        joined.append((offsets, np.concatenate([values for _, values in bags])))
    return joined


def _read_rows(split: Split, segments: Sequence[Segment]) -> pa.Table:
    """The segments' rows in order; each file's row groups are read by one call, decoded on pyarrow's threads.

    Read into buffers, not mapped into memory: a file made shorter while it is read (the processed files rewritten
    under a running training) is then a short read and this error, where the pages of a mapping past the file's new
    end killed the process (SIGBUS)."""
    wanted: dict[int, set[int]] = {}
    for seg in segments:
        wanted.setdefault(seg.group.file, set()).add(seg.group.index)
    tables, first_row = {}, {}
    for file, indices in wanted.items():
        indices = sorted(indices)
        try:
            with pq.ParquetFile(split.files[file], metadata=split.metadata[file]) as pf:
                tables[file] = pf.read_row_groups(indices, columns=split.columns, use_threads=True)
        except (OSError, pa.ArrowException) as err:
            raise BadInputError(f"{split.files[file]}: its row groups {indices} do not read ({' '.join(str(err).split())}"
                                "): the file is damaged, or was changed since the loader opened it; run the ETL "
                                "again (`python -m pipeline run etl`)") from err
        row = 0
        for index in indices:
            first_row[file, index] = row
            row += split.metadata[file].row_group(index).num_rows
    # files of one split may differ in what the checks allow (a column required in one, nullable in another; list
    # and large_list): one schema for all
    return pa.concat_tables(
        [tables[s.group.file].slice(first_row[s.group.file, s.group.index] + s.start, s.rows) for s in segments],
        promote_options="permissive",
    )


def _wide_ids_fit(split: Split, table: pa.Table, validate: bool) -> bool:
    """Whether the one-hot int64 id columns hold ids of their tables (checked before they are narrowed to int32;
    dynamic columns are packed whole)."""
    if not validate:
        return True
    for name in _checked(split.onehot, split.schema):
        values = table.column(name)
        if values.type == pa.int64() and len(values):
            low, high = pc.min_max(values).values()
            if low.as_py() < 0 or high.as_py() >= split.schema.column(name).cardinality:
                return False
    return True


def _nulls(column: pa.ChunkedArray) -> int:
    """A column's null values, and for a list column the null items of its lists too."""
    items = pc.list_flatten(column).null_count if pa.types.is_list(column.type) or pa.types.is_large_list(
        column.type) else 0
    return column.null_count + items


def _block_passes_checks(split: Split, block: np.ndarray) -> bool:
    """Whether the packed labels are 0/1, the continuous values finite and the one-hot ids within their tables: a
    few numpy passes over the block."""
    if not block.shape[1]:
        return True
    label = block[0].view(np.float32)
    if not np.logical_or(label == 0, label == 1).all():
        return False
    n = 1 + len(split.schema.continuous)
    if n > 1 and not np.isfinite(block[1:n].view(np.float32)).all():
        return False
    checked = [n + i for i, name in enumerate(split.onehot) if not split.schema.column(name).dynamic]
    if not checked:
        return True
    ids = block[checked] if len(checked) < len(split.onehot) else block[n : n + len(checked)]
    high = np.array([split.schema.column(name).cardinality for name in _checked(split.onehot, split.schema)])
    return bool((ids.min(axis=1) >= 0).all() and (ids.max(axis=1) < high).all())


def _checked(names: list[str], schema: Schema) -> list[str]:
    """The columns of ``names`` whose ids are checked against their cardinality: all but the dynamic ones."""
    return [name for name in names if not schema.column(name).dynamic]


def _ids_fit(values: np.ndarray, column: Column) -> bool:
    return not len(values) or (values.min() >= 0 and values.max() < column.cardinality)


def _raise_first_problem(split: Split, table: pa.Table, segments: Sequence[Segment], validate: bool) -> None:
    """Check the window's segments one by one and raise the error of the first bad value."""
    start = 0
    for seg in segments:
        where = RowPosition(split.files[seg.group.file], seg.group, seg.start)
        _check_segment(split, table.slice(start, seg.rows), where, validate)
        start += seg.rows
    raise AssertionError("a check of the window failed, but none of its segments")


def _check_segment(split: Split, table: pa.Table, where: RowPosition, validate: bool) -> None:
    schema = split.schema
    for name in [schema.label, *schema.continuous, *split.onehot, *schema.multihot]:
        array = _array(table, name)
        if array.null_count:
            raise null_error(name, array.is_null().to_numpy(zero_copy_only=False), where)
        items = pc.list_flatten(array) if name in schema.multihot else None
        if items is not None and items.null_count:
            items = items.is_null().to_numpy(zero_copy_only=False)
            rows = pc.list_parent_indices(array).to_numpy()
            raise null_items_error(name, int(items.sum()), where, int(rows[items.argmax()]))
        if not validate or name in schema.dynamic:
            continue
        if name in schema.continuous:
            _check_finite(array.to_numpy(zero_copy_only=False), name, where)
        elif name == schema.label:
            _check_label(array.to_numpy(), name, where)
        elif name in schema.multihot:
            offsets, values = _bag(array)
            check_ids(values, schema.column(name), where, rows=offsets)
        else:
            check_ids(array.to_numpy(), schema.column(name), where)


def _pack(split: Split, table: pa.Table, block: np.ndarray) -> None:
    """Fill ``block`` with the label and continuous bits and the one-hot ids, each column's chunks copied
    straight into its row (no intermediate tensor); int64 ids are narrowed in that copy, but for the wide
    columns', whose 32-bit halves go to their row and to their high row."""
    schema = split.schema
    n = 1 + len(schema.continuous)
    high_row = {name: len(block) - len(split.wide) + k for k, name in enumerate(split.wide)}
    for i, name in enumerate([schema.label, *schema.continuous, *split.onehot]):
        row = block[i].view(np.float32) if i < n else block[i]
        start = 0
        for chunk in table.column(name).chunks:
            values = chunk.to_numpy(zero_copy_only=False)
            if name in high_row:
                halves = values.astype("<i8", copy=False).view("<i4").reshape(-1, 2)
                values = halves[:, 0]
                block[high_row[name], start : start + len(values)] = halves[:, 1]
            row[start : start + len(values)] = values
            start += len(values)


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
        if column.cardinality > np.iinfo(np.int32).max and not column.dynamic:
            raise BadInputError(f"column {column.name!r}: cardinality {column.cardinality} does not fit int32 ids")
        want, got = expected_type(column), arrow_schema.field(column.name).type
        if column.role == "multihot" and pa.types.is_large_list(got):
            got = pa.list_(got.value_type)
        if not got.equals(want) and not (
            pa.types.is_list(got) and pa.types.is_list(want) and got.value_type == want.value_type
        ):
            raise BadInputError(f"{path}: column {column.name!r} ({column.role}) should be {want}, found {got}")


def _array(table: pa.Table, name: str) -> pa.Array:
    column = table.column(name)
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()


def _check_finite(values: np.ndarray, name: str, where: RowPosition) -> None:
    bad = ~np.isfinite(values)
    if bad.any():
        first = int(bad.argmax())
        raise finite_error(name, values[first], where, first)


def finite_error(name: str, value: np.generic, where: RowPosition, row: int) -> BadInputError:
    return BadInputError(f"{where.path}: continuous column {name!r} holds {value} at {where.row(row)}; expected "
                         "finite numbers (the ETL fills and normalizes them): the file was not written by the ETL, or "
                         "is damaged; run `python -m pipeline run etl` again")


def null_items_error(name: str, count: int, where: RowPosition, row: int) -> BadInputError:
    """Multi-hot column ``name`` has ``count`` null items in the segment's lists, the first in its row ``row``."""
    return BadInputError(f"{where.path}: column {name!r} has {count} null items in its lists, the first in "
                         f"{where.row(row)}; expected none (the ETL codes a missing item)")


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


def _bag(column: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(offsets int64 from 0, values) of a list column."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    offsets = array.offsets.to_numpy().astype(np.int64)
    values = pc.list_flatten(array).to_numpy(zero_copy_only=False)
    offsets -= offsets[0]
    return offsets, values
