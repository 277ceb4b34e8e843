"""Loader throughput (samples/s) on Criteo-shaped processed data, against simpler readers, same run.

The data: a processed split written directly in the ETL's format (label, 13 float32 continuous,
26 int32 categorical codes with Criteo-like cardinalities, row groups of 65,536 rows, random
values) under ``<workdir>/bench/loader-<rows>/``, made once and reused; or ``--data FOLDER``, a split
the ETL wrote (e.g. ``data/synthetic/processed/train``).

Measured, each over the whole split, the consumer doing nothing with the batches:

* ``pyarrow read_table``: the files read whole by pyarrow with all its threads, no batching: the
  decoding floor a loader builds on;
* ``per-row Dataset + DataLoader``: a map-style ``torch`` Dataset returning one row's tensors,
  batched by ``DataLoader``'s default collate (on ``--naive-rows`` rows): the common first try;
* ``Loader`` on the CPU, in order and shuffled; and on the GPU (``device=cuda``, shuffled, the
  batches waited on) when one is usable and the device setting is not ``cpu``;
* on a GPU where cuDF imports, the same with ``reader="cudf"`` (row groups decoded by cuDF into
  GPU memory), and its floor ``cudf read_parquet``: the files read whole into GPU memory, synchronized.

    python -m pipeline bench loader                            # 2M rows, batch 4096
    python -m pipeline bench loader --rows 20000000 --batch-size 65536 --device cuda
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=2_000_000, help="rows of the synthetic split")
    parser.add_argument("--batch-size", type=int, default=4096, help="samples per batch")
    parser.add_argument("--data", metavar="FOLDER", help="a processed split folder to read instead of synthetic data")
    parser.add_argument("--read-threads", type=int, default=0, help="loader reader threads (0: the loader's default)")
    parser.add_argument("--epochs", type=int, default=2, help="passes per loader measurement (the best is reported)")
    parser.add_argument("--naive-rows", type=int, default=100_000, help="rows read by the per-row baseline")


def run(args: argparse.Namespace, cfg) -> dict:
    import os
    import platform
    import time
    from pathlib import Path

    import torch

    from pipeline.device import resolve_device
    from pipeline.loader import Loader
    from pipeline.loader.cudf_read import cudf_problem
    from pipeline.loader.synthetic import criteo_schema, write_processed
    from pipeline.schema import Schema

    if args.data:
        folder = Path(args.data)
    else:
        root = Path(cfg.workdir) / "bench" / f"loader-{args.rows}"
        folder = root / "train"
        if not (root / "schema.json").is_file() or Schema.load(root / "schema.json").rows.get("train") != args.rows:
            print(f"[bench loader] writing {args.rows:,} synthetic processed rows to {root} ...", flush=True)
            start = time.perf_counter()
            files = max(1, args.rows // 2_000_000)
            write_processed(root, criteo_schema(size=0.01), {"train": args.rows}, files_per_split=files, seed=cfg.seed)
            print(f"[bench loader] written in {time.perf_counter() - start:.1f} s", flush=True)
    device = resolve_device(cfg.device)
    threads = {"read_threads": args.read_threads} if args.read_threads else {}
    probe = Loader(folder, args.batch_size, **threads)
    rows, schema = probe.total_rows, probe.schema
    print(
        f"[bench loader] {rows:,} rows, {len(probe.files)} files, {len(schema.continuous)} continuous, "
        f"{len(schema.sparse)} sparse; batch {args.batch_size}; {os.cpu_count()} CPU cores; "
        f"torch {torch.__version__}; {platform.processor() or platform.machine()}",
        flush=True,
    )

    cudf_missing = cudf_problem() if device.is_cuda else "no GPU"
    if device.is_cuda and cudf_missing:
        print(f"[bench loader] no cuDF measurements (cudf read_parquet, cudf reader): {cudf_missing}", flush=True)
    results: dict[str, float] = {}
    results["pyarrow read_table"] = _pyarrow_floor(probe.files, [c.name for c in schema.columns])
    if not cudf_missing:
        results["cudf read_parquet"] = _cudf_floor(probe.files, [c.name for c in schema.columns])
    results["per-row Dataset + DataLoader"] = _naive(probe.files[0], schema, args.batch_size, args.naive_rows)
    results["Loader cpu, in order"] = _loader_rate(Loader(folder, args.batch_size, **threads), args.epochs)
    results["Loader cpu, shuffled"] = _loader_rate(
        Loader(folder, args.batch_size, shuffle=True, **threads), args.epochs
    )
    results["Loader cpu, shuffled, no checks"] = _loader_rate(
        Loader(folder, args.batch_size, shuffle=True, validate=False, **threads), args.epochs
    )
    if device.is_cuda:
        results["Loader cuda, shuffled"] = _loader_rate(
            Loader(folder, args.batch_size, shuffle=True, device="cuda", **threads), args.epochs
        )
        if not cudf_missing:
            results["Loader cuda, shuffled, cudf reader"] = _loader_rate(
                Loader(folder, args.batch_size, shuffle=True, device="cuda", reader="cudf", **threads), args.epochs
            )
    else:
        print(f"[bench loader] no GPU measurement: {device.reason}", flush=True)

    base = results["per-row Dataset + DataLoader"]
    width = max(len(k) for k in results)
    print(f"\n{'reader':<{width}}  {'samples/s':>14}  {'vs per-row':>10}")
    for name, rate in results.items():
        print(f"{name:<{width}}  {rate:>14,.0f}  {rate / base:>9.1f}x")
    return results


def _loader_rate(loader, epochs: int) -> float:
    import time

    import torch

    best = 0.0
    with loader:
        for _ in range(epochs):
            start, samples = time.perf_counter(), 0
            for batch in loader:
                samples += batch.batch_size
            if loader.device.type == "cuda":
                torch.cuda.synchronize(loader.device)
            best = max(best, samples / (time.perf_counter() - start))
    return best


def _pyarrow_floor(files, columns) -> float:
    import time

    import pyarrow.parquet as pq

    start, rows = time.perf_counter(), 0
    for f in files:
        rows += pq.read_table(f, columns=columns).num_rows
    return rows / (time.perf_counter() - start)


def _cudf_floor(files, columns) -> float:
    """Rows/s of cuDF reading the files whole into GPU memory (after one untimed read that sets up CUDA)."""
    import time

    import cudf
    import torch

    cudf.read_parquet(str(files[0]), columns=columns, row_groups=[0])
    torch.cuda.synchronize()
    start, rows = time.perf_counter(), 0
    for f in files:
        frame = cudf.read_parquet(str(f), columns=columns)
        torch.cuda.synchronize()
        rows += len(frame)
        del frame
    return rows / (time.perf_counter() - start)


def _naive(path, schema, batch_size: int, rows: int) -> float:
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

    start, samples = time.perf_counter(), 0
    for d, s, y in DataLoader(Rows(), batch_size=batch_size, shuffle=True):
        samples += len(y)
    return samples / (time.perf_counter() - start)
