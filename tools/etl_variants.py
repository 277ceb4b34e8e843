"""One side of ``bench etl`` (the stage's default workflow on its cluster) under several variants, each in a
process of its own with a cluster of its own: settings (``etl.row_group_rows=1048576``) and environment variables
(``DASK_DISTRIBUTED__SCHEDULER__WORK_STEALING=False``, which the cluster's scheduler and workers see from their
start). Each variant reads the same synthetic rows (the bench's own dataset, made once), fits and transforms+writes
``--repeats`` times; the best and every repeat's seconds are printed, and written as JSON with ``--json``.

A variant is ``NAME:ITEM ITEM ...``, each item ``section.key=value`` (a setting) or ``NAME=value`` (an environment
variable, upper case). Compare variants within one run: the first repeat on a fresh cluster pays its start-up.

    python3 tools/etl_variants.py --rows 20000000 --repeats 3 "as is:" "no stealing:DASK_DISTRIBUTED__SCHEDULER__WORK_STEALING=False"
    python3 tools/etl_variants.py --backend pandas --rows 2000000 "as is:" "1M-row groups:etl.row_group_rows=1048576"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variants", nargs="*", metavar="NAME:ITEMS", help="a variant: its name, then its settings and "
                        "environment variables")
    parser.add_argument("--backend", choices=["cudf", "pandas"], default="cudf")
    parser.add_argument("--rows", type=int, default=20_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=0, help="the pandas side's worker processes (0: one a core)")
    parser.add_argument("--workdir", default="/tmp/etl-variants", help="where the synthetic rows are made once")
    parser.add_argument("--timeout", type=float, default=300, help="seconds a variant may take")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--report", metavar="FOLDER", help="also write each variant's report of where its time went "
                        "(as `bench etl --report`) to FOLDER/<n>.json, n counting the variants from 1")
    parser.add_argument("--one", metavar="JSON", help=argparse.SUPPRESS)  # a variant's own process
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(_measure(args, json.loads(args.one))), flush=True)
        return []
    if not args.variants:
        parser.error("name at least one variant, e.g. 'as is:'")
    results = []
    for number, variant in enumerate(args.variants, 1):
        name, _, items = variant.partition(":")
        settings = [item for item in items.split() if "." in item.split("=")[0]]
        environ = dict(item.split("=", 1) for item in items.split() if item not in settings)
        command = [sys.executable, __file__, "--backend", args.backend, "--rows", str(args.rows),
                   "--repeats", str(args.repeats), "--workers", str(args.workers), "--workdir", args.workdir,
                   "--one", json.dumps(settings)]
        if args.report:
            command += ["--report", str(Path(args.report) / f"{number}.json")]
        done = subprocess.run(command, env={**os.environ, **environ}, capture_output=True, text=True,
                              timeout=args.timeout, check=False)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        result = {"variant": name, "settings": settings, "environment": environ, **(
            json.loads(lines[-1]) if done.returncode == 0 and lines else {"failed": _last_line(done.stderr)})}
        results.append(result)
        _print(result)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return results


def _measure(args: argparse.Namespace, settings: list[str]) -> dict:
    import dataclasses

    from pipeline.bench.etl import _ours, bench_dataset
    from pipeline.stages.config import load_config

    device = "cuda" if args.backend == "cudf" else "cpu"
    cfg = load_config(None, [f"workdir={args.workdir}", f"device={device}", "progress=off", *settings])
    cfg, raw, roles = bench_dataset(cfg, args.rows)
    rows = raw.rows["train"]
    workers = 0 if args.backend == "cudf" else args.workers
    etl = dataclasses.replace(cfg.etl, cluster="local", workers=workers)
    out = Path(args.workdir) / "out"
    where, best, startup, _ = _ours(args.backend, etl, cfg, roles, raw.splits["train"], rows, out, args.repeats,
                                    report=args.report)
    return {"where": where, "rows": rows, "fit_s": round(best["fit"], 3), "transform_s": round(best["transform"], 3),
            "fit_rows_s": round(rows / best["fit"]), "transform_rows_s": round(rows / best["transform"]),
            "fit_each_s": best["fit_each_s"], "transform_each_s": best["transform_each_s"],
            "startup_s": round(startup, 2)}


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else "no output"


def _print(result: dict) -> None:
    if "failed" in result:
        print(f"{result['variant']}: failed\n{result['failed']}", flush=True)
        return
    print(f"{result['variant']:24} fit {result['fit_rows_s']:>12,} rows/s ({result['fit_s']:.2f} s)  transform+write "
          f"{result['transform_rows_s']:>12,} rows/s ({result['transform_s']:.2f} s)  each: fit {result['fit_each_s']}, "
          f"transform+write {result['transform_each_s']}", flush=True)


if __name__ == "__main__":
    main()
