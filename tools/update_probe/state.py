"""Does the row-wise state's random read and write cost the update its time? The rows a batch touches read and written
back with one gradient row each (row_traffic), with and without a 4-byte state read (and written) at the row's key,
against the update kernels with SGD (no state) and row-wise Adagrad; uniform and Zipf, one-hot and 20-hot; each with the
gradient rows read by row key (as the update reads them) and in the batch's order."""
from pathlib import Path

import torch

from pipeline.bench.embedding import _geometric, batch_of_ids, median_ms
from pipeline.kernels._launch import i32, i64, launch, ptr, resident_blocks
from pipeline.kernels.embedding import CudaBackend, TablePacking, launcher
from pipeline.modules.configs import EmbeddingOptimizerConfig, TableConfig

SRC = str(Path(__file__).resolve().parent / "state_traffic.cu")
rows = _geometric(1_000_000, 10_000_000, 26)
packing = TablePacking.build([TableConfig(f"t{i}", r, 128, [f"C{i}"]) for i, r in enumerate(rows)])
weights = torch.empty(packing.total_elements, device="cuda").uniform_(-0.01, 0.01)
state = torch.zeros(packing.total_rows, device="cuda")
slots = launcher.SlotArrays.from_packing(packing, "cuda")
backend = CudaBackend()
dev = torch.device("cuda")
for ids in ("uniform", "zipf"):
    for hot in (1, 20):
        ind, off = batch_of_ids(torch, rows, 65536, hot, 0, ids)
        grad = torch.randn(65536, packing.total_dim, device="cuda")
        keys, bags = launcher.sort_by_row(slots, ind, off, 65536)
        first = torch.ones_like(keys, dtype=torch.bool)
        first[1:] = keys[1:] != keys[:-1]
        key, bag = keys[first].long(), bags[first].long()
        table = torch.searchsorted(slots.table_row_starts, key, right=True) - 1
        elem = slots.table_weight_offsets[table] + (key - slots.table_row_starts[table]) * 128
        slot = bag // 65536
        gelem = (bag - slot * 65536) * slots.total_dim + slots.output_offsets[slot]
        rv, gv, n = (elem // 4).contiguous(), (gelem // 4).contiguous(), key.numel()
        out = []
        # the gradient rows in the update's order (by row key: at random in the batch) and in the batch's order
        # (sorted offsets, one pass over the gradient): what the gradient's random reads cost
        gv_in_order = torch.sort(gv).values
        for mode in (0, 1, 2):
            name = f"rows_state_{mode}"
            for order, g_vec in (("grad by key", gv), ("grad in order", gv_in_order)):
                for grid in ((n + 7) // 8, min((n + 7) // 8, resident_blocks(SRC, name, dev, 256))):
                    ms = median_ms(torch, lambda name=name, grid=grid, g_vec=g_vec: launch(
                        SRC, name, dev, grid, 256, [ptr(weights), ptr(grad), ptr(state), ptr(rv), ptr(g_vec), ptr(key),
                                                    i64(n), i32(32)]), 10)
                    out.append(f"mode {mode} {order} grid {grid}: {ms:.3f}")
        for opt_name in ("sgd", "adagrad"):
            opt = EmbeddingOptimizerConfig(opt_name, lr=0.01)
            st = {"adagrad": {"momentum1": state}}.get(opt_name, {})
            for kernel in ("segments_looped_capped", "singles_apart"):
                launcher.UPDATE_KERNEL = kernel
                ms = median_ms(torch, lambda: backend.backward_update(weights, st, packing, ind, off, 65536, grad, opt,
                                                                      0.01, 1), 10)
                out.append(f"{opt_name} {kernel} bwd+update {ms:.3f}")
        print(f"{ids} {hot}-hot rows {n:,}: " + " | ".join(out), flush=True)
        ind = off = grad = keys = bags = None
        torch.cuda.empty_cache()

# The forward with 8 rows in flight a group against 4, one-hot and 20-hot, uniform and Zipf.
FWD = str(Path(__file__).resolve().parent / "forward_u.cu")
for ids in ("uniform", "zipf"):
    for hot in (1, 20):
        ind, off = batch_of_ids(torch, rows, 65536, hot, 0, ids)
        out = torch.empty(65536, slots.total_dim, device="cuda")
        bags = slots.num_slots * 65536
        groups = slots.num_slots * ((65536 + 7) // 8)
        res = []
        for src, name in ((FWD, "pooled_forward_f32"), (FWD, "probe_forward_u8_f32")):
            ms = median_ms(torch, lambda src=src, name=name: launch(
                src, name, dev, (groups + 7) // 8, 256,
                [ptr(weights), ptr(slots.weight_offsets), ptr(slots.output_offsets), ptr(slots.mean), ptr(ind), ptr(off),
                 i32(slots.num_slots), i32(65536), i32(8), i32(5), i32(1), i32(1), ptr(out)]), 20)
            res.append(f"{name} {ms:.3f}")
        ref = launcher.pooled_forward(weights, slots, ind, off, 65536)
        print(f"forward {ids} {hot}-hot: " + ", ".join(res) + f" | same result: {torch.equal(ref, out)}", flush=True)
