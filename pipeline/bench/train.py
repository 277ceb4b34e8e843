"""Training step throughput (samples/s): our DLRM against a plain PyTorch DLRM of the same shape, same run.

Ours: the schema-built DLRM, its EmbeddingCollection applying its fused sparse optimizer (``--optimizer``:
SGD, row-wise Adagrad or lazy Adam) to the touched rows inside the backward; the MLPs take SGD.
Baseline: one ``nn.EmbeddingBag(sparse=True)`` per table, the same MLPs and interaction, the MLPs
under ``torch.optim.SGD`` and the tables under torch's nearest optimizer for sparse gradients:
``SGD``, ``Adagrad`` (element-wise, with a dense state as large as the tables) or ``SparseAdam``
(lazy, like ours). Both train on the same pre-made batches of one-hot ids, uniform over each table
or Zipf-skewed (``--ids zipf``); the rounds alternate between the two so that load from other
processes hits both alike; the median round is reported.

With ``--dynamic``, a third model joins the rounds: our DLRM with dynamic tables of the same shape
(``etl.hash_ids``' columns: raw 64-bit ids, placed in each table's rows by its hash table as the
training stage does, admitted after ``train.admit_after`` occurrences, the least recently used evicted),
trained on the same ids, each row's as a 64-bit id of its own; its step includes the mapping of the
batch's ids to rows. It reports its samples/s and the ratio of the static tables' to it.

    python -m pipeline bench train                       # CPU: 26 x 100k rows, dim 64, batch 2048
    python -m pipeline bench train --device cuda --preset mlperf --batch 65536   # bf16 autocast on GPU
    python -m pipeline bench train --device cuda --preset mlperf --batch 65536 --ids zipf --optimizer adam
    python -m pipeline bench train --device cuda --preset mlperf --batch 65536 --ids zipf --dynamic
"""

from __future__ import annotations

import argparse
import math
from typing import Any, NamedTuple

IDS = ("uniform", "zipf")
OPTIMIZERS = ("sgd", "adagrad", "adam")
BASELINE_OPTIMIZERS = {"sgd": "SGD", "adagrad": "Adagrad", "adam": "SparseAdam"}
"""The torch optimizer the baseline's tables take for each of ours (all accept sparse gradients)."""
ZIPF_EXPONENT = 1.1
HOT_FRACTION = 0.01


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
    parser.add_argument("--ids", choices=IDS, default="uniform",
                        help="uniform: every row of a table alike; zipf: row of rank r drawn with probability "
                             "~ r**-exponent, the ranks spread over each table by a fixed permutation")
    parser.add_argument("--zipf-exponent", type=float, default=ZIPF_EXPONENT,
                        help="skew of --ids zipf (> 0); default 1.1, in the 1.05-1.2 range taken as Criteo-like "
                             "for its large tables (the synthetic data generator draws 1.25-1.6, more skewed)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd",
                        help="our tables' fused optimizer: sgd | adagrad (row-wise) | adam (lazy); the baseline's "
                             "tables take torch's SGD | Adagrad (element-wise) | SparseAdam")
    parser.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                        help="torch.compile our dense part and loss, as the training stage does (auto: on a GPU); "
                             "the plain PyTorch model runs eager")
    parser.add_argument("--dynamic", action="store_true",
                        help="also train our DLRM with dynamic tables of the same shape (raw 64-bit ids placed in "
                             "their rows by a hash table, admitted after train.admit_after occurrences) on the same "
                             "ids, and report its samples/s and the ratio static / dynamic")
    parser.add_argument("--json", metavar="FILE", help="also write the figures and settings as JSON")


def run(args: argparse.Namespace, cfg) -> dict:
    import functools
    import statistics
    import time

    import numpy as np
    import torch

    from pipeline.device import resolve_device
    from pipeline.errors import UserError
    from pipeline.files import write_json
    from pipeline.schema import DYNAMIC_ROWS
    from pipeline.train.evaluate import autocast
    from pipeline.train.loop import dense_loss

    if not args.zipf_exponent > 0:
        raise UserError(f"--zipf-exponent: expected a number > 0, got {args.zipf_exponent}")
    device = torch.device(resolve_device(cfg.device).kind)
    if args.threads:
        torch.set_num_threads(args.threads)
    amp = args.amp == "bf16" or (args.amp == "auto" and device.type == "cuda")
    dim = args.dim or (128 if args.preset == "mlperf" else 64)
    bottom = ([int(w) for w in args.bottom.split(",")] if args.bottom else [512, 256]) + [dim]
    top = [int(w) for w in args.top.split(",")] if args.top else (
        [1024, 1024, 512, 256, 1] if args.preset == "mlperf" else [512, 256, 1])
    torch.manual_seed(cfg.seed)

    rng = np.random.default_rng(cfg.seed)
    ids = [draw_ids(args.ids, args.rows, (args.batch, args.tables), args.zipf_exponent, rng) for _ in range(4)]
    distinct = [np.unique(b[:, t]).size for b in ids for t in range(args.tables)]
    skew = {"hot_rows_share": hot_rows_share(args.ids, args.rows, args.zipf_exponent),
            "distinct_rows_per_batch": float(np.mean(distinct))}
    batches = _batches(ids, args.rows, device)
    ours = _ours(args, dim, bottom, top, device)
    baseline = _plain_dlrm(args.tables, args.rows, dim, bottom, top).to(device)
    base_opts = _baseline_optimizers(baseline, args.optimizer, lr=0.01)
    compiled = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")

    def train_step(model, optimizers, dense, sparse, label):
        with autocast(device, amp):
            logits = model(dense, sparse)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), label)
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()

    def our_step(model):
        """A step of our ``model`` as the training stage takes it: the lookup (and a dynamic table's mapping of
        ids to rows) eager, the dense part and loss compiled where ``compiled``, the MLPs under SGD."""
        optimizers = [torch.optim.SGD(model.parameters(), lr=0.01)]
        loss_of = torch.compile(functools.partial(dense_loss, model, amp), dynamic=False) if compiled else None

        def step(dense, kjt, label):
            if loss_of is None:
                train_step(model, optimizers, dense, kjt, label)
                return
            loss = loss_of(dense, model.embedding(kjt), label)
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
            loss.backward()
            for optimizer in optimizers:
                optimizer.step()

        return step

    ours_step = our_step(ours)
    steps = {"ours": lambda b: ours_step(b.dense, b.kjt, b.label),
             "plain_pytorch": lambda b: train_step(baseline, base_opts, b.dense, b.ids, b.label)}
    capacity = -(-args.rows // DYNAMIC_ROWS) * DYNAMIC_ROWS
    if args.dynamic:
        dynamic = _ours(args, dim, bottom, top, device, capacity=capacity, admit_after=cfg.train.admit_after)
        dynamic_step = our_step(dynamic)
        steps["ours_dynamic"] = lambda b: dynamic_step(b.dense, b.raw, b.label)

    def timed(step_fn, steps):
        _sync(device)
        start = time.perf_counter()
        for i in range(steps):
            step_fn(batches[i % len(batches)])
        _sync(device)
        return args.batch * steps / (time.perf_counter() - start)

    for step in steps.values():
        timed(step, args.warmup)
    placed_before = _placed(dynamic) if args.dynamic else 0
    rates: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            rates[name].append(timed(step, args.steps))
    baseline_opt = BASELINE_OPTIMIZERS[args.optimizer]
    result = {
        "device": device.type,
        "backend": ours.embedding.backend.name,
        "shape": f"{args.tables} tables x {args.rows} rows, dim {dim}, bottom {bottom}, top {top}",
        "batch": args.batch,
        "ids": args.ids,
        "zipf_exponent": args.zipf_exponent if args.ids == "zipf" else None,
        **skew,
        "optimizer": args.optimizer,
        "baseline_optimizer": f"{baseline_opt} (tables), SGD (MLPs)",
        "dense_optimizer": "SGD",
        "amp_bf16": amp,
        "compiled": compiled,
        "threads": torch.get_num_threads(),
        "ours_samples_per_s": statistics.median(rates["ours"]),
        "plain_pytorch_samples_per_s": statistics.median(rates["plain_pytorch"]),
        "rounds": rates,
    }
    result["speedup"] = result["ours_samples_per_s"] / result["plain_pytorch_samples_per_s"]
    if args.dynamic:
        tables = list(dynamic.embedding.dynamic.tables.values())
        stats = [table.stats() for table in tables]
        result["ours_dynamic_samples_per_s"] = statistics.median(rates["ours_dynamic"])
        result["static_over_dynamic"] = result["ours_samples_per_s"] / result["ours_dynamic_samples_per_s"]
        result["dynamic_tables"] = {
            "capacity": capacity,
            "admit_after": cfg.train.admit_after,
            "hashtable_backend": tables[0].ids.backend,
            "distinct_ids_per_table": float(np.mean([np.unique(np.concatenate([b[:, t] for b in ids])).size
                                                     for t in range(args.tables)])),
            "ids": sum(s["ids"] for s in stats),
            "evictions": sum(s["evictions"] for s in stats),
            "candidates": sum(s["candidates"] for s in stats),
            "placed_while_timed": _placed(dynamic) - placed_before,
        }
    drawn = f"zipf, exponent {args.zipf_exponent:g}" if args.ids == "zipf" else "uniform"
    print(f"bench train on {device.type} ({result['threads']} threads), {result['shape']}, batch {args.batch}, "
          f"bf16 autocast {amp}, our dense part compiled {compiled}, embedding backend {result['backend']}")
    print(f"  ids {drawn}: {skew['hot_rows_share']:.1%} of ids on the hottest {HOT_FRACTION:.0%} of rows, "
          f"{skew['distinct_rows_per_batch']:,.0f} distinct rows per table and batch")
    labels = {"ours": f"ours (fused sparse {args.optimizer}, MLPs SGD):",
              "plain_pytorch": f"plain PyTorch (EmbeddingBag + {baseline_opt}, MLPs SGD):",
              "ours_dynamic": f"ours, dynamic tables (capacity {capacity:,}):"}
    width = max(len(labels[name]) for name in steps)
    for name in steps:
        print(f"  {labels[name]:<{width}} {result[f'{name}_samples_per_s']:>12,.0f} samples/s")
    print(f"  {'ratio ours / plain:':<{width}} {result['speedup']:>12.2f}")
    if args.dynamic:
        d = result["dynamic_tables"]
        print(f"  {'ratio static / dynamic tables:':<{width}} {result['static_over_dynamic']:>12.2f}")
        print(f"  dynamic tables (hash table backend {d['hashtable_backend']}, train.admit_after={d['admit_after']}): "
              f"{d['distinct_ids_per_table']:,.0f} distinct ids per table in the batches; in the {args.tables} tables, "
              f"{d['ids']:,} ids held, {d['evictions']:,} evicted, {d['placed_while_timed']:,} placed during the "
              "timed steps")
    if args.json:
        write_json(args.json, result)
    return result


def draw_ids(kind: str, rows: int, shape: tuple[int, int], exponent: float, rng):
    """int64 ids in ``[0, rows)`` of shape ``(batch, tables)`` (a numpy array): uniform, or Zipf over each table.

    Zipf: rank ``r`` (1..rows) is drawn with probability about ``r**-exponent``
    (:func:`pipeline.data.synthetic.zipf_ranks`), and table ``t`` puts rank ``r`` on row
    ``(c_t + (r - 1) * a) mod rows``, a fixed permutation (``a`` near ``0.618 * rows`` and prime to it,
    ``c_t`` drawn per table), so the hot rows of a table are spread over it rather than packed at row 0.
    """
    import numpy as np

    from pipeline.data.synthetic import zipf_ranks

    if kind == "uniform":
        return rng.integers(0, rows, size=shape, dtype=np.int64)
    ranks = zipf_ranks(rng.random(shape), rows, exponent).astype(np.int64)
    stride = max(1, int(rows * 0.6180339887))
    while math.gcd(stride, rows) != 1:
        stride += 1
    start = rng.integers(0, rows, size=shape[1], dtype=np.int64)
    return (start[None, :] + (ranks - 1) * stride) % rows


def hot_rows_share(kind: str, rows: int, exponent: float) -> float:
    """The probability that an id of :func:`draw_ids` falls on the hottest 1% of its table's rows."""
    hot = max(1, int(rows * HOT_FRACTION))
    if kind == "uniform":
        return hot / rows
    if exponent == 1:
        return math.log(hot + 1) / math.log(rows + 1)
    return ((hot + 1) ** (1 - exponent) - 1) / ((rows + 1) ** (1 - exponent) - 1)


class StepBatch(NamedTuple):
    """One pre-made batch, as each model takes it."""

    dense: Any  # float32 [batch, 13]
    ids: Any  # int64 [batch, tables]: the rows, for the plain PyTorch model
    kjt: Any  # the rows as a KeyedJaggedTensor, for our static tables
    raw: Any  # each row as a 64-bit id of its own, as a KeyedJaggedTensor, for our dynamic tables
    label: Any  # float32 [batch]


def _batches(ids: list, rows: int, device) -> list[StepBatch]:
    """The batches of the rows ``ids`` (numpy ``[batch, tables]`` each) on ``device``. A dynamic table sees
    row ``r`` of table ``t`` as the id ``mix64(t * rows + r)`` (distinct rows, distinct ids, spread over 64 bits)."""
    import torch

    from pipeline.kernels.hashtable.reference import mix64
    from pipeline.sparse import KeyedJaggedTensor

    out = []
    for table_ids in ids:
        batch, tables = table_ids.shape
        keys = [f"C{i + 1}" for i in range(tables)]
        table_ids = torch.from_numpy(table_ids)
        raw = mix64(table_ids + torch.arange(tables, dtype=torch.int64) * rows)
        dense = torch.randn(batch, 13)
        label = torch.randint(0, 2, (batch,)).float()
        out.append(StepBatch(dense.to(device), table_ids.to(device),
                             KeyedJaggedTensor.from_dense(keys, table_ids).to(device),
                             KeyedJaggedTensor.from_dense(keys, raw).to(device), label.to(device)))
    return out


def _ours(args, dim, bottom, top, device, capacity: int = 0, admit_after: int = 1):
    """Our DLRM as the training stage builds it from a schema: static tables of ``args.rows`` rows, or with
    ``capacity``, dynamic tables of that capacity (the schema's columns of raw 64-bit ids)."""
    from pipeline.modules.configs import EmbeddingOptimizerConfig
    from pipeline.modules.models import ModelSizes, build_model
    from pipeline.schema import Column, Schema

    sparse = [Column(f"C{i + 1}", "categorical", "int64", cardinality=capacity, dynamic=True) if capacity else
              Column(f"C{i + 1}", "categorical", "int32", cardinality=args.rows) for i in range(args.tables)]
    schema = Schema([Column("label", "label", "float32")]
                    + [Column(f"I{i + 1}", "continuous", "float32") for i in range(13)] + sparse)
    sizes = ModelSizes(embedding_dim=dim, bottom_mlp=bottom, top_mlp=top)
    model = build_model("dlrm", schema, sizes, EmbeddingOptimizerConfig(args.optimizer, lr=0.01),
                        backend=args.backend, admit_after=admit_after)
    model.embedding.validate_ids = False  # the baseline does not check ids either
    return model.to(device)


def _baseline_optimizers(model, kind: str, lr: float) -> list:
    """SGD for the MLPs; the tables' sparse gradients to torch's optimizer of ``kind``."""
    import torch

    tables = list(model.tables.parameters())
    dense = [p for name, p in model.named_parameters() if not name.startswith("tables.")]
    sparse = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.SparseAdam}[kind]
    return [torch.optim.SGD(dense, lr=lr), sparse(tables, lr=lr)]


def _placed(model) -> int:
    """How many ids the dynamic tables of ``model`` have placed so far (each took an empty row or evicted an id)."""
    return sum(t.stats()["ids"] + t.stats()["evictions"] for t in model.embedding.dynamic.tables.values())


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
