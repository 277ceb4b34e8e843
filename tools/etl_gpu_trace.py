"""What each GPU worker of the ETL's cluster did on its GPU during one fit and one transform+write, and what the
client did meanwhile: the stage's default workflow on the bench's own dataset (as ``bench etl``), on its
LocalCUDACluster.

Two repeats warm the cluster up; in the third, ``torch.profiler`` (CUPTI) records every kernel, copy and memset
of each worker process (started and stopped through ``client.run``), and ``cProfile`` the client. Printed,
and written to ``--out/trace-summary.json``: each phase's wall time; each worker's GPU busy seconds (kernels,
copies, memsets), its copies alone, its longest kinds of work; the union of both workers' GPU activity against the
phase's wall time (workers of one GPU share it by time slices: a union near the sum of the busy times says their work
did not overlap); and the client's hottest functions in each phase. Each worker's Chrome trace of the transform+write
is kept in ``--out`` (``trace-transform-<n>-<pid>.json``: open it in Perfetto).

    python3 tools/etl_gpu_trace.py --rows 20000000 --out /tmp/etl-trace
    python3 tools/etl_gpu_trace.py --rows 20000000 etl.workers_per_gpu=1    # settings as the stage takes them

On a CPU (``--backend pandas``) the same runs with the workers' CPU activity only: the mechanics, no GPU figure.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import pstats
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("settings", nargs="*", metavar="KEY=VALUE", help="settings of the stage (etl.workers_per_gpu=1)")
    parser.add_argument("--backend", choices=["cudf", "pandas"], default="cudf")
    parser.add_argument("--rows", type=int, default=20_000_000)
    parser.add_argument("--workdir", default="/tmp/etl-bench", help="where the bench's synthetic rows are made once")
    parser.add_argument("--out", default="/tmp/etl-trace", help="folder of the traces and the summary")
    args = parser.parse_args(argv)

    from pipeline.bench.etl import bench_dataset
    from pipeline.etl.cluster import etl_client
    from pipeline.etl.defaults import default_workflow
    from pipeline.etl.frame_library import read_parquet
    from pipeline.etl.output import transform_split
    from pipeline.etl.progress import current_client
    from pipeline.stages.config import load_config

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if args.backend == "cudf" else "cpu"
    cfg = load_config(None, [f"workdir={args.workdir}", f"device={device}", "progress=off", *args.settings])
    cfg, raw, roles = bench_dataset(cfg, args.rows)
    files = raw.splits["train"]
    etl = dataclasses.replace(cfg.etl, cluster="local", workers=0 if args.backend == "cudf" else 2)
    written = Path(args.workdir) / "trace-out"
    results = []
    with etl_client(etl, library=args.backend):
        client = current_client()
        for repeat in range(3):
            traced = repeat == 2
            shutil.rmtree(written, ignore_errors=True)  # untimed, as in bench etl
            workflow = default_workflow(roles, etl, library=args.backend)
            if traced:
                client.run(_start)
                profile = cProfile.Profile()
                profile.enable()
            t = time.perf_counter()
            workflow.fit(read_parquet(files, workflow.input_columns, args.backend))
            fit = time.perf_counter() - t
            if traced:
                profile.disable()
                results.append(_summary("fit", client.run(_stop, path=str(out / "trace-fit.json")), fit))
                results[-1].update(_client(profile))
                client.run(_start)
                profile = cProfile.Profile()
                profile.enable()
            t = time.perf_counter()
            transform_split(workflow, files, written, etl.row_group_rows, args.backend, progress=False)
            transform = time.perf_counter() - t
            if traced:
                profile.disable()
                spans = {worker: client.run(_stop, path=str(out / f"trace-transform-{n}.json"), workers=[worker])[worker]
                         for n, worker in enumerate(client.scheduler_info()["workers"])}
                results.append(_summary("transform+write", spans, transform))
                results[-1].update(_client(profile))
            print(f"repeat {repeat + 1}: fit {fit:.3f} s, transform+write {transform:.3f} s", flush=True)
    for phase in results:
        print(f"\n{phase['phase']}: {phase['wall_s']} s; both workers' GPU activity {phase['gpu_union_s']} s")
        for worker in phase["workers"]:
            print(f"  GPU busy {worker['gpu_busy_s']} s (copies {worker['copies_s']} s, {worker['events']} events): "
                  + ", ".join(f"{name} {ms:.1f} ms" for name, ms in list(worker["longest_ms"].items())[:6]))
        if "client" in phase:
            print(f"  client's own time {phase['client_s']} s; hottest: "
                  + "; ".join(f"{line} {s} s" for line, s in phase["client"][:12]))
            print("  client, by time inside: " + "; ".join(f"{line} {s} s" for line, s in phase["client_inside"][:16]))
    (out / "trace-summary.json").write_text(json.dumps(results, indent=1) + "\n")
    return results


def _start(dask_worker=None) -> None:
    """In a worker: start recording its GPU work (and its CPU operators, which torch.profiler always records)."""
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    dask_worker._etl_gpu_trace = torch.profiler.profile(activities=activities)
    dask_worker._etl_gpu_trace.__enter__()


def _stop(path: str, dask_worker=None) -> list[tuple[float, float, str]]:
    """In a worker: stop recording, keep the Chrome trace (``path`` with the process id) and return its GPU work as
    ``(start us, end us, name)`` on the host's clock, so that two workers' spans compare."""
    import os

    trace = dask_worker._etl_gpu_trace
    trace.__exit__(None, None, None)
    path = path.replace(".json", f"-{os.getpid()}.json")
    trace.export_chrome_trace(path)
    events = json.loads(Path(path).read_text())
    base = events.get("baseTimeNanoseconds", 0) / 1000.0
    return [(base + float(e["ts"]), base + float(e["ts"]) + float(e["dur"]), e.get("name", "?"))
            for e in events.get("traceEvents", []) if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
            and "dur" in e]


def _summary(phase: str, spans: dict, wall: float) -> dict:
    workers, every = [], []
    for worker_spans in spans.values():
        kinds: dict[str, float] = {}
        for start, end, name in worker_spans:
            kinds[name[:70]] = kinds.get(name[:70], 0.0) + (end - start) / 1e3
        workers.append({"gpu_busy_s": round(sum(e - s for s, e, _ in worker_spans) / 1e6, 3),
                        "copies_s": round(sum(e - s for s, e, n in worker_spans if "emcpy" in n) / 1e6, 3),
                        "events": len(worker_spans),
                        "longest_ms": dict(sorted(kinds.items(), key=lambda kv: -kv[1])[:12])})
        every += [(s, e) for s, e, _ in worker_spans]
    return {"phase": phase, "wall_s": round(wall, 3), "gpu_union_s": round(_union(every) / 1e6, 3), "workers": workers}


def _union(spans: list[tuple[float, float]]) -> float:
    """The length of the union of ``spans``."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        total += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return total


_WAITS = ("SimpleQueue", "'acquire'", "wait", "select", "poll", "sleep")
"""What the client's waiting for the cluster is called in its profile."""


def _client(profile: cProfile.Profile, top: int = 25) -> dict:
    """The client's time in the profiled block, waiting for the cluster left out: its sum (``client_s``), the
    functions by their own time (``client``) and by their time with what they call (``client_inside``: which steps
    of the stage's code hold the hottest ones)."""
    stats = pstats.Stats(profile, stream=io.StringIO())
    own, inside = [], []
    for (file, line, name), (_, _, tottime, cumtime, _) in stats.stats.items():
        if any(wait in name for wait in _WAITS):
            continue
        own.append((f"{Path(file).name}:{line} {name}", round(tottime, 4)))
        inside.append((f"{Path(file).name}:{line} {name}", round(cumtime, 4)))
    return {"client_s": round(sum(s for _, s in own), 3), "client": sorted(own, key=lambda row: -row[1])[:top],
            "client_inside": sorted(inside, key=lambda row: -row[1])[:top * 2]}


if __name__ == "__main__":
    main()
