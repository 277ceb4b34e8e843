"""Writing the ETL's outputs: each split's parquet files, the saved workflow and ``schema.json``.

Each split is transformed partition by partition and written as ``folder/part-*.parquet`` with
plain Arrow types (label float32, continuous float32 without nulls, categorical int32 codes,
multi-hot list<int32>), the same on both frame libraries.

Example::

    rows, schema = write_outputs(workflow, raw.splits, roles, etl, processed, workflow_dir, schema_path)
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa

from pipeline.etl.column_schema import input_schema, to_schema
from pipeline.etl.config import EtlConfig
from pipeline.etl.frame_library import read_parquet
from pipeline.etl.frames import cudf_frame, is_cudf, nan_free_arrays
from pipeline.etl.progress import compute
from pipeline.etl.workflow import Workflow
from pipeline.parquet import DEFAULT_COMPRESSION, write_table
from pipeline.schema import Schema

SPLITS = ("train", "valid", "test")


def write_outputs(workflow: Workflow, splits: dict[str, list[Path]], roles: dict, etl: EtlConfig, processed: Path,
                  workflow_dir: Path, schema_path: Path, library: str = "pandas",
                  progress: str | bool = "auto") -> tuple[dict[str, int], Schema]:
    """Transform every split with the fitted workflow into ``processed/<split>``, then save the
    workflow to ``workflow_dir`` and the schema the workflow computes to ``schema_path``.

    ``schema.json`` is the mark of finished outputs. The splits are written beside their place
    (``<split>.partial``); only once all are whole is the schema removed, the splits moved into place
    and the workflow saved, the schema written last. A run that fails while it transforms (a full
    disk, an error) leaves the previous outputs as they were and no partial split; one killed while
    it moves them leaves no schema, and no split mixing two runs' files.
    Returns the rows written per split and the schema.
    """
    processed = Path(processed)
    rows = {}
    try:
        for split in SPLITS:
            rows[split] = transform_split(workflow, splits.get(split, []), processed / f"{split}.partial",
                                          etl.row_group_rows, library, progress=progress,
                                          compression=etl.compression)
    except BaseException:
        for split in SPLITS:
            shutil.rmtree(processed / f"{split}.partial", ignore_errors=True)
        raise
    Path(schema_path).unlink(missing_ok=True)
    for split in SPLITS:
        shutil.rmtree(processed / split, ignore_errors=True)
        (processed / f"{split}.partial").rename(processed / split)
    workflow.save(workflow_dir)
    schema = to_schema(workflow.output_schema(input_schema(roles)), rows, etl.row_group_rows,
                       Workflow.fingerprint(workflow_dir))
    schema.save(schema_path)
    return rows, schema


def transform_split(workflow: Workflow, files: list[Path], folder: Path, row_group_rows: int, library: str,
                    progress: str | bool = "auto", compression: str = DEFAULT_COMPRESSION) -> int:
    """Transform one split's parquet files into ``folder/part-*.parquet``; returns the rows written."""
    folder = Path(folder).absolute()  # the workers of an existing scheduler may run in another folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    if not files:
        return 0
    from dask import delayed

    out = workflow.transform(read_parquet(files, workflow.input_columns, library))
    schema = output_arrow_schema(out._meta)
    writes = [
        delayed(write_part, pure=False)(part, folder / f"part-{i:05d}.parquet", schema, row_group_rows, compression)
        for i, part in enumerate(out.to_delayed())
    ]
    return int(sum(compute(*writes, desc=f"transform {folder.stem}", progress=progress)))


def write_part(df: Any, path: Path, schema: pa.Schema, row_group_rows: int, compression: str) -> int:
    """Write one output partition as plain arrow types (pyarrow: no pandas metadata; cuDF's writer
    adds its pandas metadata, which the loader does not read); returns the rows written.

    A pandas partition is written as :mod:`pipeline.parquet` says (required columns where there are no nulls,
    integer columns dictionary-encoded, ``compression``). A cuDF partition is written by cuDF's GPU parquet
    writer (:func:`cudf_writer_options`), without a copy to host; both frame libraries write the same types and
    values (a missing or NaN float is a null).
    """
    if is_cudf(df):
        return _write_cudf(df, path, schema, row_group_rows, compression)
    return write_table(pa.Table.from_pandas(df, schema=schema, preserve_index=False), path, row_group_rows,
                       compression)


def cudf_writer_options(row_group_rows: int, compression: str = DEFAULT_COMPRESSION) -> dict:
    """The options of cuDF's parquet writer (``DataFrame.to_parquet``) for an output partition.

    - ``compression``: as on pandas (:mod:`pipeline.parquet`; LZ4 by default).
    - ``statistics="NONE"``: nothing reads the min/max of the processed files (the loader reads row
      counts), so the writer skips computing them for every page and column chunk.
    - dictionary encoding where a column chunk's dictionary stays small (cuDF's default policy,
      ADAPTIVE): codes, labels and missing indicators then take a few bits a value, so there is less to
      compress, to copy to host memory and to write; pyarrow (the loader's reader) decodes such pages
      as fast as plain ones.
    - ``max_page_size_rows``: one page per column chunk of a row group (up to cuDF's 512 KiB a page),
      as pyarrow writes them, instead of cuDF's 20,000 rows: fewer pages to encode, compress and read.

    libcudf builds row groups from whole page fragments of :data:`CUDF_FRAGMENT_ROWS` rows (an option
    ``to_parquet`` does not expose), so its row groups hold :func:`cudf_row_group_rows` rows: 65,000 for
    the default 65,536. Nothing reads the row group size from the schema; the loader reads each file's.
    """
    return {"index": False, "compression": None if compression == "none" else compression.upper(),
            "statistics": "NONE", "row_group_size_rows": row_group_rows,
            "max_page_size_rows": row_group_rows}


CUDF_FRAGMENT_ROWS = 5_000
"""Rows of a page fragment of libcudf's parquet writer (its default ``max_page_fragment_size``)."""


def cudf_row_group_rows(row_group_rows: int) -> int:
    """The rows of a row group that cuDF's writer writes when asked for ``row_group_rows``: whole fragments."""
    return max(CUDF_FRAGMENT_ROWS, row_group_rows - row_group_rows % CUDF_FRAGMENT_ROWS)


def _write_cudf(df: Any, path: Path | Any, schema: pa.Schema, row_group_rows: int, compression: str) -> int:
    """A cuDF partition written on the GPU (:func:`cudf_writer_options`): the schema's columns and order,
    NaN turned to null.

    Encoded into host memory, then written to the file in one call: given a path, libcudf copies each
    column chunk of each row group from the device and writes it with a call of its own (through KvikIO),
    which took a third of the write's time on the H200 (``tools/etl_profile.py``: "write (parquet, one file)"
    against "the stage's options, straight to the file").
    """
    out = cudf_output_frame(df, schema)
    to_file = isinstance(path, (str, Path))
    buffer = io.BytesIO() if to_file else path
    out.to_parquet(buffer, **cudf_writer_options(row_group_rows, compression))
    if to_file:
        Path(path).write_bytes(buffer.getbuffer())
    return len(out)


def cudf_output_frame(df: Any, schema: pa.Schema) -> Any:
    """The cuDF frame to write: the schema's columns in its order and types, a NaN float a null (as on pandas).

    Which float columns hold a NaN is found for all of them with one copy to the host (cuDF's ``nans_to_nulls``
    looks in each column with a copy of its own: with workers sharing a GPU, each a wait for the others' kernels);
    only those are converted."""
    columns, floats = {}, []
    for field in schema:
        column = df[field.name]
        if pa.types.is_floating(field.type) or pa.types.is_integer(field.type):
            dtype = field.type.to_pandas_dtype()
            column = column if column.dtype == dtype else column.astype(dtype)
            if pa.types.is_floating(field.type):
                floats.append(field.name)
        columns[field.name] = column
    for name in _holding_nans(columns, floats):
        columns[name] = columns[name].nans_to_nulls()
    return cudf_frame(columns)


def _holding_nans(columns: dict[str, Any], names: list[str]) -> list[str]:
    """The float cuDF Series among ``columns[names]`` that may hold a NaN: those with nulls (their values are not
    looked at), and those whose values hold one, found for all with one copy to the host."""
    with_nulls = [name for name in names if columns[name].null_count]
    nan_free = nan_free_arrays({name: columns[name].values for name in names if name not in with_nulls})
    return with_nulls + [name for name, free in nan_free.items() if not free]


def output_arrow_schema(meta: Any) -> pa.Schema:
    """The parquet schema of the output, from the (empty) output frame.

    On cuDF it comes from Arrow (an empty cuDF list column becomes an untyped object column in
    pandas); list types are rebuilt as plain ``list<item>`` so both frame libraries write the same schema.
    """
    if is_cudf(meta):
        schema = meta.to_arrow(preserve_index=False).schema
        fields = [pa.field(f.name, pa.list_(f.type.value_type) if pa.types.is_list(f.type) else f.type)
                  for f in schema]
        return pa.schema(fields)
    return pa.Schema.from_pandas(meta, preserve_index=False).remove_metadata()
