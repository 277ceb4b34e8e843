"""Dynamic tables on several ranks (gloo on CPU): table-wise, and row-wise with each id on the rank its hash
picks, train as the unsharded collection on the concatenated batch; their sharded checkpoint loads into
the unsharded collection with the same ids, rows and optimizer state; plans that cannot hold them are refused."""

from __future__ import annotations

import pytest
import torch

from pipeline.distributed import ParameterSharding, ShardedEmbeddingCollection, ShardingPlan
from pipeline.distributed.checkpoint import load_sharded_checkpoint, save_sharded_checkpoint
from pipeline.distributed.planner import EmbeddingShardingPlanner, PlannerError, Topology
from pipeline.distributed.spawn import spawn
from pipeline.distributed.types import PlanError
from pipeline.modules.collection import EmbeddingCollection
from pipeline.modules.configs import EmbeddingOptimizerConfig, TableConfig
from pipeline.modules.dynamic import owner_rank
from pipeline.sparse import KeyedJaggedTensor

FEATURES = ["A", "B", "C"]
TABLES = [
    TableConfig("d0", 768, 4, ["A"], dynamic=True),  # whole buckets of 128 rows on each of 2 or 3 ranks
    TableConfig("d1", 768, 4, ["B"], pooling="mean", dynamic=True, admit_after=2),  # multi-hot, admission
    TableConfig("s", 30, 4, ["C"]),
]
VOCABULARY = torch.randint(-(2**63), 2**63 - 1, (60,), generator=torch.Generator().manual_seed(5))
STEPS = 4
SCENARIOS = [("table_wise", "adagrad"), ("row_wise", "adam"), ("row_wise", "adagrad")]


def make_plan(kind: str, world: int) -> ShardingPlan:
    if kind == "table_wise":
        return ShardingPlan(world, {"d0": ParameterSharding.table_wise("d0", 768, world - 1),
                                    "d1": ParameterSharding.table_wise("d1", 768, 0),
                                    "s": ParameterSharding.row_wise("s", 30, world)})
    return ShardingPlan(world, {t.name: ParameterSharding.row_wise(t.name, t.rows, world) for t in TABLES})


def batch(step: int, rank: int) -> tuple[KeyedJaggedTensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step``: ``4 + rank`` samples of raw ids (A one-hot, B multi-hot), C static."""
    g = torch.Generator().manual_seed(100 * step + rank)
    b = 4 + rank
    lengths = [torch.ones(b, dtype=torch.int64), torch.randint(0, 4, (b,), generator=g), torch.ones(b, dtype=torch.int64)]
    values = [VOCABULARY[torch.randint(0, 60, (int(lengths[0].sum()),), generator=g)],
              VOCABULARY[torch.randint(0, 60, (int(lengths[1].sum()),), generator=g)],
              torch.randint(0, 30, (b,), generator=g)]
    return KeyedJaggedTensor(FEATURES, torch.cat(values), torch.cat(lengths)), torch.randn(b, 12, generator=g)


def concat(kjts: list[KeyedJaggedTensor]) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(FEATURES, torch.cat([k[f].values for f in FEATURES for k in kjts]),
                             torch.cat([k[f].lengths for f in FEATURES for k in kjts]))


def reference(opt: str) -> EmbeddingCollection:
    return EmbeddingCollection(TABLES, FEATURES, EmbeddingOptimizerConfig(opt, lr=0.1), backend="torch",
                               generator=torch.Generator().manual_seed(7))


def _worker(rank: int, world: int, folder: str) -> list[dict]:
    out = []
    for i, (kind, opt) in enumerate(SCENARIOS):
        sharded = ShardedEmbeddingCollection.from_collection(reference(opt), make_plan(kind, world))
        outputs = []
        for step in range(STEPS):
            kjt, target = batch(step, rank)
            pooled = sharded(kjt)
            (pooled * target).sum().backward()
            outputs.append(pooled.detach())
        save_sharded_checkpoint(f"{folder}/{i}", {"embedding": sharded}, step=STEPS)
        parts = {}
        for name in ("d0", "d1"):
            part = sharded.dynamic_part(name)
            if part is not None:
                table, _ = part
                views = next(v for n, lo, hi, v in sharded.local_shards() if n == name)
                parts[name] = {"keys": table.ids.export()[0], "content": table.content(views)}
        # the same plan resumes exactly: two more steps from the checkpoint equal two more steps from memory
        resumed = ShardedEmbeddingCollection.from_collection(reference(opt), make_plan(kind, world))
        load_sharded_checkpoint(f"{folder}/{i}", {"embedding": resumed})
        same = True
        for step in range(STEPS, STEPS + 2):
            kjt, target = batch(step, rank)
            a, b = sharded(kjt), resumed(kjt)
            same &= torch.equal(a, b)
            (a * target).sum().backward()
            (b * target).sum().backward()
        for (name, _, _, x), (_, _, _, y) in zip(sharded.local_shards(), resumed.local_shards()):
            same &= all(torch.equal(x[key], y[key]) for key in x)
        out.append({"outputs": outputs, "parts": parts, "resumed_the_same": same})
    return out


def _rows_by_key(ec: EmbeddingCollection, name: str, keys: torch.Tensor) -> dict[str, torch.Tensor]:
    slots = ec.dynamic[name].find(keys)
    assert (slots >= 0).all()
    return {key: view[slots] for key, view in ec.table_views(name).items()}


@pytest.mark.parametrize("world", [2, 3])
def test_dynamic_tables_sharded_train_as_unsharded_and_their_checkpoint_loads_unsharded(world, tmp_path):
    results = spawn(_worker, world, "gloo", args=(str(tmp_path),))
    sizes = [4 + r for r in range(world)]
    starts = [sum(sizes[:r]) for r in range(world)]
    for i, (kind, opt) in enumerate(SCENARIOS):
        assert all(results[r][i]["resumed_the_same"] for r in range(world))
        ec = reference(opt)
        for step in range(STEPS):
            parts = [batch(step, r) for r in range(world)]
            pooled = ec(concat([p[0] for p in parts]))
            for r in range(world):
                torch.testing.assert_close(results[r][i]["outputs"][step], pooled[starts[r] : starts[r] + sizes[r]],
                                           msg=lambda m, at=f"{kind}/{opt} rank {r} step {step}": f"{at}: {m}")
            (pooled * torch.cat([p[1] for p in parts])).sum().div(world).backward()
        for name in ("d0", "d1"):
            holders = [r for r in range(world) if name in results[r][i]["parts"]]
            assert len(holders) == (world if kind == "row_wise" else 1)
            held = torch.cat([results[r][i]["parts"][name]["keys"] for r in holders])
            assert sorted(held.tolist()) == sorted(ec.dynamic[name].content(ec.table_views(name))["keys"].tolist())
            for r in holders:
                keys = results[r][i]["parts"][name]["keys"]
                if kind == "row_wise":
                    assert (owner_rank(keys, world) == r).all()
                content = results[r][i]["parts"][name]["content"]
                order = torch.argsort(content["keys"])
                want = _rows_by_key(ec, name, content["keys"][order])
                for key, rows in content["rows"].items():
                    torch.testing.assert_close(rows[order], want[key], atol=2e-6, rtol=1e-5)
        plain = reference(opt)
        load_sharded_checkpoint(tmp_path / str(i), {"embedding": plain})
        for name in ("d0", "d1"):
            mine, theirs = plain.dynamic[name], ec.dynamic[name]
            keys = theirs.content(ec.table_views(name))["keys"]
            assert mine.stats()["ids"] == keys.numel()
            assert mine.stats()["candidates"] == theirs.stats()["candidates"]
            for key, rows in _rows_by_key(plain, name, keys).items():
                torch.testing.assert_close(rows, _rows_by_key(ec, name, keys)[key], atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(plain.table_weight("s"), ec.table_weight("s"), atol=2e-6, rtol=1e-5)


def test_plans_that_cannot_hold_a_dynamic_table_are_refused():
    table = [TableConfig("d0", 512, 4, ["A"], dynamic=True)]
    with pytest.raises(PlanError, match="d0 is dynamic .* cannot be data_parallel"):
        ShardingPlan(2, {"d0": ParameterSharding.data_parallel("d0", 512, 2)}).validate(table, 2)
    with pytest.raises(PlanError, match="multiple of 128 rows"):
        ShardingPlan(3, {"d0": ParameterSharding.row_wise("d0", 512, 3)}).validate(table, 3)
    with pytest.raises(PlanError, match="cannot be host-cached"):
        ShardingPlan(1, {"d0": ParameterSharding.table_wise("d0", 512, 0, cache_rows=128)}).validate(table, 1)
    for constraint, why in (("data_parallel", "data_parallel copies"), ("host_cached", "host-cached"),
                            ("row_wise", "multiple of 128 x 3 ranks")):
        planner = EmbeddingShardingPlanner(Topology(3), {"d0": constraint})
        with pytest.raises(PlannerError, match=f"d0: the table is dynamic and .*{why}"):
            planner.plan(table)
    plan = EmbeddingShardingPlanner(Topology(4, memory_per_rank=1 << 20)).plan(TABLES)
    assert plan["d0"].sharding_type.value in ("table_wise", "row_wise") and not plan["d0"].cache_rows


def test_ranks_train_raw_ids_resume_on_another_count_and_one_process_scores_their_model(tmp_path):
    import json

    from pipeline.distributed.launch import relaunch
    from pipeline.loader import Loader
    from pipeline.stages.cli import run_stages
    from pipeline.stages.config import load_config
    from pipeline.train.evaluate import evaluate
    from pipeline.train.model import load_trained

    common = [f"workdir={tmp_path}", "device=cpu", "data.rows=8000", "etl.hash_ids={C1: 768, C4: 768}",
              "train.batch_size=256", "train.epochs=2", "train.checkpoint_every=5", "progress=off",
              "train.embedding_backend=torch", "train.admit_after=2", "distributed.sharding={t_C1: row_wise}"]
    run_stages(["data", "etl"], load_config(None, common))
    for ranks, steps, more in ((2, 12, []), (3, 16, ["train.resume=true"])):
        assert relaunch(["run", "train", *common, f"train.max_steps={steps}", *more], ranks) == 0
        cfg = load_config(None, common)
        out = cfg.paths.train / "latest"
        result = json.loads((out / "result.json").read_text())
        assert result["ranks"] == ranks and result["steps"] == steps
        plan = json.loads((out / "plan.json").read_text())
        assert {t["table"]: t["sharding_type"] for t in plan["tables"]}["t_C1"] == "row_wise"
        if more:
            events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
            assert [e["saved_by_ranks"] for e in events if e.get("event") == "resume"] == [2]
        model, schema = load_trained(out, backend="torch")
        ids = model.embedding.dynamic["t_C1"].stats()["ids"]
        assert ids > 0 and result["dynamic_tables"]["t_C1"]["ids"] == ids  # summed over the ranks' parts
        loader = Loader(cfg.paths.processed / "test", 4096, schema=schema, device="cpu")
        try:
            alone = evaluate(model, loader, torch.device("cpu"))
        finally:
            loader.close()
        # the same weights and ids in one process: the gathered predictions of the ranks, up to float32 rounding
        assert alone["auc"] == pytest.approx(result["test"]["auc"], abs=1e-6)
