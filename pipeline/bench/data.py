"""Data stage speed: synthetic rows/s (alone and with the parquet write), and Criteo TSV and CSV table ingest rows/s.

Baselines, measured in the same run: the same synthetic strings made the usual way (a Python
f-string per value, then ``pa.array``), and ``pandas.read_csv`` on the same Criteo TSV. The Criteo
TSV is read by each reader of ``data.reader`` on the same file: Arrow, vectorized on numpy and, where
the device is a GPU with CuPy, vectorized on CuPy, each after an untimed read of the file's first two
blocks (``2 * data.chunk_rows`` lines: a process's one-time costs, CuPy compiling its kernels and
filling its pool of pinned memory with the blocks' buffers); their rows and reports must be equal. The same
rows as a user's CSV table (a header, decimals, quoted text) are then read by each reader of a table the same
way.

    python -m pipeline bench data --rows 2000000 --ingest-rows 500000
    python -m pipeline.bench.data --rows 2000000          # the same

Each figure is given per wall-clock second and per CPU second (process time, all threads): on a
shared machine the second is the fair "rows/s per core".
"""

from __future__ import annotations

import argparse

from pipeline.bench.arguments import integer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=integer(1), default=2_000_000, help="synthetic rows to generate")
    parser.add_argument("--ingest-rows", type=integer(0), default=500_000, help="Criteo TSV rows to ingest (0: skip)")
    parser.add_argument("--baseline-rows", type=integer(1), default=131_072, help="rows for the Python-strings baseline")


def run(args: argparse.Namespace, cfg) -> dict:
    import platform
    import tempfile
    import time
    from pathlib import Path

    import pyarrow as pa

    from pipeline.data import raw_folder, synthetic

    model = synthetic.ClickModel.create(cfg.seed, cfg.data.size)
    chunk_rows = cfg.data.chunk_rows
    results: dict[str, tuple[float, float]] = {}

    class _Timer:
        def __init__(self, name: str, rows: int) -> None:
            self.name, self.rows = name, rows

        def __enter__(self):
            self.wall, self.cpu = time.perf_counter(), time.process_time()

        def __exit__(self, *exc) -> None:
            wall, cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu
            results[self.name] = (self.rows / wall, self.rows / cpu)

    with _Timer("generate", args.rows):
        for _ in synthetic.iter_split(model, "train", args.rows, chunk_rows):
            pass

    with tempfile.TemporaryDirectory() as tmp:
        with _Timer("generate + parquet write", args.rows):
            writer = raw_folder.PartWriter(Path(tmp) / "train", chunk_rows)
            for chunk in synthetic.iter_split(model, "train", args.rows, chunk_rows):
                writer.write(chunk.table)
            writer.close()

        with _Timer("baseline: draws + python f-string per value", args.baseline_rows):
            for index in range(-(-args.baseline_rows // synthetic.BLOCK_ROWS)):
                n = min(synthetic.BLOCK_ROWS, args.baseline_rows - index * synthetic.BLOCK_ROWS)
                draws = synthetic.draw(model, 0, index, n)
                for f in range(26):
                    hashed = synthetic.hash32(draws.ranks[f], f, model.seed).tolist()
                    values = [None if null else f"{h:08x}" for h, null in zip(hashed, draws.cat_null[f].tolist())]
                    pa.array(values, pa.string())

        if args.ingest_rows:
            import pandas as pd

            tsv = Path(tmp) / "day.tsv"
            synthetic.write_criteo_tsv(tsv, model, "valid", args.ingest_rows)
            _time_readers("criteo", tsv, args.ingest_rows, chunk_rows, cfg.device, _Timer)
            with _Timer("baseline: pandas.read_csv", args.ingest_rows):
                for _ in pd.read_csv(tsv, sep="\t", header=None, chunksize=chunk_rows):
                    pass
            csv = _table_csv(tsv, Path(tmp) / "rows.csv", chunk_rows)
            _time_readers("table", csv, args.ingest_rows, chunk_rows, cfg.device, _Timer)

    print(f"# data stage, {platform.node()} ({platform.processor() or platform.machine()}), "
          f"{time.strftime('%Y-%m-%d')}, rows={args.rows}, size={cfg.data.size}, chunk_rows={chunk_rows}")
    print(f"{'':46s}{'rows/s':>12s}{'rows/CPU-s':>14s}")
    for name, (wall, cpu) in results.items():
        print(f"{name:46s}{wall:12,.0f}{cpu:14,.0f}")
    return {name: {"rows_per_s": wall, "rows_per_cpu_s": cpu} for name, (wall, cpu) in results.items()}


def _table_csv(tsv, path, chunk_rows: int):
    """The Criteo rows of ``tsv`` as a user's CSV table would hold them: a header, I1..I12 as decimals of a few
    digits (``x / 100``), I13 as ``log1p(x)`` written in full (up to 17 significant digits, as pandas writes a
    computed float), C1..C26 as quoted text (as Arrow writes it)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pacsv

    from pipeline.data import readers

    with pacsv.CSVWriter(path, _table_schema()) as out:
        for table, _ in readers.read_criteo(tsv, chunk_rows, readers.FileReport(str(tsv))):
            numbers = [pc.divide(pc.cast(table.column(f"I{k}"), pa.float64()), 100.0) for k in range(1, 13)]
            i13 = table.column("I13").to_numpy(zero_copy_only=False)
            numbers.append(pa.array(np.log1p(np.abs(i13)), mask=np.isnan(i13)))
            out.write_table(pa.Table.from_arrays([table.column("label"), *numbers,
                                                  *table.columns[14:]], schema=_table_schema()))
    return path


def _table_schema():
    import pyarrow as pa

    from pipeline.data.text_format import CRITEO_CATEGORICAL, CRITEO_CONTINUOUS

    return pa.schema([("label", pa.int8()), *((c, pa.float64()) for c in CRITEO_CONTINUOUS),
                      *((c, pa.string()) for c in CRITEO_CATEGORICAL)])


def _time_readers(source: str, path, rows: int, chunk_rows: int, device: str, timer) -> None:
    """Time the ``source`` reader (``criteo``: ``read_criteo``; ``table``: ``read_table`` of a CSV with Criteo's
    columns) on ``path`` with each array module; raise if their rows or reports differ."""
    import functools
    import importlib.util
    from pathlib import Path

    import numpy

    from pipeline.data import readers
    from pipeline.data.roles import Roles
    from pipeline.data.text_format import CRITEO_CATEGORICAL, CRITEO_CONTINUOUS
    from pipeline.device import resolve_device

    read = readers.read_criteo
    if source == "table":
        roles = Roles("label", CRITEO_CONTINUOUS, CRITEO_CATEGORICAL, [], [], "")
        read = functools.partial(readers.read_table, roles=roles)
    modules = {"arrow": None, "vectorized, numpy": numpy}
    if resolve_device(device).is_cuda and importlib.util.find_spec("cupy") is not None:
        import cupy

        modules["vectorized, cupy"] = cupy
    small = Path(path).with_name(f"small{Path(path).suffix}")
    with open(path, "rb") as full:
        small.write_bytes(b"".join(line for _, line in zip(range(2 * chunk_rows), full)))
    reports = {}
    for name, xp in modules.items():
        for _ in read(small, chunk_rows=chunk_rows, report=readers.FileReport(str(small)), xp=xp):
            pass
        report = readers.FileReport(str(path))
        with timer(f"{source} read + check + type ({name})", rows):
            kept = sum(table.num_rows for table, _ in read(path, chunk_rows=chunk_rows, report=report, xp=xp))
        reports[name] = (kept, report)
    if any(found != reports["arrow"] for found in reports.values()):
        raise RuntimeError(f"the {source} readers disagree on {path}: {reports}")


if __name__ == "__main__":  # the same as `python -m pipeline bench data ...`
    import sys

    from pipeline.stages.cli import main

    sys.exit(main(["bench", "data", *sys.argv[1:]]))
