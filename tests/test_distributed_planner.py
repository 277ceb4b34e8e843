"""The sharding planner and the plan file: placement choices, overrides, budgets, errors with numbers."""

from __future__ import annotations

import pytest
import torch

from pipeline.distributed import EmbeddingShardingPlanner, PlannerError, ShardingPlan, ShardingType, Topology
from pipeline.distributed.config import DistributedConfig
from pipeline.distributed.jagged import permute_segments, source_major_to_slot_major
from pipeline.distributed.launch import strip_nproc
from pipeline.distributed.planner.estimators import storage_per_rank
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
    with pytest.raises(PlannerError) as err:
        EmbeddingShardingPlanner(Topology(2, memory_per_rank=100 * 2**20)).plan(ts)
    message = str(err.value)
    assert "2 rank(s) with 100.00 MiB each" in message and "MiB per rank" in message
    assert err.value.available == [100 * 2**20] * 2 and len(err.value.needed) == 2
    assert max(err.value.needed) > 100 * 2**20
    with pytest.raises(PlannerError, match=r"pinned to rank 0"):
        EmbeddingShardingPlanner(Topology(2, memory_per_rank=300 * 2**20), {"t2": "table_wise:0"}).plan(ts)


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


def test_config_checks_override_values():
    assert DistributedConfig(sharding={"t1": "table_wise:3"}).sharding == {"t1": "table_wise:3"}
    with pytest.raises(ValueError, match="distributed.sharding.t1"):
        DistributedConfig(sharding={"t1": "column_wise"})


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
