"""Rows between device memory and host memory on a GPU: the row kernel through mapped host memory against the copy
engines, by kind of host memory, order of the rows and direction, alone and both directions at once.

What the host-cached tables (``pipeline.modules.cached_collection``) move each step: ``--moved`` random distinct rows
of ``--dim`` float32 out of a host table of ``--rows`` rows, with one float32 of optimizer state each. For each kind
of host memory (pageable memory page-locked in place, ``pipeline.kernels.host_rows.map_to_device``; the same with
transparent huge pages asked for, ``madvise``; ``cudaHostAlloc``'s mapped memory), the median of ``--reps`` timings
(CUDA events) of ``host_rows.copy_rows``: the rows in (host -> device slots) and out, in random order and sorted by
host address, the state alone, and in and out at once on two streams; and for pageable memory the copy engines
moving as many bytes contiguously (``copy_``), each way and both at once.

    python tools/host_copies.py --rows 4000000
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import time


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4_000_000, help="rows of the host table")
    parser.add_argument("--dim", type=int, default=128, help="float32 values a row")
    parser.add_argument("--moved", type=int, default=160_000, help="rows moved each way")
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions (median)")
    parser.add_argument("--json", metavar="FILE", help="also write the timings as JSON")
    args = parser.parse_args(argv)

    import numpy as np
    import torch
    from cupy.cuda import runtime

    from pipeline.bench.embedding import median_ms
    from pipeline.kernels.host_rows import copy_rows, map_to_device

    device = torch.device("cuda")
    rows, dim, n = args.rows, args.dim, args.moved
    size = rows * dim * 4

    def timed(fn) -> float:
        return median_ms(torch, fn, args.reps)

    def pageable():
        return torch.empty(rows, dim), None

    def huge_pages():
        memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        memory.madvise(mmap.MADV_HUGEPAGE)
        return torch.from_numpy(np.frombuffer(memory, dtype=np.float32).reshape(rows, dim)), memory

    def host_alloc():
        address = runtime.hostAlloc(size, 0x01 | 0x02)  # cudaHostAllocPortable | cudaHostAllocMapped
        array = np.ctypeslib.as_array((ctypes.c_float * (rows * dim)).from_address(address)).reshape(rows, dim)
        return torch.from_numpy(array), address

    slots = torch.randn(n, dim, device=device)
    staging = torch.empty(n, dim, device=device)
    state = torch.randn(n, device=device)
    at = torch.arange(n, device=device)
    streams = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def both(out, into) -> None:
        current = torch.cuda.current_stream()
        for stream in streams:
            stream.wait_stream(current)
        with torch.cuda.stream(streams[0]):
            out()
        with torch.cuda.stream(streams[1]):
            into()
        for stream in streams:
            current.wait_stream(stream)

    results = []
    for kind, make in (("pageable", pageable), ("huge pages", huge_pages), ("cudaHostAlloc", host_alloc)):
        began = time.perf_counter()
        host, keep = make()
        host.uniform_()
        filled = time.perf_counter()
        if kind != "cudaHostAlloc" and not map_to_device(host, device):
            print(f"{kind}: could not be mapped for the GPU", flush=True)
            continue
        print(f"{kind}: filled in {filled - began:.1f} s, mapped in {time.perf_counter() - filled:.1f} s", flush=True)
        host_state = torch.rand(rows)
        map_to_device(host_state, device)
        random = torch.randperm(rows, device=device)[:n]
        ordered = torch.sort(random).values
        moved = n * dim * 4 / 1e6

        def record(what: str, ms: float, megabytes: float = moved) -> None:
            results.append({"memory": kind, "what": what, "ms": ms, "GB/s": megabytes / ms})
            print(f"{kind:14} {what:40} {ms:7.3f} ms {megabytes / ms:6.1f} GB/s", flush=True)

        record("in, random order", timed(lambda: copy_rows(slots, at, host, random)))
        record("in, sorted", timed(lambda: copy_rows(slots, at, host, ordered)))
        record("out, random order", timed(lambda: copy_rows(host, random, slots, at)))
        record("out, sorted", timed(lambda: copy_rows(host, ordered, slots, at)))
        record("state in, sorted (4 B a row)", timed(lambda: copy_rows(state, at, host_state, ordered)), n * 4 / 1e6)
        record("state out, sorted (4 B a row)", timed(lambda: copy_rows(host_state, ordered, state, at)), n * 4 / 1e6)
        other = ordered.flip(0)
        record("in and out at once, sorted",
               timed(lambda: both(lambda: copy_rows(host, ordered, slots, at),
                                  lambda: copy_rows(staging, at, host, other))), 2 * moved)
        if kind == "pageable":
            first, second = host[:n], host[n: 2 * n]
            record("copy engine in, contiguous", timed(lambda: staging.copy_(first, non_blocking=True)))
            record("copy engine out, contiguous", timed(lambda: first.copy_(slots, non_blocking=True)))
            record("copy engines in and out at once",
                   timed(lambda: both(lambda: first.copy_(slots, non_blocking=True),
                                      lambda: staging.copy_(second, non_blocking=True))), 2 * moved)
        host = host_state = None  # the mapping goes with the tensors
        torch.cuda.synchronize()
        if kind == "cudaHostAlloc":
            runtime.freeHost(keep)

    print(f"\n{'memory':14} {'what':40} {'ms':>7}    {'GB/s':>6}")
    for r in results:
        print(f"{r['memory']:14} {r['what']:40} {r['ms']:7.3f}    {r['GB/s']:6.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "dim": dim, "moved": n, "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
