"""Embedding kernels on the DLRM shape: forward and backward+update time, bandwidth, speed-up over torch.

    python -m pipeline bench embedding                        # 26 tables of 1M..10M rows, dim 128, batch 65536
    python -m pipeline bench embedding --hots 1,20 --optimizer adagrad --rows-max 4000000
    python -m pipeline bench embedding --interaction          # DLRM's dot interaction of the pooled vectors

For each bag size (one-hot, 20-hot, ...) it times, with CUDA events (median after warm-up, rotating three
batches), the ``cuda`` backend's table-batched forward and its fused backward + sparse update (and, apart, the
row-grouping sort inside it; and the two back to back on one batch, as a training step runs them, timed alone
and five steps together as a training loop issues them, against the byte floor), and the same work done by
``torch.nn.EmbeddingBag``: one module per table (``sparse=True``) sharing the very same weight storage,
``torch.cat`` of the pooled outputs, ``backward`` and the torch optimizer of the same kind stepping on the
sparse gradients. Bandwidth is bytes over time, as a fraction of a device-to-device copy measured in the same
run: forward, each id and its row read once and the output written once; backward + update, each id and the
gradient row of each occurrence read once, and each touched row (with its optimizer state) read and written
once. Ids are uniform over each table, or Zipf-skewed with ``--ids zipf`` (fewer touched rows, long runs of
one row in the update). Needs a CUDA GPU and CuPy. Beside the copy it times the update's bytes alone: the rows
the first batch touches read with a gradient row each and written back, with no sort and no optimizer
(``row_traffic.cu``), a second rate and floor.

``--sweep-update-kernels`` also times the backward + update with each candidate kernel of the update
(``launcher.UPDATE_KERNELS``, ``docs/EMBEDDING.md``) side by side, alone and in a step after the forward,
over the byte floor of those bytes at the device-to-device copy's rate.

``--interaction`` times, instead, what DLRM does next with the pooled vectors: the dot interaction of
``--tables`` + 1 vectors of ``--dim`` per sample (bf16, then fp32), forward and forward + backward
through autograd, the fused ``pipeline::dot_interaction`` kernels against ``torch.bmm`` + the pair
pick as one column run per row (:mod:`pipeline.modules.columns`). Its byte floor is the vectors read
and the pairs written (forward), and the vectors and the pairs' gradient read and the vectors'
gradient written (backward), at the device-to-device copy's rate.
"""

from __future__ import annotations

import argparse
import statistics

from pipeline.bench.arguments import integer, number, output_file
from pipeline.bench.train import IDS, ZIPF_EXPONENT
from pipeline.files import write_json

GOALS = {"forward_fraction_of_copy": 0.70, "speedup_one_hot": 5.0, "speedup_multi_hot": 20.0}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tables", type=integer(1), default=26, help="number of tables (one feature each)")
    parser.add_argument("--rows-min", type=integer(1), default=1_000_000, help="rows of the smallest table")
    parser.add_argument("--rows-max", type=integer(1), default=10_000_000, help="rows of the largest (sizes are geometric)")
    parser.add_argument("--dim", type=integer(1), default=128, help="embedding dim of every table")
    parser.add_argument("--batch", type=integer(1), default=65536, help="samples per batch")
    parser.add_argument("--hots", default="1,20", help="ids per bag to measure, comma separated")
    parser.add_argument("--ids", choices=IDS, default="uniform",
                        help="uniform over each table, or Zipf (hot rows spread over the table, as bench train)")
    parser.add_argument("--zipf-exponent", type=number(above=0), default=ZIPF_EXPONENT, help="exponent of --ids zipf")
    parser.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default="fp32", help="weights dtype")
    parser.add_argument("--optimizer", choices=["sgd", "adagrad"], default="sgd",
                        help="sparse optimizer (torch side: optim.SGD / optim.Adagrad on sparse gradients)")
    parser.add_argument("--reps", type=integer(1), default=20, help="timed repetitions per measurement (median)")
    parser.add_argument("--baseline-reps", type=integer(1), default=5, help="timed repetitions of the torch baseline")
    parser.add_argument("--no-baseline", action="store_true", help="skip torch.nn.EmbeddingBag")
    parser.add_argument("--sweep-bags-per-group", default="", metavar="K,K,...",
                        help="also time the forward with each of these bags per thread group (tuning)")
    parser.add_argument("--sweep-update-kernels", default="", metavar="NAME,NAME,...|all",
                        help="also time the backward + update with each of these candidate update kernels "
                             "(all: every one), against the byte floor")
    parser.add_argument("--interaction", action="store_true",
                        help="time DLRM's dot interaction of --tables + 1 vectors of --dim instead: the fused "
                             "kernels against torch.bmm + the pair pick, bf16 and fp32, against the byte floor")
    parser.add_argument("--json", type=output_file, metavar="FILE", help="also write the figures as JSON")


def run(args: argparse.Namespace, cfg) -> dict:
    import torch

    from pipeline.device import DeviceError, gpu_problem

    update_kernels = update_kernels_to_sweep(args.sweep_update_kernels)
    problem = gpu_problem()
    if problem:
        raise DeviceError(f"bench embedding needs a CUDA GPU: {problem}")
    import pipeline.kernels
    from pipeline.kernels.embedding import TablePacking
    from pipeline.modules.configs import EmbeddingOptimizerConfig, TableConfig

    if pipeline.kernels.kernels_problem():
        raise DeviceError(f"bench embedding needs the CUDA kernels: {pipeline.kernels.kernels_problem()}")
    if args.interaction:
        return _interaction(torch, args)
    from pipeline.kernels.embedding import CudaBackend, launcher

    hots = [int(h) for h in str(args.hots).split(",") if h]
    rows = _geometric(args.rows_min, args.rows_max, args.tables)
    tables = [TableConfig(f"t{i}", r, args.dim, [f"C{i}"]) for i, r in enumerate(rows)]
    packing = TablePacking.build(tables)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    device = torch.device("cuda")
    weights = torch.empty(packing.total_elements, dtype=dtype, device=device).uniform_(-0.01, 0.01)
    opt = EmbeddingOptimizerConfig(args.optimizer, lr=0.01)
    state = {name: torch.zeros(size, dtype=torch.float32, device=device)
             for name, size in opt.state_shapes(packing.total_rows, packing.total_elements).items()}
    backend = CudaBackend()
    slots = launcher.SlotArrays.from_packing(packing, device)
    es = weights.element_size()
    copy_bw = _copy_bandwidth(torch)
    gib = packing.total_elements * es / 2**30
    print(f"[bench embedding] {torch.cuda.get_device_name()} | {args.tables} tables, {min(rows):,}..{max(rows):,} rows "
          f"({packing.total_rows:,} rows, {gib:.1f} GiB {args.dtype}), dim {args.dim}, batch {args.batch}, "
          f"{args.optimizer}, ids {args.ids} | device-to-device copy {copy_bw / 1e12:.2f} TB/s", flush=True)

    baseline = None if args.no_baseline else _Baseline(torch, weights, packing, args.optimizer, opt.lr)
    results = []
    for hot in hots:
        batches = [batch_of_ids(torch, rows, args.batch, hot, seed, args.ids, args.zipf_exponent) for seed in range(3)]
        grad = torch.randn(args.batch, packing.total_dim, device=device)
        nnz = batches[0][0].numel()
        cycle = _Cycle(batches)

        def fwd(cycle=cycle):
            ind, off = cycle.next()
            backend.forward(weights, packing, ind, off, args.batch)

        def bwd(cycle=cycle, grad=grad):
            ind, off = cycle.next()
            backend.backward_update(weights, state, packing, ind, off, args.batch, grad, opt, opt.lr, 1)

        def step(cycle=cycle, grad=grad):  # a training step's table work: forward, then backward + update
            ind, off = cycle.next()
            backend.forward(weights, packing, ind, off, args.batch)
            backend.backward_update(weights, state, packing, ind, off, args.batch, grad, opt, opt.lr, 1)

        def sort_only(cycle=cycle):
            ind, off = cycle.next()
            launcher.sort_by_row(slots, ind, off, args.batch)

        sweep = {}
        for k in [int(v) for v in str(args.sweep_bags_per_group).split(",") if v]:
            kept, launcher.BAGS_PER_GROUP = launcher.BAGS_PER_GROUP, k
            sweep[k] = median_ms(torch, fwd, args.reps)
            launcher.BAGS_PER_GROUP = kept
        if sweep:
            print(f"  {hot:>2}-hot forward by bags per group: "
                  + ", ".join(f"{k}: {ms:.3f} ms" for k, ms in sweep.items()), flush=True)
        by_kernel, step_by_kernel = {}, {}
        for name in update_kernels:
            kept, launcher.UPDATE_KERNEL = launcher.UPDATE_KERNEL, name
            by_kernel[name] = median_ms(torch, bwd, args.reps)
            step_by_kernel[name] = median_ms(torch, step, args.reps)
            launcher.UPDATE_KERNEL = kept
        t_fwd = median_ms(torch, fwd, args.reps)
        t_bwd = median_ms(torch, bwd, args.reps)
        t_sort = median_ms(torch, sort_only, args.reps)
        t_step = median_ms(torch, step, args.reps)
        t_steps = back_to_back_ms(torch, step, args.reps)
        unique = _unique_rows(torch, batches[0], packing, args.batch)
        traffic = _row_traffic(torch, launcher, weights, slots, batches[0], grad, args.batch, args.reps)
        state_bytes = {"sgd": 0, "adagrad": 8}[args.optimizer]
        fwd_bytes = nnz * (args.dim * es + 8) + args.batch * packing.total_dim * 4
        # the row-owner algorithm's fewest bytes: each occurrence's id and gradient row, each touched row
        # (and its state) read and written once; the sort's traffic is not counted
        bwd_bytes = nnz * (8 + args.dim * 4) + unique * (2 * args.dim * es + state_bytes)
        floor_ms = (fwd_bytes + bwd_bytes) / copy_bw * 1e3
        row = dict(hot=hot, nnz=nnz, forward_ms_by_bags_per_group=sweep, unique_rows=unique, forward_ms=t_fwd, backward_update_ms=t_bwd,
                   sort_ms=t_sort, forward_tb_s=fwd_bytes / t_fwd / 1e9, backward_tb_s=bwd_bytes / t_bwd / 1e9,
                   forward_fraction_of_copy=fwd_bytes / t_fwd / 1e9 / (copy_bw / 1e12),
                   backward_fraction_of_copy=bwd_bytes / t_bwd / 1e9 / (copy_bw / 1e12),
                   floor_ms=floor_ms, time_over_floor=(t_fwd + t_bwd) / floor_ms,
                   step_ms=t_step, step_over_floor=t_step / floor_ms,
                   step_back_to_back_ms=t_steps, step_back_to_back_over_floor=t_steps / floor_ms,
                   backward_update_ms_by_kernel=by_kernel,
                   time_over_floor_by_kernel={k: (t_fwd + ms) / floor_ms for k, ms in by_kernel.items()},
                   step_ms_by_kernel=step_by_kernel,
                   step_over_floor_by_kernel={k: ms / floor_ms for k, ms in step_by_kernel.items()}, **traffic)
        if traffic:
            rate = traffic["random_rows_tb_s"] * 1e12
            row["floor_ms_at_random_rows_rate"] = (fwd_bytes + bwd_bytes) / rate * 1e3
            row["step_over_random_rows_floor"] = t_step / row["floor_ms_at_random_rows_rate"]
            print(f"  {hot:>2}-hot rows read and written back at random, alone ({traffic['random_rows']:,} rows, in the "
                  f"update's order; by rows a warp): "
                  + ", ".join(f"{k}: {ms:.3f} ms" for k, ms in traffic["random_rows_ms_by_rows_per_warp"].items())
                  + f" | {rate / 1e12:.2f} TB/s, {rate / copy_bw:.0%} of copy | the step's bytes at that rate "
                  f"{row['floor_ms_at_random_rows_rate']:.3f} ms, the step {row['step_over_random_rows_floor']:.2f}x it",
                  flush=True)
        if by_kernel:
            print(f"  {hot:>2}-hot backward + update by update kernel (fwd + bwd + update over the byte floor, "
                  f"{floor_ms:.3f} ms): " + ", ".join(f"{k}: {ms:.3f} ms ({row['time_over_floor_by_kernel'][k]:.2f}x)"
                                                     for k, ms in by_kernel.items()), flush=True)
            print(f"  {hot:>2}-hot step (forward, then backward + update) by update kernel: "
                  + ", ".join(f"{k}: {ms:.3f} ms ({ms / floor_ms:.2f}x)" for k, ms in step_by_kernel.items()),
                  flush=True)
        if baseline is not None:
            row.update(baseline.measure(batches, grad, args.batch, args.baseline_reps))
            row["speedup_forward"] = row["torch_forward_ms"] / t_fwd
            row["speedup_step"] = row["torch_step_ms"] / (t_fwd + t_bwd)
            row["speedup_vs_torch_forward_backward"] = row["torch_forward_backward_ms"] / (t_fwd + t_bwd)
        results.append(row)
        del batches, grad, cycle, fwd, bwd, step, sort_only
        torch.cuda.empty_cache()
        _print_row(row)

    summary = dict(device=torch.cuda.get_device_name(), copy_tb_s=copy_bw / 1e12, tables=args.tables, ids=args.ids,
                   zipf_exponent=args.zipf_exponent if args.ids == "zipf" else None,
                   rows=rows, dim=args.dim, batch=args.batch, dtype=args.dtype, optimizer=args.optimizer,
                   update_kernel=launcher.UPDATE_KERNEL, results=results, goals=GOALS)
    if args.json:
        write_json(args.json, summary)
    return summary


def _row_traffic(torch, launcher, weights, slots, batch, grad, batch_size: int, reps: int) -> dict:
    """The rate at which this GPU reads the rows a batch touches, each with one gradient row, and writes them back (a
    unit in the last place of each word changed): the update's memory traffic alone (``launcher.rows_read_write``),
    the best of 1, 2, 4 and 8 rows a warp, in TB/s counting the rows, the gradient rows and the 16 bytes of offsets
    a row. Empty where rows or gradient rows do not start on 16-byte boundaries, or the tables' dims differ."""
    ind, off = batch
    es = weights.element_size()
    if weights.data_ptr() % 16 or slots.max_dim * es % 16 or slots.column_multiple % 4 or slots.total_dim % 4:
        return {}
    keys, bags = launcher.sort_by_row(slots, ind, off, batch_size)
    first = torch.ones_like(keys, dtype=torch.bool)
    first[1:] = keys[1:] != keys[:-1]
    rows, bags = keys[first].long(), bags[first].long()
    table = torch.searchsorted(slots.table_row_starts, rows, right=True) - 1
    elem = slots.table_weight_offsets[table] + (rows - slots.table_row_starts[table]) * slots.table_dims[table]
    if bool(((elem * es) % 16 != 0).any()) or bool((slots.table_dims != slots.max_dim).any()):
        return {}
    slot = bags // batch_size
    grad_elem = (bags - slot * batch_size) * slots.total_dim + slots.output_offsets[slot]
    row_vec, grad_vec = (elem * es // 16).contiguous(), (grad_elem // 4).contiguous()
    row_vectors, grad_vectors = slots.max_dim * es // 16, slots.max_dim // 4
    by_rows = {r: median_ms(torch, lambda r=r: launcher.rows_read_write(weights, grad, row_vec, grad_vec, row_vectors,
                                                                       grad_vectors, r), reps)
               for r in (1, 2, 4, 8)}
    moved = rows.numel() * (16 * (2 * row_vectors + grad_vectors) + 16)
    return {"random_rows": rows.numel(), "random_rows_ms_by_rows_per_warp": by_rows,
            "random_rows_tb_s": moved / min(by_rows.values()) / 1e9}


def update_kernels_to_sweep(names: str) -> list[str]:
    """The candidate update kernels ``--sweep-update-kernels`` names (``all``: every one), in its order."""
    from pipeline.errors import UserError
    from pipeline.kernels.embedding.launcher import UPDATE_KERNELS

    if names == "all":
        return list(UPDATE_KERNELS)
    chosen = [n for n in names.split(",") if n]
    unknown = [n for n in chosen if n not in UPDATE_KERNELS]
    if unknown:
        raise UserError(f"--sweep-update-kernels: expected names among {', '.join(UPDATE_KERNELS)} (or all), "
                        f"got {', '.join(unknown)}")
    return chosen


class _Cycle:
    def __init__(self, batches):
        self.batches, self.i = batches, 0

    def next(self):
        self.i = (self.i + 1) % len(self.batches)
        return self.batches[self.i]


class _Baseline:
    """``torch.nn.EmbeddingBag`` per table over views of the same storage, sparse gradients, torch optimizer."""

    def __init__(self, torch, weights, packing, optimizer: str, lr: float) -> None:
        nn = torch.nn
        self.torch = torch
        self.bags = nn.ModuleList()
        for t in range(len(packing.rows)):
            start = packing.weights_offsets[t]
            view = weights[start : start + packing.rows[t] * packing.dims[t]].view(packing.rows[t], packing.dims[t])
            self.bags.append(nn.EmbeddingBag.from_pretrained(view, freeze=False, mode="sum", sparse=True))
        params = list(self.bags.parameters())
        self.opt = torch.optim.SGD(params, lr=lr) if optimizer == "sgd" else torch.optim.Adagrad(params, lr=lr)

    def measure(self, batches, grad, batch, reps) -> dict:
        torch = self.torch
        # per-table slices are cut outside the timed region (host reads of the offsets)
        cut = [self._cut(ind, off, batch) for ind, off in batches]
        cycle = _Cycle(cut)

        def fwd():
            with torch.no_grad():
                self._run(cycle.next())

        def fwd_bwd():
            self._run(cycle.next()).backward(grad)
            for p in self.bags.parameters():
                p.grad = None

        def step():
            self.opt.zero_grad(set_to_none=True)
            self._run(cycle.next()).backward(grad)
            self.opt.step()

        out = dict(torch_forward_ms=median_ms(torch, fwd, reps), torch_forward_backward_ms=median_ms(torch, fwd_bwd, reps),
                   torch_step_ms=median_ms(torch, step, reps))
        self.opt.zero_grad(set_to_none=True)
        return out

    def _cut(self, indices, offsets, batch):
        per_table = offsets[::batch].tolist()
        return [(indices[per_table[t] : per_table[t + 1]], offsets[t * batch : (t + 1) * batch] - per_table[t])
                for t in range(len(self.bags))]

    def _run(self, pieces):
        return self.torch.cat([bag(ind, off) for bag, (ind, off) in zip(self.bags, pieces)], dim=1)


def _interaction(torch, args: argparse.Namespace) -> dict:
    from pipeline.kernels.interaction import pair_count

    batch, v, dim = args.batch, args.tables + 1, args.dim
    copy_bw = _copy_bandwidth(torch)
    print(f"[bench embedding --interaction] {torch.cuda.get_device_name()} | batch {batch}, {v} vectors of dim {dim} "
          f"({pair_count(v)} pairs) | device-to-device copy {copy_bw / 1e12:.2f} TB/s", flush=True)
    results = []
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        row = _interaction_row(torch, (batch, v, dim), dtype, copy_bw, args.reps)
        results.append({"dtype": name, **row})
        torch.cuda.empty_cache()
        print(f"  {name}: fused forward {row['fused_forward_ms']:.3f} ms, forward+backward "
              f"{row['fused_forward_backward_ms']:.3f} ms (byte floor {row['floor_forward_ms']:.3f} / "
              f"{row['floor_forward_backward_ms']:.3f}) | torch bmm + pick {row['torch_forward_ms']:.3f} / "
              f"{row['torch_forward_backward_ms']:.3f} ms | speed-up {row['speedup_forward']:.1f}x / "
              f"{row['speedup_forward_backward']:.1f}x", flush=True)
    summary = {"device": torch.cuda.get_device_name(), "copy_tb_s": copy_bw / 1e12, "batch": batch, "vectors": v,
               "dim": dim, "pairs": pair_count(v), "results": results}
    if args.json:
        write_json(args.json, summary)
    return summary


def _interaction_row(torch, shape: tuple[int, int, int], dtype, copy_bw: float, reps: int) -> dict:
    """Fused and torch times of one dtype (forward without autograd; forward + backward through autograd)."""
    from pipeline.kernels.interaction import dot_interaction, launcher, pair_count
    from pipeline.modules.columns import ColumnRun, assemble_columns

    batch, v, dim = shape
    pairs = pair_count(v)
    runs = [ColumnRun(0, i * v, i * v + i) for i in range(1, v)]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(shape, device="cuda", generator=g).to(dtype).requires_grad_()
    grad = torch.randn(batch, pairs, device="cuda", generator=g).to(dtype)
    assert launcher.supported(x)
    es = x.element_size()
    floor_fwd = (batch * v * dim + batch * pairs) * es / copy_bw * 1e3
    floor_bwd = (2 * batch * v * dim + batch * pairs) * es / copy_bw * 1e3

    def bmm_and_pick(x):
        return assemble_columns([torch.bmm(x, x.transpose(1, 2)).flatten(1)], runs)

    def forward(fn):
        with torch.no_grad():
            fn(x)

    def forward_backward(fn):
        torch.autograd.grad(fn(x), x, grad)

    row = {"floor_forward_ms": floor_fwd, "floor_forward_backward_ms": floor_fwd + floor_bwd}
    for label, fn in (("fused", dot_interaction), ("torch", bmm_and_pick)):
        row[f"{label}_forward_ms"] = median_ms(torch, lambda fn=fn: forward(fn), reps)
        row[f"{label}_forward_backward_ms"] = median_ms(torch, lambda fn=fn: forward_backward(fn), reps)
    row["speedup_forward"] = row["torch_forward_ms"] / row["fused_forward_ms"]
    row["speedup_forward_backward"] = row["torch_forward_backward_ms"] / row["fused_forward_backward_ms"]
    return row


def _geometric(lo: int, hi: int, n: int) -> list[int]:
    if n == 1:
        return [hi]
    return [round(lo * (hi / lo) ** (i / (n - 1))) for i in range(n)]


def batch_of_ids(torch, rows, batch, hot, seed, ids="uniform", exponent=ZIPF_EXPONENT, device="cuda"):
    """``(indices, offsets)``: ``hot`` ids per bag of every table, slot-major, uniform or Zipf as ``bench
    train`` draws them."""
    import numpy as np

    from pipeline.bench.train import draw_ids

    rng = np.random.default_rng(seed)
    drawn = [draw_ids(ids, r, (batch * hot, 1), exponent, rng)[:, 0] for r in rows]
    indices = torch.from_numpy(np.concatenate(drawn)).to(device)
    offsets = torch.arange(0, len(rows) * batch + 1, device=device, dtype=torch.int64) * hot
    return indices, offsets


def _unique_rows(torch, batch, packing, batch_size) -> int:
    indices, offsets = batch
    counts = offsets[batch_size::batch_size] - offsets[:-1:batch_size]
    base = torch.tensor(packing.row_offsets, device=indices.device)
    keys = indices + torch.repeat_interleave(base, counts)
    return int(torch.unique(keys).numel())


def _copy_bandwidth(torch, nbytes: int = 4 << 30) -> float:
    """Bytes read + written per second by a device-to-device copy of ``nbytes``."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = median_ms(torch, lambda: dst.copy_(src), 20)
    return 2 * nbytes / (ms / 1e3)


def median_ms(torch, fn, reps: int, warmup: int = 3) -> float:
    """The median time of ``fn`` over ``reps`` calls on the current CUDA stream (CUDA events), in ms, after
    ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(max(reps, 1)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def back_to_back_ms(torch, fn, reps: int, calls: int = 5, warmup: int = 3) -> float:
    """The time one call of ``fn`` takes when ``calls`` of them run back to back, as a training loop runs its steps
    (the host queues the next while the GPU runs this one, so no launch waits on an idle GPU): the median over
    ``reps`` of ``calls`` calls timed together, in ms a call."""
    return median_ms(torch, lambda: [fn() for _ in range(calls)], reps, warmup=max(warmup // calls, 1)) / calls


def _print_row(row: dict) -> None:
    line = (f"  {row['hot']:>2}-hot  nnz {row['nnz']:>10,}  unique {row['unique_rows']:>10,} | "
            f"forward {row['forward_ms']:8.3f} ms ({row['forward_tb_s']:.2f} TB/s, "
            f"{100 * row['forward_fraction_of_copy']:.0f}% of copy) | "
            f"backward+update {row['backward_update_ms']:8.3f} ms (sort {row['sort_ms']:.3f}; "
            f"{row['backward_tb_s']:.2f} TB/s) | {row['time_over_floor']:.2f}x the byte floor"
            f"\n          forward then backward+update back to back, as a step: {row['step_ms']:.3f} ms, "
            f"{row['step_over_floor']:.2f}x the byte floor ({row['floor_ms']:.3f} ms); steps back to back, as "
            f"training runs them: {row['step_back_to_back_ms']:.3f} ms a step, {row['step_back_to_back_over_floor']:.2f}x")
    if "torch_step_ms" in row:
        line += (f"\n          torch EmbeddingBag: forward {row['torch_forward_ms']:.3f} ms, "
                 f"forward+backward {row['torch_forward_backward_ms']:.3f} ms, "
                 f"+ optimizer step {row['torch_step_ms']:.3f} ms | speed-up forward "
                 f"{row['speedup_forward']:.1f}x, forward+backward+update {row['speedup_step']:.1f}x "
                 f"({row['speedup_vs_torch_forward_backward']:.1f}x against torch's forward+backward alone)")
    print(line, flush=True)
