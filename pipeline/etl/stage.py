"""The ETL stage: raw parquet -> processed parquet + ``schema.json`` + the saved workflow.

``python -m pipeline run etl`` (or ``run(cfg)``) makes sure the raw data exists, builds the
default workflow from the column roles in ``raw/meta.json``, fits it on ``train``, transforms
``train``, ``valid`` and ``test``, and writes::

    processed/{train,valid,test}/part-*.parquet   label float32, continuous float32 (no nulls),
                                                  categorical int32 codes, multi-hot list<int32>
    processed/schema.json                         roles, dtypes, cardinalities, rows per split
    workflow/                                     the fitted workflow (Workflow.load)

The default workflow: categorical and multi-hot columns -> Categorify(etl.freq_threshold,
etl.max_vocab_size), or HashBucket(n) for columns named in etl.hash_buckets (multi-hot too); continuous ->
FillMissing(0) >> Clip(min_value=0) >> LogOp >> Normalize; the label -> float32.

Example::

    python -m pipeline run etl data.rows=200000 etl.freq_threshold=2 etl.hash_buckets={C3:100000}
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import PipelineConfig
from pipeline.errors import BadInputError
from pipeline.etl.frame_library import choose_frame_library, read_parquet
from pipeline.etl.cluster import etl_client
from pipeline.etl.config import EtlConfig
from pipeline.etl.graph import Node
from pipeline.etl.ops import Cast, Categorify, Clip, FillMissing, HashBucket, LogOp, Normalize
from pipeline.etl.frames import cudf_frame, is_cudf
from pipeline.etl.progress import compute
from pipeline.etl.workflow import Workflow
from pipeline.schema import Column, Schema

SPLITS = ("train", "valid", "test")
OUTPUT_DTYPES = {"label": "float32", "continuous": "float32", "categorical": "int32", "multihot": "list<int32>"}


def run(cfg: PipelineConfig) -> dict:
    """Fit on train, transform every split, write parquet + schema + workflow; return a summary."""
    from pipeline.data.stage import ensure_raw

    start = time.perf_counter()
    library, reason = choose_frame_library(cfg.device)
    print(f"[etl] {library} backend ({reason})", flush=True)
    raw = ensure_raw(cfg)
    roles = roles_of(raw)
    check_raw_files(raw.splits, roles)
    workflow = default_workflow(roles, cfg.etl, library=library)
    files = [f for split in SPLITS for f in raw.splits[split]]
    input_bytes = sum(f.stat().st_size for f in files)
    timings = {}
    with etl_client(cfg.etl, input_bytes=input_bytes, library=library) as where:
        print(f"[etl] running on {where}", flush=True)
        t = time.perf_counter()
        workflow.fit(read_parquet(raw.splits["train"], workflow.input_columns, library), progress=True)
        timings["fit_s"] = round(time.perf_counter() - t, 2)
        t = time.perf_counter()
        rows, schema = write_outputs(workflow, raw.splits, roles, cfg, library)
        timings["transform_s"] = round(time.perf_counter() - t, 2)
    summary = {
        "processed": str(cfg.paths.processed),
        "schema": str(cfg.paths.schema),
        "workflow": str(cfg.paths.workflow),
        "backend": library,
        "cluster": where,
        "rows": rows,
        "cardinalities": schema.cardinalities(),
        **timings,
        "seconds": round(time.perf_counter() - start, 2),
    }
    print(f"[etl] wrote {rows} rows to {cfg.paths.processed} in {summary['seconds']} s", flush=True)
    return summary


def roles_of(raw: Any) -> dict:
    """The column roles of a raw dataset (``pipeline.data.raw_folder.RawDataset``) as the ETL uses them."""
    return {"label": raw.label, "continuous": list(raw.continuous), "categorical": list(raw.categorical),
            "multihot": list(raw.multihot)}


def write_outputs(workflow: Workflow, splits: dict[str, list[Path]], roles: dict, cfg: PipelineConfig,
                  library: str = "pandas", progress: bool = True) -> tuple[dict[str, int], Schema]:
    """Transform every split with the fitted workflow, then save the workflow and ``schema.json``.

    Returns the rows written per split and the schema.
    """
    rows = {}
    for split in SPLITS:
        rows[split] = transform_split(workflow, splits.get(split, []), cfg.paths.processed / split,
                                      cfg.etl.row_group_rows, library, progress=progress)
    workflow.save(cfg.paths.workflow)
    schema = build_schema(workflow, roles, rows, cfg.etl.row_group_rows)
    schema.save(cfg.paths.schema)
    return rows, schema


def default_workflow(roles: dict, etl: EtlConfig, library: str = "pandas") -> Workflow:
    """The standard workflow for these column roles (see the module docstring).

    ``roles`` is ``{"label": name, "continuous": [...], "categorical": [...], "multihot": [...]}``
    as in ``raw/meta.json``. Output columns come in the order label, continuous, categorical,
    multi-hot, each in the order given.
    """
    sparse = list(roles["categorical"]) + list(roles.get("multihot", []))
    unknown = sorted(set(etl.hash_buckets) - set(sparse))
    if unknown:
        raise BadInputError(f"etl.hash_buckets names {unknown}, which are not categorical columns; those are {sparse}")
    parts: list[Node] = [[roles["label"]] >> Cast("float32")]
    if roles["continuous"]:
        parts.append(list(roles["continuous"]) >> FillMissing(0.0) >> Clip(min_value=0) >> LogOp() >> Normalize())
    for group in _runs(sparse, etl.hash_buckets):
        if group[0] in etl.hash_buckets:
            parts.append(group >> HashBucket(etl.hash_buckets[group[0]]))
        else:
            parts.append(group >> Categorify(freq_threshold=etl.freq_threshold, max_vocab_size=etl.max_vocab_size))
    output = parts[0]
    for part in parts[1:]:
        output = output + part
    return Workflow(output, library=library)


def _runs(columns: list[str], hashed: dict[str, int]) -> list[list[str]]:
    """Consecutive columns with the same treatment, so the output keeps the given order."""
    runs: list[tuple[tuple, list[str]]] = []
    for name in columns:
        key = ("hash", hashed[name]) if name in hashed else ("vocab",)
        if runs and runs[-1][0] == key:
            runs[-1][1].append(name)
        else:
            runs.append((key, [name]))
    return [cols for _, cols in runs]


def check_raw_files(splits: dict[str, list[Path]], roles: dict) -> None:
    """One BadInputError listing every declared column that is missing or of the wrong type."""
    expected = {roles["label"]: "label", **{c: "continuous" for c in roles["continuous"]},
                **{c: "categorical" for c in roles["categorical"]}, **{c: "multihot" for c in roles.get("multihot", [])}}
    if not splits.get("train"):
        raise BadInputError("no raw training data: expected raw/train/part-*.parquet")
    problems = []
    for files in splits.values():
        for path in files[:1] + files[-1:] if files else []:
            schema = pq.read_schema(path)
            for name, role in expected.items():
                if name not in schema.names:
                    problems.append(f"{path}: column {name!r} ({role}) is missing (found {schema.names})")
                elif not _type_fits(role, schema.field(name).type):
                    problems.append(f"{path}: column {name!r} should be {_EXPECTED_TYPES[role]}, found {schema.field(name).type}")
    if problems:
        unique = list(dict.fromkeys(problems))
        raise BadInputError("the raw files do not match meta.json:\n  " + "\n  ".join(unique[:20]))


_EXPECTED_TYPES = {
    "label": "integer, boolean or float 0/1",
    "continuous": "integer or float",
    "categorical": "string or integer",
    "multihot": "list of strings or integers",
}


def _type_fits(role: str, kind: pa.DataType) -> bool:
    numeric = pa.types.is_integer(kind) or pa.types.is_floating(kind)
    text = pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_dictionary(kind)
    if role == "label":
        return numeric or pa.types.is_boolean(kind)
    if role == "continuous":
        return numeric or pa.types.is_null(kind)
    if role == "categorical":
        return text or pa.types.is_integer(kind) or pa.types.is_null(kind)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        inner = kind.value_type
        return pa.types.is_string(inner) or pa.types.is_large_string(inner) or pa.types.is_integer(inner)
    return False


def transform_split(workflow: Workflow, files: list[Path], folder: Path, row_group_rows: int, library: str,
                    progress: bool = True) -> int:
    """Transform one split's parquet files into ``folder/part-*.parquet``; returns the rows written."""
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    if not files:
        return 0
    from dask import delayed

    out = workflow.transform(read_parquet(files, workflow.input_columns, library))
    schema = output_arrow_schema(out._meta)
    writes = [
        delayed(_write_part, pure=False)(part, folder / f"part-{i:05d}.parquet", schema, row_group_rows)
        for i, part in enumerate(out.to_delayed())
    ]
    return int(sum(compute(*writes, desc=f"transform {folder.name}", progress=progress)))


def _write_part(df: Any, path: Path, schema: pa.Schema, row_group_rows: int) -> int:
    """Write one output partition as plain arrow types (pyarrow: no pandas metadata; cuDF's writer
    adds its pandas metadata, which the loader does not read).

    Only the integer code columns are dictionary-encoded: floats rarely repeat enough to pay for
    the attempt, and skipping it nearly halves the writing time. A cuDF partition is written by
    cuDF's GPU parquet writer (a copy to host and pyarrow's writer made the GPU ETL slower than the
    CPU one); both backends write the same types and values (a missing or NaN float is a null).
    """
    if is_cudf(df):
        return _write_cudf(df, path, schema, row_group_rows)
    table = pa.Table.from_pandas(df, schema=schema, preserve_index=False).replace_schema_metadata(None)
    codes = [f.name for f in schema if not pa.types.is_floating(f.type)]
    pq.write_table(table, path, row_group_size=row_group_rows, use_dictionary=codes)
    return table.num_rows


def _write_cudf(df: Any, path: Path, schema: pa.Schema, row_group_rows: int) -> int:
    """A cuDF partition written on the GPU: the schema's columns and order, NaN turned to null."""
    columns = {}
    for field in schema:
        column = df[field.name]
        if pa.types.is_floating(field.type):
            column = column.nans_to_nulls().astype(field.type.to_pandas_dtype())
        elif pa.types.is_integer(field.type):
            column = column.astype(field.type.to_pandas_dtype())
        columns[field.name] = column
    out = cudf_frame(columns)
    # Nullable like pyarrow's schema: cuDF's writer would mark a column without nulls "not null".
    out.to_parquet(path, index=False, row_group_size_rows=row_group_rows, compression="snappy",
                   force_nullable_schema=True)
    return len(out)


def output_arrow_schema(meta: Any) -> pa.Schema:
    """The parquet schema of the output, from the (empty) output frame.

    On cuDF it comes from Arrow (an empty cuDF list column becomes an untyped object column in
    pandas); list types are rebuilt as plain ``list<item>`` so both backends write the same schema.
    """
    if is_cudf(meta):
        schema = meta.to_arrow(preserve_index=False).schema
        fields = [pa.field(f.name, pa.list_(f.type.value_type) if pa.types.is_list(f.type) else f.type)
                  for f in schema]
        return pa.schema(fields)
    return pa.Schema.from_pandas(meta, preserve_index=False).remove_metadata()


def build_schema(workflow: Workflow, roles: dict, rows: dict[str, int], row_group_rows: int) -> Schema:
    """``schema.json`` contents: the columns with roles, dtypes and cardinalities, in output order."""
    producers = workflow.producers()
    role_of = {roles["label"]: "label", **{c: "continuous" for c in roles["continuous"]},
               **{c: "categorical" for c in roles["categorical"]}, **{c: "multihot" for c in roles.get("multihot", [])}}
    columns = []
    for name in workflow.output_columns:
        role = role_of[name]
        column = Column(name=name, role=role, dtype=OUTPUT_DTYPES[role],
                        cardinality=producers[name].cardinality(name) if role in ("categorical", "multihot") else 0)
        if role == "multihot":
            column.max_length = producers[name].max_lengths[name]
        columns.append(column)
    return Schema(columns=columns, row_group_rows=row_group_rows, rows=rows)
