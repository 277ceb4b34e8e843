"""Processed-data look-alikes: parquet files and a ``schema.json`` shaped like the ETL's output.

For the loader's benchmark and examples, where a dataset of a given size is wanted without running
the data and ETL stages. Values are random (uniform ids, 0/1 labels, log-normal-ish dense values; a dynamic column's ids
are ``cardinality`` random 64-bit values); only the shape and the types follow the ETL contract.

Example::

    schema = criteo_schema(multihot={"M1": 8})
    write_processed("data/loader-bench/processed", schema, {"train": 1_000_000}, row_group_rows=65_536)
    Loader("data/loader-bench/processed/train", batch_size=4096)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.parquet import DEFAULT_COMPRESSION, required_where_no_nulls, writer_options
from pipeline.schema import Column, Schema

CRITEO_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
"""Distinct values of C1..C26 in Criteo Kaggle; the schema adds 2 reserved indices (missing, OOV)."""


def criteo_schema(
    size: float = 0.01, continuous: int = 13, categorical: int = 26, multihot: dict[str, int] | None = None
) -> Schema:
    """A schema with Criteo's columns (``label``, ``I1..``, ``C1..``) and optional multi-hot ones.

    ``size`` scales the cardinalities (1.0: Criteo Kaggle's); ``multihot`` maps a name to its
    longest list (its cardinality is 1000).
    """
    columns = [Column("label", "label", "float32")]
    columns += [Column(f"I{i}", "continuous", "float32") for i in range(1, continuous + 1)]
    for i in range(categorical):
        base = CRITEO_CARDINALITIES[i % len(CRITEO_CARDINALITIES)]
        columns.append(
            Column(f"C{i + 1}", "categorical", "int32", cardinality=max(min(base, 32), int(base * size)) + 2)
        )
    for name, longest in (multihot or {}).items():
        columns.append(Column(name, "multihot", "list<int32>", cardinality=1000, max_length=longest))
    return Schema(columns)


def random_table(schema: Schema, rows: int, rng: np.random.Generator) -> pa.Table:
    """``rows`` random rows of ``schema``'s columns, with the ETL's types."""
    arrays: dict[str, pa.Array] = {}
    for column in schema.columns:
        if column.role == "label":
            arrays[column.name] = pa.array((rng.random(rows) < 0.25).astype(np.float32))
        elif column.role == "continuous":
            arrays[column.name] = pa.array(np.log1p(rng.exponential(8.0, rows)).astype(np.float32))
        elif column.role == "categorical":
            arrays[column.name] = pa.array(_ids(column, rows, rng))
        else:
            lengths = rng.integers(0, column.max_length + 1, rows)
            offsets = np.zeros(rows + 1, dtype=np.int32)
            np.cumsum(lengths, out=offsets[1:])
            arrays[column.name] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(_ids(column, int(offsets[-1]), rng)))
    return pa.table(arrays)


def _ids(column: Column, count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` uniform ids of ``column``: codes below its cardinality, or (dynamic) that many random int64s."""
    codes = rng.integers(0, column.cardinality, count, dtype=np.int32)
    if not column.dynamic:
        return codes
    vocabulary = np.random.default_rng(column.cardinality).integers(-(2**63), 2**63 - 1, column.cardinality,
                                                                    dtype=np.int64)
    return vocabulary[codes]


def write_processed(
    folder: str | Path,
    schema: Schema,
    splits: dict[str, int],
    row_group_rows: int = 65_536,
    files_per_split: int = 1,
    seed: int = 0,
    compression: str = DEFAULT_COMPRESSION,
) -> Schema:
    """Write ``folder/<split>/part-<i>.parquet`` with ``splits[split]`` random rows each, and ``schema.json``, as
    the ETL writes its output (:mod:`pipeline.parquet`)."""
    folder = Path(folder)
    rng = np.random.default_rng(seed)
    for split, rows in splits.items():
        out = folder / split
        out.mkdir(parents=True, exist_ok=True)
        for old in out.glob("part-*.parquet"):
            old.unlink()
        bounds = np.linspace(0, rows, files_per_split + 1).astype(int)
        for i in range(files_per_split):
            table = random_table(schema, 0, rng)
            with pq.ParquetWriter(out / f"part-{i}.parquet", required_where_no_nulls(table),
                                  **writer_options(table.schema, compression)) as writer:
                done = bounds[i]
                while done < bounds[i + 1]:
                    n = min(row_group_rows, bounds[i + 1] - done)
                    table = random_table(schema, n, rng)
                    writer.write_table(table.cast(required_where_no_nulls(table)), row_group_size=row_group_rows)
                    done += n
    schema = Schema(schema.columns, row_group_rows=row_group_rows, rows=dict(splits))
    schema.save(folder / "schema.json")
    return schema
