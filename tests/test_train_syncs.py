"""Host synchronisations on the training path: a step reads nothing back from the device; the loop reads
the loss once per logged line.

On the CPU a sync cannot be seen, so a dispatch mode records the operations that make one on a GPU:
a tensor read as a Python number (``.item()``, ``float``, ``int``, ``bool``), ``nonzero`` and what is
built on it (boolean-mask indexing, reading or writing, ``masked_select``), ``unique`` and
``repeat_interleave`` without ``output_size``. The hash table's plain-torch stand-ins for its kernels
(``pipeline.kernels.hashtable.reference``: placing keys, finding them, copying rows) are left out: on a GPU
the kernels run instead, and read nothing back. A function mode records the copies of a tensor to the host
(``.tolist()``, ``.cpu()``, ``.numpy()``), the reads a step makes on purpose, which the dispatch mode does
not see on the CPU, and a Python number written by a tensor index (``x[rows] = False``): on a GPU the number is
copied from pageable host memory, which waits for the stream (``index_fill_`` takes it as an argument instead).
On a GPU, ``torch.cuda.set_sync_debug_mode`` turns a real sync into an error or a warning.
"""

import json
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from pipeline.distributed.world import World
from pipeline.kernels.hashtable import reference
from pipeline.loader import Loader
from pipeline.loader.synthetic import criteo_schema, write_processed
from pipeline.modules.configs import EmbeddingOptimizerConfig
from pipeline.modules.models import MODEL_CLASSES, ModelSizes, build_model
from pipeline.modules.side_stream import SideStream
from pipeline.schema import Column, Schema
from pipeline.train.config import TrainConfig
from pipeline.train.loop import Trainer

SIZES = ModelSizes(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1])
_SYNCING = {"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten._unique2", "aten.unique_dim",
            "aten.unique_consecutive"}
_INDEXING = {"aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"}
_COPIES = {torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy}
# The hash table reference's functions that run as kernels on a GPU (pipeline.kernels.hashtable.launcher's).
_KERNEL_STAND_INS = {getattr(reference, name).__code__
                     for name in ("place", "locate", "find", "read_rows", "take_rows", "write_rows")}


def _in_kernel_stand_in() -> bool:
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code in _KERNEL_STAND_INS:
            return True
        frame = frame.f_back
    return False


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
        bool_index = name in _INDEXING and any(i is not None and i.dtype == torch.bool for i in args[1])
        unsized = name == "aten.repeat_interleave" and kwargs.get("output_size") is None and (
            len(args) < 4 or args[3] is None) and isinstance(args[0], torch.Tensor) and args[0].dim() > 0
        if (name in _SYNCING or bool_index or unsized) and not self._host_counter(args[0]) \
                and not _in_kernel_stand_in():
            self.seen.append(name)
        return func(*args, **kwargs)

    def _host_counter(self, tensor: torch.Tensor) -> bool:
        states = self.optimizer.state.values() if self.optimizer is not None else ()
        return any(s.get("step") is not None and s["step"].data_ptr() == tensor.data_ptr() for s in states)


class HostCopies(TorchFunctionMode):
    """Records each copy of a tensor to the host (``.tolist()``, ``.cpu()``, ``.numpy()``), and each Python number
    written by a tensor index (a copy to the device), by name."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _COPIES and not _in_kernel_stand_in():
            self.seen.append(f"Tensor.{func.__name__}")
        if func is torch.Tensor.__setitem__ and _number_by_tensor_index(*args[1:]) and not _in_kernel_stand_in():
            self.seen.append("Tensor.__setitem__ of a number")
        return func(*args, **(kwargs or {}))


def _number_by_tensor_index(index, value) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return isinstance(value, (bool, int, float)) and any(isinstance(p, torch.Tensor) for p in parts)


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
    with HostReads(trainer.optimizer) as reads, HostCopies() as copies:
        for batch in batches[1:]:
            trainer.train_step(batch)
    assert reads.seen == copies.seen == []


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_host_cached_step_reads_nothing_back_but_its_counts_and_missing_rows(tmp_path, pipelined):
    """The step of a model with host-cached tables (their rows prefetched at the lookup, or a step ahead):
    none of the operations above. Its host waits are for copies to pinned memory on its side stream
    (``HostCachedCollection._read``: the per-table counts, and the missing rows' numbers), no-ops here."""
    from pipeline.distributed.train_pipeline import PrefetchPipeline
    from pipeline.modules.cached_collection import HostCachedCollection

    trainer, loader = _trainer(tmp_path, "dlrm", optimizer="adagrad")
    model = trainer.model
    model.embedding = HostCachedCollection.from_collection(model.embedding, {"t_C3": 200, "t_M1": 400})
    with loader:
        batches = iter(list(loader)[:6])
    if pipelined:
        batches = PrefetchPipeline(model, "cpu")(batches)
    trainer.train_step(next(batches))
    with HostReads(trainer.optimizer) as reads, HostCopies() as copies:
        for batch in batches:
            trainer.train_step(batch)
    assert reads.seen == []
    assert "Tensor.__setitem__ of a number" not in copies.seen
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


def _dynamic_trainer(tmp_path, name: str, tables: int, admit_after: int, device: str = "cpu"):
    """A trainer of ``name`` whose first ``tables`` sparse columns are raw 64-bit ids in dynamic tables of 128 rows,
    beside two static columns and a multi-hot one. The data holds 1024 ids per raw column, so the tables evict."""
    raw = {f"C{i + 1}" for i in range(tables)}

    def schema(rows: int) -> Schema:
        base = criteo_schema(size=0.0001, categorical=tables + 2, continuous=3, multihot={"M1": 3})
        return Schema([Column(c.name, c.role, "int64", cardinality=rows, dynamic=True) if c.name in raw else c
                       for c in base.columns])

    data = tmp_path / "processed"
    write_processed(data, schema(1024), {"train": 640}, row_group_rows=320, seed=3)
    cfg = TrainConfig(model=name, batch_size=64, optimizer="adam", checkpoint_every=0)
    model = build_model(name, schema(128), SIZES, EmbeddingOptimizerConfig("adagrad", lr=0.1), admit_after=admit_after,
                        backend="cuda" if device == "cuda" else "auto").to(device)
    model.embedding.validate_ids = False
    loader = Loader(data / "train", cfg.batch_size, shuffle=True, device=device)
    return Trainer(model, cfg, tmp_path / "out", loader, World(device=torch.device(device))), loader


@pytest.mark.parametrize("name, admit_after, reads, pipelined", [
    ("dlrm", 1, 1, False), ("dlrm", 2, 3, False), ("deepfm", 1, 1, False), ("deepfm", 2, 3, False),
    ("dlrm", 2, 3, True), ("deepfm", 1, 1, True)])
def test_dynamic_tables_read_the_device_a_fixed_number_of_times_a_step_whatever_their_number(tmp_path, name,
                                                                                             admit_after, reads,
                                                                                             pipelined):
    """Mapping the ids of every dynamic table of a training step copies one set of numbers to the host (the
    rows to start, the ids without a row), two more with admission (the ids to count, those admitted), and does
    none of the operations above: with 2 tables as with 6, and DeepFM's deep and wide tables, two dims, in the
    same reads; ``pipelined``: each batch's ids placed a step ahead (the training pipeline), the same reads, and
    the step itself adds none."""
    from pipeline.distributed.train_pipeline import PrefetchPipeline

    seen = {}
    for tables in (2, 6):
        trainer, loader = _dynamic_trainer(tmp_path / str(tables), name, tables, admit_after)
        with loader:
            batches = iter(list(loader)[:5])
        if pipelined:
            batches = PrefetchPipeline(trainer.model, "cpu")(batches)
        trainer.train_step(next(batches))
        with HostReads(trainer.optimizer) as syncs, HostCopies() as copies:
            for batch in batches:
                trainer.train_step(batch)
        seen[tables] = syncs.seen + copies.seen
        stats = [t.stats() for t in trainer.model.embedding.dynamic.tables.values()]
        assert len(stats) == tables * (2 if name == "deepfm" else 1)
        assert all(s["candidates"] > 0 if admit_after > 1 else s["evictions"] > 0 for s in stats), stats
    assert seen[2] == seen[6] == ["Tensor.tolist"] * reads * 4


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

    trainer, loader = _trainer(tmp_path, "dlrm", log_every=4, max_steps=40, eval_every=5)
    trainer.start_fresh()
    with loader:
        start = time.perf_counter()
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


class CountedWaits(SideStream):
    """A side stream counting the host's waits for it (every read back goes through ``wait``)."""

    waits = 0

    def wait(self, event) -> None:
        self.waits += 1
        super().wait(event)


@pytest.mark.gpu
def test_a_training_step_of_dynamic_tables_on_the_gpu_waits_for_its_side_stream_once_and_syncs_nothing(tmp_path):
    """The kernels place the ids of 12 dynamic tables (DeepFM's deep and wide ones) on the collection's side stream:
    the host waits for an event of that stream once a step (the mapping's one read of a few numbers), and
    ``set_sync_debug_mode("error")`` sees no sync, each batch placed at its lookup or a step ahead through the
    training pipeline (its side stream waiting for the event recorded when the batch was read, not for the step
    before). Both end with the same ids, slots and scores, and the same rows to float tolerance."""
    from pipeline.distributed.train_pipeline import PrefetchPipeline

    trained = {}
    for pipelined in (False, True):
        torch.manual_seed(0)
        trainer, loader = _dynamic_trainer(tmp_path / str(pipelined), "deepfm", 6, 1, device="cuda")
        embedding = trainer.model.embedding
        assert embedding.dynamic["t_C1"].ids.backend == "cuda"
        embedding.side = side = CountedWaits()
        with loader:
            batches = iter(list(loader)[:6])
        if pipelined:
            batches = PrefetchPipeline(trainer.model, "cuda")(batches)
        trainer.train_step(next(batches))  # first use: the kernels are compiled, the step counter read
        torch.cuda.synchronize()
        waits, steps = side.waits, 0
        torch.cuda.set_sync_debug_mode("error")
        try:
            for batch in batches:
                trainer.train_step(batch)
                steps += 1
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        assert steps == 5 and side.waits - waits == steps
        trained[pipelined] = embedding
    at_lookup, ahead = trained[False], trained[True]
    assert sum(t.stats()["evictions"] for t in ahead.dynamic.tables.values()) > 0
    for name in at_lookup.dynamic.tables:
        a, b = at_lookup.dynamic[name].get_extra_state(), ahead.dynamic[name].get_extra_state()
        assert a["evictions"] == b["evictions"], name
        for key in ("keys", "slots", "scores"):
            assert torch.equal(a["ids"][key], b["ids"][key]), (name, key)
    # the fused CUDA update may sum a row's gradients in another order from run to run
    for key, value in at_lookup.state_dict().items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            torch.testing.assert_close(ahead.state_dict()[key], value, atol=1e-5, rtol=1e-4)
