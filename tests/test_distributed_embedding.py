"""The sharded embedding collection equals the unsharded one, on real ranks (gloo on CPU, NCCL on GPUs).

Every rank trains a ShardedEmbeddingCollection on its own batch (uneven sizes, empty bags, a shared
table, mean-pooled multi-hot bags, several dims); the parent process trains the plain collection on
the concatenated batch and compares each rank's outputs at every step and the final rows and
optimizer state of every table part a rank holds, for table-wise, row-wise, data-parallel and mixed
plans with each fused optimizer, and a plan with table-wise and row-wise parts host-cached (in host
memory behind device caches, one small enough to evict); and the three calls, with each next batch's
input dist launched before the current lookup (as a pipelined loop does), train exactly as
``forward`` does.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from pipeline.distributed import ParameterSharding, ShardedEmbeddingCollection, ShardingPlan
from pipeline.distributed.spawn import spawn
from pipeline.modules.cached_collection import HostCachedCollection
from pipeline.modules.collection import EmbeddingCollection
from pipeline.modules.configs import EmbeddingOptimizerConfig, TableConfig
from pipeline.sparse import KeyedJaggedTensor

FEATURES = ["A", "B", "C", "D", "E"]
TABLES = [
    TableConfig("t0", 50, 8, ["A"]),
    TableConfig("t1", 37, 4, ["B", "C"], pooling="mean"),   # shared by two features
    TableConfig("t2", 101, 8, ["D"], pooling="mean"),
    TableConfig("t3", 9, 4, ["A"]),                         # a second table on feature A
    TableConfig("t4", 64, 16, ["E"]),
]
MAX_ID = {"A": 9, "B": 37, "C": 37, "D": 101, "E": 64}
STEPS = 3


def make_plan(kind: str, world: int) -> ShardingPlan:
    if kind == "table_wise":
        return ShardingPlan(world, {t.name: ParameterSharding.table_wise(t.name, t.rows, (i + 1) % world)
                                    for i, t in enumerate(TABLES)})
    if kind == "row_wise":
        return ShardingPlan(world, {t.name: ParameterSharding.row_wise(t.name, t.rows, world) for t in TABLES})
    if kind == "data_parallel":
        return ShardingPlan(world, {t.name: ParameterSharding.data_parallel(t.name, t.rows, world) for t in TABLES})
    if kind == "host_cached":  # parts in host memory behind device caches: t4's the least that holds 2 steps
        ids = [{v for r in range(world) for v in batch(step, r)[0]["E"].values.tolist()} for step in range(STEPS)]
        least = max(len(a | b) for a, b in itertools.pairwise(ids))
        return ShardingPlan(world, {
            "t0": ParameterSharding.table_wise("t0", 50, world - 1, cache_rows=9),
            "t1": ParameterSharding.row_wise("t1", 37, world, cache_rows=37),   # each part's cache: the part
            "t2": ParameterSharding.data_parallel("t2", 101, world),
            "t3": ParameterSharding.table_wise("t3", 9, 0),
            "t4": ParameterSharding.table_wise("t4", 64, 0, cache_rows=least),
        })
    return ShardingPlan(world, {
        "t0": ParameterSharding.table_wise("t0", 50, world - 1),
        "t1": ParameterSharding.row_wise("t1", 37, world),
        "t2": ParameterSharding.data_parallel("t2", 101, world),
        "t3": ParameterSharding.table_wise("t3", 9, 0),
        "t4": ParameterSharding.row_wise("t4", 64, world),
    })


SCENARIOS = [("table_wise", "adagrad", "fp32"), ("row_wise", "adagrad", "fp32"), ("data_parallel", "adagrad", "fp32"),
             ("mixed", "adagrad", "fp32"), ("mixed", "adam", "fp32"), ("mixed", "sgd", "fp32"),
             ("mixed", "adagrad", "bf16"), ("host_cached", "adam", "fp32")]


def optimizer(kind: str) -> EmbeddingOptimizerConfig:
    return EmbeddingOptimizerConfig(kind, lr=0.1, weight_decay=0.01 if kind == "sgd" else 0.0)


def batch(step: int, rank: int) -> tuple[KeyedJaggedTensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step``: ``3 + rank`` samples, multi-hot B and D, some empty bags."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    b = 3 + rank
    bags = []
    for f in FEATURES:
        most = 4 if f in ("B", "D") else 1
        lengths = torch.randint(0, most + 1, (b,), generator=g).tolist()
        bags.append([torch.randint(0, MAX_ID[f], (n,), generator=g).tolist() for n in lengths])
    target = torch.randn(b, sum(TABLES[t].dim for t in (0, 1, 1, 2, 3, 4)), generator=g)
    return KeyedJaggedTensor.from_lists(FEATURES, bags), target


def concat(kjts: list[KeyedJaggedTensor]) -> KeyedJaggedTensor:
    """The batches one after the other: per feature, the bags of each batch in turn."""
    return KeyedJaggedTensor(FEATURES, torch.cat([k[f].values for f in FEATURES for k in kjts]),
                             torch.cat([k[f].lengths for f in FEATURES for k in kjts]))


def reference(kind: str, opt: str) -> EmbeddingCollection:
    return EmbeddingCollection(TABLES, FEATURES, optimizer(opt), backend="torch",
                               generator=torch.Generator().manual_seed(7))


def _train_sharded(rank: int, world: int, device: str, scenarios=SCENARIOS, autocast: bool = False) -> list[dict]:
    """Each scenario's outputs and shards after STEPS steps; ``autocast``: every training lookup under bf16 autocast,
    so the local tables hand over bf16 rows and update from bf16 gradients."""
    out = []
    for kind, opt, comm in scenarios:
        ec = reference(kind, opt)
        if device != "cpu":
            ec.backend_name = "auto"  # the local lookups use the fused CUDA kernels where registered
        sharded = ShardedEmbeddingCollection.from_collection(ec, make_plan(kind, world), device=device, comm_dtype=comm)
        del ec
        outputs = []
        for step in range(STEPS):
            kjt, target = batch(step, rank)
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=autocast):
                pooled = sharded(kjt.to(device))
            (pooled.float() * target.to(device)).sum().backward()
            outputs.append(pooled.detach().cpu())
        shards = {(name, lo, hi): {k: v.detach().cpu().clone() for k, v in views.items()}
                  for name, lo, hi, views in sharded.local_shards()}
        with torch.no_grad():
            sharded.eval()
            kjt, _ = batch(99, rank)
            outputs.append(sharded(kjt.to(device)).cpu())
        backends = {st.local.backend.name for st in sharded.strategies if st.local is not None}
        evictions = sum(s.evictions for st in sharded.strategies if isinstance(st.local, HostCachedCollection)
                        for s in st.local.cache_stats().values())
        out.append({"outputs": outputs, "shards": shards, "step": sharded.step, "backends": backends,
                    "evictions": evictions})
    return out


def _worker(rank: int, world: int, device: str) -> list[dict]:
    if device == "cuda":
        device = f"cuda:{rank}"
        # CPU kernels are deterministic already; switching this on imports torch's compiler (seconds).
        torch.use_deterministic_algorithms(True, warn_only=True)
    return _train_sharded(rank, world, device)


def _check(world: int, results: list[list[dict]], gpu: bool = False, scenarios=SCENARIOS,
           autocast: bool = False) -> None:
    for i, (kind, opt, comm) in enumerate(scenarios):
        ec = reference(kind, opt)
        # bf16 exchange or autocast: pooled vectors and gradients are rounded to 8 mantissa bits on the way.
        # GPU kernels against the CPU reference: float32 sums in another order.
        tol = {"atol": 2e-2, "rtol": 2e-2} if comm == "bf16" or autocast else {"atol": 1e-5, "rtol": 1e-4} if gpu \
            else {}
        sizes = [3 + r for r in range(world)]
        starts = [sum(sizes[:r]) for r in range(world)]
        for step in range(STEPS + 1):
            parts = [batch(step if step < STEPS else 99, r) for r in range(world)]
            kjt = concat([p[0] for p in parts])
            if step == STEPS:
                ec.eval()
                with torch.no_grad():
                    pooled = ec(kjt)
            else:
                pooled = ec(kjt)
            for r in range(world):
                # Row-wise pools are sums of per-rank partial sums, added in another order than one
                # rank's single pass: float32 rounding, so the default float32 tolerance and not exact.
                torch.testing.assert_close(results[r][i]["outputs"][step], pooled[starts[r] : starts[r] + sizes[r]],
                                           msg=lambda m, at=f"{kind}/{opt}/{comm}, rank {r}, step {step}": f"{at}: {m}",
                                           **tol)
            if step < STEPS:
                # The unsharded loss sums over the global batch divided by the world size: the
                # sharded collection averages its gradients over ranks, as DDP does.
                (pooled * torch.cat([p[1] for p in parts])).sum().div(world).backward()
        held = set()
        for r in range(world):
            assert results[r][i]["step"] == STEPS
            for (name, lo, hi), tensors in results[r][i]["shards"].items():
                held.update((name, row) for row in range(lo, hi))
                full = {"weight": ec.table_weight(name)}
                t = ec.packing.table_names.index(name)
                for key, buf in ec.optimizer_state().items():
                    if buf.numel() == ec.packing.total_rows:
                        full[key] = buf[ec.packing.row_offsets[t] : ec.packing.row_offsets[t] + ec.packing.rows[t]]
                    else:
                        start = ec.packing.weights_offsets[t]
                        full[key] = buf[start : start + ec.packing.rows[t] * ec.packing.dims[t]].view(ec.packing.rows[t], -1)
                assert set(tensors) == set(full)
                for key, value in tensors.items():
                    # float32 sums of the same gradients in another order (all-to-all, all-reduce)
                    torch.testing.assert_close(value, full[key][lo:hi], **(tol or {"atol": 2e-6, "rtol": 1e-5}),
                                               msg=lambda m, at=f"{kind}/{opt}/{comm}: {name}.{key} rows {lo}..{hi}": f"{at}: {m}")
        assert held == {(t.name, row) for t in TABLES for row in range(t.rows)}, f"{kind}: some rows are held by no rank"
        if kind == "host_cached":
            assert results[0][i]["evictions"] > 0, "t4's cache on rank 0 should have evicted rows"


# CI runs 2 and 3 ranks; PIPELINE_TEST_WORLDS=4,8 runs more (the code must not assume 2).
WORLDS = [int(w) for w in os.environ.get("PIPELINE_TEST_WORLDS", "2,3").split(",")]


@pytest.mark.parametrize("world", WORLDS)
def test_sharded_equals_unsharded_gloo(world):
    _check(world, spawn(_worker, world, "gloo", args=("cpu",)))


def _under_autocast(rank: int, world: int) -> list[dict]:
    return _train_sharded(rank, world, "cpu", AUTOCAST_SCENARIOS, autocast=True)


AUTOCAST_SCENARIOS = [("mixed", "adagrad", "fp32"), ("mixed", "adam", "bf16")]


def test_sharded_lookups_under_autocast_train_as_the_unsharded_collection():
    """The local tables' bf16 rows (as the training stage's autocast asks on a GPU) through every kind of sharding:
    the exchange, the row-wise sums and the updates from bf16 gradients."""
    _check(2, spawn(_under_autocast, 2, "gloo"), scenarios=AUTOCAST_SCENARIOS, autocast=True)


@pytest.mark.multigpu
def test_sharded_equals_unsharded_nccl():
    results = spawn(_worker, 2, "nccl", args=("cuda",))
    print("local embedding backends on the GPUs:", sorted(set().union(*(s["backends"] for r in results for s in r))))
    _check(2, results, gpu=True)


def test_plan_rejects_a_world_it_was_not_made_for():
    from pipeline.distributed.types import PlanError

    with pytest.raises(PlanError, match="for 2 ranks, this world has 1"):
        ShardedEmbeddingCollection(TABLES, FEATURES, make_plan("mixed", 2), backend="torch")


def _all_tables_on_rank0(rank: int, world: int) -> tuple[int, bool]:
    plan = ShardingPlan(world, {t.name: ParameterSharding.table_wise(t.name, t.rows, 0) for t in TABLES})
    sharded = ShardedEmbeddingCollection.from_collection(reference("table_wise", "adam"), plan)
    for step in range(STEPS):
        kjt, target = batch(step, rank)
        (sharded(kjt) * target).sum().backward()
    return sharded.step, any(True for _ in sharded.local_shards())


def test_a_rank_holding_no_table_still_counts_the_steps():
    # Adam's bias correction and the checkpoints read the step: a rank with no table part must know it too.
    assert spawn(_all_tables_on_rank0, 2, "gloo") == [(STEPS, True), (STEPS, False)]


def _forward_and_pipelined(rank: int, world: int) -> tuple[list, list]:
    """The mixed plan trained twice from the same weights: through ``forward``, and in the three calls
    with each next batch's input dist launched before this batch's lookup, as a pipelined loop does."""
    plan = make_plan("mixed", world)
    plain = ShardedEmbeddingCollection.from_collection(reference("mixed", "adam"), plan)
    piped = ShardedEmbeddingCollection.from_collection(reference("mixed", "adam"), plan)
    runs = ([], [])
    for step in range(STEPS):
        kjt, target = batch(step, rank)
        pooled = plain(kjt)
        (pooled * target).sum().backward()
        runs[0].append(pooled.detach())
    sent = piped.input_dist(batch(0, rank)[0])
    for step in range(STEPS):
        bags = sent.wait().wait()
        if step + 1 < STEPS:
            sent = piped.input_dist(batch(step + 1, rank)[0])
        pooled = piped.output_dist(piped.compute(bags), bags).wait()
        (pooled * batch(step, rank)[1]).sum().backward()
        runs[1].append(pooled.detach())
    for run, sharded in zip(runs, (plain, piped)):
        run.append({(name, lo, hi): views["weight"].clone() for name, lo, hi, views in sharded.local_shards()})
    return runs


def test_the_next_batch_input_dist_can_run_before_this_batch_lookup():
    for plain, piped in spawn(_forward_and_pipelined, 2, "gloo"):
        for a, b in zip(plain[:-1], piped[:-1]):
            torch.testing.assert_close(b, a, rtol=0, atol=0)  # the same operations on the same values
        assert plain[-1].keys() == piped[-1].keys()
        for key, weight in plain[-1].items():
            torch.testing.assert_close(piped[-1][key], weight, rtol=0, atol=0)
