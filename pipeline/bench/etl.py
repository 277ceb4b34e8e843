"""ETL fit and transform+write throughput: our Dask workflow (cuDF and/or pandas) against plain pandas, same run.

Synthetic Criteo-like rows from the data stage (all in the train split): Categorify on the 26
categorical columns, FillMissing (median) >> LogOp(signed) >> Normalize and a missing indicator on
the 13 continuous ones. Ours
runs the stage's default workflow; the baseline is the same operations written plainly with pandas
in this process. Every side reads the raw parquet in fit and again in transform, and writes parquet
with the same row groups; the bench checks that all sides wrote the same table.

Sides, in this order (each side's figures are printed, and the JSON rewritten, as soon as measured):

- with ``--device cuda`` (or ``auto`` where a GPU and cuDF are usable): ours on cuDF, on a
  ``dask_cuda.LocalCUDACluster`` (``etl.workers_per_gpu`` workers on each GPU, on ``--gpu-workers`` GPUs if
  set; ``--cluster threads``: threads in this process on one GPU);
- ours on pandas, on a ``LocalCluster`` of ``--workers`` processes (0: one per core) or threads;
- plain pandas in one process (``--no-baseline`` skips it).

At the end, a table of every side, and how many times faster the first side ran than each other (``speedup`` in
the JSON).

    python -m pipeline bench etl --rows 2000000 --workers 2
    python -m pipeline bench etl --device cuda --rows 20000000 --workers 0 --json etl-gpu.json

Run it as ``python -m pipeline ...`` (or from a script under ``if __name__ == "__main__":``):
the clusters start worker processes, which import the main module again.
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import Any

from pipeline.bench.arguments import bench_rows, integer, output_file
from pipeline.files import write_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=integer(1), help="synthetic rows (default: data.rows where it is set, else 2M; "
                        "20M+ on a GPU)")
    parser.add_argument("--workers", type=integer(0), default=2,
                        help="LocalCluster worker processes of the pandas side (default 2; 0: one per core)")
    parser.add_argument("--gpu-workers", type=integer(0), default=0,
                        help="GPUs of the cuDF side's LocalCUDACluster (0: every GPU)")
    parser.add_argument("--cluster", choices=["local", "threads"], default="local",
                        help="run ours on a LocalCluster / LocalCUDACluster (default) or on threads in this process")
    parser.add_argument("--repeats", type=integer(1), default=1,
                        help="runs of each of our sides, the best reported (the first pays one-time costs: imports "
                             "on the workers, GPU kernels compiled on first use); plain pandas runs once")
    parser.add_argument("--no-baseline", action="store_true", help="skip the plain pandas side")
    parser.add_argument("--json", type=output_file, metavar="FILE", help="also write the figures as JSON (rewritten after each side)")
    parser.add_argument("--report", type=output_file, metavar="FILE",
                        help="also write where each cluster side's fit and transform spent their time "
                             "(seconds per kind of task, from Dask's task stream, and the lines of code the "
                             "workers were sampled in) as JSON to FILE")


def run(args: argparse.Namespace, cfg) -> dict:
    import dataclasses
    import os
    import shutil
    import tempfile
    import time
    from datetime import datetime, timezone

    from pipeline.etl.frame_library import choose_frame_library

    if not args.no_baseline:
        _refuse_what_the_baseline_does_not_do(cfg)
    library, reason = choose_frame_library(cfg.device)
    workers = args.workers or os.cpu_count() or 1
    t = time.perf_counter()
    cfg, raw, roles = bench_dataset(cfg, bench_rows(args.rows, cfg.data, 2_000_000))
    files = raw.splits["train"]
    rows = raw.rows["train"]
    load = os.getloadavg()
    print(f"[bench etl] {rows:,} rows in {len(files)} files (ready in {time.perf_counter() - t:.1f} s), "
          f"size={cfg.data.size}, {os.cpu_count()} cores, load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
          f"{library} backend ({reason})", flush=True)

    sides = []
    if library == "cudf":
        sides.append(("cudf", dataclasses.replace(cfg.etl, cluster=args.cluster, workers=args.gpu_workers)))
    sides.append(("pandas", dataclasses.replace(cfg.etl, cluster=args.cluster, workers=workers)))
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    summary = {"rows": rows, "files": len(files), "when": when, "machine": _machine(), "backend_choice": reason,
               "load_before": load, "results": {}, "agreement": {}}

    with tempfile.TemporaryDirectory(prefix="bench-etl-") as tmp:
        reference: Path | None = None
        for kind, etl in sides:
            name, best, startup, out = _ours(kind, etl, cfg, roles, files, rows, Path(tmp) / kind, args.repeats,
                                             args.report)
            summary["results"][name] = {**best, "startup_s": round(startup, 2)}
            _print_side(name, rows, best, startup)
            if reference is None:
                reference = out
            else:
                _check_agreement(reference, out, roles)
                summary["agreement"][name] = "same table as the first side"
                shutil.rmtree(out)
            _write_json(args.json, summary)
        if not args.no_baseline:
            baseline = _PandasBaseline(roles, cfg.etl.freq_threshold, cfg.etl.max_vocab_size)
            t = time.perf_counter()
            baseline.fit(files)
            base = {"fit": time.perf_counter() - t}
            t = time.perf_counter()
            baseline.transform_write(files, Path(tmp) / "pandas.parquet", cfg.etl.row_group_rows)
            base["transform"] = time.perf_counter() - t
            del baseline
            summary["results"]["plain pandas (1 process)"] = base
            _print_side("plain pandas (1 process)", rows, base, None)
            _check_agreement(reference, Path(tmp) / "pandas.parquet", roles)
            summary["agreement"]["plain pandas (1 process)"] = "same table as the first side"
            _write_json(args.json, summary)

    print(f"\n{'':44} {'fit rows/s':>12} {'transform+write rows/s':>24} {'fit s':>7} {'transform s':>12}")
    for name, r in summary["results"].items():
        print(f"{name:44} {rows / r['fit']:>12,.0f} {rows / r['transform']:>24,.0f} {r['fit']:>7.2f} "
              f"{r['transform']:>12.2f}")
    summary["speedup"] = speedups(summary["results"])
    _write_json(args.json, summary)
    first = next(iter(summary["results"]))
    for name, times in summary["speedup"].items():
        print(f"{first}: {times['fit']:.2f}x the fit and {times['transform']:.2f}x the transform+write of {name}")
    print(f"\n{when}, {summary['machine']}, load before {load[0]:.2f}; cluster start-up not counted; "
          "every side wrote the same table")
    return summary


def speedups(results: dict[str, dict]) -> dict[str, dict[str, float]]:
    """How many times faster the first side ran than each other side, fit and transform+write apart (the goals of
    the GPU workflow are put so: 5x the same workflow on the machine's cores, 20x plain pandas)."""
    (_, first), *others = results.items()
    return {name: {phase: round(times[phase] / first[phase], 2) for phase in ("fit", "transform")}
            for name, times in others}


def bench_dataset(cfg, rows: int):
    """``(cfg, raw, roles)`` of the bench's own dataset of ``rows`` synthetic rows (or of the data settings' source),
    made where missing: every row in train, so a user's dataset of that name is left as it is."""
    import dataclasses

    from pipeline.etl.defaults import roles_of
    from pipeline.stages.data import ensure_raw

    own = f"bench-etl-{rows}" if cfg.data.source == "synthetic" else f"bench-etl-{cfg.data.dataset_name}"
    data = dataclasses.replace(cfg.data, rows=rows, valid_fraction=0.0, test_fraction=0.0, name=own)
    cfg = dataclasses.replace(cfg, data=data)
    raw = ensure_raw(cfg)
    return cfg, raw, roles_of(raw)


def _ours(kind: str, etl, cfg, roles: dict, files: list, rows: int, out: Path, repeats: int,
          report: str | None = None):
    """Fit + transform+write with our workflow on ``kind`` ("cudf" or "pandas"); the best of ``repeats``."""
    import shutil
    import time

    from pipeline.etl.cluster import etl_client
    from pipeline.etl.defaults import default_workflow
    from pipeline.etl.frame_library import read_parquet
    from pipeline.etl.output import transform_split

    t = time.perf_counter()
    with etl_client(etl, library=kind) as where:
        startup = time.perf_counter() - t
        each: dict[str, list[float]] = {"fit": [], "transform": []}
        for repeat in range(repeats):
            # the last repeat's output removed untimed: transform+write into a new folder, as the stage does (it
            # writes <split>.partial), not also the unlinking of gigabytes just written
            shutil.rmtree(out, ignore_errors=True)
            held = _wait_for_idle_scheduler()
            if held:
                print(f"[bench etl] {kind}, run {repeat + 1}: the scheduler still held {held} tasks of the run before "
                      "after 30 s; this run's times may include their results")
            workflow = default_workflow(roles, etl, library=kind)
            with _report(report, f"{kind}-fit"):  # timed inside: the report's own collection is not counted
                t = time.perf_counter()
                workflow.fit(read_parquet(files, workflow.input_columns, kind))
                each["fit"].append(time.perf_counter() - t)
            with _report(report, f"{kind}-transform"):
                t = time.perf_counter()
                written = transform_split(workflow, files, out, etl.row_group_rows, kind, progress=False)
                each["transform"].append(time.perf_counter() - t)
            if written != rows:
                raise RuntimeError(f"ours ({kind}) wrote {written} rows, expected {rows}")
    label = "ours, cuDF" if kind == "cudf" else "ours, pandas"
    best = {phase: min(times) for phase, times in each.items()}
    best.update({f"{phase}_each_s": [round(t, 3) for t in times] for phase, times in each.items()})
    return f"{label} on {where}", best, startup, out


def _wait_for_idle_scheduler(timeout_s: float = 30.0) -> int:
    """Wait until the cluster's scheduler holds no task: a repeat must compute everything again, not find an
    earlier repeat's results still held (their release reaches the scheduler after ``compute`` returns).
    Returns how many tasks it still held when ``timeout_s`` ran out (0: idle)."""
    import time

    from pipeline.etl.progress import current_client

    client = current_client()
    if client is None:
        return 0
    deadline = time.monotonic() + timeout_s
    while (held := client.run_on_scheduler(_scheduler_tasks)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return held


def _scheduler_tasks(dask_scheduler: Any) -> int:
    return len(dask_scheduler.tasks)


@contextlib.contextmanager
def _report(path: str | None, name: str):
    """Where the block's time went (Dask's task stream), added as ``name`` to the JSON at ``path``.

    ``wall_s``: the block; ``before_first_task_s`` / ``after_last_task_s``: the client alone (building
    and optimising graphs, reading file metadata, finishing statistics); ``no_task_running_s``: gaps
    with no task on any worker in between (round trips between computations); ``busy_s``: seconds of
    tasks per worker; ``tasks``: seconds per kind of task (compute, transfer ...); ``worker_lines``: the
    lines the workers' threads spent the block in (:func:`hot_lines`).
    """
    from pipeline.etl.progress import current_client

    if not path or current_client() is None:
        yield
        return
    import json
    import time

    import dask
    from dask.utils import key_split, parse_timedelta
    from distributed import get_task_stream

    start = time.time()
    with get_task_stream() as stream:
        yield
    end = time.time()
    kinds: dict[str, dict] = {}
    busy: dict[str, float] = {}
    spans = []
    for task in stream.data:
        entry = kinds.setdefault(key_split(task["key"]), {"tasks": 0})
        entry["tasks"] += 1
        for part in task.get("startstops", ()):
            action = part["action"] + "_s"
            entry[action] = entry.get(action, 0.0) + part["stop"] - part["start"]
            if part["action"] == "compute":
                busy[task.get("worker", "?")] = busy.get(task.get("worker", "?"), 0.0) + part["stop"] - part["start"]
                spans.append((part["start"], part["stop"]))
    summary = {"wall_s": round(end - start, 3)}
    if spans:
        spans.sort()
        covered, reach = 0.0, spans[0][0]
        for left, right in spans:
            covered += max(0.0, right - max(left, reach))
            reach = max(reach, right)
        summary.update(before_first_task_s=round(spans[0][0] - start, 3), after_last_task_s=round(end - reach, 3),
                       no_task_running_s=round(reach - spans[0][0] - covered, 3))
    summary["busy_s"] = {worker: round(seconds, 3) for worker, seconds in sorted(busy.items())}
    summary["tasks"] = dict(sorted(kinds.items(), key=lambda kv: -kv[1].get("compute_s", 0.0)))
    # A worker files its samples every profile cycle, and answers for a span only from filed cycles: wait one.
    time.sleep(1.5 * parse_timedelta(dask.config.get("distributed.worker.profile.cycle")))
    summary["worker_lines"] = hot_lines(current_client().profile(start=start))
    file = Path(path)
    try:
        report = json.loads(file.read_text()) if file.is_file() else {}
    except (ValueError, OSError):
        report = None
    if not isinstance(report, dict):  # not a report of this bench: replaced, not merged into
        print(f"[bench etl] {file} holds no report of this bench: it is replaced", flush=True)
        report = {}
    report[name] = summary
    write_json(file, report)


def hot_lines(tree: dict, top: int = 25) -> list[dict]:
    """The lines of code the workers' threads were sampled in most (Dask's statistical profiler, a sample every
    10 ms), from a ``Client.profile`` tree: ``self`` samples in the line itself (a call into compiled code, as
    cuDF's, counts as its caller's line), ``total`` with the calls under it, as fractions of all samples."""
    lines: dict[str, dict] = {}
    total = max(tree.get("count", 0), 1)

    def walk(node: dict, seen: frozenset) -> None:
        children = node.get("children", {}).values()
        description = node.get("description") or {}
        where = f"{description.get('filename', '?')}:{description.get('line_number', '?')} {description.get('name', '')}"
        if description:
            entry = lines.setdefault(where, {"line": where, "self": 0, "total": 0})
            entry["self"] += node["count"] - sum(child["count"] for child in children)
            if where not in seen:  # a recursive line counts once in its total
                entry["total"] += node["count"]
        for child in children:
            walk(child, seen | {where})

    walk(tree, frozenset())
    ranked = sorted(lines.values(), key=lambda entry: -entry["self"])[:top]
    return [{**entry, "self": round(entry["self"] / total, 4), "total": round(entry["total"] / total, 4)}
            for entry in ranked if entry["self"] > 0]


def _print_side(name: str, rows: int, r: dict, startup: float | None) -> None:
    extra = f" (cluster start-up {startup:.1f} s, not counted)" if startup is not None else ""
    if len(r.get("fit_each_s", ())) > 1:
        extra += (f"; each run: fit {', '.join(f'{t:.2f}' for t in r['fit_each_s'])} s, transform+write "
                  f"{', '.join(f'{t:.2f}' for t in r['transform_each_s'])} s")
    print(f"[bench etl] {name}: fit {rows / r['fit']:,.0f} rows/s ({r['fit']:.2f} s), transform+write "
          f"{rows / r['transform']:,.0f} rows/s ({r['transform']:.2f} s){extra}", flush=True)


def _write_json(path: str | None, summary: dict) -> None:
    if not path:
        return

    rows = summary["rows"]
    for r in summary["results"].values():
        r["fit_rows_per_s"] = round(rows / r["fit"])
        r["transform_rows_per_s"] = round(rows / r["transform"])
    write_json(path, summary)


def _machine() -> str:
    import os
    import platform

    text = f"{platform.machine()} {os.cpu_count()} cores, python {platform.python_version()}"
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
    except Exception:  # noqa: BLE001 - no NVML: a CPU machine, or no binding
        return text
    return text + f", {count} x {name.decode() if isinstance(name, bytes) else name}"


def _read_table(path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path.is_dir():
        return pa.concat_tables([pq.read_table(p) for p in sorted(path.glob("part-*.parquet"))])
    return pq.read_table(path)


def _check_agreement(first: Path, other: Path, roles: dict) -> None:
    """Two sides must have written the same table (floats to float32 rounding)."""
    import numpy as np

    mine, theirs = _read_table(first), _read_table(other)
    if mine.num_rows != theirs.num_rows:
        raise RuntimeError(f"{first} has {mine.num_rows} rows, {other} {theirs.num_rows}")
    for name in [roles["label"], *roles["categorical"]]:
        if not mine[name].equals(theirs[name].cast(mine[name].type)):
            raise RuntimeError(f"{first} and {other} disagree on column {name}")
    for name in [*roles["continuous"], *(f"{c}_missing" for c in roles["continuous"])]:
        if not np.allclose(mine[name].to_numpy(), theirs[name].to_numpy(), rtol=1e-5, atol=1e-6):
            raise RuntimeError(f"{first} and {other} disagree on column {name}")


def _refuse_what_the_baseline_does_not_do(cfg) -> None:
    """The plain pandas baseline writes the default workflow of one-hot columns; other work is not comparable to it."""
    from pipeline.errors import UserError

    other = [name for name, differs in (("etl.missing_indicator=false", not cfg.etl.missing_indicator),
                                        ("etl.hash_buckets", bool(cfg.etl.hash_buckets)),
                                        ("etl.hash_ids", bool(cfg.etl.hash_ids)),
                                        ("data.multihot", bool(cfg.data.multihot))) if differs]
    if other:
        raise UserError(f"bench etl: the plain pandas baseline does the default workflow on one-hot columns, not "
                        f"{', '.join(other)}: add --no-baseline to time the workflow alone")


class _PandasBaseline:
    """The same operations written plainly with pandas, in one process, all rows in memory: values seen fewer than
    ``freq_threshold`` times, and past the ``max_vocab_size`` most frequent (0: no limit), are out of vocabulary."""

    def __init__(self, roles: dict, freq_threshold: int = 0, max_vocab_size: int = 0):
        self.roles = roles
        self.freq_threshold, self.max_vocab_size = freq_threshold, max_vocab_size
        self.vocab: dict = {}
        self.median: dict = {}
        self.mean: dict = {}
        self.std: dict = {}

    def _read(self, files):
        import pandas as pd

        return pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)

    def _dense(self, series):
        import numpy as np

        filled = series.astype("float64").fillna(self.median[series.name])
        return np.sign(filled) * np.log1p(filled.abs())

    def fit(self, files) -> None:
        import pandas as pd

        df = self._read(files)
        for name in self.roles["categorical"]:
            counts = df[name].value_counts().rename_axis("value").reset_index(name="count")
            counts = counts[counts["count"] >= self.freq_threshold].sort_values(["count", "value"],
                                                                                ascending=[False, True])
            self.vocab[name] = pd.Index(counts["value"][:self.max_vocab_size or None])
        for name in self.roles["continuous"]:
            self.median[name] = df[name].median()
            values = self._dense(df[name])
            self.mean[name], self.std[name] = values.mean(), values.std()

    def transform_write(self, files, path, row_group_rows: int) -> None:
        import numpy as np
        import pandas as pd

        df = self._read(files)
        out = {self.roles["label"]: df[self.roles["label"]].astype("float32")}
        for name in self.roles["continuous"]:
            out[name] = ((self._dense(df[name]) - self.mean[name]) / self.std[name]).astype("float32")
        for name in self.roles["continuous"]:
            out[f"{name}_missing"] = df[name].isna().astype("float32")
        for name in self.roles["categorical"]:
            codes = self.vocab[name].get_indexer(df[name])
            out[name] = np.where(df[name].isna(), 0, np.where(codes < 0, 1, codes + 2)).astype("int32")
        pd.DataFrame(out).to_parquet(path, index=False, row_group_size=row_group_rows)
