"""The time of one embedding-cache lookup of a request over many tables: each table's tier looked up on its
own (``PerTable``) against all tables in one step (the tier's ``for_tables``), without a server.

Tables of ``--dim`` float32 columns, their rows spread log-evenly from 10 to ``--max-rows``, each cached up
to a quarter of its rows with a floor of 1,024 (the served lookup's default). Two kinds of traffic:
``repeated`` sends the same request again (every id hits, as when a bench repeats its rows), ``zipf`` draws
every request anew from Zipf-distributed ids (hits, misses and evictions). Each case is timed over
``--requests`` lookups after as many untimed ones; the median and the 90th percentile are printed in ms.

    python3 tools/cache_profile.py --device cpu                          # the torch tiers on the CPU
    python3 tools/cache_profile.py --device cuda --policies gpu-lru      # on a GPU
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="the torch tiers' device (cpu, cuda, cuda:1)")
    parser.add_argument("--policies", default="gpu-lru,gpu-lfu,lru", help="cache policies, comma-separated")
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--batches", default="1,32", help="rows per request, comma-separated")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--max-rows", type=int, default=100_000, help="rows of the largest table")
    parser.add_argument("--requests", type=int, default=200, help="timed lookups per case")
    parser.add_argument("--json", metavar="FILE", help="also write the timings as JSON")
    args = parser.parse_args(argv)

    import torch

    from export.cache import TIERS, PerTable

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    sizes = np.geomspace(10, args.max_rows, args.tables).astype(int)
    tables = {f"t{i}": rng.standard_normal((int(n), args.dim)).astype(np.float32) for i, n in enumerate(sizes)}
    capacities = {name: min(len(t), max(1024, len(t) // 4)) for name, t in tables.items()}
    names = list(tables)
    results = {}
    for policy in args.policies.split(","):
        factory = TIERS.load(policy)
        options = {"device": args.device} if policy.startswith("gpu-") else {}
        for batch in map(int, args.batches.split(",")):
            for traffic in ("repeated", "zipf"):
                requests = [np.stack([rng.zipf(1.2, size=batch) % len(tables[n]) for n in names], axis=1)
                            for _ in range(1 if traffic == "repeated" else 2 * args.requests)]
                for way in ("per table", "one step"):
                    if way == "per table":
                        caches = PerTable({n: factory(t, capacities[n], **options) for n, t in tables.items()})
                    else:
                        caches = factory.for_tables(tables, capacities, **options)
                    times = []
                    for i in range(2 * args.requests):
                        start = time.perf_counter()
                        caches.lookup(names, requests[i % len(requests)])
                        times.append(time.perf_counter() - start)
                    ms = np.array(times[args.requests:]) * 1e3
                    key = f"{policy} batch {batch} {traffic} {way}"
                    results[key] = {"p50_ms": float(np.median(ms)), "p90_ms": float(np.percentile(ms, 90))}
                    print(f"{key:40s} p50 {results[key]['p50_ms']:8.3f} ms   p90 {results[key]['p90_ms']:8.3f} ms",
                          flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
