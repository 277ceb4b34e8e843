"""Training step throughput (samples/s): our DLRM against a plain PyTorch DLRM of the same shape, same run;
or, with ``--embedding-budget-mb``, our DLRM with its tables in device memory against the same model with
its tables placed by the planner under that budget.

Ours: the schema-built DLRM, its EmbeddingCollection applying its fused sparse optimizer (``--optimizer``:
SGD, row-wise Adagrad or lazy Adam) to the touched rows inside the backward; the MLPs take SGD.
Baseline: one ``nn.EmbeddingBag(sparse=True)`` per table, the same MLPs and interaction, the MLPs
under ``torch.optim.SGD`` and the tables under torch's nearest optimizer for sparse gradients:
``SGD``, ``Adagrad`` (element-wise, with a dense state as large as the tables) or ``SparseAdam``
(lazy, like ours). Both train on the same pre-made batches of one-hot ids, uniform over each table
or Zipf-skewed (``--ids zipf``); the rounds alternate between the two so that load from other
processes hits both alike; the median round is reported.

``--embedding-budget-mb N``: the planner places the tables as the training stage does under
``distributed.memory_per_rank_mb=N`` on one process (the tables that do not fit host-cached: in host
memory behind device caches of their hot rows, the caches sharing what the budget leaves), and the
step of that model, its rows prefetched a step ahead as the stage does
(:class:`~pipeline.distributed.train_pipeline.CachePrefetchPipeline`), is timed against the same model
with every table in device memory, on the same stream of batches: a fresh batch every step (warm-up,
then the rounds'), since a cache would hold a few batches used again whole. It reports both rates, their
ratio and each host-cached table's cache hit rate over the timed steps. On the CPU the budget is
simulated as on a GPU: the caches are tensors of their own beside the host tables.

    python -m pipeline bench train                       # CPU: 26 x 100k rows, dim 64, batch 2048
    python -m pipeline bench train --device cuda --preset mlperf --batch 65536   # bf16 autocast on GPU
    python -m pipeline bench train --device cuda --preset mlperf --batch 65536 --ids zipf --optimizer adam
    python -m pipeline bench train --device cuda --preset mlperf --batch 65536 --rows 4000000 --ids zipf --optimizer adagrad --embedding-budget-mb 16384 --warmup 100
"""

from __future__ import annotations

import argparse
import math

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
    parser.add_argument("--embedding-budget-mb", type=float, default=0.0,
                        help="device memory in MiB for the embedding tables (as distributed.memory_per_rank_mb): time "
                             "the model with its tables placed under it (host-cached where they do not fit) against "
                             "the same model with every table in device memory, instead of plain PyTorch (0: off)")
    parser.add_argument("--json", metavar="FILE", help="also write the figures and settings as JSON")


def run(args: argparse.Namespace, cfg) -> dict:
    import statistics
    import time

    import numpy as np
    import torch

    from pipeline.device import resolve_device
    from pipeline.errors import UserError
    from pipeline.files import write_json

    if not args.zipf_exponent > 0:
        raise UserError(f"--zipf-exponent: expected a number > 0, got {args.zipf_exponent}")
    if args.embedding_budget_mb < 0:
        raise UserError(f"--embedding-budget-mb: expected a number >= 0, got {args.embedding_budget_mb}")
    device = torch.device(resolve_device(cfg.device).kind)
    if args.threads:
        torch.set_num_threads(args.threads)
    amp = args.amp == "bf16" or (args.amp == "auto" and device.type == "cuda")
    compiled = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")
    dim = args.dim or (128 if args.preset == "mlperf" else 64)
    bottom = ([int(w) for w in args.bottom.split(",")] if args.bottom else [512, 256]) + [dim]
    top = [int(w) for w in args.top.split(",")] if args.top else (
        [1024, 1024, 512, 256, 1] if args.preset == "mlperf" else [512, 256, 1])
    torch.manual_seed(cfg.seed)

    rng = np.random.default_rng(cfg.seed)
    budget = args.embedding_budget_mb
    count = args.warmup + args.rounds * args.steps if budget else 4
    # One draw for the whole stream: each table's hot rows stay where they are from batch to batch.
    ids = np.split(draw_ids(args.ids, args.rows, (count * args.batch, args.tables), args.zipf_exponent, rng), count)
    distinct = [np.unique(b[:, t]).size for b in ids[:4] for t in range(args.tables)]
    skew = {"hot_rows_share": hot_rows_share(args.ids, args.rows, args.zipf_exponent),
            "distinct_rows_per_batch": float(np.mean(distinct))}
    batches = _batches(ids, device)
    del ids
    ours = _ours(args, dim, bottom, top, device)
    our_step = _our_step(ours, amp, compiled)

    def ours_on(round_batches):
        for dense, kjt, _, label in round_batches:
            our_step(dense, kjt, label)

    if budget:
        placed, topology = _placed(args, dim, bottom, top, device)
        rival, rival_name = _through_caches(placed, _our_step(placed, amp, compiled), device), "host_cached"
        rounds = [batches[args.warmup + r * args.steps : args.warmup + (r + 1) * args.steps] for r in range(args.rounds)]
        warmup = batches[: args.warmup]
    else:
        baseline = _plain_dlrm(args.tables, args.rows, dim, bottom, top).to(device)
        base_step = _plain_step(baseline, _baseline_optimizers(baseline, args.optimizer, lr=0.01), amp)

        def rival(round_batches):
            for dense, _, table_ids, label in round_batches:
                base_step(dense, table_ids, label)

        rival_name = "plain_pytorch"
        rounds = [[batches[i % len(batches)] for i in range(args.steps)]] * args.rounds
        warmup = [batches[i % len(batches)] for i in range(args.warmup)]

    def timed(train_on, round_batches):
        _sync(device)
        start = time.perf_counter()
        train_on(round_batches)
        _sync(device)
        return args.batch * len(round_batches) / (time.perf_counter() - start)

    for train_on in (ours_on, rival):
        timed(train_on, warmup)
    found_before = dict(placed.embedding.cache_stats()) if budget else {}
    rates: dict[str, list[float]] = {"ours": [], rival_name: []}
    for round_batches in rounds:
        rates["ours"].append(timed(ours_on, round_batches))
        rates[rival_name].append(timed(rival, round_batches))
    result = {
        "device": device.type,
        "backend": ours.embedding.backend.name,
        "shape": f"{args.tables} tables x {args.rows} rows, dim {dim}, bottom {bottom}, top {top}",
        "batch": args.batch,
        "ids": args.ids,
        "zipf_exponent": args.zipf_exponent if args.ids == "zipf" else None,
        **skew,
        "optimizer": args.optimizer,
        "dense_optimizer": "SGD",
        "amp_bf16": amp,
        "compiled": compiled,
        "threads": torch.get_num_threads(),
        "ours_samples_per_s": statistics.median(rates["ours"]),
        f"{rival_name}_samples_per_s": statistics.median(rates[rival_name]),
        "rounds": rates,
    }
    drawn = f"zipf, exponent {args.zipf_exponent:g}" if args.ids == "zipf" else "uniform"
    print(f"bench train on {device.type} ({result['threads']} threads), {result['shape']}, batch {args.batch}, "
          f"bf16 autocast {amp}, our dense part compiled {compiled}, embedding backend {result['backend']}")
    print(f"  ids {drawn}: {skew['hot_rows_share']:.1%} of ids on the hottest {HOT_FRACTION:.0%} of rows, "
          f"{skew['distinct_rows_per_batch']:,.0f} distinct rows per table and batch")
    if budget:
        result.update(_placement_figures(placed, topology, found_before, budget))
        result["host_cached_ratio"] = result["host_cached_samples_per_s"] / result["ours_samples_per_s"]
        _print_placement(result, args.optimizer)
    else:
        baseline_opt = BASELINE_OPTIMIZERS[args.optimizer]
        result["baseline_optimizer"] = f"{baseline_opt} (tables), SGD (MLPs)"
        result["speedup"] = result["ours_samples_per_s"] / result["plain_pytorch_samples_per_s"]
        _print_rates([(f"ours (fused sparse {args.optimizer}, MLPs SGD):", result["ours_samples_per_s"]),
                      (f"plain PyTorch (EmbeddingBag + {baseline_opt}, MLPs SGD):",
                       result["plain_pytorch_samples_per_s"])], "ratio ours / plain:", result["speedup"])
    if args.json:
        write_json(args.json, result)
    return result


def _our_step(model, amp: bool, compiled: bool):
    """One training step of our model on ``(dense, sparse, label)``: its dense part and loss compiled (as the
    training stage does) when ``compiled``, its tables updated in the backward, its MLPs by SGD."""
    import functools

    import torch

    from pipeline.train.loop import dense_loss

    loss_of = functools.partial(dense_loss, model, amp)
    if compiled:
        loss_of = torch.compile(loss_of, dynamic=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(dense, sparse, label):
        loss = loss_of(dense, model.embedding(sparse), label)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def _plain_step(model, optimizers: list, amp: bool):
    """One training step of the plain PyTorch model (eager) on ``(dense, ids, label)``."""
    import torch

    from pipeline.train.evaluate import autocast

    def step(dense, ids, label):
        with autocast(dense.device, amp):
            logits = model(dense, ids)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), label)
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()

    return step


def _placed(args, dim, bottom, top, device):
    """Our model with its tables placed by the planner under ``--embedding-budget-mb``, as the training stage
    places them on one process (the same values as :func:`_ours`'), and the planner's topology."""
    import torch

    from pipeline.distributed.config import DistributedConfig
    from pipeline.distributed.model_parallel import make_planner
    from pipeline.errors import UserError
    from pipeline.modules.cached_collection import HostCachedCollection

    model = _ours(args, dim, bottom, top, "cpu")
    ec = model.embedding
    planner = make_planner(DistributedConfig(memory_per_rank_mb=args.embedding_budget_mb), 1, device,
                           batch_size=args.batch, optimizer=args.optimizer, weight_bytes=4)
    plan = planner.plan(ec.tables)
    cached = {name: p.cache_rows for name, p in plan.tables.items() if p.cache_rows}
    if not cached:
        raise UserError(f"--embedding-budget-mb {args.embedding_budget_mb:g}: every table fits in it, so none is "
                        "host-cached: give a budget below what the tables take")
    # The plain tables go before the host-cached ones are drawn (by build_model's generator, seed 0), so that
    # host memory holds the tables once.
    tables, features, optimizer = ec.tables, ec.feature_names, ec.optimizer
    model.embedding = ec = None
    model.embedding = HostCachedCollection(tables, features, cached, optimizer, backend=args.backend, validate_ids=False,
                                           generator=torch.Generator().manual_seed(0))
    return model.to(device), planner.topology


def _through_caches(model, step, device):
    """Trains on a round's batches as the training stage does with host-cached tables: each batch's rows
    prefetched into the caches while the batch before trains."""
    from pipeline.distributed.train_pipeline import CachePrefetchPipeline
    from pipeline.loader import Batch

    pipeline = CachePrefetchPipeline(model, device)

    def train_on(round_batches):
        for batch in pipeline(Batch(dense, kjt, label) for dense, kjt, _, label in round_batches):
            step(batch.dense, batch.sparse, batch.label)

    return train_on


def _placement_figures(model, topology, found_before: dict, budget_mb: float) -> dict:
    """The budget against the tables, each host-cached table's cache and its hit rate over the timed steps."""
    from pipeline.distributed.planner.estimators import bytes_per_row

    tables = model.embedding.tables
    size = sum(t.rows * bytes_per_row(t.dim, topology) for t in tables) / 2**20
    cached = {t.name: t.slots for t in model.embedding.cache.tables}
    hit_rates = {}
    for name, stats in model.embedding.cache_stats().items():
        before = found_before[name]
        rows = stats.rows - before.rows
        hit_rates[name] = (stats.hits - before.hits) / rows if rows else float("nan")
    return {"embedding_budget_mb": budget_mb, "tables_mb": size, "tables_over_budget": size / budget_mb,
            "host_cached_tables": {t.name: {"rows": t.rows, "cache_rows": cached[t.name]} for t in tables
                                   if t.name in cached},
            "tables_in_device_memory": [t.name for t in tables if t.name not in cached],
            "hit_rates": hit_rates}


def _print_placement(result: dict, optimizer: str) -> None:
    cached, resident = result["host_cached_tables"], result["tables_in_device_memory"]
    cache_rows = sum(c["cache_rows"] for c in cached.values())
    print(f"  embedding budget {_mib(result['embedding_budget_mb'])} MiB, tables {_mib(result['tables_mb'])} MiB "
          f"({result['tables_over_budget']:.2f}x): {len(resident)} tables in device memory, {len(cached)} host-cached "
          f"behind device caches of {cache_rows:,} rows in all")
    _print_rates([(f"ours, every table in device memory (fused sparse {optimizer}):", result["ours_samples_per_s"]),
                  ("ours, tables placed under the budget:", result["host_cached_samples_per_s"])],
                 "ratio placed / in device memory:", result["host_cached_ratio"])
    print("  cache hit rate over the timed steps (the share of a batch's distinct rows found in the cache):")
    for name, rate in result["hit_rates"].items():
        print(f"    {name}: {rate:6.1%}, a cache of {cached[name]['cache_rows']:,} of its {cached[name]['rows']:,} rows")


def _mib(value: float) -> str:
    return f"{value:,.0f}" if value >= 10 else f"{value:.3g}"


def _print_rates(rates: list[tuple[str, float]], ratio_label: str, ratio: float) -> None:
    width = max(len(label) for label, _ in rates + [(ratio_label, 0)])
    for label, rate in rates:
        print(f"  {label:<{width}} {rate:>12,.0f} samples/s")
    print(f"  {ratio_label:<{width}} {ratio:>12.2f}")


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


def _batches(ids: list, device):
    import torch

    from pipeline.sparse import KeyedJaggedTensor

    out = []
    for table_ids in ids:
        batch, tables = table_ids.shape
        keys = [f"C{i + 1}" for i in range(tables)]
        table_ids = torch.from_numpy(table_ids)
        dense = torch.randn(batch, 13)
        label = torch.randint(0, 2, (batch,)).float()
        kjt = KeyedJaggedTensor.from_dense(keys, table_ids)
        out.append((dense.to(device), kjt.to(device), table_ids.to(device), label.to(device)))
    return out


def _ours(args, dim, bottom, top, device):
    from pipeline.modules.configs import EmbeddingOptimizerConfig
    from pipeline.modules.models import ModelSizes, build_model
    from pipeline.schema import Column, Schema

    schema = Schema([Column("label", "label", "float32")]
                    + [Column(f"I{i + 1}", "continuous", "float32") for i in range(13)]
                    + [Column(f"C{i + 1}", "categorical", "int32", cardinality=args.rows) for i in range(args.tables)])
    sizes = ModelSizes(embedding_dim=dim, bottom_mlp=bottom, top_mlp=top)
    model = build_model("dlrm", schema, sizes, EmbeddingOptimizerConfig(args.optimizer, lr=0.01),
                        backend=args.backend)
    model.embedding.validate_ids = False  # the baseline does not check ids either
    return model.to(device)


def _baseline_optimizers(model, kind: str, lr: float) -> list:
    """SGD for the MLPs; the tables' sparse gradients to torch's optimizer of ``kind``."""
    import torch

    tables = list(model.tables.parameters())
    dense = [p for name, p in model.named_parameters() if not name.startswith("tables.")]
    sparse = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.SparseAdam}[kind]
    return [torch.optim.SGD(dense, lr=lr), sparse(tables, lr=lr)]


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
