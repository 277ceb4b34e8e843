"""Training step throughput (samples/s): our DLRM against a plain PyTorch DLRM of the same shape, same run.

Ours: the schema-built DLRM, its EmbeddingCollection applying SGD to the touched rows inside the
backward. Baseline: one ``nn.EmbeddingBag(sparse=True)`` per table, the same MLPs and interaction,
``torch.optim.SGD`` over everything (sparse gradients for the tables). Both train on the same
pre-made random batches (one-hot ids, uniform over each table); the rounds alternate between the
two so that load from other processes hits both alike; the median round is reported.

    python -m pipeline bench train                       # CPU: 26 x 100k rows, dim 64, batch 2048
    python -m pipeline bench train --device cuda --preset mlperf --batch 65536   # bf16 autocast on GPU
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=["cpu", "mlperf"], default="cpu",
                        help="cpu: dim 64, bottom 512-256-64, top 512-256-1; mlperf: dim 128, "
                             "bottom 512-256-128, top 1024-1024-512-256-1")
    parser.add_argument("--tables", type=int, default=26, help="embedding tables, one per sparse feature")
    parser.add_argument("--rows", type=int, default=100_000, help="rows per table")
    parser.add_argument("--dim", type=int, default=0, help="embedding dim (0: the preset's)")
    parser.add_argument("--batch", type=int, default=2048, help="samples per step")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per model (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before the first round")
    parser.add_argument("--bottom", default="", help="bottom MLP widths before the embedding dim, e.g. 512,256")
    parser.add_argument("--top", default="", help="top MLP widths ending in 1, e.g. 512,256,1")
    parser.add_argument("--backend", default="auto", help="our embedding backend: torch | cuda | auto")
    parser.add_argument("--amp", choices=["auto", "bf16", "off"], default="auto",
                        help="bf16 autocast of the MLPs (auto: on GPU only)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")


def run(args: argparse.Namespace, cfg) -> dict:
    import statistics
    import time

    import torch

    from pipeline.device import resolve_device
    from pipeline.train.evaluate import autocast

    device = torch.device(resolve_device(cfg.device).kind)
    if args.threads:
        torch.set_num_threads(args.threads)
    amp = args.amp == "bf16" or (args.amp == "auto" and device.type == "cuda")
    dim = args.dim or (128 if args.preset == "mlperf" else 64)
    bottom = ([int(w) for w in args.bottom.split(",")] if args.bottom else [512, 256]) + [dim]
    top = [int(w) for w in args.top.split(",")] if args.top else (
        [1024, 1024, 512, 256, 1] if args.preset == "mlperf" else [512, 256, 1])
    torch.manual_seed(cfg.seed)

    batches = _batches(args, device, n=4)
    ours = _ours(args, dim, bottom, top, device)
    baseline = _plain_dlrm(args.tables, args.rows, dim, bottom, top).to(device)
    base_opt = torch.optim.SGD(baseline.parameters(), lr=0.01)
    our_opt = torch.optim.SGD(ours.parameters(), lr=0.01)

    def train_step(model, optimizer, dense, sparse, label):
        with autocast(device, amp):
            logits = model(dense, sparse)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), label)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    def our_step(batch):
        dense, kjt, _, label = batch
        train_step(ours, our_opt, dense, kjt, label)

    def base_step(batch):
        dense, _, ids, label = batch
        train_step(baseline, base_opt, dense, ids, label)

    def timed(step_fn, steps):
        _sync(device)
        start = time.perf_counter()
        for i in range(steps):
            step_fn(batches[i % len(batches)])
        _sync(device)
        return args.batch * steps / (time.perf_counter() - start)

    timed(our_step, args.warmup)
    timed(base_step, args.warmup)
    rates: dict[str, list[float]] = {"ours": [], "plain_pytorch": []}
    for _ in range(args.rounds):
        rates["ours"].append(timed(our_step, args.steps))
        rates["plain_pytorch"].append(timed(base_step, args.steps))
    result = {
        "device": device.type,
        "backend": ours.embedding.backend.name,
        "shape": f"{args.tables} tables x {args.rows} rows, dim {dim}, bottom {bottom}, top {top}",
        "batch": args.batch,
        "amp_bf16": amp,
        "threads": torch.get_num_threads(),
        "ours_samples_per_s": statistics.median(rates["ours"]),
        "plain_pytorch_samples_per_s": statistics.median(rates["plain_pytorch"]),
        "rounds": rates,
    }
    result["speedup"] = result["ours_samples_per_s"] / result["plain_pytorch_samples_per_s"]
    print(f"bench train on {device.type} ({result['threads']} threads), {result['shape']}, batch {args.batch}, "
          f"bf16 autocast {amp}, embedding backend {result['backend']}")
    print(f"  ours (fused sparse SGD):            {result['ours_samples_per_s']:>12,.0f} samples/s")
    print(f"  plain PyTorch (EmbeddingBag + SGD): {result['plain_pytorch_samples_per_s']:>12,.0f} samples/s")
    print(f"  ratio ours / plain:                 {result['speedup']:>12.2f}")
    return result


def _batches(args, device, n):
    import torch

    from pipeline.sparse import KeyedJaggedTensor

    keys = [f"C{i + 1}" for i in range(args.tables)]
    out = []
    for _ in range(n):
        ids = torch.randint(0, args.rows, (args.batch, args.tables))
        dense = torch.randn(args.batch, 13)
        label = torch.randint(0, 2, (args.batch,)).float()
        kjt = KeyedJaggedTensor.from_dense(keys, ids)
        out.append((dense.to(device), kjt.to(device), ids.to(device), label.to(device)))
    return out


def _ours(args, dim, bottom, top, device):
    from pipeline.modules.configs import EmbeddingOptimizerConfig
    from pipeline.modules.models import ModelSizes, build_model
    from pipeline.schema import Column, Schema

    schema = Schema([Column("label", "label", "float32")]
                    + [Column(f"I{i + 1}", "continuous", "float32") for i in range(13)]
                    + [Column(f"C{i + 1}", "categorical", "int32", cardinality=args.rows) for i in range(args.tables)])
    sizes = ModelSizes(embedding_dim=dim, bottom_mlp=bottom, top_mlp=top)
    model = build_model("dlrm", schema, sizes, EmbeddingOptimizerConfig("sgd", lr=0.01), backend=args.backend)
    model.embedding.validate_ids = False  # the baseline does not check ids either
    return model.to(device)


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _plain_dlrm(tables, rows, dim, bottom, top):
    import torch
    from torch import nn

    from pipeline.modules.models import mlp

    class PlainDLRM(nn.Module):
        """DLRM in plain PyTorch: EmbeddingBag(sparse=True) per table, bottom / top MLP, dot interaction."""

        def __init__(self, tables, rows, dim, bottom, top):
            super().__init__()
            self.tables = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum", sparse=True) for _ in range(tables))
            self.bottom = mlp(bottom, 13, last_activation=True)
            n = tables + 1
            r, c = torch.tril_indices(n, n, offset=-1)
            self.register_buffer("pairs", r * n + c, persistent=False)
            self.top = mlp(top, dim + r.numel(), last_activation=False)

        def forward(self, dense, ids):
            x = self.bottom(dense)
            pooled = [table(ids[:, t : t + 1]) for t, table in enumerate(self.tables)]
            vectors = torch.stack([x] + [p.to(x.dtype) for p in pooled], dim=1)
            dots = torch.bmm(vectors, vectors.transpose(1, 2)).flatten(1)[:, self.pairs]
            return self.top(torch.cat([x, dots], dim=1)).squeeze(1)

    return PlainDLRM(tables, rows, dim, bottom, top)
