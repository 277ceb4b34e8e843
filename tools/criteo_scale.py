"""A Criteo-scale run of the data and ETL stages, from raw TSV to the processed parquet the loader reads.

    python tools/criteo_scale.py --rows 100000000 --device cuda --workdir /tmp/scale --json scale.json
    python tools/criteo_scale.py --rows 300000 --device cpu --workdir /tmp/scale-small     # the mechanics, anywhere

1. ``tsv``: ``--rows`` synthetic Criteo-like rows at Criteo Kaggle's cardinalities (``data.size=1.0``, the planted
   click model) written as Criteo's TSV (label, I1..I13, C1..C26, no header), a file per core, each made by a process
   of its own from its own blocks of the generator;
2. ``data``: ``python -m pipeline run data`` reading those files (``data.source=criteo``) into the raw layout;
3. ``etl``: ``python -m pipeline run etl`` fitting the standard workflow and writing the processed splits (on a GPU,
   on a LocalCUDACluster that spills to host memory);

each stage a process of its own, timed, with the machine's used host memory and every GPU's used memory
(``nvidia-smi``) sampled while it runs: the peak of each above what was used before the stage. Then
4. ``sample``: the first ``--sample-rows`` rows through the same two stages on the CPU and on ``--device``, and the two
   processed training splits compared (codes and labels equal, floats within 1e-5);

and the rows/s of each stage and of the whole, with the hours that Criteo's 1 TB dataset (24 days, about 4.37B rows)
would take at that rate. Each stage's own output goes to ``<workdir>/logs/<stage>.log``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

CRITEO_1TB_ROWS = 4_373_472_329
"""Rows of Criteo's 1 TB click logs (24 days)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000_000, help="rows of TSV to write and process")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="where the stages run")
    parser.add_argument("--workdir", default="/tmp/criteo-scale", help="folder of the TSV, the stages' data and logs")
    parser.add_argument("--parts", type=int, default=0, help="TSV files, one process each (0: one per core)")
    parser.add_argument("--sample-rows", type=int, default=1_000_000,
                        help="rows of the CPU-against-device comparison (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="", help="write every figure here")
    parser.add_argument("settings", nargs="*", help="more settings for both stages, e.g. etl.gpu_threads=2")
    args = parser.parse_args(argv)
    work = Path(args.workdir)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    result: dict = {"rows": args.rows, "device": args.device, "settings": args.settings, "stages": {}}

    def record() -> None:  # after every stage: a run cut short keeps what it measured
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")

    parts = args.parts or os.cpu_count() or 1
    tsv = work / "tsv"
    result["stages"]["tsv"] = _timed(lambda: _write_tsv(tsv, args.rows, parts, args.seed), args.rows)
    result["tsv_bytes"] = sum(p.stat().st_size for p in tsv.glob("*.tsv"))
    print(f"tsv: {result['stages']['tsv']}", flush=True)
    record()
    settings = [f"workdir={work / 'run'}", "data.source=criteo", f"data.path={tsv}", "progress=plain",
                f"seed={args.seed}", *args.settings]
    for stage in ("data", "etl"):
        result["stages"][stage] = _timed(lambda stage=stage: _stage(stage, args.device, settings, work), args.rows)
        print(f"{stage}: {result['stages'][stage]}", flush=True)
        record()
    timed = [result["stages"][s] for s in ("data", "etl")]
    seconds = sum(s["seconds"] for s in timed)
    result["raw_tsv_to_processed"] = {"seconds": seconds, "rows_per_s": args.rows / seconds,
                                      "criteo_1tb_hours": CRITEO_1TB_ROWS / (args.rows / seconds) / 3600}
    if args.sample_rows:
        result["sample"] = _compare_on_a_sample(work, tsv, args, settings)
    _print(result)
    record()
    return 0 if not args.sample_rows or result["sample"]["equal"] else 1


def _write_tsv(folder: Path, rows: int, parts: int, seed: int) -> None:
    """``rows`` rows of the synthetic training split as Criteo TSV, ``parts`` files of whole generator blocks, each
    written by a process of its own."""
    from pipeline.data import synthetic

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    model = synthetic.ClickModel.create(seed, 1.0)
    blocks = -(-rows // synthetic.BLOCK_ROWS)
    per_part = -(-blocks // parts)
    ranges = [(k * per_part, (k + 1) * per_part) for k in range(parts) if k * per_part < blocks]
    with ProcessPoolExecutor(len(ranges), mp_context=multiprocessing.get_context("spawn")) as pool:
        written = sum(pool.map(synthetic.write_criteo_tsv, [folder / f"part-{k:03d}.tsv" for k in range(len(ranges))],
                               [model] * len(ranges), ["train"] * len(ranges), [rows] * len(ranges),
                               *zip(*ranges)))
    if written != rows:
        raise RuntimeError(f"wrote {written:,} rows, expected {rows:,}")


def _stage(stage: str, device: str, settings: list[str], work: Path, log_name: str | None = None) -> None:
    log = work / "logs" / f"{log_name or stage}.log"
    with open(log, "w") as out:
        done = subprocess.run([sys.executable, "-m", "pipeline", "run", stage, f"device={device}", *settings],
                              stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode:
        raise RuntimeError(f"stage {stage} failed (exit {done.returncode}): see {log}")


def _timed(run, rows: int) -> dict:
    """``run()`` timed, with the peak host and GPU memory used above what was in use before it."""
    sampler = _MemorySampler()
    start = time.perf_counter()
    with sampler:
        run()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "rows_per_s": rows / seconds, **sampler.peaks()}


class _MemorySampler:
    """The machine's used host memory (``/proc/meminfo``) and each GPU's used memory (``nvidia-smi``), sampled on a
    thread while the block runs."""

    def __init__(self, every_s: float = 0.2) -> None:
        self.every_s = every_s
        self.host: list[int] = []
        self.gpus: list[list[int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> _MemorySampler:  # noqa: PYI034
        self.host_before, self.gpus_before = _host_used(), _gpus_used()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(self.every_s):
            self.host.append(_host_used())
            gpus = _gpus_used()
            if gpus:
                self.gpus.append(gpus)

    def peaks(self) -> dict:
        out = {"host_peak_gib": (max(self.host, default=self.host_before) - self.host_before) / 2**30}
        if self.gpus_before:
            out["gpu_peak_gib"] = [(max(s[i] for s in self.gpus) if self.gpus else before) / 1024 - before / 1024
                                   for i, before in enumerate(self.gpus_before)]
        return out


def _host_used() -> int:
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return (int(fields["MemTotal"].split()[0]) - int(fields["MemAvailable"].split()[0])) * 1024


def _gpus_used() -> list[int]:
    """Each GPU's used memory in MiB; empty without ``nvidia-smi``."""
    if shutil.which("nvidia-smi") is None:
        return []
    done = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, check=False)
    return [int(v) for v in done.stdout.split()] if done.returncode == 0 else []


def _compare_on_a_sample(work: Path, tsv: Path, args, settings: list[str]) -> dict:
    """The first ``--sample-rows`` rows through the data and ETL stages on the CPU and on ``--device``; their processed
    training splits compared."""
    import numpy as np
    import pandas as pd

    from pipeline.stages.config import load_config

    sample = work / "sample-tsv"
    shutil.rmtree(sample, ignore_errors=True)
    sample.mkdir()
    with open(min(tsv.glob("*.tsv")), "rb") as src, open(sample / "sample.tsv", "wb") as dst:
        dst.writelines(line for _, line in zip(range(args.sample_rows), src))
    frames = {}
    for device in ("cpu", args.device):
        side = [f"workdir={work / f'sample-{device}'}", "data.source=criteo", f"data.path={sample}",
                "progress=plain", f"seed={args.seed}", *args.settings]
        for stage in ("data", "etl"):
            _stage(stage, device, side, work, f"sample-{device}-{stage}")
        processed = load_config(None, side).paths.processed / "train"
        frames[device] = pd.concat([pd.read_parquet(p) for p in sorted(processed.glob("*.parquet"))],
                                   ignore_index=True)
    a, b = frames["cpu"], frames[args.device]
    out = {"rows": len(a), "columns": list(a.columns)}
    if list(a.columns) != list(b.columns) or len(a) != len(b):
        return {**out, "equal": False, "why": f"columns or rows differ: {list(b.columns)}, {len(b)} rows"}
    exact = [c for c in a.columns if not np.issubdtype(a[c].dtype, np.floating)]
    a, b = (f.sort_values(exact, kind="stable", ignore_index=True) for f in (a, b))
    unequal = [c for c in exact if not a[c].equals(b[c])]
    floats = [c for c in a.columns if c not in exact]
    worst = max((float(np.nanmax(np.abs(a[c].to_numpy(np.float64) - b[c].to_numpy(np.float64)), initial=0.0))
                 for c in floats), default=0.0)
    return {**out, "equal": not unequal and worst <= 1e-5, "unequal_columns": unequal,
            "largest_float_difference": worst}


def _print(r: dict) -> None:
    print(f"criteo scale: {r['rows']:,} rows, device {r['device']}, TSV {r['tsv_bytes'] / 2**30:.1f} GiB")
    print(f"  {'stage':8s} {'seconds':>9s} {'rows/s':>12s} {'host peak GiB':>14s}  GPU peak GiB")
    for name, s in r["stages"].items():
        gpu = ", ".join(f"{g:.1f}" for g in s.get("gpu_peak_gib", [])) or "-"
        print(f"  {name:8s} {s['seconds']:9.1f} {s['rows_per_s']:12,.0f} {s['host_peak_gib']:14.1f}  {gpu}")
    whole = r["raw_tsv_to_processed"]
    print(f"  raw TSV to processed parquet: {whole['seconds']:.1f} s, {whole['rows_per_s']:,.0f} rows/s; Criteo 1 TB "
          f"({CRITEO_1TB_ROWS / 1e9:.2f}B rows) at that rate: {whole['criteo_1tb_hours']:.1f} h")
    if "sample" in r:
        s = r["sample"]
        print(f"  sample of {s['rows']:,} rows, CPU against {r['device']}: "
              + ("equal" if s["equal"] else f"NOT equal ({s.get('why') or s})")
              + (f", largest float difference {s['largest_float_difference']:.2g}" if "largest_float_difference" in s
                 else ""))


if __name__ == "__main__":
    sys.exit(main())
