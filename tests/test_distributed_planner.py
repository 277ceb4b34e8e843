"""The sharding planner and the plan file: placement choices, overrides, budgets, errors with numbers."""

from __future__ import annotations

import pytest
import torch

from pipeline.distributed import EmbeddingShardingPlanner, PlannerError, ShardingPlan, ShardingType, Topology
from pipeline.distributed.config import DistributedConfig
from pipeline.distributed.jagged import permute_segments, source_major_to_slot_major
from pipeline.distributed.launch import strip_nproc
from pipeline.distributed.planner.estimators import min_cache_rows, storage_per_rank
from pipeline.distributed.types import ParameterSharding, PlanError, even_row_ranges
from pipeline.modules.configs import TableConfig


def tables(sizes=(10, 1_000_000, 2_000_000, 50_000, 8), dim=64):
    return [TableConfig(f"t{i}", rows, dim, [f"f{i}"]) for i, rows in enumerate(sizes)]


def test_default_plan_replicates_small_tables_and_spreads_large_ones():
    ts = tables()
    plan = EmbeddingShardingPlanner(Topology(4, batch_size=65536)).plan(ts)
    kinds = {name: p.sharding_type for name, p in plan.tables.items()}
    assert kinds["t0"] == kinds["t4"] == ShardingType.DATA_PARALLEL
    assert kinds["t1"] == kinds["t2"] == ShardingType.TABLE_WISE
    assert plan["t1"].ranks != plan["t2"].ranks, "the two largest tables should not share a rank"
    plan.validate(ts, 4)


def test_a_table_above_the_budget_goes_row_wise_and_every_rank_stays_within_it():
    ts = tables()
    topo = Topology(4, batch_size=4096, memory_per_rank=400 * 2**20)
    planner = EmbeddingShardingPlanner(topo)
    plan = planner.plan(ts)
    assert plan["t2"].sharding_type == ShardingType.ROW_WISE   # 2M x (64 x 4 B + 4 B of Adagrad) = 496 MiB
    assert plan["t2"].row_ranges == even_row_ranges(2_000_000, 4)
    used = planner.storage(plan, ts)
    assert max(used.values()) <= topo.memory_per_rank
    assert sum(used.values()) >= sum(storage_per_rank(t, ShardingType.TABLE_WISE, topo) for t in ts)


def test_overrides_are_honoured_and_a_pinned_rank_too():
    ts = tables()
    plan = EmbeddingShardingPlanner(Topology(3), {"t0": "row_wise", "t3": "table_wise:2",
                                                  "t1": "data_parallel"}).plan(ts)
    assert plan["t0"].sharding_type == ShardingType.ROW_WISE and plan["t0"].row_ranges == [(0, 4), (4, 7), (7, 10)]
    assert plan["t3"].ranks == [2]
    assert plan["t1"].sharding_type == ShardingType.DATA_PARALLEL
    with pytest.raises(ValueError, match="does not have"):
        EmbeddingShardingPlanner(Topology(3), {"nope": "row_wise"}).plan(ts)
    with pytest.raises(ValueError, match="at least one row per rank"):
        EmbeddingShardingPlanner(Topology(16), {"t4": "row_wise"}).plan(ts)


def test_planner_error_reports_needed_and_available_per_rank():
    ts = tables()
    with pytest.raises(PlannerError) as err:  # too little even for the least device caches
        EmbeddingShardingPlanner(Topology(2, memory_per_rank=2**20)).plan(ts)
    message = str(err.value)
    assert "2 rank(s) with 1.00 MiB each" in message and "MiB per rank" in message
    assert "host-cached in a device cache of 8,192 rows at least" in message  # 2 steps x 2 ranks x 2048 ids
    assert message.endswith("give each rank more (distributed.memory_per_rank_mb), lower train.batch_size (a device "
                            "cache holds two batches of ids), or train on more ranks")
    assert err.value.available == [2**20] * 2 and len(err.value.needed) == 2
    assert max(err.value.needed) > 2**20
    with pytest.raises(PlannerError, match=r"pinned to rank 0"):
        EmbeddingShardingPlanner(Topology(2, memory_per_rank=300 * 2**20), {"t2": "table_wise:0"}).plan(ts)


@pytest.mark.parametrize("world", [1, 2])
def test_tables_over_the_budget_are_host_cached_and_their_caches_fill_what_it_leaves(world):
    ts = tables()
    topo = Topology(world, batch_size=4096, memory_per_rank=100 * 2**20)
    planner = EmbeddingShardingPlanner(topo)
    plan = planner.plan(ts)
    cached = {name: p.cache_rows for name, p in plan.tables.items() if p.cache_rows}
    assert sorted(cached) == ["t1", "t2"]   # 1M and 2M rows x 260 B: 248 and 496 MiB
    for name, rows in cached.items():
        assert plan[name].sharding_type == ShardingType.TABLE_WISE
        assert min_cache_rows(ts[int(name[1])], topo) < rows < ts[int(name[1])].rows
    used = planner.storage(plan, ts)
    assert all(100 * 2**20 - 2 * 260 < u <= 100 * 2**20 for r, u in used.items() if any(
        plan[n].ranks == [r] for n in cached))
    if world == 1:  # beyond the least cache, a share of what is left in proportion to the table
        least = min_cache_rows(ts[1], topo)
        assert cached["t2"] - least == pytest.approx(2 * (cached["t1"] - least), abs=2)
    assert "host-cached" in planner.describe(plan, ts)


def test_host_cached_overrides_and_a_table_pinned_in_device_memory():
    ts = tables()
    plan = EmbeddingShardingPlanner(Topology(2), {"t3": "host_cached:1", "t0": "host_cached"}).plan(ts)
    assert plan["t3"].ranks == [1] and plan["t3"].cache_rows == 50_000   # no budget: a cache of the whole table
    assert plan["t0"].cache_rows == 10 and plan["t1"].cache_rows == 0
    with pytest.raises(PlannerError, match="t2"):  # too large, and kept table-wise in device memory
        EmbeddingShardingPlanner(Topology(1, memory_per_rank=300 * 2**20), {"t2": "table_wise"}).plan(ts)


def test_plan_json_round_trip_and_validation(tmp_path):
    ts = tables()
    plan = EmbeddingShardingPlanner(Topology(2)).plan(ts)
    plan.save(tmp_path / "plan.json")
    assert ShardingPlan.load(tmp_path / "plan.json") == plan
    assert "t2" in plan.describe(ts)
    with pytest.raises(PlanError, match="for 2 ranks"):
        plan.validate(ts, 3)
    bad = ShardingPlan(2, dict(plan.tables))
    bad.tables["t1"] = ParameterSharding("t1", ShardingType.ROW_WISE, [0, 1], [(0, 10), (11, 1_000_000)])
    with pytest.raises(PlanError, match="do not tile"):
        bad.validate(ts, 2)
    cached = EmbeddingShardingPlanner(Topology(2), {"t1": "host_cached"}).plan(ts)
    cached.save(tmp_path / "cached.json")
    assert ShardingPlan.load(tmp_path / "cached.json") == cached and cached["t1"].cache_rows == 1_000_000
    older = cached.to_dict()
    for item in older["tables"]:
        del item["cache_rows"]  # a plan written before tables could be host-cached
    assert ShardingPlan.from_dict(older)["t1"].cache_rows == 0
    bad = ShardingPlan(2, dict(plan.tables))
    bad.tables["t0"] = ParameterSharding.data_parallel("t0", 10, 2)
    bad.tables["t0"].cache_rows = 5
    with pytest.raises(PlanError, match="host-cached tables are table-wise or row-wise"):
        bad.validate(ts, 2)


def test_config_checks_override_values():
    assert DistributedConfig(sharding={"t1": "table_wise:3"}).sharding == {"t1": "table_wise:3"}
    assert DistributedConfig(sharding={"t1": "host_cached:1", "t2": "host_cached"}).sharding["t2"] == "host_cached"
    for bad in ("column_wise", "row_wise:1"):
        with pytest.raises(ValueError, match="distributed.sharding.t1"):
            DistributedConfig(sharding={"t1": bad})


def test_regrouping_bags_from_sources_into_slot_major_order():
    # two sources, two slots; source 0 has 2 samples, source 1 has 1
    per_source = [[[[1], [2, 3]], [[4], []]], [[[5, 6]], [[7]]]]  # [source][slot][sample] -> ids
    lengths = torch.tensor([len(b) for src in per_source for slot in src for b in slot])
    values = torch.tensor([v for src in per_source for slot in src for b in slot for v in b])
    new_lengths, new_values = source_major_to_slot_major(lengths, values, 2, [2, 1])
    assert new_lengths.tolist() == [1, 2, 2, 1, 0, 1]
    assert new_values.tolist() == [1, 2, 3, 5, 6, 4, 7]
    assert permute_segments(torch.arange(6), torch.tensor([2, 1, 3]), torch.tensor([2, 0, 0])).tolist() == \
        [3, 4, 5, 0, 1, 0, 1]


def test_workers_do_not_launch_again():
    assert strip_nproc(["run", "train", "--nproc", "2", "x=1", "--nproc=4"]) == ["run", "train", "x=1"]
