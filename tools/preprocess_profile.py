"""The served preprocess in one process: raw request tensors -> model tensors, per batch, by phase.

Loads the preprocess of an export (``ensemble/1/artifacts`` of a fused one, or ``preprocess/1/artifacts`` of the
chain) as the served model does, makes requests of the raw test rows with the client's code
(``RequestLayout.tensors``: the tensors the served model gets), and times ``Preprocessor.__call__`` on 8 different
requests in turn: the median of ``--calls`` calls (after 30) per batch size, each of ``--rounds`` rounds, and its
phases (the request's columns as blocks, the workflow's ``transform_columns``, the model's tensors cut from them).
With ``--cold`` a 128 MiB array is written before each call, which empties the CPU's caches as the rest of a served
request and the server's other processes do between two preprocesses of one instance (a warm loop of the same call
measures code that stays in cache). Only the public ``Preprocessor`` API is used, so the same file times any revision:
put that revision first on ``PYTHONPATH``; run it with the served models' memory settings
(``export.environment.MALLOC``) to time their allocations.

    python tools/preprocess_profile.py --export data/synthetic/export --cold
    for code in /path/to/before .; do PYTHONPATH=$code python tools/preprocess_profile.py --export X; done
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--export", required=True, help="an export folder (python -m pipeline run export)")
    parser.add_argument("--raw", default="", help="raw parquet rows for the requests (default: <export>/../raw/test)")
    parser.add_argument("--batches", default="1,32,1024", help="batch sizes, comma-separated")
    parser.add_argument("--calls", type=int, default=300, help="timed calls per batch size and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over all batch sizes")
    parser.add_argument("--cold", action="store_true", help="empty the CPU's caches before each call")
    parser.add_argument("--json", metavar="FILE", help="also write the timings as JSON")
    args = parser.parse_args(argv)

    import numpy as np
    import pyarrow.parquet as pq

    import export.preprocess
    from export.preprocess import Preprocessor

    folder = Path(args.export)
    artifacts = next(p for p in (folder / "ensemble/1/artifacts", folder / "preprocess/1/artifacts") if p.exists())
    preprocess = Preprocessor.load(artifacts)
    rows = pq.read_table(args.raw or folder.parent / "raw" / "test").to_pandas()
    batches = [int(b) for b in args.batches.split(",") if b]

    requests = {batch: [preprocess.raw.layout.tensors(rows.iloc[start: start + batch])
                        for start in (k * batch % max(len(rows) - batch, 1) for k in range(8))] for batch in batches}
    results: dict = {"code": str(Path(export.preprocess.__file__).resolve().parents[1]), "cold": args.cold,
                     "rounds": []}
    print(f"[preprocess] {artifacts} ({results['code']}); {len(rows):,} raw rows; p50 of {args.calls} calls"
          f"{', caches emptied before each' if args.cold else ''}, ms", flush=True)
    spill = np.ones(16 << 20) if args.cold else None
    for round_ in range(args.rounds):
        figures = {}
        for batch in batches:
            times = {"total": [], "columns": [], "transform": [], "tensors": []}
            for call in range(args.calls + 30):
                request = requests[batch][call % 8]
                if spill is not None:
                    spill += 1.0
                start = time.perf_counter()
                columns = preprocess.columns(request)
                middle = time.perf_counter()
                processed = preprocess.transform(columns)
                end = time.perf_counter()
                preprocess.tensors(processed)
                done = time.perf_counter()
                if call >= 30:
                    for name, seconds in (("total", done - start), ("columns", middle - start),
                                          ("transform", end - middle), ("tensors", done - end)):
                        times[name].append(seconds)
            figures[batch] = {name: statistics.median(values) * 1e3 for name, values in times.items()}
            phases = ", ".join(f"{name} {figures[batch][name]:.3f}" for name in ("columns", "transform", "tensors"))
            print(f"round {round_ + 1} batch {batch}: {figures[batch]['total']:.3f} ms ({phases})", flush=True)
        results["rounds"].append(figures)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    sys.path.append(str(Path(__file__).resolve().parent.parent))  # after PYTHONPATH: it picks the code to time
    main()
