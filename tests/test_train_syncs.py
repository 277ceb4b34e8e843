"""Host synchronisations on the training path: a step reads nothing back from the device; the loop reads
the loss once per logged line.

On the CPU a sync cannot be seen, so a dispatch mode records the operations that make one on a GPU:
a tensor read as a Python number (``.item()``, ``float``, ``int``, ``bool``), ``nonzero`` and what is
built on it (boolean-mask indexing, ``masked_select``), ``unique`` and ``repeat_interleave`` without
``output_size``. On a GPU, ``torch.cuda.set_sync_debug_mode("error")`` turns a real sync into an error.
"""

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pipeline.distributed.world import World
from pipeline.loader import Loader
from pipeline.loader.synthetic import criteo_schema, write_processed
from pipeline.modules.configs import EmbeddingOptimizerConfig
from pipeline.modules.models import MODEL_CLASSES, ModelSizes, build_model
from pipeline.schema import Schema
from pipeline.train.config import TrainConfig
from pipeline.train.loop import Trainer

SIZES = ModelSizes(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1])
_SYNCING = {"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten._unique2", "aten.unique_dim",
            "aten.unique_consecutive"}


class HostReads(TorchDispatchMode):
    """Records each operation that would wait for a GPU (see the module's text), by name.

    Reads of ``optimizer``'s step counters are left out: torch keeps them on the host (also for CUDA
    parameters, unless the optimizer is capturable or fused), so reading them is no sync.
    """

    def __init__(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        super().__init__()
        self.optimizer = optimizer
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket._qualified_op_name.replace("::", ".")
        bool_index = name == "aten.index" and any(i is not None and i.dtype == torch.bool for i in args[1])
        unsized = name == "aten.repeat_interleave" and kwargs.get("output_size") is None and (
            len(args) < 4 or args[3] is None) and isinstance(args[0], torch.Tensor) and args[0].dim() > 0
        if (name in _SYNCING or bool_index or unsized) and not self._host_counter(args[0]):
            self.seen.append(name)
        return func(*args, **kwargs)

    def _host_counter(self, tensor: torch.Tensor) -> bool:
        states = self.optimizer.state.values() if self.optimizer is not None else ()
        return any(s.get("step") is not None and s["step"].data_ptr() == tensor.data_ptr() for s in states)


def _data(tmp_path, rows=640):
    schema = criteo_schema(size=0.0001, categorical=4, continuous=3, multihot={"M1": 3})
    write_processed(tmp_path / "processed", schema, {"train": rows}, row_group_rows=320, seed=3)
    return tmp_path / "processed"


def _trainer(tmp_path, name, device="cpu", optimizer="adam", backend="auto", **settings):
    data = _data(tmp_path)
    schema = Schema.load(data / "schema.json")
    cfg = TrainConfig(model=name, batch_size=64, optimizer=optimizer, checkpoint_every=0, **settings)
    model = build_model(name, schema, SIZES, EmbeddingOptimizerConfig("adagrad", lr=0.1), backend=backend).to(device)
    model.embedding.validate_ids = False  # as the driver trains on a GPU: the loader checks the ids
    loader = Loader(data / "train", cfg.batch_size, shuffle=True, device=device)
    return Trainer(model, cfg, tmp_path / "out", loader, World(device=torch.device(device))), loader


@pytest.mark.parametrize("name", sorted(MODEL_CLASSES))
@pytest.mark.parametrize("optimizer", ["adam", "adagrad", "sgd"])
def test_a_training_step_reads_nothing_back_from_the_device(tmp_path, name, optimizer):
    trainer, loader = _trainer(tmp_path, name, optimizer=optimizer)
    with loader:
        batches = list(loader)[:3]
    trainer.train_step(batches[0])  # first use: the optimizers make their state
    with HostReads(trainer.optimizer) as reads:
        for batch in batches[1:]:
            trainer.train_step(batch)
    assert reads.seen == []


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_host_cached_step_reads_nothing_back_but_its_counts_and_missing_rows(tmp_path, pipelined):
    """The step of a model with host-cached tables (their rows prefetched at the lookup, or a step ahead):
    none of the operations above. Its host waits are for copies to pinned memory on its side stream
    (``HostCachedCollection._read``: the per-table counts, and the missing rows' numbers), no-ops here."""
    from pipeline.distributed.train_pipeline import CachePrefetchPipeline
    from pipeline.modules.cached_collection import HostCachedCollection

    trainer, loader = _trainer(tmp_path, "dlrm", optimizer="adagrad")
    model = trainer.model
    model.embedding = HostCachedCollection.from_collection(model.embedding, {"t_C3": 200, "t_M1": 400})
    with loader:
        batches = iter(list(loader)[:6])
    if pipelined:
        batches = CachePrefetchPipeline(model, "cpu")(batches)
    trainer.train_step(next(batches))
    with HostReads(trainer.optimizer) as reads:
        for batch in batches:
            trainer.train_step(batch)
    assert reads.seen == []
    assert all(s.evictions > 0 for s in model.embedding.cache_stats().values())


def test_shared_tables_with_a_feature_left_out_read_one_number(tmp_path):
    """Tables that do not serve every feature the same number of times: the ids they select are counted
    with one read (one sync per step), not one per table."""
    from pipeline.modules.collection import EmbeddingCollection
    from pipeline.modules.configs import TableConfig
    from pipeline.sparse import KeyedJaggedTensor

    emb = EmbeddingCollection([TableConfig("a", 10, 4, ["C2", "C3"]), TableConfig("b", 10, 2, ["C3"])],
                              ["C1", "C2", "C3"], validate_ids=False)
    kjt = KeyedJaggedTensor.from_lists(["C1", "C2", "C3"], [[[1], [2, 3]], [[4], []], [[5, 6], [7]]])
    with HostReads() as reads:
        emb(kjt).sum().backward()
    assert reads.seen == ["aten._local_scalar_dense"]


def test_the_loop_reads_the_loss_once_per_logged_line(tmp_path):
    trainer, loader = _trainer(tmp_path, "dlrm", log_every=4, max_steps=10)
    trainer.start_fresh()
    with loader, HostReads(trainer.optimizer) as reads:
        trainer.fit()
    logged = [json.loads(line) for line in trainer.metrics_path.read_text().splitlines()]
    losses = [r["loss"] for r in logged if "loss" in r]
    assert [r["step"] for r in logged if "loss" in r] == [4, 8, 10]
    assert reads.seen == ["aten._local_scalar_dense"] * len(losses)


def test_the_loop_times_its_regions_and_they_add_up_to_its_wall_time(tmp_path):
    import time

    trainer, loader = _trainer(tmp_path, "dlrm", log_every=4, max_steps=10, eval_every=5)
    trainer.start_fresh()
    start = time.perf_counter()
    with loader:
        trainer.fit(lambda: {"auc": 0.5})
    wall = time.perf_counter() - start
    seconds = trainer.timings.seconds
    assert set(seconds) == {"batch wait", "step", "loss read", "log", "progress", "evaluation", "checkpoint",
                            "callbacks"}
    assert all(v >= 0 for v in seconds.values()) and seconds["step"] > 0
    assert sum(seconds.values()) == pytest.approx(wall, rel=0.05)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(MODEL_CLASSES))
def test_a_training_step_on_the_gpu_does_not_sync(tmp_path, name):
    trainer, loader = _trainer(tmp_path, name, device="cuda", backend="cuda")
    with loader:
        batches = list(loader)[:3]
    trainer.train_step(batches[0])  # first use: the step counter is read once, the kernels are compiled
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batch in batches[1:]:
            trainer.train_step(batch)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
