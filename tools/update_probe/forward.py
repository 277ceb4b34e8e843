"""The pooled forward in its slot-major order (embedding_forward.cu) against batch-major (forward_bm.cu): one-hot and
20-hot, uniform and Zipf, the bench's tables (26 x 1M..10M rows, dim 128, fp32), batch 65536; the same result."""
from pathlib import Path

import torch

from pipeline.bench.embedding import _geometric, batch_of_ids, median_ms
from pipeline.kernels._launch import i32, launch, ptr
from pipeline.kernels.embedding import TablePacking, launcher
from pipeline.modules.configs import TableConfig

SRC = str(Path(__file__).resolve().parent / "forward_bm.cu")
B = 65536
rows = _geometric(1_000_000, 10_000_000, 26)
packing = TablePacking.build([TableConfig(f"t{i}", r, 128, [f"C{i}"]) for i, r in enumerate(rows)])
weights = torch.empty(packing.total_elements, device="cuda").uniform_(-0.01, 0.01)
slots = launcher.SlotArrays.from_packing(packing, "cuda")
dev = torch.device("cuda")
for ids in ("uniform", "zipf"):
    for hot in (1, 20):
        ind, off = batch_of_ids(torch, rows, B, hot, 0, ids)
        out = torch.empty(B, slots.total_dim, device="cuda")
        groups = slots.num_slots * ((B + 7) // 8)
        plain = median_ms(torch, lambda: launcher.pooled_forward(weights, slots, ind, off, B), 20)
        bm = median_ms(torch, lambda: launch(
            SRC, "forward_batch_major_f32", dev, (groups + 7) // 8, 256,
            [ptr(weights), ptr(slots.weight_offsets), ptr(slots.output_offsets), ptr(slots.mean), ptr(ind), ptr(off),
             i32(slots.num_slots), i32(B), i32(8), i32(5), i32(1), i32(1), ptr(out)]), 20)
        same = torch.equal(launcher.pooled_forward(weights, slots, ind, off, B), out)
        print(f"forward {ids} {hot}-hot: slot-major {plain:.3f} ms, batch-major {bm:.3f} ms | same result: {same}",
              flush=True)
