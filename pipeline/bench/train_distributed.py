"""Model-parallel training throughput: DLRM at 1 and N ranks with the per-rank batch fixed.

For each rank count the ranks train the schema-built DLRM (the MLPerf shape by default: 26 tables,
dim 128, bottom 512-256-128, top 1024-1024-512-256-1, 65536 samples per rank and step) on pre-made
random batches (one-hot ids, uniform over each table, different on every rank). One rank trains
the plain model (no sharding, no DDP: the baseline); N ranks train it through
DistributedModelParallel (the planner's plan, table-wise unless ``--sharding`` says otherwise),
pipelined as the training stage trains them (``--loop pipelined``: each next batch's id exchange
started by the stage's :class:`~pipeline.distributed.train_pipeline.SparseDistPipeline` while a
batch trains), one batch after the other (``--loop plain``), or both (``--loop pipelined,plain``, one
run each). Reported: samples/s over all ranks (median of the rounds), scaling efficiency
``rate(N) / (N * rate(1))``, and from one extra profiled round (collectives synchronized and
timed) the all-to-all / all-reduce time per step beside the rest of the step, and the loss of the
trained weights on each rank's first batch (the mean over the ranks: the same for both loops, which
train the same weights).

    python -m pipeline.bench.train_distributed --device cuda --nproc 1,2
    python -m pipeline.bench.train_distributed --device cpu --nproc 1,2 --rows 20000 --dim 16 --batch 1024
    python -m pipeline bench train_distributed --device cpu --nproc 2 --loop pipelined,plain --mlp small
"""

from __future__ import annotations

import argparse
import statistics
import sys

from pipeline.bench.arguments import integer, integers, one_of, output_file
from pipeline.errors import UserError
from pipeline.files import write_json

LOOPS = ("pipelined", "plain")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=integers(1), default=[1, 2],
                        help="rank counts to run, comma separated (default 1,2; 1 = the baseline)")
    parser.add_argument("--tables", type=integer(1), default=26, help="embedding tables, one per sparse feature")
    parser.add_argument("--rows", type=integer(1), default=500_000, help="rows per table")
    parser.add_argument("--dim", type=integer(1), default=128, help="embedding dim")
    parser.add_argument("--mlp", choices=["mlperf", "small"], default="mlperf",
                        help="mlperf: bottom 512-256-dim, top 1024-1024-512-256-1; small: bottom 64-dim, top 64-1")
    parser.add_argument("--batch", type=integer(1), default=65536, help="samples per rank and step")
    parser.add_argument("--steps", type=integer(1), default=20, help="timed steps per round")
    parser.add_argument("--rounds", type=integer(1), default=3, help="timed rounds (median reported)")
    parser.add_argument("--warmup", type=integer(0), default=3, help="untimed steps first")
    parser.add_argument("--backend", choices=["auto", "torch", "cuda"], default="auto", help="embedding backend")
    parser.add_argument("--amp", choices=["auto", "bf16", "off"], default="auto", help="bf16 autocast of the MLPs")
    parser.add_argument("--sharding", choices=["table_wise", "row_wise", "data_parallel", "auto"], default="table_wise",
                        help="how the tables are placed (auto: the planner's choice)")
    parser.add_argument("--comm", type=one_of("fp32", "bf16"), default=["fp32"],
                        help="fp32 | bf16 | fp32,bf16: dtype(s) of the pooled vectors between ranks (one run each)")
    parser.add_argument("--loop", type=one_of(*LOOPS), default=["pipelined"],
                        help="pipelined | plain | pipelined,plain: N ranks' step as the training stage runs it (the "
                        "next batch's id exchange started while one trains) or one batch after the other (one run each)")
    parser.add_argument("--out", type=output_file, help="also write the results as JSON here")
    parser.add_argument("--profile", default="", metavar="DIR",
                        help="also profile a few steps per rank (torch.profiler) and write the op tables to DIR")


def run(args: argparse.Namespace, cfg=None) -> dict:
    import torch

    from pipeline.device import resolve_device
    from pipeline.distributed.spawn import spawn
    from pipeline.modules.backends import check_backend

    device = resolve_device(getattr(cfg, "device", None) or args.device).kind
    counts, comms, loops = args.nproc, args.comm, args.loop
    if device == "cuda" and max(counts) > torch.cuda.device_count():
        raise UserError(f"--nproc {max(counts)} needs as many GPUs, found {torch.cuda.device_count()}")
    if args.amp == "bf16" and device != "cuda":
        raise UserError(f"--amp bf16: the ranks' autocast runs on GPUs; on {device} use --amp auto or off")
    check_backend(f"--backend {args.backend}", args.backend, device)
    backend = "nccl" if device == "cuda" else "gloo"
    results = {}
    for n in counts:
        runs = [(comm, loop) for comm in comms for loop in loops] if n > 1 else [("-", "plain")]
        for comm, loop in runs:
            per_rank = spawn(_worker, n, backend, args=({**vars(args), "comm": comm, "loop": loop}, device),
                             timeout_s=900)
            results[f"{n}" if n == 1 else f"{n}/{comm}/{loop}"] = {**_summarize(n, per_rank, args), "loop": loop}
    base = results.get("1")
    for r in results.values():
        r["scaling_efficiency"] = r["samples_per_s"] / (r["ranks"] * base["samples_per_s"]) if base else None
    shape = (f"{args.tables} tables x {args.rows} rows, dim {args.dim}, mlp {args.mlp}, "
             f"batch {args.batch} per rank, sharding {args.sharding}")
    print(f"bench train_distributed on {device} ({backend}): {shape}")
    print(f"  {'ranks/exchange/loop':>19} {'samples/s':>14} {'efficiency':>10} {'step ms':>9} {'comm ms':>9} "
          f"{'rest ms':>9} {'loss':>8}")
    for key, r in results.items():
        eff = f"{r['scaling_efficiency']:.3f}" if r["scaling_efficiency"] is not None else "-"
        print(f"  {key:>19} {r['samples_per_s']:>14,.0f} {eff:>10} {r['profiled_step_ms']:>9.2f} "
              f"{r['comm_ms_per_step']:>9.2f} {r['profiled_step_ms'] - r['comm_ms_per_step']:>9.2f} {r['loss']:>8.5f}")
    out = {"device": device, "shape": shape, "results": results}
    if args.out:
        write_json(args.out, out)
    return out


def _summarize(n: int, per_rank: list[dict], args) -> dict:
    rounds = [sum(r["rates"][i] for r in per_rank) for i in range(len(per_rank[0]["rates"]))]
    return {
        "ranks": n,
        "samples_per_s": statistics.median(rounds),
        "rounds": rounds,
        "profiled_step_ms": max(r["profiled_step_ms"] for r in per_rank),
        "comm_ms_per_step": max(r["comm_ms_per_step"] for r in per_rank),
        "plan": per_rank[0].get("plan"),
        "embedding_backend": per_rank[0]["embedding_backend"],
        "loss": statistics.fmean(r["loss"] for r in per_rank),
    }


def _worker(rank: int, world: int, args: dict, device_kind: str) -> dict:
    import contextlib
    import itertools
    import time

    import torch
    import torch.nn.functional as F

    from pipeline.distributed import DistributedModelParallel, EmbeddingShardingPlanner, Topology
    from pipeline.distributed.comm import CommTimer
    from pipeline.distributed.train_pipeline import SparseDistPipeline
    from pipeline.loader import Batch
    from pipeline.modules.configs import EmbeddingOptimizerConfig
    from pipeline.modules.models import ModelSizes, build_model
    from pipeline.schema import Column, Schema
    from pipeline.sparse import KeyedJaggedTensor

    a = argparse.Namespace(**args)
    device = torch.device(f"cuda:{rank}" if device_kind == "cuda" else "cpu")
    amp = a.amp == "bf16" or (a.amp == "auto" and device.type == "cuda")
    schema = Schema([Column("label", "label", "float32")]
                    + [Column(f"I{i + 1}", "continuous", "float32") for i in range(13)]
                    + [Column(f"C{i + 1}", "categorical", "int32", cardinality=a.rows) for i in range(a.tables)])
    if a.mlp == "mlperf":
        sizes = ModelSizes(embedding_dim=a.dim, bottom_mlp=[512, 256, a.dim], top_mlp=[1024, 1024, 512, 256, 1])
    else:
        sizes = ModelSizes(embedding_dim=a.dim, bottom_mlp=[64, a.dim], top_mlp=[64, 1])
    model = build_model("dlrm", schema, sizes, EmbeddingOptimizerConfig("sgd", lr=0.01), backend=a.backend, seed=0)
    model.embedding.validate_ids = False
    plan = None
    if world == 1:
        net = model.to(device)
        embedding = model.embedding
    else:
        constraints = {} if a.sharding == "auto" else {t.name: a.sharding for t in model.embedding.tables}
        planner = EmbeddingShardingPlanner(Topology(world, batch_size=a.batch, optimizer="sgd"), constraints)
        net = DistributedModelParallel(model, planner=planner, device=device, verbose=False, comm_dtype=a.comm)
        plan = net.plans["embedding"].to_dict()
        embedding = net.module.embedding
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    keys = [f"C{i + 1}" for i in range(a.tables)]
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = []
    for _ in range(2):
        ids = torch.randint(0, a.rows, (a.batch, a.tables), generator=gen)
        batches.append(Batch(torch.randn(a.batch, 13, generator=gen), KeyedJaggedTensor.from_dense(keys, ids),
                             torch.randint(0, 2, (a.batch,), generator=gen).float()).to(device))
    # The batches in turn; pipelined, each handed out with the next one's input dist started.
    ahead = SparseDistPipeline(net, device)(itertools.cycle(batches)) if a.loop == "pipelined" else None
    source = ahead if ahead is not None else itertools.cycle(batches)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if world > 1:
            torch.distributed.barrier()

    def step():
        batch = next(source)
        ctx = torch.autocast("cuda", dtype=torch.bfloat16) if amp else contextlib.nullcontext()
        with ctx:
            logits = net(batch.dense, batch.sparse)
        loss = F.binary_cross_entropy_with_logits(logits.float(), batch.label)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    def timed(steps):
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        return time.perf_counter() - start

    timed(a.warmup)
    rates = [a.batch * a.steps / timed(a.steps) for _ in range(a.rounds)]
    timer = CommTimer.get()
    timer.reset()
    timer.enabled = True
    seconds = timed(a.steps)
    timer.enabled = False
    if a.profile:
        _profile(timed, device, f"{a.profile}/ranks{world}-{a.comm}-{a.loop}-rank{rank}.txt")
    if ahead is not None:
        ahead.close()
    with torch.no_grad():  # the trained weights' loss on this rank's first batch: the same for both loops
        loss = F.binary_cross_entropy_with_logits(net(batches[0].dense, batches[0].sparse).float(), batches[0].label)
    if world > 1:
        backend_name = next((st.local.backend.name for st in embedding.strategies if st.local is not None), "?")
    else:
        backend_name = embedding.backend.name
    return {"rates": rates, "profiled_step_ms": 1e3 * seconds / a.steps,
            "comm_ms_per_step": 1e3 * timer.seconds / a.steps, "plan": plan, "embedding_backend": backend_name,
            "loss": float(loss)}


def _profile(timed, device, path: str, steps: int = 5) -> None:
    """Op tables of ``steps`` training steps: by device time (on a GPU) and by host time."""
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        seconds = timed(steps)
    table = prof.key_averages()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    text = [f"{steps} steps, {1e3 * seconds / steps:.2f} ms per step (profiled)"]
    if cuda:
        text.append(table.table(sort_by="self_cuda_time_total", row_limit=40))
    text.append(table.table(sort_by="self_cpu_time_total", row_limit=30))
    Path(path).write_text("\n".join(text))
    prof.export_chrome_trace(str(Path(path).with_suffix(".trace.json")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.bench.train_distributed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto")
    try:
        run(parser.parse_args(argv))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
