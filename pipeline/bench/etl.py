"""ETL fit and transform+write throughput: our Dask workflow against plain pandas, same run.

Synthetic Criteo-like rows from the data stage (all in the train split): Categorify on the 26
categorical columns and FillMissing >> Clip >> LogOp >> Normalize on the 13 continuous ones. Ours
runs the stage's default workflow on a LocalCluster of ``--workers`` processes (or threads); the
baseline is the same operations written plainly with pandas in this process. Both read the raw
parquet in fit and again in transform, and write parquet with the same row groups.

    python -m pipeline bench etl --rows 2000000 --workers 2
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=2_000_000, help="synthetic rows (default 2M)")
    parser.add_argument("--workers", type=int, default=2, help="LocalCluster worker processes (default 2)")
    parser.add_argument("--cluster", choices=["local", "threads"], default="local",
                        help="run ours on a LocalCluster (default) or on threads in this process")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each side; the best is reported")


def run(args: argparse.Namespace, cfg) -> dict:
    import dataclasses
    import os
    import platform
    import tempfile
    import time
    from datetime import datetime, timezone

    from pipeline.data.stage import ensure_raw
    from pipeline.etl.backend import read_parquet
    from pipeline.etl.cluster import etl_client
    from pipeline.etl.stage import default_workflow, transform_split

    data = dataclasses.replace(cfg.data, rows=args.rows, valid_fraction=0.0, test_fraction=0.0,
                               name=cfg.data.name or f"bench-etl-{args.rows}")
    cfg = dataclasses.replace(cfg, data=data, etl=dataclasses.replace(cfg.etl, cluster=args.cluster, workers=args.workers))
    raw = ensure_raw(cfg)
    roles = {"label": raw.label, "continuous": raw.continuous, "categorical": raw.categorical, "multihot": raw.multihot}
    files = raw.splits["train"]
    rows = raw.rows["train"]
    load = os.getloadavg()
    print(f"[bench etl] {rows:,} rows in {len(files)} files, size={cfg.data.size}, "
          f"{os.cpu_count()} cores, load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)

    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-etl-") as tmp:
        t = time.perf_counter()
        with etl_client(cfg.etl, backend="pandas") as where:
            startup = time.perf_counter() - t
            best = {"fit": float("inf"), "transform": float("inf")}
            for _ in range(args.repeats):
                workflow = default_workflow(roles, cfg.etl)
                t = time.perf_counter()
                workflow.fit(read_parquet(files, workflow.input_columns, "pandas"))
                best["fit"] = min(best["fit"], time.perf_counter() - t)
                t = time.perf_counter()
                written = transform_split(workflow, files, Path(tmp) / "ours", cfg.etl.row_group_rows, "pandas",
                                          progress=False)
                if written != rows:
                    raise RuntimeError(f"ours wrote {written} rows, expected {rows}")
                best["transform"] = min(best["transform"], time.perf_counter() - t)
            results[f"ours ({where})"] = best
        base = {"fit": float("inf"), "transform": float("inf")}
        for _ in range(args.repeats):
            baseline = _PandasBaseline(roles)
            t = time.perf_counter()
            baseline.fit(files)
            base["fit"] = min(base["fit"], time.perf_counter() - t)
            t = time.perf_counter()
            baseline.transform_write(files, Path(tmp) / "pandas.parquet", cfg.etl.row_group_rows)
            base["transform"] = min(base["transform"], time.perf_counter() - t)
        results["plain pandas (1 process)"] = base
        _check_agreement(Path(tmp) / "ours", Path(tmp) / "pandas.parquet", roles)

    print(f"\ncluster start-up (not counted): {startup:.1f} s")
    print(f"{'':32} {'fit rows/s':>12} {'transform+write rows/s':>24} {'fit s':>7} {'transform s':>12}")
    for name, r in results.items():
        print(f"{name:32} {rows / r['fit']:>12,.0f} {rows / r['transform']:>24,.0f} {r['fit']:>7.2f} {r['transform']:>12.2f}")
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"\n{when}, {platform.machine()} {os.cpu_count()} cores, python {platform.python_version()}, "
          f"load before {load[0]:.2f}")
    return {"rows": rows, "results": results, "startup_s": startup, "load": load}


def _check_agreement(ours: Path, baseline: Path, roles: dict) -> None:
    """Both sides must have written the same table (floats to float32 rounding)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    mine = pa.concat_tables([pq.read_table(p) for p in sorted(ours.glob("part-*.parquet"))])
    theirs = pq.read_table(baseline)
    for name in [roles["label"], *roles["categorical"]]:
        if not mine[name].equals(theirs[name].cast(mine[name].type)):
            raise RuntimeError(f"ours and the pandas baseline disagree on column {name}")
    for name in roles["continuous"]:
        if not np.allclose(mine[name].to_numpy(), theirs[name].to_numpy(), rtol=1e-5, atol=1e-6):
            raise RuntimeError(f"ours and the pandas baseline disagree on column {name}")


class _PandasBaseline:
    """The same operations written plainly with pandas, in one process, all rows in memory."""

    def __init__(self, roles: dict):
        self.roles = roles
        self.vocab: dict = {}
        self.mean: dict = {}
        self.std: dict = {}

    def _read(self, files):
        import pandas as pd

        return pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)

    def _dense(self, series):
        import numpy as np

        return np.log1p(series.astype("float64").fillna(0).clip(lower=0))

    def fit(self, files) -> None:
        import pandas as pd

        df = self._read(files)
        for name in self.roles["categorical"]:
            counts = df[name].value_counts().rename_axis("value").reset_index(name="count")
            counts = counts.sort_values(["count", "value"], ascending=[False, True])
            self.vocab[name] = pd.Index(counts["value"])
        for name in self.roles["continuous"]:
            values = self._dense(df[name])
            self.mean[name], self.std[name] = values.mean(), values.std()

    def transform_write(self, files, path, row_group_rows: int) -> None:
        import numpy as np
        import pandas as pd

        df = self._read(files)
        out = {self.roles["label"]: df[self.roles["label"]].astype("float32")}
        for name in self.roles["continuous"]:
            out[name] = ((self._dense(df[name]) - self.mean[name]) / self.std[name]).astype("float32")
        for name in self.roles["categorical"]:
            codes = self.vocab[name].get_indexer(df[name])
            out[name] = np.where(df[name].isna(), 0, np.where(codes < 0, 1, codes + 2)).astype("int32")
        pd.DataFrame(out).to_parquet(path, index=False, row_group_size=row_group_rows)
