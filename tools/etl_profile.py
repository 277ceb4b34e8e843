"""Where one ETL partition's time goes, without Dask: read, each operator's fit statistics and
transform, and the write, on one backend in this process (one GPU for cuDF).

The stage's default workflow on synthetic Criteo-like rows (the data stage's generator). Each step
runs ``--repeats`` times after one warm-up run (cuDF compiles kernels on first use); the best time is
printed. On cuDF the device is synchronised around every timed step. Compare with the Dask run's
per-task report (``bench etl --report``) to see what the cluster adds.

    python3 tools/etl_profile.py --backend cudf --rows 5000000
    CUDF_SPILL=on python3 tools/etl_profile.py --backend cudf --rows 5000000    # with cuDF spilling
    python3 tools/etl_profile.py --backend pandas --rows 1000000
"""

from __future__ import annotations

import argparse
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
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="etl-profile-") as tmp:
        return _profile(args, Path(args.workdir or tmp), Path(tmp))


def _profile(args, workdir: Path, tmp: Path) -> dict:

    import dask

    from pipeline.stages.config import load_config
    from pipeline.stages.data import ensure_raw
    from pipeline.etl.frame_library import read_parquet
    from pipeline.etl.graph import Node
    from pipeline.etl.defaults import default_workflow, roles_of
    from pipeline.etl.output import output_arrow_schema, write_part

    cfg = load_config(overrides=[f"workdir={workdir}", f"data.rows={args.rows}", "data.valid_fraction=0",
                                 "data.test_fraction=0", "progress=off"])
    raw = ensure_raw(cfg)
    files, roles = raw.splits["train"], roles_of(raw)
    workflow = default_workflow(roles, cfg.etl, library=args.backend)
    sync = _synchroniser(args.backend)
    timings: dict[str, float] = {}

    def timed(name: str, fn):
        best, result = float("inf"), None
        for i in range(args.repeats + 1):
            sync()
            t = time.perf_counter()
            result = fn()
            sync()
            if i:  # the first run warms up
                best = min(best, time.perf_counter() - t)
        timings[name] = best
        print(f"{name:44} {best * 1e3:10.1f} ms", flush=True)
        return result

    frame = timed("read (one partition, all input columns)", lambda: _read_one(files, workflow.input_columns,
                                                                              args.backend))
    print(f"  {len(frame):,} rows, {len(frame.columns)} columns, {type(frame).__module__.split('.')[0]}")
    with dask.config.set(scheduler="sync"):
        ddf = read_parquet(files, workflow.input_columns, args.backend)
        single = ddf.repartition(npartitions=1) if ddf.npartitions > 1 else ddf
        timed("fit (all statistics, Dask sync scheduler)", lambda: workflow.fit(single))
    for node in workflow.output.walk():
        if node.op is None:
            continue
        source = workflow.transform_partition(frame, Node(node.parents))  # the operator's input, not timed
        label = f"transform {type(node.op).__name__} ({len(node.input_columns)} cols)"
        timed(label, lambda op=node.op, df=source: op.transform(df))
    out = timed("transform (whole graph, one call)", lambda: workflow.transform_partition(frame, workflow.output))
    schema = output_arrow_schema(out.iloc[:0] if hasattr(out, "iloc") else out)
    timed("write (parquet, one file)", lambda: write_part(out, tmp / "out.parquet", schema, cfg.etl.row_group_rows))
    if args.backend == "cudf":
        _cudf_alternatives(frame, workflow, timed)
    summary = {"backend": args.backend, "rows": len(frame), "ms": {k: round(v * 1e3, 2) for k, v in timings.items()}}
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


def _cudf_alternatives(frame, workflow, timed) -> None:
    """Pieces of Categorify's cuDF encoding on their own, summed over its columns."""
    import cudf
    import cupy

    from pipeline.etl.frames import cudf_strings
    from pipeline.etl.ops.categorify import Categorify

    op, columns = next((op, cols) for op, cols in workflow.operators() if isinstance(op, Categorify))
    tables = {name: cudf.Series.from_arrow(op.vocabularies[name]) for name in columns}

    def each(fn):
        return lambda: [fn(name) for name in columns]

    def merge(name, how):
        values = frame[name]
        rows = cudf.DataFrame({"value": values, "row": cupy.arange(len(values), dtype="int32")})
        table = cudf.DataFrame({"value": tables[name], "code": cupy.arange(len(tables[name]), dtype="int32")})
        return rows.merge(table, on="value", how=how)

    timed("  Categorify: cudf_strings", each(lambda name: cudf_strings(frame[name])))
    timed("  Categorify: vocabulary to the GPU", each(lambda name: cudf.Series.from_arrow(op.vocabularies[name])))
    timed("  Categorify: left merge", each(lambda name: merge(name, "left")))
    timed("  Categorify: left merge + sort", each(lambda name: merge(name, "left").sort_values("row")))
    timed("  Categorify: inner merge", each(lambda name: merge(name, "inner")))
    timed("  Categorify: value_counts", each(lambda name: frame[name].value_counts(sort=False)))
    timed("  Categorify: isna", each(lambda name: frame[name].isna().values))


if __name__ == "__main__":
    main()
