"""The fused served model's work in one process, by phase: refresh, preprocess, lookup, dense, per batch size.

Loads a fused export's one model (``ensemble``) as its instance does on ``--device`` (the preprocess of
``ensemble/1/artifacts``, the embedding lookup through ``ensemble/store`` with the instance's caches: ``gpu-lru`` on a
GPU, ``lru`` on the CPU, and the dense part with CUDA graphs on a GPU), makes requests of the raw test rows with the
client's code (the tensors the served model gets), and times each phase of 8 requests in turn: the median of
``--calls`` calls (after 50), warm and with the CPU's caches emptied before each call (``cold``: a 128 MiB array
written, as the rest of a served request and the server's other processes leave them). ``--gather`` picks how the rows
of a GPU cache reach the dense part: ``graph`` (the fused model's way: the dense part's CUDA graph gathers them from
the cache), ``before`` (the lookup gathers them, as the ``embedding`` model of the chain does) or ``both``, in turn;
``whole`` times what a GPU instance that holds its tables whole does instead (``export/device_ranker.py``: the
workflow, the rows and the dense part as one graph a batch; its time is the ``total``; on the CPU the same code runs
without a graph). What a request costs beyond this (Triton, the python backend, the transport) is ``tools/serve_profile.py``'s.

    python tools/ranker_profile.py --export data/bench-serve/bench-serve-50000/export --device cuda --gather both
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

PHASES = ("refresh", "preprocess", "lookup", "dense", "total")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--export", required=True, help="a fused export folder (export.fuse=all)")
    parser.add_argument("--raw", default="", help="raw parquet rows for the requests (default: <export>/../raw/test)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda[:N]: where the instance runs")
    parser.add_argument("--batches", default="1,32,1024", help="batch sizes, comma-separated")
    parser.add_argument("--calls", type=int, default=300, help="timed calls per batch size, way and round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over the ways, each batch size")
    parser.add_argument("--gather", choices=("graph", "before", "both", "whole"), default="both",
                        help="where the rows of a GPU cache are gathered (whole: the whole batch in one graph)")
    parser.add_argument("--json", metavar="FILE", help="also write the timings as JSON")
    args = parser.parse_args(argv)

    import numpy as np
    import pyarrow.parquet as pq

    from export.dense import DenseRunner
    from export.lookup import EmbeddingLookup, LookupConfig
    from export.preprocess import CATEGORICAL_IDS, DENSE, MULTIHOT_IDS, MULTIHOT_LENGTHS, Preprocessor

    folder = Path(args.export) / "ensemble"
    on_gpu = args.device.startswith("cuda")
    preprocess = Preprocessor.load(folder / "1" / "artifacts")
    lookup = EmbeddingLookup(folder / "store", LookupConfig.load(folder / "1" / "layout.json"),
                             policy="gpu-lru" if on_gpu else "lru", device=args.device if on_gpu else None)
    max_batch = int(re.search(r"max_batch_size: (\d+)", (folder / "config.pbtxt").read_text()).group(1))
    dense = DenseRunner(folder / "1" / "model.pt", args.device, cuda_graphs=True, max_batch=max_batch)
    rows = pq.read_table(args.raw or Path(args.export).parent / "raw" / "test").to_pandas()

    def requests(batch: int) -> list[dict]:
        starts = [k * batch % max(len(rows) - batch, 1) for k in range(8)]
        return [preprocess.raw.layout.tensors(rows.iloc[start: start + batch]) for start in starts]

    spill = np.ones(16 << 20)

    one_graph = None
    if args.gather == "whole":
        from export.device_preprocess import DevicePreprocessor
        from export.device_ranker import DeviceRanker

        planned = DevicePreprocessor.plan(preprocess, args.device, max_batch)
        whole = EmbeddingLookup(folder / "store", LookupConfig.load(folder / "1" / "layout.json"), policy="gpu-lru",
                                device=args.device, whole_mb=float("inf"))
        resident = whole.resident()
        if planned is None or resident is None:
            sys.exit("error: this export's workflow or tables do not run as one graph (export/device_ranker.py)")
        ranker = DeviceRanker(planned, dense)

        def one_graph(request: dict):
            return ranker(request, resident)

    def timed(batch: int, cold: bool, in_graph: bool) -> dict[str, float]:
        made, times = requests(batch), {phase: [] for phase in PHASES}
        for call in range(args.calls + 50):
            if cold:
                np.add(spill, 1.0, out=spill)
            start = time.perf_counter()
            lookup.refresh()
            refreshed = time.perf_counter()
            if one_graph is not None:
                if one_graph(made[call % 8]) is None:
                    sys.exit("error: a request went the usual way (its text, or its batch size)")
                done = time.perf_counter()
                if call >= 50:
                    times["refresh"].append(refreshed - start)
                    times["total"].append(done - start)
                time.sleep(0.001)
                continue
            features = preprocess(made[call % 8])
            preprocessed = time.perf_counter()
            ids = features.get(CATEGORICAL_IDS), features.get(MULTIHOT_IDS), features.get(MULTIHOT_LENGTHS)
            pooled = lookup.rows_or_pooled(*ids) if in_graph else lookup(*ids)
            looked_up = time.perf_counter()
            dense(features.get(DENSE), pooled)
            done = time.perf_counter()
            if call >= 50:
                marks = (start, refreshed, preprocessed, looked_up, done)
                for phase, begin, end in zip(PHASES, marks, marks[1:]):
                    times[phase].append(end - begin)
                times["total"].append(done - start)
            time.sleep(0.001)  # a served instance waits between requests: its GPU idles, its caches go cold
        return {phase: round(statistics.median(values) * 1e3, 3) if values else 0.0 for phase, values in times.items()}

    ways = {"graph": [True], "before": [False], "both": [False, True], "whole": [True]}[args.gather] if on_gpu \
        else [False]
    results: dict = {"export": str(args.export), "device": args.device, "figures": []}
    print(f"[ranker] {folder} on {args.device}; {len(rows):,} raw rows; p50 of {args.calls} calls, ms", flush=True)
    for batch in [int(b) for b in args.batches.split(",") if b]:
        for cold in (False, True):
            for round_ in range(args.rounds):
                for in_graph in ways:
                    figures = timed(batch, cold, in_graph)
                    way = ("one graph" if one_graph else "gathered in the graph" if in_graph else "gathered before"
                           if on_gpu else "host caches")
                    results["figures"].append({"batch": batch, "cold": cold, "round": round_ + 1,
                                               "gather": "graph" if in_graph else "before" if on_gpu else "host", **figures})
                    print(f"batch {batch:5} {'cold' if cold else 'warm'} round {round_ + 1} {way:22} "
                          + ", ".join(f"{phase} {figures[phase]:.3f}" for phase in PHASES), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    sys.path.append(str(Path(__file__).resolve().parent.parent))  # after PYTHONPATH: it picks the code to time
    main()
