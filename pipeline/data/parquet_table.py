"""A parquet table's rows, read in batches and checked as the text readers check theirs
(:func:`~pipeline.data.column_checks.check_and_convert`): the columns the roles name, each of a type its role
can take, pandas' index columns left out.

Example::

    for table, rows in read_parquet_table(path, roles, kinds, 100_000, FileReport(str(path)), False, "|"):
        ...  # table: the raw layout's types; rows: the rows' numbers in the file, from 1
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.data.column_checks import check_and_convert, is_text
from pipeline.data.roles import Roles
from pipeline.data.text_format import FileReport, date_or_time_advice
from pipeline.errors import BadInputError


def _pandas_index_columns(schema: pa.Schema) -> set[str]:
    """The columns that pandas wrote its index to (``__index_level_0__`` for a filtered frame's), which are not
    data: a file written by ``DataFrame.to_parquet`` names them in its pandas metadata."""
    try:
        return {c for c in (schema.pandas_metadata or {}).get("index_columns", []) if isinstance(c, str)}
    except (ValueError, TypeError, AttributeError):  # metadata that is not pandas' JSON
        return set()


def read_parquet_table(path: Path, roles: Roles, kinds: dict[str, str], chunk_rows: int, report: FileReport,
                  stop_on_bad: bool, separator: str) -> Iterator[tuple[pa.Table, np.ndarray]]:
    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as err:
        raise BadInputError(f"{path}: expected a parquet file, could not read it ({err})") from err
    index = _pandas_index_columns(file.schema_arrow)
    roles.check_against([n for n in file.schema_arrow.names if n not in index or n in roles.columns], str(path))
    for name, kind in kinds.items():
        _check_parquet_type(path, name, kind, file.schema_arrow.field(name).type, roles.time)
    first = 1
    for batch in file.iter_batches(batch_size=chunk_rows, columns=list(kinds)):
        table = pa.Table.from_batches([batch])
        lines = np.arange(first, first + table.num_rows, dtype=np.int64)
        first += table.num_rows
        report.rows_read += table.num_rows

        def quote(i: int, table=table) -> str:
            return "row " + ", ".join(f"{n}={table.column(n)[i].as_py()!r}" for n in kinds)

        table, lines = check_and_convert(table, lines, kinds, separator, report, quote, roles.time)
        if stop_on_bad and report.bad_rows:
            report.stopped_at_line = int(first - 1)
            return
        report.rows_kept += table.num_rows
        if table.num_rows:
            yield table, lines


def _check_parquet_type(path: Path, name: str, kind: str, t: pa.DataType, time_column: str) -> None:
    if pa.types.is_dictionary(t):
        t = t.value_type
    numeric = pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)
    if kind == "float" and pa.types.is_decimal(t):  # what databases and Spark export prices as
        return
    if kind in ("label", "float"):
        ok, expected = numeric or is_text(t), "a numeric column"
    elif kind == "string":
        ok, expected = is_text(t) or numeric, "a string, number or boolean column"
    elif kind == "time":
        ok = numeric or is_text(t) or pa.types.is_timestamp(t) or pa.types.is_date(t)
        expected = "integers, ISO 8601 text, timestamps or dates"
    else:
        ok = is_text(t) or ((pa.types.is_list(t) or pa.types.is_large_list(t)) and (
            is_text(t.value_type) or pa.types.is_integer(t.value_type)))
        expected = "a list of strings or integers (or text to split on data.list_separator)"
    if not ok and not (pa.types.is_null(t) and kind not in ("label", "time")):  # a column of no value (pandas')
        raise BadInputError(f"{path}: column {name!r} ({ROLE_SETTINGS[kind]}) should be {expected}, found {t}"
                            + _temporal_advice(name, kind, t, time_column))


def _temporal_advice(name: str, kind: str, t: pa.DataType, time_column: str) -> str:
    """What to do with a column of durations, times of day or dates named where numbers are read."""
    if kind not in ("label", "float", "time"):
        return ""
    if pa.types.is_duration(t):
        return " (a duration: write it as a number, such as seconds (pandas: .dt.total_seconds()), a continuous feature)"
    if pa.types.is_time(t):
        return " (a time of day: write it as a number, such as seconds since midnight, a continuous feature)"
    if pa.types.is_temporal(t) and kind != "time":
        return f" ({date_or_time_advice(name, None, time_column)})"
    return ""


ROLE_SETTINGS = {"label": "data.label", "float": "data.continuous", "string": "data.categorical",
                  "list": "data.multihot", "time": "data.time_column"}
"""The setting that gave a column each kind of the readers."""
