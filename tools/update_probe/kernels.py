"""Device time of each kernel of a training step's table work (forward, then backward + update), by update kernel:
the bench's tables (26 x 1M..10M rows, dim 128, fp32, row-wise Adagrad), batch 65536, torch.profiler over 6 steps."""
import sys
from collections import defaultdict

import torch

from pipeline.bench.embedding import _geometric, batch_of_ids
from pipeline.kernels.embedding import CudaBackend, TablePacking, launcher
from pipeline.modules.configs import EmbeddingOptimizerConfig, TableConfig

rows = _geometric(1_000_000, 10_000_000, 26)
packing = TablePacking.build([TableConfig(f"t{i}", r, 128, [f"C{i}"]) for i, r in enumerate(rows)])
weights = torch.empty(packing.total_elements, device="cuda").uniform_(-0.01, 0.01)
opt = EmbeddingOptimizerConfig("adagrad", lr=0.01)
state = {n: torch.zeros(s, device="cuda") for n, s in opt.state_shapes(packing.total_rows, packing.total_elements).items()}
backend = CudaBackend()
kernels = sys.argv[1].split(",")
for ids in ("uniform", "zipf"):
    for hot in (1, 20):
        batches = [batch_of_ids(torch, rows, 65536, hot, s, ids) for s in range(3)]
        grad = torch.randn(65536, packing.total_dim, device="cuda")
        for name in kernels:
            launcher.UPDATE_KERNEL = name

            def step(i):
                ind, off = batches[i % 3]
                backend.forward(weights, packing, ind, off, 65536)
                backend.backward_update(weights, state, packing, ind, off, 65536, grad, opt, opt.lr, 1)

            for i in range(3):
                step(i)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(10):
                step(i)
            end.record()
            end.synchronize()
            wall = start.elapsed_time(end) / 10
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for i in range(6):
                    step(i)
                torch.cuda.synchronize()
            by = defaultdict(float)
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    by[e.name[:60]] += e.device_time_total / 1e3 / 6
            parts = sorted(by.items(), key=lambda kv: -kv[1])
            print(f"{ids} {hot:>2}-hot {name}: step {wall:.3f} ms (events, 10 back to back), kernels {sum(by.values()):.3f} ms | "
                  + ", ".join(f"{k} {v:.3f}" for k, v in parts[:12]), flush=True)
        batches = grad = None
        torch.cuda.empty_cache()
