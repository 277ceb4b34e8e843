"""DLRM trained model-parallel (sharded embeddings + DDP) equals DLRM trained in one process, and its
sharded checkpoint reloads into another number of ranks with the same predictions.

A 2-rank run trains a few steps under a memory budget too small for the largest table on one rank
(so the planner must shard it row-wise), saves a sharded checkpoint and its predictions; a 3-rank run
loads it under a new plan, predicts, and trains on; the parent process loads the same checkpoint into
the plain model (one rank) and checks all of it against plain single-process training.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeline.distributed import (
    DistributedModelParallel,
    EmbeddingShardingPlanner,
    PlannerError,
    ShardingType,
    Topology,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
)
from pipeline.distributed.checkpoint import read_meta
from pipeline.distributed.spawn import spawn
from pipeline.modules.configs import EmbeddingOptimizerConfig
from pipeline.modules.models import ModelSizes, build_model
from pipeline.schema import Column, Schema
from pipeline.sparse import KeyedJaggedTensor

CARDS = {"C1": 5, "C2": 40, "C3": 300, "C4": 60}
DENSE = 3
BATCH = 4  # per rank
EVAL_ROWS = 12
# 36 bytes a row (dim 8 fp32 + one Adagrad fp32): C3 needs 10.8 kB whole, the budget is 8 kB per rank.
BUDGET = 8000.0


def schema() -> Schema:
    cols = [Column("label", "label", "int8")] + [Column(f"I{i}", "continuous", "float32") for i in range(1, DENSE + 1)]
    cols += [Column(name, "categorical", "int64", card) for name, card in CARDS.items()]
    return Schema(cols)


def model():
    sizes = ModelSizes(embedding_dim=8, bottom_mlp=[16, 8], top_mlp=[16, 1])
    return build_model("dlrm", schema(), sizes, EmbeddingOptimizerConfig("adagrad", lr=0.05), backend="torch", seed=3)


def planner(world: int) -> EmbeddingShardingPlanner:
    return EmbeddingShardingPlanner(Topology(world, memory_per_rank=BUDGET, batch_size=BATCH))


def batch(seed: int, rows: int):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(rows, DENSE, generator=g)
    ids = torch.stack([torch.randint(0, c, (rows,), generator=g) for c in CARDS.values()], 1)
    label = torch.randint(0, 2, (rows,), generator=g).float()
    return dense, KeyedJaggedTensor.from_dense(list(CARDS), ids), label


def rank_batch(step: int, rank: int):
    return batch(100 * step + rank, BATCH)


def global_batch(step: int, world: int):
    parts = [rank_batch(step, r) for r in range(world)]
    dense = torch.cat([p[0] for p in parts])
    ids = torch.cat([p[1].values.view(len(CARDS), -1) for p in parts], 1).t()
    return dense, KeyedJaggedTensor.from_dense(list(CARDS), ids), torch.cat([p[2] for p in parts])


def eval_slice(rank: int, world: int):
    dense, kjt, _ = batch(12345, EVAL_ROWS)
    n = EVAL_ROWS // world
    ids = kjt.values.view(len(CARDS), -1)[:, rank * n : (rank + 1) * n].t()
    return dense[rank * n : (rank + 1) * n], KeyedJaggedTensor.from_dense(list(CARDS), ids)


def train_step(net, optimizer, dense, kjt, label) -> torch.Tensor:
    logits = net(dense, kjt)
    loss = F.binary_cross_entropy_with_logits(logits, label)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return logits.detach()


def _save_worker(rank: int, world: int, folder: str, steps: int) -> dict:
    dmp = DistributedModelParallel(model(), planner=planner(world))
    opt = torch.optim.Adam(dmp.parameters(), lr=0.01)
    logits = [train_step(dmp, opt, *rank_batch(step, rank)) for step in range(steps)]
    dmp.eval()
    with torch.no_grad():
        pred = dmp(*eval_slice(rank, world))
    save_sharded_checkpoint(folder, dmp.sharded_collections(),
                            dense={"model": dmp.dense_state_dict(), "optimizer": opt.state_dict()}, step=steps)
    return {"logits": logits, "pred": pred, "plan": dmp.plans["embedding"].to_dict(),
            "dense": {k: v.clone() for k, v in dmp.dense_state_dict().items()} if rank == 0 else None}


def _load_worker(rank: int, world: int, folder: str, steps: int, start: int) -> dict:
    dmp = DistributedModelParallel(model(), planner=planner(world))
    opt = torch.optim.Adam(dmp.parameters(), lr=0.01)
    saved = load_sharded_checkpoint(folder, dmp.sharded_collections())
    dmp.load_dense_state_dict(saved["dense"]["model"])
    opt.load_state_dict(saved["dense"]["optimizer"])
    dmp.eval()
    with torch.no_grad():
        pred = dmp(*eval_slice(rank, world))
    dmp.train()
    logits = [train_step(dmp, opt, *rank_batch(step, rank)) for step in range(start, start + steps)]
    return {"pred": pred, "logits": logits, "plan": dmp.plans["embedding"].to_dict()}


def _train_worker(rank: int, world: int, steps: int) -> dict:
    device = torch.device(f"cuda:{rank}")
    torch.use_deterministic_algorithms(True, warn_only=True)
    dmp = DistributedModelParallel(model(), planner=planner(world), device=device)
    opt = torch.optim.Adam(dmp.parameters(), lr=0.01)
    logits = []
    for step in range(steps):
        dense, kjt, label = rank_batch(step, rank)
        logits.append(train_step(dmp, opt, dense.to(device), kjt.to(device), label.to(device)).cpu())
    return {"logits": logits, "plan": dmp.plans["embedding"].to_dict()}


def train_one_process(steps: int):
    """The unsharded model trained in one process on both ranks' batches: (model, logits per step)."""
    ref = model()
    opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    return ref, [train_step(ref, opt, *global_batch(step, 2)) for step in range(steps)]


@pytest.mark.multigpu
def test_two_gpus_train_like_one_process_nccl():
    results = spawn(_train_worker, 2, "nccl", args=(3,))
    _, reference_logits = train_one_process(3)
    for step, logits in enumerate(reference_logits):
        for r in range(2):
            # GPU against CPU float32 arithmetic, row-wise partial sums and DDP averaging: rounding only.
            torch.testing.assert_close(results[r]["logits"][step], logits[r * BATCH : (r + 1) * BATCH],
                                       atol=1e-4, rtol=1e-3)


@pytest.fixture(scope="module")
def saved_by_two(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sharded") / "ckpt"
    return folder, spawn(_save_worker, 2, "gloo", args=(str(folder), 3))


def test_two_ranks_train_like_one_process_with_a_row_wise_table(saved_by_two):
    folder, results = saved_by_two
    plan = results[0]["plan"]
    kinds = {t["table"]: t["sharding_type"] for t in plan["tables"]}
    assert kinds["t_C3"] == ShardingType.ROW_WISE.value, f"C3 exceeds one rank's budget, got plan {kinds}"
    assert results[1]["plan"] == plan
    ref, reference_logits = train_one_process(3)
    for step, logits in enumerate(reference_logits):
        for r in range(2):
            # Row-wise pools are summed from per-rank partials and dense gradients averaged by DDP:
            # float32 rounding in another order, hence a tolerance and not bitwise equality.
            torch.testing.assert_close(results[r]["logits"][step], logits[r * BATCH : (r + 1) * BATCH],
                                       atol=1e-5, rtol=1e-4)
    # same reason as above, for the dense weights after three Adam steps and for the predictions
    for key, value in ref.state_dict().items():
        if not key.startswith("embedding."):
            torch.testing.assert_close(results[0]["dense"][key], value, atol=1e-5, rtol=1e-4, msg=key)
    ref.eval()
    with torch.no_grad():
        pred = ref(*eval_slice(0, 1))
    torch.testing.assert_close(torch.cat([r["pred"] for r in results]), pred, atol=1e-5, rtol=1e-4)
    assert read_meta(folder)["world_size"] == 2


def test_checkpoint_of_two_ranks_loads_into_three_and_into_one(saved_by_two):
    folder, saved = saved_by_two
    saved_pred = torch.cat([r["pred"] for r in saved])
    three = spawn(_load_worker, 3, "gloo", args=(str(folder), 2, 3))
    assert three[0]["plan"]["world_size"] == 3
    # The same weights give the same predictions, whatever the number of ranks holding them; only the
    # row-wise table's partial pools are added in another order (3 parts, not 2): float32 rounding.
    torch.testing.assert_close(torch.cat([r["pred"] for r in three]), saved_pred, atol=1e-6, rtol=1e-5)

    one = model()
    opt = torch.optim.Adam(one.parameters(), lr=0.01)
    state = load_sharded_checkpoint(folder, {"embedding": one.embedding})
    one.load_state_dict({**one.state_dict(), **state["dense"]["model"]})
    opt.load_state_dict(state["dense"]["optimizer"])
    assert int(one.embedding.step) == 3
    one.eval()
    with torch.no_grad():
        # one pass over each bag here, 2 partial pools there: float32 rounding
        torch.testing.assert_close(one(*eval_slice(0, 1)), saved_pred, atol=1e-6, rtol=1e-5)
    one.train()
    # Training goes on from the restored optimizer states (Adagrad rows resharded, Adam dense).
    for i, step in enumerate(range(3, 5)):
        logits = train_step(one, opt, *global_batch(step, 3))
        for r in range(3):
            # see above: partial sums and DDP averaging round in another order
            torch.testing.assert_close(three[r]["logits"][i], logits[r * BATCH : (r + 1) * BATCH], atol=1e-5, rtol=1e-4)


def test_planner_error_gives_the_numbers():
    tables = model().embedding.tables
    with pytest.raises(PlannerError, match=r"needed per rank \[.*\] MiB, available 0.01 MiB") as err:
        EmbeddingShardingPlanner(Topology(1, memory_per_rank=BUDGET)).plan(tables)
    assert err.value.needed and err.value.available == [BUDGET]
    with pytest.raises(PlannerError, match="need at least"):
        EmbeddingShardingPlanner(Topology(2, memory_per_rank=1000.0)).plan(tables)
