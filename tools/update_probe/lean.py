"""Where the lean singles kernel's time goes (lean_ladder.cu): the singles of a batch updated by the ladder's kernels,
each adding one of the lean kernel's steps to the rows' traffic alone, and by the lean kernels themselves, each alone
on the same list; uniform and Zipf, one-hot and 20-hot; fp32 rows of dim 128 (the bench's tables)."""
from pathlib import Path

import torch

from pipeline.bench.embedding import _geometric, batch_of_ids, median_ms
from pipeline.kernels._launch import f32, i32, i64, launch, ptr, resident_blocks, u64
from pipeline.kernels.embedding import TablePacking, launcher
from pipeline.modules.configs import TableConfig

SRC = str(Path(__file__).resolve().parent / "lean_ladder.cu")
B = 65536
rows = _geometric(1_000_000, 10_000_000, 26)
packing = TablePacking.build([TableConfig(f"t{i}", r, 128, [f"C{i}"]) for i, r in enumerate(rows)])
weights = torch.empty(packing.total_elements, device="cuda").uniform_(-0.01, 0.01)
state = torch.zeros(packing.total_rows, device="cuda")
slots = launcher.SlotArrays.from_packing(packing, "cuda")
dev = torch.device("cuda")
sms = torch.cuda.get_device_properties(0).multi_processor_count
for ids in ("uniform", "zipf"):
    for hot in (1, 20):
        ind, off = batch_of_ids(torch, rows, B, hot, 0, ids)
        grad = torch.randn(B, packing.total_dim, device="cuda")
        keys, bags = launcher.sort_by_row(slots, ind, off, B)
        (skey, sbag, scount), _ = launcher.list_segments_apart(keys, bags)
        n = int(scount.item())
        key, bag = skey[:n].long(), sbag[:n].long()
        slot = bag // B
        rv = (slots.weight_offsets[slot] + (key - slots.row_offsets[slot]) * 128).contiguous()
        gv = ((bag - slot * B) * slots.total_dim + slots.output_offsets[slot]).contiguous()
        out = []
        lean_blocks = resident_blocks(launcher.RUNS_SOURCE, "sparse_update_singles_adagrad_f32_i32", dev, 256) // sms
        for name in ("ladder_0_0", "ladder_0_1", "ladder_0_2", "ladder_1_0", "ladder_1_2", "ladder_2_0", "ladder_2_1",
                     "ladder_2_2"):
            res = resident_blocks(SRC, name, dev, 256) // sms
            for per_sm in sorted({res, lean_blocks}):
                ms = median_ms(torch, lambda name=name, grid=per_sm * sms: launch(
                    SRC, name, dev, grid, 256,
                    [ptr(weights), ptr(grad), ptr(state), ptr(rv), ptr(gv), ptr(skey), ptr(sbag), ptr(scount),
                     ptr(slots.weight_offsets), ptr(slots.row_offsets), ptr(slots.output_offsets), i32(B),
                     i64(slots.total_dim), f32(0.01)]), 10)
                out.append(f"{name} x{per_sm} {ms:.3f}")
        for opt in ("sgd", "adagrad"):
            name = f"lean_resolved_{opt}"
            res = resident_blocks(SRC, name, dev, 256) // sms
            for per_sm in sorted({res, lean_blocks}):
                ms = median_ms(torch, lambda name=name, grid=per_sm * sms: launch(
                    SRC, name, dev, grid, 256, [ptr(weights), ptr(state), ptr(skey), ptr(rv), ptr(gv), ptr(scount),
                                                ptr(grad), i32(128), f32(0.01)]), 10)
                out.append(f"{name} x{per_sm} {ms:.3f}")
        for opt in ("sgd", "adagrad"):
            name = f"sparse_update_singles_{opt}_f32_i32"
            grid = resident_blocks(launcher.RUNS_SOURCE, name, dev, 256)
            ms = median_ms(torch, lambda name=name, grid=grid: launch(
                launcher.RUNS_SOURCE, name, dev, grid, 256,
                [ptr(weights), ptr(None), ptr(state), ptr(None), ptr(skey), ptr(sbag), ptr(scount), i64(keys.numel()),
                 ptr(off), ptr(slots.weight_offsets), ptr(slots.row_offsets), ptr(slots.output_offsets),
                 ptr(slots.mean), ptr(grad), i32(slots.num_slots), i32(B), i32(5), i32(1), i32(1), f32(0.01),
                 f32(1e-8), f32(0.9), f32(0.999), f32(0.1), f32(0.001), f32(0.0), i32(0), u64(1)]), 10)
            out.append(f"lean {opt} x{grid // sms} {ms:.3f}")
        print(f"{ids} {hot}-hot singles {n:,}: " + " | ".join(out), flush=True)
        ind = off = grad = keys = bags = skey = sbag = rv = gv = None
        torch.cuda.empty_cache()
