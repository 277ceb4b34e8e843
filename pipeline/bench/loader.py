"""Loader throughput (samples/s) on Criteo-shaped processed data, against simpler readers, same run.

The data: a processed split written directly in the ETL's format (label, 13 float32 continuous,
26 int32 categorical codes with Criteo-like cardinalities, row groups of 65,536 rows, random
values, pages compressed as ``etl.compression`` says) under ``<workdir>/bench/loader-<rows>-<compression>/``,
made once and reused; or ``--data FOLDER``, a split the ETL wrote (e.g. ``data/synthetic/processed/train``).

Measured, each over the whole split, the consumer doing nothing with the batches:

* ``pyarrow read_table``: the files read whole by pyarrow with all its threads, no batching: the
  decoding floor a loader builds on;
* ``per-row Dataset + DataLoader``: a map-style ``torch`` Dataset returning one row's tensors,
  batched by ``DataLoader``'s default collate (on ``--naive-rows`` rows): the common first try;
* ``Loader host side``: what the loader does on the host for a GPU, every window of a shuffled epoch
  read, checked and packed into its block by ``read_threads`` reader threads (on a GPU the rest,
  the copy, the shuffle and the batches, is the device's work and a few Python objects per batch);
* ``Loader`` on the CPU, in order and shuffled; and on the GPU (``device=cuda``, shuffled, the
  batches waited on) when one is usable and the device setting is not ``cpu``;
* on a GPU, the loader with ``reader="pyarrow"`` and, where cuDF imports, with ``reader="cudf"`` (a
  window's row groups decoded by cuDF into GPU memory in one call: what ``reader="auto"``, the default,
  picks there), and its floor ``cudf read_parquet``: the files read whole into GPU memory, synchronized.

Beside samples/s: the process's CPU time per batch (all its threads: decoding, packing, the
producer), and, for the shuffled loader on the device, how it shares the GIL with a training
thread: a Python thread spinning beside it (the worst case of a training thread) is timed, and
the share of its time it waited for the GIL (neither running nor waiting for a CPU, from Linux's
per-thread ``schedstat``) is what the loader's threads held; the loader's rate beside it is
shown too; and the Python calls per batch in all of the process's threads (the host work that
holds the GIL). On a GPU the copies to the device per window are counted with ``torch.profiler``.

    python -m pipeline bench loader                            # 2M rows, batch 4096
    python -m pipeline bench loader --rows 20000000 --batch-size 65536 --device cuda
    python -m pipeline bench loader --data /tmp/w/synthetic/processed/train --batch-size 65536 --device cuda
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass

from pipeline.bench.arguments import integer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=integer(1), default=2_000_000, help="rows of the synthetic split")
    parser.add_argument("--batch-size", type=integer(1), default=4096, help="samples per batch")
    parser.add_argument("--data", metavar="FOLDER", help="a processed split folder to read instead of synthetic data")
    parser.add_argument("--read-threads", type=integer(0), default=0, help="loader reader threads (0: the loader's default)")
    parser.add_argument("--window-rows", type=integer(0), default=0, help="loader window rows (0: the loader's default)")
    parser.add_argument("--epochs", type=integer(1), default=2, help="passes per loader measurement (the best is reported)")
    parser.add_argument("--naive-rows", type=integer(1), default=100_000, help="rows read by the per-row baseline")


def run(args: argparse.Namespace, cfg) -> dict:
    with contextlib.ExitStack() as held:  # the split's lock, where the bench makes its own
        return _measure(args, cfg, held)


def _measure(args: argparse.Namespace, cfg, held: contextlib.ExitStack) -> dict:
    import os
    import platform
    import time
    from pathlib import Path

    import torch

    from pipeline.device import resolve_device
    from pipeline.files import FileLock
    from pipeline.loader import Loader
    from pipeline.loader.cudf_read import cudf_problem
    from pipeline.loader.synthetic import criteo_schema, write_processed
    from pipeline.schema import Schema

    if args.data:
        folder = Path(args.data)
    else:
        root = Path(cfg.workdir) / "bench" / f"loader-{args.rows}-{cfg.etl.compression}"
        folder = root / "train"
        # held while this bench writes or reads the split: another bench of the same split rewrote its files under
        # this one's reads
        held.enter_context(FileLock(root.with_name(root.name + ".lock"), f"another bench loader reads or writes "
                                    f"{root} now: wait for it to end, or give this one another workdir"))
        if not (root / "schema.json").is_file() or Schema.load(root / "schema.json").rows.get("train") != args.rows:
            print(f"[bench loader] writing {args.rows:,} synthetic processed rows to {root} ...", flush=True)
            start = time.perf_counter()
            files = max(1, args.rows // 2_000_000)
            write_processed(root, criteo_schema(size=0.01), {"train": args.rows}, files_per_split=files, seed=cfg.seed,
                            compression=cfg.etl.compression)
            print(f"[bench loader] written in {time.perf_counter() - start:.1f} s", flush=True)
    device = resolve_device(cfg.device)
    settings = {k: v for k, v in (("read_threads", args.read_threads), ("window_rows", args.window_rows)) if v}
    probe = Loader(folder, args.batch_size, **settings)
    rows, schema = probe.total_rows, probe.schema
    print(
        f"[bench loader] {rows:,} rows, {len(probe.files)} files, {len(schema.continuous)} continuous, "
        f"{len(schema.sparse)} sparse; batch {args.batch_size}, windows of {probe.window_rows:,} rows, "
        f"{probe.read_threads} reader threads; {os.cpu_count()} CPU cores; "
        f"torch {torch.__version__}; {platform.processor() or platform.machine()}",
        flush=True,
    )

    cudf_missing = cudf_problem() if device.is_cuda else "no GPU"
    if device.is_cuda and cudf_missing:
        print(f"[bench loader] no cuDF measurements (cudf read_parquet, cudf reader): {cudf_missing}", flush=True)
    results: dict[str, Rate] = {}
    results["pyarrow read_table"] = _pyarrow_floor(probe.files, [c.name for c in schema.columns], args.batch_size)
    if not cudf_missing:
        results["cudf read_parquet"] = _cudf_floor(probe.files, [c.name for c in schema.columns], args.batch_size)
    if schema.multihot:  # its default collate stacks one-hot rows; lists need a collate of their own
        print(f"[bench loader] no per-row Dataset baseline: the split has multi-hot columns {schema.multihot}",
              flush=True)
    else:
        results["per-row Dataset + DataLoader"] = _naive(probe.files[0], schema, args.batch_size, args.naive_rows)
    results["Loader host side (read, check, pack)"] = _host_side(probe, args.epochs)
    results["Loader cpu, in order"] = _loader_rate(Loader(folder, args.batch_size, **settings), args.epochs)
    results["Loader cpu, shuffled"] = _loader_rate(
        Loader(folder, args.batch_size, shuffle=True, **settings), args.epochs
    )
    results["Loader cpu, shuffled, no checks"] = _loader_rate(
        Loader(folder, args.batch_size, shuffle=True, validate=False, **settings), args.epochs
    )
    target = "cpu"
    if device.is_cuda:
        target = "cuda"
        results["Loader cuda, shuffled, pyarrow reader"] = _loader_rate(
            Loader(folder, args.batch_size, shuffle=True, device="cuda", reader="pyarrow", **settings), args.epochs
        )
        if not cudf_missing:
            results["Loader cuda, shuffled, cudf reader"] = _loader_rate(
                Loader(folder, args.batch_size, shuffle=True, device="cuda", reader="cudf", **settings), args.epochs
            )
    else:
        print(f"[bench loader] no GPU measurement: {device.reason}", flush=True)

    base = results.get("per-row Dataset + DataLoader")
    width = max(len(k) for k in results)
    print(f"\n{'reader':<{width}}  {'samples/s':>14}  {'vs per-row':>10}  {'CPU ms/batch':>12}")
    for name, rate in results.items():
        versus = f"{rate.samples_per_s / base.samples_per_s:>9.1f}x" if base else f"{'-':>10}"
        print(f"{name:<{width}}  {rate.samples_per_s:>14,.0f}  {versus}  {rate.cpu_ms_per_batch:>12.2f}")

    figures = {name: rate.samples_per_s for name, rate in results.items()}
    figures |= {f"{name}, CPU ms/batch": rate.cpu_ms_per_batch for name, rate in results.items()}
    shared = _beside_a_python_thread(Loader(folder, args.batch_size, shuffle=True, device=target, **settings))
    if shared is not None:
        rate, blocked = shared
        print(f"\nLoader {target}, shuffled, beside a Python thread spinning: {rate:,.0f} samples/s; the thread "
              f"waited for the GIL {blocked:.1%} of the time")
        figures |= {f"Loader {target} beside a Python thread": rate, "GIL share held by the loader": blocked}
    calls = _python_calls_per_batch(Loader(folder, args.batch_size, shuffle=True, device=target, **settings))
    print(f"Python calls per batch (shuffled, {target}; the loader's threads and the consumer): {calls:,.0f}")
    figures[f"Python calls per batch, {target}"] = calls
    if device.is_cuda:
        copies = _copies_per_window(Loader(folder, args.batch_size, shuffle=True, device="cuda", reader="pyarrow",
                                           **settings))
        print(f"copies to the GPU per window (shuffled, cuda, pyarrow reader): {copies:.2f}")
        figures["copies to the GPU per window"] = copies
    return figures


@dataclass
class Rate:
    samples_per_s: float
    cpu_ms_per_batch: float
    """The process's CPU time (every thread) per batch of ``--batch-size`` samples."""


def _loader_rate(loader, epochs: int) -> Rate:
    import time

    import torch

    best = Rate(0.0, 0.0)
    with loader:
        for _ in range(epochs):
            start, cpu, samples = time.perf_counter(), time.process_time(), 0
            for batch in loader:
                samples += batch.batch_size
            if loader.device.type == "cuda":
                torch.cuda.synchronize(loader.device)
            rate = samples / (time.perf_counter() - start)
            if rate > best.samples_per_s:
                best = Rate(rate, _per_batch(time.process_time() - cpu, samples, loader.batch_size))
    return best


def _per_batch(cpu_seconds: float, samples: int, batch_size: int) -> float:
    return 1e3 * cpu_seconds * batch_size / max(samples, 1)


def _host_side(loader, epochs: int) -> Rate:
    """Every window of a shuffled epoch read, checked and packed as the loader's reader threads do for a GPU."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from pipeline.loader import plan
    from pipeline.loader.decode import find_files, open_split, read_window

    split = open_split(find_files(loader.files), loader.schema)
    groups = plan.group_order(split.groups, True, loader.seed, 0)
    shard = plan.plan_shard(groups, 0, 1, loader.batch_size, drop_last=False)
    windows = plan.windows(shard, loader.window_rows, loader.batch_size)
    segments = [plan.window_segments(shard, w.start, w.stop) for w in windows]
    best = Rate(0.0, 0.0)
    with ThreadPoolExecutor(loader.read_threads) as pool:
        for _ in range(epochs):
            start, cpu = time.perf_counter(), time.process_time()
            for _chunk in pool.map(lambda s: read_window(split, s), segments):
                pass
            rate = shard.rows / (time.perf_counter() - start)
            if rate > best.samples_per_s:
                best = Rate(rate, _per_batch(time.process_time() - cpu, shard.rows, loader.batch_size))
    return best


def _beside_a_python_thread(loader) -> tuple[float, float] | None:
    """(samples/s of one epoch, the share of time a spinning Python thread waited for the GIL), or ``None``
    where Linux's per-thread scheduler statistics are not readable."""
    import threading
    import time
    from pathlib import Path

    def times(tid: int) -> float:  # seconds on a CPU and waiting for one
        running, waiting, _ = Path(f"/proc/self/task/{tid}/schedstat").read_text().split()
        return (int(running) + int(waiting)) / 1e9

    try:
        times(threading.get_native_id())
    except (OSError, ValueError):
        return None
    stop, spun = threading.Event(), []

    def spin() -> None:
        tid, start = threading.get_native_id(), time.perf_counter()
        before, n = times(tid), 0
        while not stop.is_set():
            n += 1
        spun.append(1 - (times(tid) - before) / (time.perf_counter() - start))

    with loader:
        for _ in loader:  # the first epoch, untimed: the pinned buffers are made
            pass
        thread = threading.Thread(target=spin)
        thread.start()
        start, samples = time.perf_counter(), 0
        for batch in loader:
            samples += batch.batch_size
        if loader.device.type == "cuda":
            import torch

            torch.cuda.synchronize(loader.device)
        rate = samples / (time.perf_counter() - start)
        stop.set()
        thread.join()
    return rate, max(0.0, spun[0])


def _python_calls_per_batch(loader) -> float:
    """Python functions and builtins called per batch over one shuffled epoch, in every thread of the
    process (after an epoch that imports what the first use imports): the host's work that holds the GIL."""
    import itertools
    import sys
    import threading

    calls = itertools.count()

    def count(frame, event, arg) -> None:
        if event in ("call", "c_call"):
            next(calls)

    with loader:
        for _ in loader:
            pass
        batches = 0
        threading.setprofile(count)
        sys.setprofile(count)
        try:
            for _ in loader:
                batches += 1
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
    return next(calls) / batches


def _copies_per_window(loader) -> float:
    """Host-to-device copies per window over one shuffled epoch (after one that makes the pinned buffers)."""
    import math

    import torch
    from torch.profiler import ProfilerActivity, profile

    with loader:
        for _ in loader:
            pass
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in loader:
                pass
            torch.cuda.synchronize(loader.device)
    copies = sum("Memcpy HtoD" in event.name for event in prof.events())
    return copies / math.ceil(loader.rows_per_rank / loader.window_rows)


def _pyarrow_floor(files, columns, batch_size: int) -> Rate:
    import time

    import pyarrow.parquet as pq

    start, cpu, rows = time.perf_counter(), time.process_time(), 0
    for f in files:
        rows += pq.read_table(f, columns=columns).num_rows
    return Rate(rows / (time.perf_counter() - start), _per_batch(time.process_time() - cpu, rows, batch_size))


def _cudf_floor(files, columns, batch_size: int) -> Rate:
    """Rows/s of cuDF reading the files whole into GPU memory (after one untimed read that sets up CUDA)."""
    import time

    import cudf
    import torch

    cudf.read_parquet(str(files[0]), columns=columns, row_groups=[0])
    torch.cuda.synchronize()
    start, cpu, rows = time.perf_counter(), time.process_time(), 0
    for f in files:
        frame = cudf.read_parquet(str(f), columns=columns)
        torch.cuda.synchronize()
        rows += len(frame)
        del frame
    return Rate(rows / (time.perf_counter() - start), _per_batch(time.process_time() - cpu, rows, batch_size))


def _naive(path, schema, batch_size: int, rows: int) -> Rate:
    """A per-row map-style Dataset over a pandas frame, batched by DataLoader's default collate."""
    import time

    import pyarrow.parquet as pq
    import torch
    from torch.utils.data import DataLoader, Dataset

    frame = pq.read_table(path).slice(0, rows).to_pandas()
    dense = frame[schema.continuous].to_numpy("float32")
    sparse = frame[schema.sparse].to_numpy("int64")
    label = frame[schema.label].to_numpy("float32")

    class Rows(Dataset):
        def __len__(self) -> int:
            return len(label)

        def __getitem__(self, i: int):
            return torch.from_numpy(dense[i].copy()), torch.from_numpy(sparse[i].copy()), torch.tensor(label[i])

    start, cpu, samples = time.perf_counter(), time.process_time(), 0
    for d, s, y in DataLoader(Rows(), batch_size=batch_size, shuffle=True):
        samples += len(y)
    return Rate(samples / (time.perf_counter() - start), _per_batch(time.process_time() - cpu, samples, batch_size))
