"""Where one ETL partition's time goes, without Dask: read, each operator's fit statistics and
transform, the pieces of Categorify and the continuous chain, and the write, on one backend in this
process (one GPU for cuDF).

The stage's default workflow on synthetic Criteo-like rows (the data stage's generator). Each step
runs ``--repeats`` times after one warm-up run (cuDF compiles kernels on first use); the best time is
printed. On cuDF the device is synchronised around every timed step, and each step runs once more under
``torch.profiler`` for the time of its kernels and copies on the GPU, printed beside it (``gpu_ms`` in the JSON): the
rest of the step's time is the host's (Python, libcudf's host work, waits). Compare with the Dask run's per-task
report (``bench etl --report``) to see what the cluster adds. The steps:

- read; fit: the whole workflow (Dask's sync scheduler, one partition), then each fit task on the
  partition: Categorify's counts of all its columns, FillMissing's median summaries and windows, Normalize's
  moments;
- transform: each operator, the whole graph; Categorify's pieces (the 64-bit keys of every column, the
  look-ups in the vocabularies' sorted keys, and for comparison the string merge and a string
  ``value_counts`` that the keys replace on cuDF); the continuous chain column by column and as one
  matrix;
- write: the output partition to a file and to memory (the encoding alone), and on cuDF straight to the
  file by libcudf (the stage encodes into memory first) with the stage's options and with others (cuDF's
  default pages and statistics, no dictionary, no compression, row groups of 1M rows), each with the size
  it wrote, and on cuDF the frame the writer is given (the output's types, a NaN a null) alone.

    python3 tools/etl_profile.py --backend cudf --rows 5000000
    CUDF_SPILL=on python3 tools/etl_profile.py --backend cudf --rows 5000000    # with cuDF spilling
    python3 tools/etl_profile.py --backend pandas --rows 1000000
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["pandas", "cudf"], default="pandas")
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows in the partition (default 1M)")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each step after a warm-up (best kept)")
    parser.add_argument("--workdir", default="", help="where the raw rows are generated (default: a temporary folder)")
    parser.add_argument("--json", metavar="FILE", help="also write the timings as JSON")
    parser.add_argument("--python-profile", metavar="FILE",
                        help="also write where the host's time goes (cProfile, the 40 costliest calls by own time and by "
                             "total time) in one whole-graph transform and one write")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="etl-profile-") as tmp:
        return _profile(args, Path(args.workdir or tmp), Path(tmp))


def _profile(args, workdir: Path, tmp: Path) -> dict:

    import dask

    from pipeline.etl.defaults import default_workflow, roles_of
    from pipeline.etl.frame_library import read_parquet
    from pipeline.etl.graph import Node
    from pipeline.etl.output import output_arrow_schema, write_part
    from pipeline.stages.config import load_config
    from pipeline.stages.data import ensure_raw

    cfg = load_config(overrides=[f"workdir={workdir}", f"data.rows={args.rows}", "data.valid_fraction=0",
                                 "data.test_fraction=0", "progress=off"])
    raw = ensure_raw(cfg)
    files, roles = raw.splits["train"], roles_of(raw)
    workflow = default_workflow(roles, cfg.etl, library=args.backend)
    sync = _synchroniser(args.backend)
    timings: dict[str, float] = {}
    notes: dict[str, str] = {}

    gpu_ms: dict[str, float] = {}

    def timed(name: str, fn, note=None):
        best, result = float("inf"), None
        for i in range(args.repeats + 1):
            sync()
            t = time.perf_counter()
            result = fn()
            sync()
            if i:  # the first run warms up
                best = min(best, time.perf_counter() - t)
        timings[name] = best
        extra = f"  {note(result)}" if note else ""
        if extra:
            notes[name] = extra.strip()
        on_gpu = ""
        if args.backend == "cudf":  # one run more, its kernels' and copies' time: the rest of the wall time is the host's
            gpu_ms[name] = _device_time(fn)[1]
            on_gpu = f"  (GPU {gpu_ms[name]:.1f} ms)"
        print(f"{name:60} {best * 1e3:10.1f} ms{on_gpu}{extra}", flush=True)
        return result

    frame = timed("read (one partition, all input columns)", lambda: _read_one(files, workflow.input_columns,
                                                                              args.backend))
    print(f"  {len(frame):,} rows, {len(frame.columns)} columns, {type(frame).__module__.split('.')[0]}")
    with dask.config.set(scheduler="sync"):
        ddf = read_parquet(files, workflow.input_columns, args.backend)
        single = ddf.repartition(npartitions=1) if ddf.npartitions > 1 else ddf
        timed("fit (all statistics, Dask sync scheduler)", lambda: workflow.fit(single))
    _fit_tasks(frame, workflow, timed)
    for node in workflow.output.walk():
        if node.op is None:
            continue
        source = workflow.transform_partition(frame, Node(node.parents))  # the operator's input, not timed
        label = f"transform {type(node.op).__name__} ({len(node.input_columns)} cols)"
        timed(label, lambda op=node.op, df=source: op.transform(df))
    out = timed("transform (whole graph, one call)", lambda: workflow.transform_partition(frame, workflow.output))
    _categorify_pieces(frame, workflow, timed)
    _continuous_chain(frame, workflow, timed)
    schema = output_arrow_schema(out.iloc[:0] if hasattr(out, "iloc") else out)
    rows = cfg.etl.row_group_rows
    path = tmp / "out.parquet"
    packing = cfg.etl.compression
    timed("write (parquet, one file)", lambda: write_part(out, path, schema, rows, packing), lambda _: _size(path))
    timed("write (parquet, to memory)", lambda: _to_memory(lambda buffer: write_part(out, buffer, schema, rows, packing)),
          lambda written: f"{written / 1e6:.1f} MB")
    if args.python_profile:
        _python_profile(Path(args.python_profile), sync, {
            "transform (whole graph, one call)": lambda: workflow.transform_partition(frame, workflow.output),
            "write (parquet, one file)": lambda: write_part(out, path, schema, rows, packing)})
    if args.backend == "cudf":
        from pipeline.etl.output import cudf_output_frame

        timed("  write: the output frame (its types, a NaN a null)", lambda: cudf_output_frame(out, schema))
        _cudf_writer_variants(out, schema, rows, tmp, timed)
    summary = {"backend": args.backend, "rows": len(frame), "ms": {k: round(v * 1e3, 2) for k, v in timings.items()},
               "notes": notes}
    if gpu_ms:
        summary["gpu_ms"] = {k: round(v, 2) for k, v in gpu_ms.items()}
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _read_one(files, columns, backend):
    if backend == "cudf":
        import cudf

        return cudf.read_parquet([str(f) for f in files], columns=columns)
    import pandas as pd
    import pyarrow.parquet as pq

    return pq.read_table(files, columns=columns).to_pandas(types_mapper=pd.ArrowDtype, ignore_metadata=True)


def _synchroniser(backend: str):
    if backend != "cudf":
        return lambda: None
    import cupy

    return cupy.cuda.runtime.deviceSynchronize


def _size(path: Path) -> str:
    return f"{path.stat().st_size / 1e6:.1f} MB"


def _python_profile(path: Path, sync, steps: dict) -> None:
    """cProfile of each step (run once more, warm), the costliest calls by own time and by total time."""
    import cProfile
    import pstats

    out = io.StringIO()
    for name, fn in steps.items():
        profile = cProfile.Profile()
        sync()
        profile.enable()
        fn()
        sync()
        profile.disable()
        for order in ("tottime", "cumulative"):
            out.write(f"== {name}, by {order}\n")
            pstats.Stats(profile, stream=out).sort_stats(order).print_stats(40)
    path.write_text(out.getvalue())
    print(f"python profile: {path}")


def _to_memory(write) -> int:
    """Bytes ``write(buffer)`` put into an in-memory buffer: the writer's work without a file system."""
    buffer = io.BytesIO()
    write(buffer)
    return buffer.getbuffer().nbytes


def _categorical(workflow):
    from pipeline.etl.ops.categorify import Categorify

    return next((op, cols) for op, cols in workflow.operators() if isinstance(op, Categorify))


def _continuous(workflow) -> list:
    """The continuous chain's operators in order, with their columns (the standard one: FillMissing >> LogOp >> Normalize)."""
    from pipeline.etl.ops.continuous import Clip, FillMissing, LogOp, Normalize

    return [(op, cols) for op, cols in workflow.operators() if isinstance(op, (FillMissing, Clip, LogOp, Normalize))]


def _fit_tasks(frame, workflow, timed) -> None:
    """Each fit task of the stage's workflow on the whole partition, as one Dask task runs it."""
    from pipeline.etl.ops import median
    from pipeline.etl.ops.categorify import _count_partition
    from pipeline.etl.ops.continuous import _moments

    op, columns = _categorical(workflow)
    multihot = {name: op.multihot[name] for name in columns}
    timed(f"fit task: Categorify counts ({len(columns)} cols)", lambda: _count_partition(frame[columns], columns, multihot))
    chain = _continuous(workflow)
    if chain:
        names = chain[0][1]
        timed(f"fit task: FillMissing median summaries ({len(names)} cols)",
              lambda: median._summarize_partition(frame[names], names))

        pivots = {name: median.Pivot(1.0, median.SUMMARY_POINTS) for name in names}
        timed(f"fit task: FillMissing median windows ({len(names)} cols)",
              lambda: median._window_partition(frame[names], pivots))
        timed(f"fit task: Normalize moments ({len(names)} cols, before the chain)",
              lambda: _moments(frame[names], names))


def _categorify_pieces(frame, workflow, timed) -> None:
    """Categorify's transform split into its pieces, and the string operations the keys replace on cuDF."""
    from pipeline.etl.frames import is_cudf
    from pipeline.etl.ops import keyed
    from pipeline.etl.ops.categorify import (
        _codes_by_strings,
        _flat_strings,
        _keyed_codes,
        _plain_strings,
        _vocabulary_series,
    )

    op, columns = _categorical(workflow)
    strings = {name: (_flat_strings if op.multihot[name] else _plain_strings)(frame[name]) for name in columns}
    each = len(columns)
    timed(f"  Categorify: text of the values ({each} cols)",
          lambda: [(_flat_strings if op.multihot[n] else _plain_strings)(frame[n]) for n in columns])
    timed(f"  Categorify: 64-bit keys ({each} cols)", lambda: [keyed.string_keys(strings[n]) for n in columns])
    timed(f"  Categorify: counts in one sort ({each} cols)", lambda: keyed.count_columns(list(strings.values())))
    vocabularies = {n: _vocabulary_series(op.vocabularies[n], strings[n]) for n in columns}
    timed(f"  Categorify: key tables, built anew ({each} vocabularies)",
          lambda: [keyed.key_table(vocabularies[n]) for n in columns])
    timed(f"  Categorify: codes by key ({each} cols)",
          lambda: [_keyed_codes(strings[n], op.vocabularies[n], op.vocabulary_ids[n]) for n in columns])
    timed(f"  Categorify: codes by string ({each} cols)",
          lambda: [_codes_by_strings(strings[n], op.vocabularies[n]) for n in columns])
    if is_cudf(frame):
        timed(f"  Categorify: value_counts of strings ({each} cols)",
              lambda: [strings[n].value_counts(sort=False) for n in columns])


def _continuous_chain(frame, workflow, timed) -> None:
    """The continuous chain on its columns as a partition runs it, each operator's output a frame: column by
    column (``transform_column``, a pandas partition's way) and as one matrix (``transform_many``, a cuDF
    partition's way)."""
    from pipeline.etl.frames import frame_like

    chain = _continuous(workflow)
    if not chain:
        return
    names = chain[0][1]

    def column_by_column():
        df = frame[names]
        for op, _ in chain:
            df = frame_like(df, {name: op.transform_column(name, df[name]) for name in df.columns})
        return df

    def matrix():
        df = frame[names]
        for op, _ in chain:
            df = frame_like(df, op.transform_many({name: df[name] for name in df.columns}))
        return df

    timed(f"  continuous chain, column by column ({len(names)} cols)", column_by_column)
    timed(f"  continuous chain, one matrix ({len(names)} cols)", matrix)


def _device_time(fn) -> tuple[float, float]:
    """The wall time of one call of ``fn`` and the device time of the kernels and copies it ran, in ms
    (``torch.profiler`` records every kernel of the process, cuDF's too)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    device = sum(e.self_device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA")
    return wall * 1e3, device / 1e3


def _cudf_writer_variants(out, schema, rows: int, tmp: Path, timed) -> None:
    """cuDF's writer straight to a file (libcudf copies and writes each column chunk of each row group on its own,
    through KvikIO; the stage encodes into memory and writes the file once), with the stage's options and with
    others, with the size each wrote."""
    from pipeline.etl.output import cudf_output_frame, cudf_writer_options

    frame = cudf_output_frame(out, schema)
    chosen = cudf_writer_options(rows)
    defaults = {k: v for k, v in chosen.items() if k not in ("statistics", "max_page_size_rows")}
    variants = {
        "the stage's options, straight to the file": chosen,
        "cuDF's default pages and statistics": defaults,
        "no dictionary": {**chosen, "use_dictionary": False},
        "no compression": {**chosen, "compression": None},
        "row groups of 1M rows": {**chosen, "row_group_size_rows": 1_000_000, "max_page_size_rows": 1_000_000},
    }
    for name, options in variants.items():
        path = tmp / f"variant-{len(name)}.parquet"
        timed(f"  write: {name}", lambda options=options, path=path: frame.to_parquet(path, **options),
              lambda _, path=path: _size(path))


if __name__ == "__main__":
    main()
