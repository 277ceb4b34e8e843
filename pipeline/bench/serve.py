"""Serving latency and throughput: the Triton ensemble against the in-process model, same run.

Makes a small synthetic dataset (``--rows``), runs the ETL, builds the configured model (untrained:
speed does not depend on the weights) and exports it under ``--workdir``; starts the real server.
Then, for batch 1, 64 and 1024 raw rows: p50 / p99 latency of ``--requests`` sequential gRPC
requests (their tensors made from the rows beforehand, as a load generator sends them; the time to make them is
said beside), and of the in-process model on the same rows (workflow transform + forward, no server;
and the forward alone on features computed beforehand), timed in turn, 10 calls at a time;
the time each ensemble step took (Triton's own statistics) and, inside the model that looks up embeddings, each
phase of its batches (the store's refresh, inputs read, preprocess, lookup, dense, outputs: host time, so GPU work shows
where the host waits for it); throughput with ``--clients``
concurrent gRPC client processes; and the embedding cache's hit rate on the raw rows, whose categorical
values are Zipf-distributed (served LRU, summed over the instances of the model that looks up embeddings, said
beside it since each warms a cache of its own; plus LRU / LFU at several cache sizes offline).

    python -m pipeline bench serve --requests 200 --clients 8
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from pipeline.bench.arguments import bench_rows, integer, integers, number, output_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=integer(1), help="synthetic rows made for the benchmark (default: data.rows "
                        "where it is set, else 50,000)")
    parser.add_argument("--batches", type=integers(1), default=[1, 64, 1024],
                        help="batch sizes, comma-separated (default 1,64,1024; fewer test rows are taken again)")
    parser.add_argument("--requests", type=integer(1), default=200, help="sequential requests per batch size")
    parser.add_argument("--clients", type=integer(1), default=8, help="concurrent gRPC client processes for throughput")
    parser.add_argument("--seconds", type=number(above=0), default=10.0, help="duration of the throughput run")
    parser.add_argument("--throughput-batch", type=integer(1), default=64, help="rows per request in the throughput run")
    parser.add_argument("--workdir", help="where the benchmark's data and export go (default <workdir>/bench-serve)")
    parser.add_argument("--json", type=output_file, metavar="FILE", help="also write the figures as JSON")


def run(args: argparse.Namespace, cfg) -> dict:
    import dataclasses
    import os
    import platform
    import time
    from datetime import datetime, timezone

    import torch

    torch.set_num_threads(cfg.export.dense_threads)  # the same torch threads as each served dense instance
    made = bench_rows(args.rows, cfg.data, 50_000)
    cfg = dataclasses.replace(
        cfg, workdir=args.workdir or str(Path(cfg.workdir) / "bench-serve"),
        device="cpu" if cfg.device == "auto" else cfg.device,
        data=dataclasses.replace(cfg.data, rows=made, name=cfg.data.name or f"bench-serve-{made}"),
        etl=dataclasses.replace(cfg.etl, cluster="threads"))
    batches = args.batches
    cfg = dataclasses.replace(cfg, export=dataclasses.replace(cfg.export, max_batch_size=max(batches + [1024])))
    reference, rows, exported = _prepare(cfg)
    fused = exported["options"]["fused"]
    steps_of = exported["models"] if fused else [m for m in exported["models"] if m != "ensemble"]
    served_by = (f"{'one python model' if fused else ' + '.join(steps_of)} "
                 f"({exported['options']['instance_kind']} instances)")
    print(f"[bench serve] {len(rows):,} raw test rows; model {cfg.train.model} on {reference.device.type}, served by "
          f"{served_by}; {os.cpu_count()} cores; load {os.getloadavg()[0]:.2f}", flush=True)

    from export.client import Client
    from export.instance import STATS_EVERY_S
    from export.repository import cache_stats
    from export.server import start_server
    from pipeline.files import write_json

    results: dict = {"command": f"python -m pipeline bench serve --rows {made} --batches {','.join(map(str, batches))} "
                                + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                                           if k in ("requests", "clients", "seconds", "throughput_batch")),
        "machine": f"{platform.node()} ({os.cpu_count()} cores, {platform.machine()})",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "load_average": os.getloadavg()[0],
        "device": reference.device.type, "served_by": served_by,
        "latency": {}, "steps": {}, "phases": {}}
    started = time.perf_counter()
    server = start_server(cfg.paths.export, cfg.serve)
    results["startup_s"] = round(time.perf_counter() - started, 2)
    try:
        with Client(server.grpc_url, "grpc") as client:
            for batch in batches:
                # a batch of that many rows, the test rows taken again where they are fewer
                frame = rows.iloc[np.arange(batch) % len(rows)].reset_index(drop=True)
                request = client.tensors(frame)
                timed = _timed_in_turn({"ensemble": lambda request=request: client.infer(request),
                                        "in_process": lambda frame=frame: reference.predict(frame),
                                        "model_only": _forward_only(reference, frame),
                                        "request": lambda frame=frame: client.tensors(frame)}, args.requests)
                served, local, model_only = timed["ensemble"], timed["in_process"], timed["model_only"]
                time.sleep(2 * STATS_EVERY_S)  # the instances' phase totals written since the last request
                before, phases_before = _model_stats(client), cache_stats(cfg.paths.export)
                _timed_in_turn({"ensemble": lambda request=request: client.infer(request)}, max(20, args.requests // 4))
                time.sleep(2 * STATS_EVERY_S)
                steps = _per_request(before, _model_stats(client), steps_of)
                phases = _per_batch(phases_before, cache_stats(cfg.paths.export))
                results["latency"][batch] = {"ensemble": served, "in_process": local, "model_only": model_only,
                                             "request_tensors": timed["request"]}
                results["steps"][batch] = steps
                results["phases"][batch] = phases
                print(f"[bench serve] batch {batch:5d}: ensemble p50 {served['p50_ms']:.2f} ms p99 "
                      f"{served['p99_ms']:.2f} ms | in-process p50 {local['p50_ms']:.2f} ms p99 {local['p99_ms']:.2f} ms"
                      f" | ensemble / in-process p50 {served['p50_ms'] / local['p50_ms']:.2f}x"
                      f" | model forward alone p50 {model_only['p50_ms']:.2f} ms | the request's tensors made from"
                      f" the rows p50 {timed['request']['p50_ms']:.2f} ms | steps (ms): "
                      + ", ".join(f"{k} {v:.2f}" for k, v in steps.items())
                      + f" | {phases_before['model']}'s phases (ms a batch): "
                      + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()), flush=True)
        results["throughput"] = _throughput(server, rows, args, reference)
        print(f"[bench serve] throughput, {args.clients} gRPC client processes x batch {args.throughput_batch}: "
              f"{results['throughput']['ensemble_rows_per_s']:,.0f} rows/s ensemble, "
              f"{results['throughput']['in_process_rows_per_s']:,.0f} rows/s in-process (one thread)", flush=True)
        time.sleep(0.5)
        served_cache = cache_stats(cfg.paths.export)
        results["served_cache"] = {k: served_cache[k] for k in ("model", "instances", "hits", "misses", "evictions",
                                                                "hit_rate")}
    finally:
        server.stop()
    results["cache_offline"] = _offline_hit_rates(cfg, reference, rows)
    served_cache = results["served_cache"]
    print(f"[bench serve] served LRU cache (fraction {cfg.export.cache_fraction}) of {served_cache['model']}, "
          f"{served_cache['instances']} instance(s) each warming its own: hit rate "
          f"{served_cache['hit_rate']:.3f} (repeated requests); steady state on "
          f"{results['cache_offline']['rows']:,} train rows: " + ", ".join(
              f"{k} {v:.3f}" for k, v in results["cache_offline"].items() if k != "rows"), flush=True)
    if args.json:
        write_json(args.json, results)
    return results


def _prepare(cfg):
    import dataclasses

    from export.inprocess import InProcessModel
    from export.repository import raw_columns, write_repository
    from pipeline.data.raw_folder import RawDataset
    from pipeline.device import resolve_device
    from pipeline.etl.workflow import Workflow
    from pipeline.modules.models import ModelSizes, build_model
    from pipeline.schema import Schema
    from pipeline.stages.data import run as make_data
    from pipeline.stages.etl import run as run_etl
    from pipeline.stages.export import model_options
    from pipeline.stages.serve import sample_rows

    etl_cfg = dataclasses.replace(cfg, device="auto")  # the GPU's model needs no cuDF: pandas where it is missing
    make_data(etl_cfg)
    run_etl(etl_cfg)  # always: the raw data may have just been rebuilt
    schema = Schema.load(cfg.paths.schema)
    device = resolve_device(cfg.device).kind  # a GPU model is served by GPU instances (export.instance_kind=auto)
    model = build_model(cfg.train.model, schema, ModelSizes.from_train_config(cfg.train, device), seed=cfg.seed)
    model = model.to(device).eval()
    raw = raw_columns(RawDataset.load(cfg.paths.raw), cfg.data.list_separator)
    exported = write_repository(model, schema, cfg.paths.workflow, raw, cfg.paths.export, model_options(cfg))
    reference = InProcessModel(model, schema, Workflow.load(cfg.paths.workflow))
    return reference, sample_rows(cfg, 1 << 30), exported


def _timed_in_turn(fns: dict, repeats: int, block: int = 10) -> dict[str, dict]:
    """p50 / p99 of ``repeats`` calls of each function, in blocks of ``block`` calls taken in turn: on a
    shared machine a change of load falls on all of them alike, and each block runs as warm as a loop of
    its own (the first call of a block, after the others ran, is the only cold one)."""
    import time

    import numpy as np

    for fn in fns.values():
        for _ in range(min(10, repeats)):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    while len(times[next(iter(fns))]) < repeats:
        for name, fn in fns.items():
            for _ in range(min(block, repeats - len(times[name]))):
                t = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t) * 1000)
    return {name: {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)), "requests": repeats}
            for name, ms in times.items()}


def _forward_only(reference, frame):
    """The model's forward on features computed beforehand: the in-process time without the workflow."""
    import torch

    dense, kjt = reference.features(frame)

    def forward():
        with torch.inference_mode():
            return torch.sigmoid(reference.model(dense, kjt)).cpu()  # the answer on the host, as served

    return forward


def _model_stats(client) -> dict[str, dict[str, int]]:
    stats = client.inference_statistics()
    out = {}
    for model in stats["model_stats"]:
        infer = model["inference_stats"]
        out[model["name"]] = {
            "count": int(infer["success"].get("count", 0)),
            "queue": int(infer["queue"].get("ns", 0)),
            "compute": int(infer["compute_input"].get("ns", 0)) + int(infer["compute_infer"].get("ns", 0))
            + int(infer["compute_output"].get("ns", 0)),
            "model": int(infer["compute_infer"].get("ns", 0)),
            "total": int(infer["success"].get("ns", 0)),
        }
    return out


def _per_batch(before: dict, after: dict) -> dict[str, float]:
    """Per batch the lookup model executed between two :func:`~export.repository.cache_stats`, ms: the host time of
    each of its phases (the store's refresh, inputs read, preprocess, lookup, dense, outputs made)."""
    batches = after["batches"] - before["batches"]
    if batches <= 0:
        return {}
    return {phase: (ns - before["phases_ns"].get(phase, 0)) / batches / 1e6 for phase, ns in after["phases_ns"].items()}


def _per_request(before: dict, after: dict, models: list[str]) -> dict[str, float]:
    """Per request, ms: each of ``models``' compute (its inputs in, its ``execute``, its outputs out), the part
    in its ``execute`` alone (``model``), its queue; and the whole time in the server of the entry clients call
    (``ensemble``: one of ``models`` where the export is fused, else the Triton ensemble of them)."""
    out = {}
    for name in dict.fromkeys([*models, "ensemble"]):  # the entry last, once
        if name not in after:
            continue
        count = after[name]["count"] - before.get(name, {}).get("count", 0)
        if count <= 0:
            continue
        ms = {key: (after[name][key] - before.get(name, {}).get(key, 0)) / count / 1e6 for key in after[name]}
        if name in models:
            out[name] = ms["compute"]
            out[f"{name} model"] = ms["model"]
            out[f"{name} queue"] = ms["queue"]
        if name == "ensemble":
            out["ensemble (server side)"] = ms["total"]
    return out


def _throughput(server, rows, args, reference) -> dict:
    """Rows/s through the server with ``args.clients`` client processes (each its own Python and gRPC connection,
    as separate users are: threads of one process would share its interpreter), each sending its requests of
    ``args.throughput_batch`` rows in turn, counted over the same ``args.seconds`` window; then the in-process
    model on one thread over the same rows."""
    import multiprocessing
    import threading
    import time

    from export.client import Client

    batch = args.throughput_batch
    frames = [rows.iloc[i: i + batch] for i in range(0, min(len(rows), batch * 64), batch)]
    with Client(server.grpc_url, "grpc") as client:
        requests = [(client.tensors(f), len(f)) for f in frames]
    context = multiprocessing.get_context("spawn")  # no fork of a process that holds gRPC and torch threads
    ready, window, results = context.Barrier(args.clients + 1), context.Array("d", 2), context.Queue()
    workers = [context.Process(target=_client_process, daemon=True,
                               args=(server.grpc_url, requests[k:] + requests[:k], ready, window, results))
               for k in range(args.clients)]
    for worker in workers:
        worker.start()
    try:
        try:
            ready.wait(timeout=300)  # every client connected and answered once
            window[0] = time.time() + 0.5
            window[1] = window[0] + args.seconds
            ready.wait(timeout=60)
        except threading.BrokenBarrierError:
            pass  # a client failed: its error is in the results
        counts = [results.get(timeout=args.seconds + 120) for _ in workers]
    finally:
        for worker in workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.kill()
    errors = [c for c in counts if isinstance(c, str)]
    if errors:
        raise RuntimeError(f"throughput run: {errors[0]}")
    served = sum(counts) / args.seconds
    t = time.perf_counter()
    local_rows = 0
    while time.perf_counter() - t < min(args.seconds, 5.0):
        reference.predict(frames[local_rows // batch % len(frames)])
        local_rows += batch
    local = local_rows / (time.perf_counter() - t)
    return {"clients": args.clients, "client_processes": True, "batch": batch, "ensemble_rows_per_s": served,
            "in_process_rows_per_s": local}


def _client_process(url: str, requests: list, ready, window, results) -> None:
    """One throughput client: sends ``requests`` (``(tensors, rows)``) in turn and puts the rows answered within the
    window the parent sets (``window``: start and end, ``time.time()``) on ``results``, or its error as text."""
    import time

    from export.client import Client

    try:
        with Client(url, "grpc") as client:
            client.infer(requests[0][0])
            ready.wait(timeout=300)
            ready.wait(timeout=60)
            start, end = window[0], window[1]
            answered, i = 0, 0
            while time.time() < end:
                tensors, n = requests[i % len(requests)]
                client.infer(tensors)
                if start <= time.time() <= end:
                    answered += n
                i += 1
        results.put(answered)
    except BaseException as err:  # noqa: BLE001 - the parent reports it
        results.put(f"{type(err).__name__}: {err}")
        ready.abort()


def _offline_hit_rates(cfg, reference, rows) -> dict[str, float]:
    """Steady-state LRU / LFU hit rates at several cache sizes, computed without a server.

    The traffic is the raw train rows in order (their categorical values are Zipf-distributed) in
    batches of 64; the first half warms the cache, the hit rate is over the second half.
    """
    from export.lookup import EmbeddingLookup, LookupConfig
    from export.preprocess import Preprocessor
    from export.repository import artifacts_dir, lookup_dir
    from pipeline.stages.serve import sample_rows

    export = cfg.paths.export
    preprocess = Preprocessor.load(artifacts_dir(export))
    traffic = sample_rows(cfg, 1 << 30, split="train")
    half = len(traffic) // 2
    # batches of 64 rows, none across the half (a multi-hot batch's ids are cut by its lengths, not by rows)
    starts = [*range(0, half, 64), *range(half, len(traffic), 64)]
    ends = [min(s + 64, half if s < half else len(traffic)) for s in starts]
    batches = [preprocess.tensors(reference.workflow.transform(traffic.iloc[s:e])) for s, e in zip(starts, ends)]
    warming = sum(s < half for s in starts)
    layout = LookupConfig.load(lookup_dir(export) / "1" / "layout.json")
    out = {"rows": len(traffic)}
    for policy in ("lru", "lfu"):
        for fraction in (0.05, 0.25):
            lookup = EmbeddingLookup(lookup_dir(export) / "store", layout, policy, fraction, min_cache_rows=0)
            warm = lookup.stats()
            for k, t in enumerate(batches):
                if k == warming:
                    warm = lookup.stats()
                lookup(t.get("CATEGORICAL_IDS"), t.get("MULTIHOT_IDS"), t.get("MULTIHOT_LENGTHS"))
            done = lookup.stats()
            hits, misses = done["hits"] - warm["hits"], done["misses"] - warm["misses"]
            out[f"{policy}@{fraction}"] = hits / (hits + misses)
    return out
