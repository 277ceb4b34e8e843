"""The dataframe library: pandas on CPU, cuDF on GPU, chosen explicitly and imported lazily.

``choose_frame_library(requested)`` turns ``cpu | cuda | auto`` into a library and the reason for it:
``auto`` picks cuDF only when a GPU is usable (checked first, through torch) AND cuDF with
dask_cudf imports; ``cuda`` without either is an error naming what is missing. cuDF is imported
only after a usable GPU was found, so a machine with cuDF installed but no GPU never imports it.

Example::

    library, reason = choose_frame_library("auto")   # ("pandas", "auto: no usable GPU (...)") without a GPU
    read_parquet("data/raw/train", ["C1", "I1"], library)
"""

from __future__ import annotations

import contextlib
import functools
import glob
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.data.column_checks import is_text
from pipeline.errors import BadInputError, UserError

FRAME_LIBRARIES = ("pandas", "cudf")
PARTITION_ROWS = 250_000


class FrameLibraryError(UserError):
    """The chosen dataframe library cannot be used here."""


def cudf_problem() -> str | None:
    """``None`` when cuDF and dask_cudf import, else what went wrong (any error, not only ImportError:
    a cuDF build that cannot find the CUDA driver raises other errors at import)."""
    for name in ("cudf", "dask_cudf"):
        try:
            __import__(name)
        except Exception as err:  # noqa: BLE001 - the message is what the user needs
            missing = getattr(err, "name", None) if isinstance(err, ImportError) else None
            return f"{missing or name} is not importable ({type(err).__name__}: {err})"
    return None


def check_frame_library(library: str) -> str:
    if library not in FRAME_LIBRARIES:
        raise ValueError(f"library: expected one of {FRAME_LIBRARIES}, got {library!r}")
    if library == "cudf":
        problem = cudf_problem()
        if problem:
            raise FrameLibraryError(
                f"the cudf backend was chosen (device cuda) but {problem}: "
                "install RAPIDS (environment.yml, or the [gpu] extra) or use --device cpu"
            )
    return library


def choose_frame_library(requested: str) -> tuple[str, str]:
    """``(library, reason)`` for ``--device cpu|cuda|auto``; raises when ``cuda`` cannot be honoured.

    The GPU is checked before cuDF is imported; ``auto`` falls back to pandas (and says why) when
    either is missing, ``cuda`` raises :class:`pipeline.device.DeviceError` (no usable GPU) or
    :class:`FrameLibraryError` (no cuDF).
    """
    from pipeline.device import resolve_device

    device = resolve_device(requested)
    if not device.is_cuda:
        return "pandas", device.reason
    if requested == "auto":
        problem = cudf_problem()
        if problem:
            return "pandas", f"auto: a CUDA GPU is usable but {problem}"
        return "cudf", "auto: a usable CUDA GPU and cuDF were found"
    return check_frame_library("cudf"), device.reason


def read_parquet(path: str | Path | list, columns: list[str] | None, library: str,
                 partition_rows: int = PARTITION_ROWS) -> Any:
    """A lazy Dask DataFrame over parquet files.

    On the pandas library every column is arrow-backed (``pd.ArrowDtype``) and string columns are
    read as Arrow dictionaries: parquet stores them dictionary-encoded, so this skips decoding each
    value, and Categorify counts and looks up the (few) dictionary values instead of every row.
    Partitions are whole row groups: on pandas about ``partition_rows`` rows each (a file per partition at
    least), on cuDF :func:`gpu_pieces`.
    """
    import dask.dataframe as dd

    check_frame_library(library)
    files = parquet_files(path)
    schema = pq.read_schema(files[0])
    columns = list(columns or schema.names)
    _check_columns(files[0], schema, columns)
    if library == "cudf":
        # Straight into GPU memory (libcudf's parquet reader): strings are plain cuDF string
        # columns, lists cuDF list columns, integers keep their width and nulls.
        pieces = gpu_pieces(files, columns)
        first_file, first_groups = pieces[0][0]
        meta = _read_cudf_piece([(first_file, first_groups[:1])], columns).head(0)
        return dd.from_map(_read_cudf_piece, pieces, columns=columns, meta=meta, enforce_metadata=False)
    dictionary = tuple(_string_columns(schema))
    return dd.from_map(_read_piece, _pieces(files, partition_rows, columns), columns=columns, dictionary_columns=dictionary,
                       meta=_empty(schema, columns, dictionary), enforce_metadata=False)


def gpu_pieces(files: list[Path], columns: list[str]) -> list[list[tuple[str, list[int]]]]:
    """The cuDF reader's partitions: the files' row groups, in order, cut into :func:`piece_count` pieces of about
    equal rows (:func:`split_row_groups`); each piece is ``[(file, [row groups]), ...]`` and may span files.

    Dask cuDF's reader (1/32 of a GPU's memory a partition, small files merged up to it) puts a few GB in
    one partition: a 20M-row dataset becomes one task on one GPU; with a size a partition instead, the
    partitions seldom divide among the workers, and the last round runs on some workers while the others
    wait (9 partitions on 2 workers take the time of 10). Fewer, larger partitions suit a GPU: each
    partition's category counts are merged with every other's, work that grows with their number, and
    workers sharing a GPU (``etl.workers_per_gpu``) overlap one partition's host work with another's GPU work,
    which several partitions a worker otherwise would.
    """
    from pipeline.etl.progress import task_slots

    names = set(columns)
    groups: list[tuple[str, int, int]] = []
    total = 0
    first = None
    for f in files:
        meta, schema = parquet_footer(f)
        first = _check_columns(f, schema, columns, first)
        wanted = [i for i in range(meta.num_columns) if meta.schema.column(i).path.split(".")[0] in names]
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            groups.append((str(f), g, group.num_rows))
            total += sum(group.column(i).total_uncompressed_size for i in wanted)
    if not groups:
        return [[(str(files[0]), [])]]
    return split_row_groups(groups, piece_count(total, task_slots()))


def piece_count(total_bytes: int, slots: int) -> int:
    """How many partitions ``total_bytes`` of columns make on a cluster of GPU workers that runs ``slots`` tasks at
    once (their threads, ``etl.gpu_threads`` each): one a slot, each kept within 32 MiB to 1 GiB (a partition takes
    several times its bytes of GPU memory while it is worked on), and then (where there are more than the slots) a
    multiple of the slots, so that every round of tasks keeps every thread busy."""
    size = min(1 << 30, max(32 << 20, total_bytes // slots))
    parts = max(1, round(total_bytes / size))
    return -(-parts // slots) * slots if parts > slots else parts


def split_row_groups(groups: list[tuple[str, int, int]], parts: int) -> list[list[tuple[str, list[int]]]]:
    """Row groups ``(file, index, rows)``, in order, cut into at most ``parts`` pieces of about equal rows (a row
    group whole in the piece where its first row falls); each piece is ``[(file, [indices]), ...]``."""
    parts = max(1, min(parts, len(groups)))
    rows = max(1, sum(n for _, _, n in groups))
    pieces: list[list[tuple[str, list[int]]]] = [[] for _ in range(parts)]
    before = 0
    for path, index, n in groups:
        piece = pieces[min(parts - 1, before * parts // rows)]
        if piece and piece[-1][0] == path:
            piece[-1][1].append(index)
        else:
            piece.append((path, [index]))
        before += n
    return [piece for piece in pieces if piece]


def _read_cudf_piece(piece: list[tuple[str, list[int]]], columns: list[str] | None = None) -> Any:
    """Row groups of one or more files as one cuDF DataFrame, in one call to libcudf's reader.

    Importing ``dask_cudf.backends`` tells Dask the size of cuDF frames in the process that reads them (a worker):
    Dask knows them only from there, and without it took every partition for 48 bytes, so its scheduler moved
    partitions of gigabytes between workers to save moving a few kilobytes of statistics. A worker without dask_cudf
    (another cluster's) still reads, its partitions' sizes unknown.
    """
    import cudf

    with contextlib.suppress(ImportError):
        import dask_cudf.backends  # noqa: F401  (registers Dask's sizeof of cuDF objects)

    if not any(groups for _, groups in piece):  # files without row groups: an empty frame of their columns
        return cudf.read_parquet(piece[0][0], columns=columns)
    return cudf.read_parquet([path for path, _ in piece], columns=columns, row_groups=[g for _, g in piece])


def parquet_files(path: str | Path | list) -> list[Path]:
    """The parquet files of a file, a folder (``*.parquet`` inside, sorted), a glob or a list of those, as whole
    paths: the workers of an existing scheduler may run in another folder than this process."""
    items = path if isinstance(path, (list, tuple)) else [path]
    files: list[Path] = []
    for item in items:
        item = Path(item)
        if item.is_dir():
            files.extend(sorted(item.glob("*.parquet")))
        elif item.is_file():
            files.append(item)
        else:
            files.extend(sorted(Path(p) for p in glob.glob(str(item))))
    if not files:
        raise BadInputError(f"no parquet files at {path}")
    return [f.absolute() for f in files]


def _pieces(files: list[Path], partition_rows: int, columns: list[str]) -> list[tuple[str, list[int]]]:
    pieces = []
    first = None
    for path in files:
        metadata, schema = parquet_footer(path)
        first = _check_columns(path, schema, columns, first)
        group: list[int] = []
        rows = 0
        for i in range(metadata.num_row_groups):
            group.append(i)
            rows += metadata.row_group(i).num_rows
            if rows >= partition_rows:
                pieces.append((str(path), group))
                group, rows = [], 0
        if group or not pieces or pieces[-1][0] != str(path):
            pieces.append((str(path), group))
    return pieces


def parquet_footer(path: str | Path) -> tuple[pq.FileMetaData, pa.Schema]:
    """A parquet file's footer and its Arrow schema, read once for each version of the file (its inode, size and
    modification time): the fit and the transform of a split plan their partitions from the same files."""
    stat = os.stat(path)
    return _read_footer(str(path), stat.st_ino, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=512)
def _read_footer(path: str, inode: int, size: int, mtime_ns: int) -> tuple[pq.FileMetaData, pa.Schema]:
    metadata = pq.read_metadata(path)
    return metadata, metadata.schema.to_arrow_schema()


def _check_columns(path: Path, schema: pa.Schema, columns: list[str],
                   first: tuple[Path, pa.Schema] | None = None) -> tuple[Path, pa.Schema]:
    """Refuse a file that lacks some of ``columns``, or that holds one of them as text where the ``first`` file of
    the input holds numbers (or the other way round): each file of a folder is checked, they may differ. Categorify
    counts 7 and "7" as one value, but the hashing operators hash a number's bytes and a text's characters, so one id
    would be two. A column without any value (Arrow's null type) fits either. Returns ``first``, or this file where
    there is none."""
    if first is not None and schema.equals(first[1]):
        return first
    names = set(schema.names)
    missing = [c for c in columns if c not in names]
    if missing:
        raise BadInputError(f"{path}: expected the columns {columns}; missing {missing}; found {schema.names}")
    if first is None:
        return path, schema
    for name in columns:
        here, there = schema.field(name).type, first[1].field(name).type
        if _is_text(here) != _is_text(there) and not (pa.types.is_null(here) or pa.types.is_null(there)):
            raise BadInputError(f"{path}: column {name!r} is {here} where {first[0]} has {there}: one id would be two "
                                "values (hashing operators hash a number's bytes and a text's characters); write the "
                                "column with one type in every file")
    return first


def _is_text(kind: pa.DataType) -> bool:
    """Whether a column of this type holds text (or lists of text)."""
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        kind = kind.value_type
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return is_text(kind)


def _string_columns(schema: pa.Schema) -> list[str]:
    return [f.name for f in schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)]


def _empty(schema: pa.Schema, columns: list[str], dictionary_columns: list[str]) -> Any:
    fields = [schema.field(c) for c in columns]
    fields = [pa.field(f.name, pa.dictionary(pa.int32(), f.type)) if f.name in dictionary_columns else f for f in fields]
    return _to_pandas(pa.schema(fields).empty_table())


def _read_piece(piece: tuple[str, list[int]], columns: list[str] | None = None,
                dictionary_columns: tuple[str, ...] = ()) -> Any:
    """Row groups of one file as an arrow-backed pandas DataFrame (Dask passes the projected ``columns``)."""
    path, row_groups = piece
    parquet = pq.ParquetFile(path, read_dictionary=[c for c in dictionary_columns if columns is None or c in columns])
    return _to_pandas(parquet.read_row_groups(row_groups, columns=columns))


def _to_pandas(table: pa.Table) -> Any:
    import pandas as pd

    return table.to_pandas(types_mapper=pd.ArrowDtype, ignore_metadata=True)
