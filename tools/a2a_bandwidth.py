"""All-to-all bandwidth between the GPUs of one machine, the exchange the sharded embeddings use.

Each rank sends ``--mb`` MB to every other rank (and keeps its own part) with
``all_to_all_single``, as the pooled-vector exchange does; the time per exchange (CUDA events, median
of ``--iters``) and the bytes each rank sent to the others per second are printed per size and dtype,
beside a plain device-to-device copy between two GPUs in one process (the link's ceiling).
NCCL's tuning variables (``NCCL_MIN_NCHANNELS``, ``NCCL_PROTO`` ...) apply as usual: run it once per
setting to compare.

    python3 tools/a2a_bandwidth.py --mb 16,64,218
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _rank(rank: int, world: int, sizes_mb: list[float], iters: int) -> list[dict]:
    import torch
    import torch.distributed as dist

    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for mb in sizes_mb:
            per_peer = int(mb * 2**20) // dtype.itemsize
            send = torch.randn(per_peer * world, device=f"cuda:{rank}").to(dtype)
            recv = torch.empty_like(send)
            times = []
            for i in range(iters + 2):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                dist.barrier()
                start.record()
                dist.all_to_all_single(recv, send)
                end.record()
                end.synchronize()
                if i >= 2:
                    times.append(start.elapsed_time(end) / 1e3)
            seconds = statistics.median(times)
            sent = per_peer * dtype.itemsize * (world - 1)
            out.append({"dtype": str(dtype).removeprefix("torch."), "mb_per_peer": mb, "ms": 1e3 * seconds,
                        "gb_per_s_sent": sent / seconds / 1e9})
    return out


def _copy_ceiling(mb: float, iters: int) -> float:
    import torch

    if torch.cuda.device_count() < 2:
        return float("nan")
    src = torch.empty(int(mb * 2**20), dtype=torch.uint8, device="cuda:0")
    dst = torch.empty_like(src, device="cuda:1")
    times = []
    for _ in range(iters + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        times.append(start.elapsed_time(end) / 1e3)
    return src.numel() / statistics.median(times[2:]) / 1e9


def main(argv: list[str] | None = None) -> int:
    import os

    import torch

    from pipeline.distributed.spawn import spawn

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", default="16,64,218", help="MB each rank sends to each peer, comma separated")
    parser.add_argument("--world", type=int, default=0, help="ranks (default: every GPU)")
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args(argv)
    world = args.world or torch.cuda.device_count()
    if world < 2:
        print("needs 2 or more GPUs", file=sys.stderr)
        return 2
    sizes = [float(x) for x in args.mb.split(",") if x]
    nccl = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
    print(f"{world} GPUs, torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
          f"env {nccl}")
    print(f"device-to-device copy GPU0 -> GPU1, {max(sizes):g} MB: {_copy_ceiling(max(sizes), args.iters):.1f} GB/s")
    rows = spawn(_rank, world, "nccl", args=(sizes, args.iters))
    print(f"{'dtype':>9} {'MB/peer':>8} {'ms':>8} {'GB/s sent per rank':>19}")
    for i, r in enumerate(rows[0]):
        slowest = max(rank_rows[i]["ms"] for rank_rows in rows)
        print(f"{r['dtype']:>9} {r['mb_per_peer']:>8g} {slowest:>8.3f} {r['gb_per_s_sent'] * r['ms'] / slowest:>19.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
