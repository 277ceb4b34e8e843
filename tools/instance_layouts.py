"""Served latency and throughput of a fused export for several layouts of its one model's instances.

A layout is a count of instances and how Triton picks among them: ``turn`` (one group: the free instance that ran
least, so sequential requests visit every instance in turn) or ``priority`` (the export's way,
``export.pbtxt.instance_groups``: one group per instance, the k-th of rate-limiter priority 20**k, so a light load
keeps to the first instance). For each, on a copy of the export: the p50 of sequential gRPC requests to the
``ensemble`` at each batch size (two rounds of 300, after 30), how many batches each instance ran, then the rows/s
of ``--clients`` client processes sending 1,024-row requests for 4 s.

    python tools/instance_layouts.py --export data/bench-serve/bench-serve-50000/export \\
        --layouts 1:turn,8:turn,8:priority,4:turn,4:priority --batches 1,32 --clients 16
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import tempfile
import time
from pathlib import Path

THROUGHPUT_BATCH = 1024
THROUGHPUT_S = 4.0


def _client(url: str, tensors: dict, seconds: float, out) -> None:
    from export.client import Client

    with Client(url, "grpc") as client:
        calls, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            client.infer(tensors)
            calls += 1
    out.put(calls)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--export", required=True, help="a fused export (bench serve export.fuse=all makes one)")
    parser.add_argument("--layouts", default="1:turn,8:turn,8:priority", help="COUNT:turn|priority, comma-separated")
    parser.add_argument("--batches", default="1,32", help="batch sizes of the sequential requests")
    parser.add_argument("--clients", type=int, default=16, help="client processes of the throughput run")
    args = parser.parse_args(argv)

    import numpy as np
    import pyarrow.parquet as pq

    from export.client import Client
    from export.instance import live_stats
    from export.pbtxt import regrouped
    from export.server import TritonServer

    export = Path(args.export)
    rows = pq.read_table(export.parent / "raw" / "test").to_pandas()
    results = []
    for layout in args.layouts.split(","):
        count, way = layout.split(":")
        with tempfile.TemporaryDirectory(prefix="instance-layouts-") as tmp:
            work = Path(tmp) / "repository"
            shutil.copytree(export, work, symlinks=True, ignore=shutil.ignore_patterns("stats"))
            config = work / "ensemble" / "config.pbtxt"
            config.write_text(regrouped(config.read_text(), int(count), by_priority=way == "priority"))
            with TritonServer(work) as server, Client(server.grpc_url, "grpc") as client:
                line: dict = {"instances": int(count), "way": way}
                for _ in range(2):
                    for batch in [int(b) for b in args.batches.split(",")]:
                        tensors = client.tensors(rows.iloc[:batch])
                        for _ in range(30):
                            client.infer(tensors)
                        spans = []
                        for _ in range(300):
                            start = time.perf_counter_ns()
                            client.infer(tensors)
                            spans.append(time.perf_counter_ns() - start)
                        line.setdefault(f"p50 ms at {batch}", []).append(round(float(np.median(spans)) / 1e6, 3))
                time.sleep(0.5)  # the instances' counters written
                line["batches per instance"] = sorted((s["batches"] for s in live_stats(work / "ensemble")),
                                                      reverse=True)
                tensors = client.tensors(rows.iloc[np.arange(THROUGHPUT_BATCH) % len(rows)])
                done = mp.Queue()
                clients = [mp.Process(target=_client, args=(server.grpc_url, tensors, THROUGHPUT_S, done))
                           for _ in range(args.clients)]
                for process in clients:
                    process.start()
                calls = sum(done.get() for _ in clients)
                for process in clients:
                    process.join()
                line["rows/s"] = round(calls * THROUGHPUT_BATCH / THROUGHPUT_S)
            print(json.dumps(line), flush=True)
            results.append(line)
    return results


if __name__ == "__main__":
    main()
