"""Data stage speed: synthetic rows/s (alone and with the parquet write) and Criteo ingest rows/s.

Baselines, measured in the same run: the same synthetic strings made the usual way (a Python
f-string per value, then ``pa.array``), and ``pandas.read_csv`` on the same Criteo TSV.

    python -m pipeline bench data --rows 2000000 --ingest-rows 500000
    python -m pipeline.data.bench --rows 2000000          # the same, without the CLI registry

Generation runs on one core (numpy), so rows/s here is rows/s per core.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=2_000_000, help="synthetic rows to generate")
    parser.add_argument("--ingest-rows", type=int, default=500_000, help="Criteo TSV rows to ingest (0: skip)")
    parser.add_argument("--baseline-rows", type=int, default=131_072, help="rows for the Python-strings baseline")


def run(args: argparse.Namespace, cfg) -> dict:
    import platform
    import tempfile
    import time
    from pathlib import Path

    import numpy as np
    import pyarrow as pa
    import pyarrow.csv as pacsv

    from pipeline.data import layout, readers, synthetic

    model = synthetic.ClickModel.create(cfg.seed, cfg.data.size)
    chunk_rows = cfg.data.chunk_rows
    results: dict[str, float] = {}

    start = time.perf_counter()
    for _ in synthetic.iter_split(model, "train", args.rows, chunk_rows):
        pass
    results["generate rows/s"] = args.rows / (time.perf_counter() - start)

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        writer = layout.PartWriter(Path(tmp) / "train", chunk_rows)
        for chunk in synthetic.iter_split(model, "train", args.rows, chunk_rows):
            writer.write(chunk.table)
        writer.close()
        results["generate + parquet rows/s"] = args.rows / (time.perf_counter() - start)

        start = time.perf_counter()
        for index in range(-(-args.baseline_rows // synthetic.BLOCK_ROWS)):
            n = min(synthetic.BLOCK_ROWS, args.baseline_rows - index * synthetic.BLOCK_ROWS)
            draws = synthetic._draw(model, 0, index, n)
            for f in range(26):
                hashed = synthetic._hash32(draws.ranks[f], f, model.seed)
                values = [None if null else f"{h:08x}" for h, null in zip(hashed.tolist(), draws.cat_null[f].tolist())]
                pa.array(values, pa.string())
        results["baseline: python strings rows/s"] = args.baseline_rows / (time.perf_counter() - start)

        if args.ingest_rows:
            import pandas as pd

            tsv = Path(tmp) / "day.tsv"
            with pacsv.CSVWriter(tsv, next(synthetic.iter_split(model, "valid", 1, 1)).table.schema,
                                 write_options=pacsv.WriteOptions(include_header=False, delimiter="\t",
                                                                  quoting_style="none")) as out:
                for chunk in synthetic.iter_split(model, "valid", args.ingest_rows, chunk_rows):
                    out.write_table(chunk.table)
            start = time.perf_counter()
            report = readers.FileReport(str(tsv))
            rows = sum(t.num_rows for t, _ in readers.read_criteo(tsv, chunk_rows, report))
            results["criteo ingest (read + check + type) rows/s"] = rows / (time.perf_counter() - start)
            start = time.perf_counter()
            for frame in pd.read_csv(tsv, sep="\t", header=None, chunksize=chunk_rows):
                pass
            results["baseline: pandas.read_csv rows/s"] = args.ingest_rows / (time.perf_counter() - start)

    print(f"# data stage, {platform.node()} ({platform.processor() or platform.machine()}), "
          f"{time.strftime('%Y-%m-%d')}, rows={args.rows}, size={cfg.data.size}, chunk_rows={chunk_rows}")
    for name, value in results.items():
        print(f"{name:45s} {value:14,.0f}")
    return results


if __name__ == "__main__":
    from pipeline.config import load_config

    parser = argparse.ArgumentParser(prog="python -m pipeline.data.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parsed = parser.parse_args()
    run(parsed, load_config(None, parsed.overrides))
