"""Training step throughput (samples/s): our DLRM against a plain PyTorch DLRM of the same shape, same run;
with ``--dynamic``, also our DLRM with dynamic tables; with ``--embedding-budget-mb``, our DLRM with its tables
in device memory against the same model with its tables placed under that budget.

Ours: the schema-built DLRM, its EmbeddingCollection applying its fused sparse optimizer (``--optimizer``:
SGD, row-wise Adagrad or lazy Adam) to the touched rows inside the backward; the MLPs take SGD.
Baseline: one ``nn.EmbeddingBag(sparse=True)`` per table, the same MLPs and interaction, the MLPs
under ``torch.optim.SGD`` and the tables under torch's nearest optimizer for sparse gradients:
``SGD``, ``Adagrad`` (element-wise, with a dense state as large as the tables) or ``SparseAdam``
(lazy, like ours). Both train on the same pre-made batches of one-hot ids, uniform over each table
or Zipf-skewed (``--ids zipf``), four batches in turn; the rounds alternate between the models so that
load from other processes hits them alike; the median round is reported. The ids of a run are drawn
once for all its batches, so each table's hot rows stay where they are from batch to batch.

``--dynamic``: a third model joins the rounds: our DLRM with dynamic tables of the same shape
(``etl.hash_ids``' columns: raw 64-bit ids, placed in each table's rows by its hash table as the
training stage does, admitted after ``train.admit_after`` occurrences, the least recently used evicted),
trained on the same ids, each row's as a 64-bit id of its own, as the stage trains it: each batch's ids
placed a step ahead, while the batch before trains, its new rows started at its lookup
(:class:`~pipeline.distributed.train_pipeline.PrefetchPipeline`, one pass over all the run's batches). It reports
its samples/s and the ratio of the static tables' to it.

``--embedding-budget-mb N``: the planner places the tables as the training stage does under
``distributed.memory_per_rank_mb=N`` on one process (the tables that do not fit host-cached: in host
memory behind device caches of their hot rows, the caches sharing what the budget leaves), and the
step of that model, its rows prefetched a step ahead as the stage does
(:class:`~pipeline.distributed.train_pipeline.PrefetchPipeline`, one pass over all the run's batches, as the stage's
over an epoch: a round starts with its first batches prefetched during the round before), is timed against the same
model with every table in device memory, on the same stream of batches: a fresh batch every step (warm-up,
then the rounds'), since a cache would hold a few batches used again whole. It reports both rates, their
ratio and each host-cached table's cache hit rate over the timed steps; no plain PyTorch model is built.
On the CPU the budget is simulated as on a GPU: the caches are tensors of their own beside the host
tables. It places static tables, so it is not taken with ``--dynamic``.

    python -m pipeline bench train                       # CPU: 26 x 100k rows, dim 64, batch 2048
    python -m pipeline bench train --device cuda --preset mlperf --batch 65536   # bf16 autocast on GPU
    python -m pipeline bench train --device cuda --preset mlperf --batch 65536 --ids zipf --optimizer adam
    python -m pipeline bench train --device cuda --preset mlperf --batch 65536 --ids zipf --dynamic
    python -m pipeline bench train --device cuda --preset mlperf --batch 65536 --rows 2000000 --ids zipf --optimizer adagrad --embedding-budget-mb 8192 --warmup 30
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from pipeline.bench.arguments import integer, integers, number, output_file, widths_ending_in_one
from pipeline.train.config import COMPILE_MODES, MLP_BACKENDS

IDS = ("uniform", "zipf")
OPTIMIZERS = ("sgd", "adagrad", "adam")
ZIPF_EXPONENT = 1.1
HOT_FRACTION = 0.01
ROTATING_BATCHES = 4
"""Without a budget, the models train on this many pre-made batches in turn."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=["cpu", "mlperf"], default="cpu",
                        help="cpu: dim 64, bottom 512-256-64, top 512-256-1; mlperf: dim 128, "
                             "bottom 512-256-128, top 1024-1024-512-256-1")
    parser.add_argument("--tables", type=integer(1), default=26, help="embedding tables, one per sparse feature")
    parser.add_argument("--rows", type=integer(1), default=100_000, help="rows per table")
    parser.add_argument("--dim", type=integer(0), default=0, help="embedding dim (0: the preset's)")
    parser.add_argument("--batch", type=integer(1), default=2048, help="samples per step")
    parser.add_argument("--steps", type=integer(1), default=20, help="timed steps per round")
    parser.add_argument("--rounds", type=integer(1), default=3, help="alternating rounds per model (median reported)")
    parser.add_argument("--warmup", type=integer(0), default=3, help="untimed steps before the first round")
    parser.add_argument("--bottom", type=integers(1), help="bottom MLP widths before the embedding dim, e.g. 512,256")
    parser.add_argument("--top", type=widths_ending_in_one, help="top MLP widths ending in 1, e.g. 512,256,1")
    parser.add_argument("--backend", choices=["auto", "torch", "cuda"], default="auto", help="our embedding backend")
    parser.add_argument("--amp", choices=["auto", "bf16", "off"], default="auto",
                        help="bf16 autocast of the MLPs (auto: on GPU only)")
    parser.add_argument("--threads", type=integer(0), default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--ids", choices=IDS, default="uniform",
                        help="uniform: every row of a table alike; zipf: row of rank r drawn with probability "
                             "~ r**-exponent, the ranks spread over each table by a fixed permutation")
    parser.add_argument("--zipf-exponent", type=number(above=0), default=ZIPF_EXPONENT,
                        help="skew of --ids zipf (> 0); default 1.1, in the 1.05-1.2 range taken as Criteo-like "
                             "for its large tables (the synthetic data generator draws 1.25-1.6, more skewed)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd",
                        help="our tables' fused optimizer: sgd | adagrad (row-wise) | adam (lazy); the baseline's "
                             "tables take torch's SGD | Adagrad (element-wise) | SparseAdam")
    parser.add_argument("--compile", choices=COMPILE_MODES, default="auto",
                        help="torch.compile our dense part and loss, as the training stage does (train.compile; "
                             "auto: on a GPU); the plain PyTorch model runs eager")
    parser.add_argument("--mlp-backend", choices=MLP_BACKENDS, default="torch",
                        help="our MLPs in training, as train.mlp_backend (cublaslt: bias and ReLU inside cuBLASLt's "
                             "products, their gradients from the ReLU's bit mask); the plain PyTorch model's are "
                             "torch's layers")
    parser.add_argument("--dynamic", action="store_true",
                        help="also train our DLRM with dynamic tables of the same shape (raw 64-bit ids placed in "
                             "their rows by a hash table, admitted after train.admit_after occurrences) on the same "
                             "ids, and report its samples/s and the ratio static / dynamic (not with "
                             "--embedding-budget-mb)")
    parser.add_argument("--embedding-budget-mb", type=number(low=0), default=0.0,
                        help="device memory in MiB for the embedding tables (as distributed.memory_per_rank_mb): time "
                             "the model with its tables placed under it (host-cached where they do not fit) against "
                             "the same model with every table in device memory, instead of plain PyTorch, on a fresh "
                             "batch every step (0: off; not with --dynamic)")
    parser.add_argument("--json", type=output_file, metavar="FILE", help="also write the figures and settings as JSON")
    parser.add_argument("--profile", type=integer(0), default=0, metavar="N",
                        help="after the timed rounds, profile N more steps of each model with torch.profiler: its "
                             "ms a step, its kernels' ms a step on the device, and the top operations in "
                             "profile-<model>.txt beside --json (or in the workdir)")


def run(args: argparse.Namespace, cfg) -> dict:
    import statistics
    import time

    import numpy as np
    import torch

    from pipeline.bench.stage_probe import sync
    from pipeline.bench.train_dynamic import DynamicTraining, print_dynamic_tables
    from pipeline.bench.train_host_cached import HostCachedTraining, print_hit_rates, print_placement
    from pipeline.bench.train_models import our_dlrm, our_training, print_rates, step_batches
    from pipeline.bench.train_plain import BASELINE_OPTIMIZERS, plain_training
    from pipeline.bench.train_profile import print_profiles, profile_steps
    from pipeline.device import resolve_device
    from pipeline.errors import UserError
    from pipeline.files import write_json
    from pipeline.modules.backends import check_backend
    from pipeline.modules.models import ModelSizes
    from pipeline.train.loop import compiles

    budget = args.embedding_budget_mb
    if budget and args.dynamic:
        raise UserError("--dynamic with --embedding-budget-mb: give one of them: the budget places static tables, "
                        "host-caching those that do not fit, and dynamic tables are not placed under it")
    device = torch.device(resolve_device(cfg.device).kind)
    if args.threads:
        torch.set_num_threads(args.threads)
    amp = args.amp == "bf16" or (args.amp == "auto" and device.type == "cuda")
    compiled = compiles(args.compile, device)
    dim = args.dim or (128 if args.preset == "mlperf" else 64)
    bottom = (args.bottom or [512, 256]) + [dim]
    top = args.top or ([1024, 1024, 512, 256, 1] if args.preset == "mlperf" else [512, 256, 1])
    check_backend(f"--backend {args.backend}", args.backend, device)
    sizes = ModelSizes(embedding_dim=dim, bottom_mlp=bottom, top_mlp=top)
    torch.manual_seed(cfg.seed)

    rng = np.random.default_rng(cfg.seed)
    count = args.warmup + args.rounds * args.steps + args.profile if budget else ROTATING_BATCHES
    # One draw for the whole stream: each table's hot rows stay where they are from batch to batch.
    ids = np.split(draw_ids(args.ids, args.rows, (count * args.batch, args.tables), args.zipf_exponent, rng), count)
    distinct = [np.unique(b[:, t]).size for b in ids[:ROTATING_BATCHES] for t in range(args.tables)]
    skew = {"hot_rows_share": hot_rows_share(args.ids, args.rows, args.zipf_exponent),
            "distinct_rows_per_batch": float(np.mean(distinct))}
    batches = step_batches(ids, args.rows, device, raw=args.dynamic)
    del ids
    if budget:
        warmup = batches[: args.warmup]
        rounds = [batches[args.warmup + r * args.steps : args.warmup + (r + 1) * args.steps] for r in range(args.rounds)]
    else:
        warmup = [batches[i % count] for i in range(args.warmup)]
        rounds = [[batches[i % count] for i in range(args.steps)]] * args.rounds
    profiled = batches[count - args.profile:] if budget else [batches[i % count] for i in range(args.profile)]

    stream = warmup + [batch for round_batches in rounds for batch in round_batches] + profiled

    ours = our_dlrm(args, sizes, device)
    models = {"ours": our_training(ours, amp, args.compile)}
    if budget:
        host_cached = models["host_cached"] = HostCachedTraining(args, sizes, device, amp, args.compile,
                                                                    cfg.distributed.sharding, stream)
    else:
        models["plain_pytorch"] = plain_training(args, sizes, device, amp)
        if args.dynamic:
            dynamic = models["ours_dynamic"] = DynamicTraining(args, sizes, device, amp, args.compile,
                                                               cfg.train.admit_after, stream)

    def timed(train_on, round_batches):
        sync(device)
        start = time.perf_counter()
        train_on(round_batches)
        sync(device)
        return args.batch * len(round_batches) / (time.perf_counter() - start)

    for train_on in models.values():
        timed(train_on, warmup)
    if budget:
        host_cached.start_timing()
    elif args.dynamic:
        dynamic.start_timing()
    rates: dict[str, list[float]] = {name: [] for name in models}
    for r, round_batches in enumerate(rounds, 1):
        for name, train_on in models.items():
            rates[name].append(timed(train_on, round_batches))
        print(f"[bench train] round {r} of {len(rounds)}: "
              + ", ".join(f"{name} {rates[name][-1]:,.0f}" for name in models) + " samples/s", flush=True)
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
        "compile": args.compile,
        "mlp_backend": args.mlp_backend,
        "threads": torch.get_num_threads(),
        **{f"{name}_samples_per_s": statistics.median(rates[name]) for name in models},
        "rounds": rates,
    }
    drawn = f"zipf, exponent {args.zipf_exponent:g}" if args.ids == "zipf" else "uniform"
    print(f"bench train on {device.type} ({result['threads']} threads), {result['shape']}, batch {args.batch}, "
          f"bf16 autocast {amp}, our dense part compiled {compiled}, embedding backend {result['backend']}, our MLPs "
          f"through {args.mlp_backend}")
    print(f"  ids {drawn}: {skew['hot_rows_share']:.1%} of ids on the hottest {HOT_FRACTION:.0%} of rows, "
          f"{skew['distinct_rows_per_batch']:,.0f} distinct rows per table and batch")
    if budget:
        result.update(host_cached.figures())
        result["host_cached_ratio"] = result["host_cached_samples_per_s"] / result["ours_samples_per_s"]
        print_placement(result)
        print_rates([(f"ours, every table in device memory (fused sparse {args.optimizer}):",
                      result["ours_samples_per_s"]),
                     ("ours, tables placed under the budget:", result["host_cached_samples_per_s"])],
                    [("ratio placed / in device memory:", result["host_cached_ratio"])])
        print_hit_rates(result)
    else:
        baseline_opt = BASELINE_OPTIMIZERS[args.optimizer]
        result["baseline_optimizer"] = f"{baseline_opt} (tables), SGD (MLPs)"
        result["speedup"] = result["ours_samples_per_s"] / result["plain_pytorch_samples_per_s"]
        printed_rates = [(f"ours (fused sparse {args.optimizer}, MLPs SGD):", result["ours_samples_per_s"]),
                         (f"plain PyTorch (EmbeddingBag + {baseline_opt}, MLPs SGD):",
                          result["plain_pytorch_samples_per_s"])]
        ratios = [("ratio ours / plain:", result["speedup"])]
        if args.dynamic:
            result["static_over_dynamic"] = result["ours_samples_per_s"] / result["ours_dynamic_samples_per_s"]
            result["dynamic_tables"] = dynamic.figures(batches)
            printed_rates.append((f"ours, dynamic tables (capacity {dynamic.capacity:,}):",
                                  result["ours_dynamic_samples_per_s"]))
            ratios.append(("ratio static / dynamic tables:", result["static_over_dynamic"]))
        print_rates(printed_rates, ratios)
        if args.dynamic:
            print_dynamic_tables(result["dynamic_tables"], args.tables)
    if args.profile:
        folder = Path(args.json).parent if args.json else Path(cfg.workdir)
        folder.mkdir(parents=True, exist_ok=True)
        result["profile"] = {name: profile_steps(name, train_on, profiled, device, folder)
                             for name, train_on in models.items()}
        print_profiles(result["profile"])
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
