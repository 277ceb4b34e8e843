"""The pipelined training step (``distributed.pipeline``: each batch's input dist started while the
batch before it trains) trains the same weights as the plain one-batch-at-a-time loop, on 2 and 3
gloo ranks, for table-wise, row-wise, data-parallel and mixed plans, through epoch ends, a short last
batch, evaluation between steps and a last step inside an epoch (a batch started ahead, never
trained); and a pipelined run killed mid-epoch resumes exactly. One process with a host-cached table
(each batch's rows prefetched into its device cache during the step before) does the same.

Each rank count is one spawn: every rank runs the training driver for each plan both ways, then a
pipelined run that crashes after a mid-epoch checkpoint and its resume.
"""

from __future__ import annotations

import pytest
import torch

from pipeline.distributed.config import DistributedConfig
from pipeline.distributed.spawn import spawn
from pipeline.distributed.world import World
from pipeline.loader.synthetic import criteo_schema, write_processed
from pipeline.schema import Schema
from pipeline.stages.config import load_config
from pipeline.train.driver import train
from pipeline.train.loop import Callback
from tests.test_train import Crash, CrashAfter

TABLES = ["t_C1", "t_C2", "t_C3", "t_C4", "t_C5", "t_M1"]
# 1500 rows: per rank 6 batches of 128 (the last short) on 2 ranks, 4 on 3; two epochs less the last batch.
SETTINGS = ["device=cpu", "progress=off", "seed=3", "train.batch_size=128", "train.eval_batch_size=512",
            "train.embedding_dim=8", "train.bottom_mlp=[16,8]", "train.top_mlp=[16,1]", "train.epochs=2",
            "train.log_every=4", "train.eval_every=4", "train.checkpoint_every=5", "train.warmup_steps=3",
            "train.embedding_backend=torch", "train.embedding_optimizer=adam", "train.early_stopping=0"]
CRASH_STEP = 6  # after the checkpoint of step 5, which is mid-epoch on 2 and on 3 ranks


def batches_per_epoch(world: int) -> int:
    return -(-1500 // world // 128)


def plans(world: int) -> dict[str, dict[str, str]]:
    mixed = {"t_C1": "table_wise:0", "t_C2": "row_wise", "t_C3": f"table_wise:{world - 1}", "t_C4": "data_parallel",
             "t_C5": "data_parallel", "t_M1": "row_wise"}
    return {kind: {t: kind for t in TABLES} for kind in ("table_wise", "row_wise", "data_parallel")} | {"mixed": mixed}


class Ahead(Callback):
    """Records, after each step inside an epoch, how many batches the loader handed out beyond those trained."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def on_step(self, trainer) -> None:
        if trainer.state.batch:
            loader = trainer.loader.state_dict()  # (its epoch ends once it was asked for a batch beyond the last)
            handed_out = (loader["epoch"] - trainer.state.epoch) * trainer.steps_per_epoch + loader["batches"]
            self.seen.append(handed_out - trainer.state.batch)


def _train(rank: int, world: int, workdir: str, name: str, sharding: dict, pipeline: bool, *extra: str,
           callbacks=()) -> dict:
    steps = 2 * batches_per_epoch(world) - 1
    cfg = load_config(None, [f"workdir={workdir}", *SETTINGS, f"train.max_steps={steps}", *extra])
    return train(cfg.train, cfg.paths.processed, cfg.paths.train / name, schema=Schema.load(cfg.paths.schema),
                 seed=cfg.seed, world=World(rank, world), callbacks=callbacks, progress="off",
                 distributed=DistributedConfig(sharding=sharding, pipeline=pipeline))


def _final(workdir: str, name: str) -> dict[str, torch.Tensor]:
    cfg = load_config(None, [f"workdir={workdir}", *SETTINGS])
    return torch.load(cfg.paths.train / name / "latest" / "model.pt", weights_only=True)


def _both_ways_and_resumed(rank: int, world: int, workdir: str) -> dict:
    out: dict = {"ahead": {}, "steps": {}}
    for kind, sharding in plans(world).items():
        for pipeline in (False, True):
            ahead = Ahead()
            result = _train(rank, world, workdir, f"{kind}-{pipeline}", sharding, pipeline, callbacks=[ahead])
            out["ahead"][kind, pipeline] = ahead.seen
            out["steps"][kind, pipeline] = result["steps"]
    sharding = plans(world)["mixed"]
    with pytest.raises(Crash):
        _train(rank, world, workdir, "resumed", sharding, True, callbacks=[CrashAfter(CRASH_STEP)])
    _train(rank, world, workdir, "resumed", sharding, True, "train.resume=true")
    if rank == 0:
        names = [f"{kind}-{pipeline}" for kind in plans(world) for pipeline in (False, True)] + ["resumed"]
        out["final"] = {name: _final(workdir, name) for name in names}
    return out


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys()
    for key, expected in a.items():
        torch.testing.assert_close(b[key], expected, msg=lambda m, key=key: f"{what}, {key}: {m}")


@pytest.mark.parametrize("world", [2, 3])
def test_the_pipelined_step_trains_as_the_plain_one_and_resumes_exactly(tmp_path, world):
    cfg = load_config(None, [f"workdir={tmp_path}", *SETTINGS])
    write_processed(cfg.paths.processed, criteo_schema(size=0.0001, categorical=5, continuous=3, multihot={"M1": 3}),
                    {"train": 1500, "valid": 300, "test": 300}, row_group_rows=500, seed=7)
    results = spawn(_both_ways_and_resumed, world, "gloo", args=(str(tmp_path),))
    batches = batches_per_epoch(world)
    for got in results:
        for (kind, pipeline), seen in got["ahead"].items():
            # inside an epoch the loader is one batch ahead of training when pipelined, never otherwise
            assert seen == [int(pipeline)] * (2 * (batches - 1)), (kind, pipeline)
            assert got["steps"][kind, pipeline] == 2 * batches - 1
    final = results[0]["final"]
    for kind in plans(world):
        _assert_same(final[f"{kind}-False"], final[f"{kind}-True"], f"{kind} plan, pipelined vs plain")
    _assert_same(final["mixed-True"], final["resumed"], "pipelined, crashed and resumed vs straight")


def _one_process(workdir, name: str, pipeline: bool, *extra: str, callbacks=()) -> dict:
    # 0.15 MiB: every table but t_C3 (1,015 rows) in device memory, t_C3 behind a cache of 314 rows
    cfg = load_config(None, [f"workdir={workdir}", *SETTINGS, f"train.max_steps={2 * batches_per_epoch(1) - 1}",
                             *extra])
    return train(cfg.train, cfg.paths.processed, cfg.paths.train / name, schema=Schema.load(cfg.paths.schema),
                 seed=cfg.seed, callbacks=callbacks, progress="off",
                 distributed=DistributedConfig(memory_per_rank_mb=0.15, pipeline=pipeline))


def test_one_process_prefetches_host_cached_rows_a_step_ahead_and_trains_the_same_weights(tmp_path):
    cfg = load_config(None, [f"workdir={tmp_path}", *SETTINGS])
    write_processed(cfg.paths.processed, criteo_schema(size=0.0001, categorical=5, continuous=3, multihot={"M1": 3}),
                    {"train": 1500, "valid": 300, "test": 300}, row_group_rows=500, seed=7)
    batches = batches_per_epoch(1)
    for pipeline in (False, True):
        ahead = Ahead()
        result = _one_process(tmp_path, f"cached-{pipeline}", pipeline, callbacks=[ahead])
        # the loader two batches ahead of training when pipelined (the next batch's books may run during the step
        # before), never otherwise
        assert ahead.seen == [min(2 * pipeline, batches - b) for b in range(1, batches)] * 2
        assert list(result["embedding_cache"]) == ["t_C3"] and result["embedding_cache"]["t_C3"]["evictions"] > 0
    with pytest.raises(Crash):
        _one_process(tmp_path, "resumed", True, callbacks=[CrashAfter(CRASH_STEP)])
    _one_process(tmp_path, "resumed", True, "train.resume=true")
    plain, pipelined, resumed = (_final(tmp_path, name) for name in ("cached-False", "cached-True", "resumed"))
    assert all(torch.equal(plain[key], pipelined[key]) and torch.equal(plain[key], resumed[key]) for key in plain)


class Holding(torch.nn.Module):
    """A model that is only its ``embedding``, as a training pipeline sees one."""

    def __init__(self, embedding) -> None:
        super().__init__()
        self.embedding = embedding


@pytest.mark.parametrize("tables", ["host-cached", "dynamic"])
def test_host_cached_tables_take_the_next_batch_before_the_step_and_dynamic_ones_when_it_is_asked_for(tables):
    from pipeline.distributed.train_pipeline import PrefetchPipeline
    from pipeline.loader import Batch
    from pipeline.modules.cached_collection import HostCachedCollection
    from pipeline.modules.collection import EmbeddingCollection, Prefetched
    from pipeline.modules.configs import TableConfig
    from pipeline.sparse import KeyedJaggedTensor

    table = TableConfig("t", 1024, 4, ["f"], dynamic=tables == "dynamic")
    embedding = (HostCachedCollection([table], ["f"], {"t": 100}, backend="torch") if tables == "host-cached"
                 else EmbeddingCollection([table], ["f"], backend="torch"))
    ones = torch.ones(8, dtype=torch.int64)
    batches = [Batch(torch.zeros(8, 1), KeyedJaggedTensor(["f"], torch.arange(8) + 8 * i, ones), torch.zeros(8))
               for i in range(4)]
    read = []
    ahead = PrefetchPipeline(Holding(embedding), "cpu")(read.append(b) or b for b in batches)
    first = next(ahead)
    assert isinstance(first.sparse, Prefetched)
    next_one = ahead.following
    assert isinstance(next_one, Prefetched) == (tables == "host-cached")
    assert len(read) == (3 if tables == "host-cached" else 2)  # the loader two batches ahead, or one
    embedding(first.sparse).sum().backward()
    second = next(ahead)
    assert next_one is None or second.sparse is next_one
    ahead.close()
    assert ahead.following is None and not ahead.ahead


def test_a_batch_too_large_for_its_cache_prefetched_ahead_is_reported_when_the_loop_asks_for_it():
    from pipeline.distributed.train_pipeline import PrefetchPipeline
    from pipeline.loader import Batch
    from pipeline.modules.cached_collection import HostCachedCollection
    from pipeline.modules.configs import TableConfig
    from pipeline.modules.host_cache import CacheTooSmall
    from pipeline.sparse import KeyedJaggedTensor

    embedding = HostCachedCollection([TableConfig("t", 1024, 4, ["f"])], ["f"], {"t": 6}, backend="torch")
    ones = torch.ones(8, dtype=torch.int64)
    ids = [torch.tensor([0, 1] * 4), torch.arange(100, 108)]  # 2 distinct rows, then 8 for a cache of 6
    ahead = PrefetchPipeline(Holding(embedding), "cpu")(
        iter([Batch(torch.zeros(8, 1), KeyedJaggedTensor(["f"], i, ones), torch.zeros(8)) for i in ids]))
    first = next(ahead)
    embedding(first.sparse).sum().backward()
    with pytest.raises(CacheTooSmall, match="table t: a batch needs 8 rows"):
        next(ahead)
    ahead.close()
