"""How processed parquet is written: what the loader reads, from the ETL and from the loader's synthetic splits.

Columns without nulls are written as required (not null), as cuDF's writer does, and only the integer columns
(codes, ids, lists of them) are dictionary-encoded: floats rarely repeat enough to pay for the attempt. Pages
are compressed with ``compression`` (``etl.compression``): LZ4 by default, which the loader decodes with about a
third of the CPU that snappy-compressed nullable pages take at the same size on disk; ``none`` takes about 1.5x
less decoding CPU again for about 2.4x the bytes (Criteo-like data), for a loader bound by the host's decoding.

Example::

    write_table(table, "processed/train/part-00000.parquet", row_group_rows=65_536, compression="lz4")
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

COMPRESSIONS = ("lz4", "zstd", "snappy", "none")
DEFAULT_COMPRESSION = "lz4"


def write_table(table: pa.Table, where: str | Path | Any, row_group_rows: int,
                compression: str = DEFAULT_COMPRESSION) -> int:
    """Write ``table`` (no pandas metadata) to ``where`` (a path or a writable buffer); returns its rows."""
    table = table.replace_schema_metadata(None)
    table = table.cast(required_where_no_nulls(table))
    pq.write_table(table, where, row_group_size=row_group_rows, **writer_options(table.schema, compression))
    return table.num_rows


def writer_options(schema: pa.Schema, compression: str) -> dict:
    """pyarrow writer options for a processed table of ``schema``: its integer columns dictionary-encoded,
    ``compression`` (one of :data:`COMPRESSIONS`), no min / max statistics (nothing reads them: the loader reads row
    groups whole, in its own order; cuDF's writer leaves them out too)."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression: expected one of {', '.join(COMPRESSIONS)}, got {compression!r}")
    codes = [f.name for f in schema if not pa.types.is_floating(f.type)]
    return {"use_dictionary": codes, "compression": compression, "write_statistics": False}


def required_where_no_nulls(table: pa.Table) -> pa.Schema:
    """The table's schema with each column, and a list column's items, marked required where it holds no nulls:
    what cuDF's writer writes."""
    fields = []
    for field, column in zip(table.schema, table.columns):
        kind = field.type
        if pa.types.is_list(kind) and not pc.list_flatten(column).null_count:
            kind = pa.list_(kind.value_field.with_nullable(False))
        fields.append(pa.field(field.name, kind, nullable=column.null_count > 0))
    return pa.schema(fields)
