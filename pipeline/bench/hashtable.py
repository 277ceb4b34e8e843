"""Hash table of embedding ids: find and insert_or_assign keys/s by dim and load factor, against copy bandwidth.

    python -m pipeline bench hashtable                        # 64Mi slots, dims 8,64,128, loads 0.5,0.75,0.9
    python -m pipeline bench hashtable --dims 64 --loads 0.75 --batch 4194304
    python -m pipeline bench hashtable --device cpu           # the reference, at a small size

For each dim and load factor, a table (``pipeline.kernels.hashtable.HashTable``, policy lru) of
``--capacity`` slots is filled with random keys to the load factor, ``--batch`` keys per
insert_or_assign; then, median of ``--reps`` after warm-up (CUDA events on a GPU), rotating three
batches of ``--batch`` keys: ``find`` of keys all in the table, and ``insert_or_assign`` of keys half in
the table (their rows assigned) and half new (erased again after each timed call, untimed, so the load
stays). Bytes counted, the fewest this layout moves per key: find, the key, the bucket's 128 digests,
the matching key, the row read and written, the found flag; insert_or_assign, the key, the bucket's
digests, the slot's key and score written, the row read and written, the slot returned (the sort of the
batch is not counted); as a fraction of a device-to-device copy measured in the same run. On a GPU the
kernels run, and the plain-torch reference on the same GPU is timed as the baseline (``--no-baseline``
skips it); on the CPU the reference runs alone, by default at 64Ki slots and batches of 4096.
"""

from __future__ import annotations

import argparse
import statistics
import time

from pipeline.bench.arguments import integer, output_file

GOAL = {"dim": 64, "load": 0.75, "find_keys_per_s": 3e9}  # on an H200
SIZES = {"cuda": (1 << 26, 1 << 20), "cpu": (1 << 16, 4096)}  # default (capacity, batch) by device
WARMUP = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--capacity", type=integer(1), help="slots of each table, a multiple of 128 (default: 64Mi on a "
                                                     "GPU, 64Ki on the CPU)")
    parser.add_argument("--batch", type=integer(1), help="keys per call (default: 1Mi on a GPU, 4096 on the CPU)")
    parser.add_argument("--dims", default="8,64,128", help="row sizes (floats) to measure, comma separated")
    parser.add_argument("--loads", default="0.5,0.75,0.9", help="load factors to measure, comma separated")
    parser.add_argument("--reps", type=integer(1), default=20, help="timed repetitions per measurement (median)")
    parser.add_argument("--no-baseline", action="store_true", help="on a GPU, skip the plain-torch reference")
    parser.add_argument("--json", type=output_file, metavar="FILE", help="also write the figures as JSON")


def run(args: argparse.Namespace, cfg) -> dict:
    import torch

    from pipeline.device import DeviceError, resolve_device
    from pipeline.errors import UserError
    from pipeline.files import write_json
    from pipeline.kernels import kernels_problem
    from pipeline.kernels.hashtable import SLOTS

    device = resolve_device(cfg.device)
    if device.is_cuda and kernels_problem():
        raise DeviceError(f"bench hashtable on a GPU needs the CUDA kernels: {kernels_problem()}")
    capacity, batch = (args.capacity or SIZES[device.kind][0]), (args.batch or SIZES[device.kind][1])
    dims, loads = _numbers(args.dims, int, "--dims"), _numbers(args.loads, float, "--loads")
    if capacity <= 0 or capacity % SLOTS:
        raise UserError(f"--capacity: expected a positive multiple of {SLOTS}, got {capacity}")
    if batch <= 0 or args.reps <= 0 or min(dims) <= 0 or not all(0 < load <= 1 for load in loads):
        raise UserError(f"--batch, --reps and --dims: expected numbers > 0, --loads in (0, 1]; got --batch {batch}, "
                        f"--reps {args.reps}, --dims {args.dims}, --loads {args.loads}")
    torch.manual_seed(cfg.seed)
    clock = _Clock(torch, device.is_cuda)
    copy = _copy_bandwidth(torch, device.kind, clock)
    name = torch.cuda.get_device_name() if device.is_cuda else "CPU"
    print(f"[bench hashtable] {name} | {capacity:,} slots ({capacity // SLOTS:,} buckets of {SLOTS}), batch "
          f"{batch:,}, policy lru | {device.kind} copy {copy / 1e9:.1f} GB/s", flush=True)
    results = []
    for dim in dims:
        for load in loads:
            row = _measure(torch, device.kind, capacity, dim, load, batch, args, clock, copy)
            results.append(row)
            _print_row(row)
            if device.is_cuda:
                torch.cuda.empty_cache()  # the tables of this row are gone
    summary = {"device": name, "backend": "cuda" if device.is_cuda else "torch", "copy_gb_s": copy / 1e9,
               "capacity": capacity, "batch": batch, "reps": args.reps, "results": results, "goal": GOAL}
    goal = [r for r in results if (r["dim"], r["load"]) == (GOAL["dim"], GOAL["load"])]
    if device.is_cuda and goal:
        met = goal[0]["find_keys_per_s"] >= GOAL["find_keys_per_s"]
        print(f"[bench hashtable] goal {GOAL['find_keys_per_s'] / 1e9:.0f}G finds/s at dim {GOAL['dim']}, load "
              f"{GOAL['load']}: {'met' if met else 'missed'} ({goal[0]['find_keys_per_s'] / 1e9:.2f}G)", flush=True)
    if args.json:
        write_json(args.json, summary)
    return summary


def _numbers(text: str, kind, flag: str) -> list:
    from pipeline.errors import UserError

    try:
        values = [kind(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        values = []
    if not values:
        raise UserError(f"{flag}: expected comma-separated numbers, got {text!r}")
    return values


class _Clock:
    """Seconds of one call: CUDA events around it on a GPU, the wall clock on the CPU."""

    def __init__(self, torch, cuda: bool) -> None:
        self.torch, self.cuda = torch, cuda

    def median(self, fn, reps: int, before=None) -> float:
        """The median seconds of ``fn()`` over ``reps`` calls after ``WARMUP``, ``before()`` untimed ahead of each."""
        torch, times = self.torch, []
        for rep in range(WARMUP + reps):
            if before is not None:
                before()
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                seconds = start.elapsed_time(end) / 1e3
            else:
                begin = time.perf_counter()
                fn()
                seconds = time.perf_counter() - begin
            if rep >= WARMUP:
                times.append(seconds)
        return statistics.median(times)


def _copy_bandwidth(torch, device: str, clock: _Clock) -> float:
    """Bytes read + written per second by a copy of 4 GiB on a GPU (256 MiB on the CPU) within the device."""
    nbytes = (4 << 30) if device == "cuda" else (256 << 20)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    seconds = clock.median(lambda: dst.copy_(src), 10)
    return 2 * nbytes / seconds


class _Batches:
    """Three batches, handed out in turn."""

    def __init__(self, batches) -> None:
        self.batches, self.i = batches, 0

    def next(self):
        self.i = (self.i + 1) % len(self.batches)
        return self.batches[self.i]


def _random_keys(torch, n: int, device: str):
    return torch.randint(-(2**63), 2**63 - 1, (n,), dtype=torch.int64, device=device)


def _filled(torch, device: str, capacity: int, dim: int, load: float, batch: int):
    """A table of policy lru holding random keys in ``load`` of its slots."""
    from pipeline.kernels.hashtable import HashTable

    table = HashTable(capacity, dim, device, policy="lru")
    target = int(load * capacity)
    while (size := table.size()) < target:
        n = min(batch, target - size)
        table.insert_or_assign(_random_keys(torch, n, device), torch.randn(n, dim, device=device))
    return table


def _measure(torch, device: str, capacity: int, dim: int, load: float, batch: int, args, clock: _Clock,
             copy: float) -> dict:
    from pipeline.kernels.hashtable import HashTable

    table = _filled(torch, device, capacity, dim, load, batch)
    present = table.export()[0]

    def some_present(n: int):
        return present[torch.randint(0, present.numel(), (n,), device=device)]

    finds = _Batches([some_present(batch) for _ in range(3)])
    half = batch // 2
    inserts = _Batches([(torch.cat([some_present(batch - half), _random_keys(torch, half, device)]),
                         torch.randn(batch, dim, device=device)) for _ in range(3)])
    row = {"dim": dim, "load": load, "measured_load": table.size() / capacity}
    tables = [("", table)]
    if device == "cuda" and not args.no_baseline:
        baseline = HashTable(capacity, dim, device, policy="lru", backend="torch")
        baseline.load_state_dict(table.state_dict())
        tables.append(("reference_", baseline))
    for prefix, t in tables:
        row[f"{prefix}find_keys_per_s"] = batch / clock.median(lambda t=t: t.find(finds.next()), args.reps)
        row[f"{prefix}insert_or_assign_keys_per_s"] = batch / clock.median(
            lambda t=t: t.insert_or_assign(*inserts.next()), args.reps,
            before=lambda t=t: t.erase(inserts.batches[inserts.i][0][batch - half:]))  # the last call's new keys
    find_bytes, insert_bytes = 8 + 128 + 8 + 8 * dim + 1, 8 + 128 + 16 + 8 * dim + 8
    row["find_bytes_per_key"], row["insert_bytes_per_key"] = find_bytes, insert_bytes
    row["find_fraction_of_copy"] = row["find_keys_per_s"] * find_bytes / copy
    row["insert_fraction_of_copy"] = row["insert_or_assign_keys_per_s"] * insert_bytes / copy
    return row


def _rate(keys_per_s: float) -> str:
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if keys_per_s >= scale:
            return f"{keys_per_s / scale:.2f}{unit}"
    return f"{keys_per_s:.0f}"


def _print_row(row: dict) -> None:
    line = (f"  dim {row['dim']:>4}  load {row['load']:.2f} ({row['measured_load']:.3f}) | find "
            f"{_rate(row['find_keys_per_s'])} keys/s ({100 * row['find_fraction_of_copy']:.0f}% of copy) | "
            f"insert_or_assign {_rate(row['insert_or_assign_keys_per_s'])} keys/s "
            f"({100 * row['insert_fraction_of_copy']:.0f}% of copy)")
    if "reference_find_keys_per_s" in row:
        line += (f" | reference: find {_rate(row['reference_find_keys_per_s'])}, insert_or_assign "
                 f"{_rate(row['reference_insert_or_assign_keys_per_s'])} keys/s")
    print(line, flush=True)
