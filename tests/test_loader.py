"""The loader against a small processed split whose every value is a function of the row's id.

``I1`` holds the row id, so a batch can be checked sample by sample: its label, its one-hot ids
and its multi-hot bag must be those of that row, whatever the shuffling or sharding did.

``reader="cudf"`` is compared with the pyarrow reader: everywhere on a small stand-in for cuDF (its
logic, and on a GPU its device side), and with the real cuDF on a GPU (``-m gpu``).
"""

from __future__ import annotations

import gc
import itertools
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.errors import BadInputError
from pipeline.loader import Batch, Loader, LoaderStateError
from pipeline.schema import Column, Schema
from pipeline.sparse import KeyedJaggedTensor

ROWS = 1000
GROUP_ROWS = 64
CARD = {"C1": 7, "C2": 50, "C3": 1000}
MULTIHOT_CARD = 300


def make_schema() -> Schema:
    return Schema(
        [
            Column("label", "label", "float32"),
            Column("I1", "continuous", "float32"),
            Column("I2", "continuous", "float32"),
            Column("C1", "categorical", "int32", cardinality=CARD["C1"]),
            Column("M1", "multihot", "list<int32>", cardinality=MULTIHOT_CARD, max_length=3),
            Column("C2", "categorical", "int32", cardinality=CARD["C2"]),
            Column("C3", "categorical", "int32", cardinality=CARD["C3"]),
        ],
        row_group_rows=GROUP_ROWS,
    )


def bag_of(row: int) -> list[int]:
    return [(row * 7 + j) % MULTIHOT_CARD for j in range(row % 4)]


def table_of(rows: np.ndarray) -> pa.Table:
    bags = [bag_of(int(r)) for r in rows]
    return pa.table(
        {
            "label": pa.array((rows % 3 == 0).astype(np.float32)),
            "I1": pa.array(rows.astype(np.float32)),
            "I2": pa.array((rows * 0.5).astype(np.float32)),
            "C1": pa.array((rows % CARD["C1"]).astype(np.int32)),
            "M1": pa.array(bags, type=pa.list_(pa.int32())),
            "C2": pa.array((rows % CARD["C2"]).astype(np.int32)),
            "C3": pa.array((rows % CARD["C3"]).astype(np.int32)),
        }
    )


def write_split(folder: Path, bounds: list[int], schema: Schema | None = None) -> Path:
    """Files ``part-<i>`` holding rows ``bounds[i]:bounds[i+1]``, and ``schema.json`` one folder up."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        pq.write_table(table_of(np.arange(lo, hi)), folder / f"part-{i}.parquet", row_group_size=GROUP_ROWS)
    (schema or make_schema()).save(folder.parent / "schema.json")
    return folder


@pytest.fixture(scope="module")
def split(tmp_path_factory) -> Path:
    # Uneven files, so row groups of several sizes; 1000 rows over ranks of 3 leaves a remainder.
    return write_split(tmp_path_factory.mktemp("processed") / "train", [0, 300, 310, 1000])


def rows_of(batch: Batch) -> list[int]:
    return batch.dense[:, 0].to(torch.int64).tolist()


def check_batch(batch: Batch) -> None:
    """Every value of the batch is the one its row id says."""
    rows = np.array(rows_of(batch))
    assert batch.dense.dtype == torch.float32 and batch.dense.shape == (len(rows), 2)
    assert batch.label.dtype == torch.float32 and batch.label.shape == (len(rows),)
    assert batch.sparse.keys == ["C1", "M1", "C2", "C3"]
    assert batch.sparse.values.dtype == torch.int64 and batch.sparse.lengths.dtype == torch.int64
    assert batch.label.tolist() == (rows % 3 == 0).astype(np.float32).tolist()
    assert batch.dense[:, 1].tolist() == (rows * 0.5).tolist()
    expected = KeyedJaggedTensor.from_lists(
        ["C1", "M1", "C2", "C3"],
        [
            [[r % CARD["C1"]] for r in rows],
            [bag_of(r) for r in rows],
            [[r % CARD["C2"]] for r in rows],
            [[r % CARD["C3"]] for r in rows],
        ],
    )
    assert batch.sparse.values.tolist() == expected.values.tolist()
    assert torch.equal(batch.sparse.lengths, expected.lengths)
    assert batch.sparse.length_per_key == expected.lengths.view(4, -1).sum(1).tolist()


def epoch_rows(loader: Loader) -> list[list[int]]:
    return [rows_of(b) for b in loader]


def small(split: Path, **kw) -> Loader:
    kw.setdefault("batch_size", 32)
    kw.setdefault("window_rows", 128)
    kw.setdefault("reader", "pyarrow")  # the reference the cudf reader is compared with, also where cuDF imports
    return Loader(split, **kw)


def test_in_order_batches_hold_every_row_once_with_its_values(split):
    loader = small(split)
    batches = list(loader)
    assert len(batches) == len(loader) == -(-ROWS // 32)
    assert [r for b in batches for r in rows_of(b)] == list(range(ROWS))
    assert [b.batch_size for b in batches] == [32] * (ROWS // 32) + [ROWS % 32]
    for batch in batches:
        check_batch(batch)
        assert batch.dense.is_contiguous()
    assert loader.epoch == 1


def test_shuffle_is_seeded_per_epoch_and_keeps_every_row_once(split):
    a = small(split, shuffle=True, seed=1)
    first, second = epoch_rows(a), epoch_rows(a)
    assert first == epoch_rows(small(split, shuffle=True, seed=1))
    assert first != epoch_rows(small(split, shuffle=True, seed=2))
    assert first != second, "the next epoch has another order"
    for order in (first, second):
        flat = [r for b in order for r in b]
        assert sorted(flat) == list(range(ROWS))
        assert flat != list(range(ROWS))
    for batch in small(split, shuffle=True, seed=3):
        check_batch(batch)


def test_shuffle_mixes_rows_across_row_groups(split):
    batch = next(iter(small(split, shuffle=True, seed=0, batch_size=64)))
    groups = {r // GROUP_ROWS for r in rows_of(batch)}
    assert len(groups) > 1


@pytest.mark.parametrize("shuffle", [False, True])
def test_shards_are_disjoint_equal_and_complete_without_drop_last(split, shuffle):
    world = 3
    loaders = [small(split, shuffle=shuffle, seed=5, rank=r, world_size=world) for r in range(world)]
    shards = [epoch_rows(loader) for loader in loaders]
    assert len({len(s) for s in shards}) == 1 and len(shards[0]) == len(loaders[0])
    assert len({tuple(len(b) for b in s) for s in shards}) == 1, "every rank has the same batch sizes"
    real, padded = [], []
    for loader, shard in zip(loaders, shards):
        flat = [r for b in shard for r in b]
        assert len(flat) == loader.rows_per_rank == -(-ROWS // world)
        cut = len(flat) - loader.padding
        real += flat[:cut]
        padded += flat[cut:]
    assert sorted(real) == list(range(ROWS)), "every row exactly once over the ranks"
    assert sum(loader.padding for loader in loaders) == len(padded) == world * -(-ROWS // world) - ROWS
    assert set(padded) <= set(real)


@pytest.mark.parametrize("shuffle", [False, True])
def test_shards_with_drop_last_are_disjoint_and_full(split, shuffle):
    world, batch_size = 3, 32
    loaders = [small(split, shuffle=shuffle, rank=r, world_size=world, drop_last=True) for r in range(world)]
    shards = [epoch_rows(loader) for loader in loaders]
    per_rank = (ROWS // world) // batch_size
    seen = []
    for loader, shard in zip(loaders, shards):
        assert len(shard) == len(loader) == per_rank
        assert all(len(b) == batch_size for b in shard)
        seen += [r for b in shard for r in b]
    assert len(seen) == len(set(seen)) == world * per_rank * batch_size


def test_drop_last_with_too_few_rows_says_so(split):
    with pytest.raises(Exception, match="fewer than batch_size=4000"):
        Loader(split, batch_size=4000, drop_last=True)


@pytest.mark.parametrize("stop_after", [1, 5, 12, 16, 23])
def test_resume_from_state_gives_exactly_the_remaining_batches(split, stop_after):
    settings = {"shuffle": True, "seed": 7, "rank": 1, "world_size": 2}
    reference = small(split, **settings)
    uninterrupted = epoch_rows(reference) + epoch_rows(reference)
    per_epoch = len(reference)

    first = small(split, **settings)
    seen, state = [], None
    for _ in range(2):
        for batch in first:
            seen.append(rows_of(batch))
            if len(seen) == stop_after:
                state = first.state_dict()
                break
        if state:
            break
    first.close()
    epoch, index = divmod(stop_after - 1, per_epoch)
    assert (state["epoch"], state["batches"]) == (epoch, index + 1)

    resumed = small(split, **settings)
    resumed.load_state_dict(state)
    for epoch in range(resumed.epoch, 2):
        for batch in resumed:
            seen.append(rows_of(batch))
    assert seen == uninterrupted
    assert resumed.state_dict()["epoch"] == 2


def test_resume_refuses_other_settings(split):
    state = small(split, shuffle=True, seed=1).state_dict()
    with pytest.raises(LoaderStateError, match="seed: saved 1, now 2"):
        small(split, shuffle=True, seed=2).load_state_dict(state)
    with pytest.raises(LoaderStateError, match="batch_size"):
        small(split, shuffle=True, seed=1, batch_size=16).load_state_dict(state)


def test_set_epoch_and_a_broken_iteration_restart_the_epoch(split):
    loader = small(split, shuffle=True, seed=1)
    first_batch = rows_of(next(iter(loader)))
    assert loader.epoch == 0
    assert rows_of(next(iter(loader))) == first_batch
    loader.set_epoch(3)
    third = epoch_rows(loader)
    loader.set_epoch(3)
    assert epoch_rows(loader) == third
    assert loader.epoch == 4


def loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("pipeline-loader")]


@pytest.mark.parametrize("how", ["break", "close", "garbage", "with", "new_iteration"])
def test_stopping_early_leaves_no_thread(split, how):
    before = threading.active_count()
    loader = small(split, prefetch=2, batch_size=8)
    if how == "break":
        for i, _ in enumerate(loader):
            if i == 2:
                break
    elif how == "close":
        it = iter(loader)
        next(it)
        assert loader_threads()
        loader.close()
        with pytest.raises(RuntimeError, match="stopped"):
            for _ in it:
                pass
    elif how == "garbage":
        it = iter(loader)
        next(it)
        del it, loader
        gc.collect()
    elif how == "with":
        with loader:
            next(iter(loader))
            it = iter(loader)
            next(it)
    elif how == "new_iteration":
        it = iter(loader)
        next(it)
        assert rows_of(next(iter(loader))) == list(range(8))
        del it
    assert not loader_threads()
    assert threading.active_count() == before


def test_an_error_in_the_reading_thread_is_raised_in_the_consumer(tmp_path):
    folder = write_split(tmp_path / "train", [0, 200])
    table = table_of(np.arange(200, 400))
    labels = table.column("label").to_numpy().copy()
    labels[150] = 0.5
    pq.write_table(table.set_column(0, "label", pa.array(labels)), folder / "part-1.parquet", row_group_size=GROUP_ROWS)
    before = threading.active_count()
    loader = Loader(folder, batch_size=32, window_rows=64, prefetch=1)
    seen = 0
    with pytest.raises(BadInputError) as err:
        for _ in loader:
            seen += 1
    assert seen >= 1, "batches before the bad row group still arrive"
    message = str(err.value)
    assert "part-1.parquet" in message and "'label'" in message and "0.5" in message and "row 150" in message
    assert threading.active_count() == before


def rewrite(folder: Path, name: str, array: pa.Array, rows=(0, 100)) -> None:
    table = table_of(np.arange(*rows))
    index = table.schema.get_field_index(name)
    pq.write_table(table.set_column(index, name, array), folder / "part-0.parquet", row_group_size=GROUP_ROWS)


def bad_split(tmp_path: Path) -> Path:
    return write_split(tmp_path / "train", [0, 100])


def read_all(folder: Path) -> None:
    for _ in Loader(folder, batch_size=16):
        pass


def test_missing_column_is_named(tmp_path):
    folder = bad_split(tmp_path)
    pq.write_table(table_of(np.arange(100)).drop_columns(["C2"]), folder / "part-0.parquet")
    with pytest.raises(BadInputError, match=r"part-0.parquet: column 'C2' of the schema \(categorical\) is missing"):
        Loader(folder, batch_size=16)


@pytest.mark.parametrize(
    "name, array, found",
    [
        ("I2", pa.array(np.zeros(100, dtype=np.float64)), "double"),
        ("C1", pa.array(np.zeros(100, dtype=np.int64)), "int64"),
        ("label", pa.array(np.zeros(100, dtype=np.int8)), "int8"),
        ("M1", pa.array(np.zeros(100, dtype=np.int32)), "int32"),
    ],
)
def test_wrong_dtype_is_named(tmp_path, name, array, found):
    folder = bad_split(tmp_path)
    rewrite(folder, name, array)
    with pytest.raises(BadInputError, match=rf"part-0.parquet: column '{name}' .* should be .*, found {found}"):
        Loader(folder, batch_size=16)


@pytest.mark.parametrize(
    "name, values, pattern",
    [
        (
            "label",
            np.where(np.arange(100) == 70, 2, 0).astype(np.float32),
            r"'label' should hold 0 or 1, found 2.0 at row 70",
        ),
        ("C2", np.where(np.arange(100) == 9, CARD["C2"], 1).astype(np.int32), rf"'C2' holds id {CARD['C2']} at row 9"),
        ("C3", np.where(np.arange(100) == 99, -4, 1).astype(np.int32), r"'C3' holds id -4 at row 99"),
    ],
)
def test_bad_values_are_named_with_file_column_row_and_value(tmp_path, name, values, pattern):
    folder = bad_split(tmp_path)
    rewrite(folder, name, pa.array(values))
    with pytest.raises(BadInputError, match=rf"part-0.parquet: (label )?column {pattern}"):
        read_all(folder)


def test_multihot_id_beyond_cardinality_is_named(tmp_path):
    folder = bad_split(tmp_path)
    bags = [[1, 2]] * 100
    bags[66] = [3, MULTIHOT_CARD + 5]
    rewrite(folder, "M1", pa.array(bags, type=pa.list_(pa.int32())))
    with pytest.raises(
        BadInputError, match=rf"'M1' holds id {MULTIHOT_CARD + 5} at row 66 .*cardinality {MULTIHOT_CARD}"
    ):
        read_all(folder)


def test_nulls_are_refused(tmp_path):
    folder = bad_split(tmp_path)
    values = pa.array([None if i == 12 else 1.0 for i in range(100)], type=pa.float32())
    rewrite(folder, "I1", values)
    with pytest.raises(BadInputError, match=r"'I1' has 1 null values, the first at row 12"):
        read_all(folder)


def test_missing_folder_and_schema_are_clear(tmp_path):
    with pytest.raises(BadInputError, match="no such file or folder"):
        Loader(tmp_path / "nothing", batch_size=4)
    (tmp_path / "empty").mkdir()
    with pytest.raises(BadInputError, match="expected part-\\*.parquet"):
        Loader(tmp_path / "empty", batch_size=4, schema=make_schema())


def test_batch_to_and_repr(split):
    loader = small(split)
    batch = next(iter(loader)).to("cpu")
    check_batch(batch)
    assert "1000 rows" in repr(loader)


def onehot_schema() -> Schema:
    """The test schema without its multi-hot column: the files are the same, ``M1`` is not read."""
    return Schema([c for c in make_schema().columns if c.role != "multihot"], row_group_rows=GROUP_ROWS)


def test_windows_are_whole_batches_at_least_four_row_groups_at_most_a_rank(split):
    assert small(split, window_rows=100).window_rows == 4 * GROUP_ROWS
    assert small(split, window_rows=1 << 20).window_rows == 1024
    assert small(split, window_rows=1 << 20, rank=1, world_size=4).window_rows == 256
    assert small(split, batch_size=48, window_rows=1000).window_rows == 1008
    assert small(split, batch_size=300, window_rows=1).window_rows == 300


@pytest.fixture
def row_group_reads(monkeypatch) -> list[list[int]]:
    """The row groups of every ``read_row_groups`` call, in the order the calls were made (from any thread)."""
    calls = []
    read = pq.ParquetFile.read_row_groups

    def recorded(self, row_groups, *args, **kwargs):
        calls.append(list(row_groups))
        return read(self, row_groups, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_groups", recorded)
    return calls


def test_a_window_is_read_with_one_call_per_file(split, row_group_reads):
    calls = row_group_reads
    batches = list(small(split, window_rows=1024, read_threads=1))  # one window: every row, in one part
    assert [r for b in batches for r in rows_of(b)] == list(range(ROWS))
    assert calls == [[0, 1, 2, 3, 4], [0], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]  # 300, 10 and 690 rows


def test_reader_threads_read_a_window_in_parts_cut_between_row_groups(split, row_group_reads):
    """Three reader threads read the first window (here the only one) in three parts of about a third of its rows
    each, cut between row groups (none read twice), one call per file of a part; the batches are those of one
    reader thread."""
    calls = row_group_reads
    for shuffle in (False, True):
        calls.clear()
        parts = list(small(split, window_rows=1024, read_threads=3, shuffle=shuffle, seed=1))
        if not shuffle:  # 300 + 10 + 64 rows, then 320 and 306
            assert sorted(calls) == sorted([[0, 1, 2, 3, 4], [0], [0], [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
        assert sum(len(c) for c in calls) == 17  # every row group read once
        whole = list(small(split, window_rows=1024, read_threads=1, shuffle=shuffle, seed=1))
        assert [rows_of(b) for b in parts] == [rows_of(b) for b in whole]
        for a, b in zip(parts, whole):
            assert a.sparse.values.tolist() == b.sparse.values.tolist()
            assert a.sparse.lengths.tolist() == b.sparse.lengths.tolist()


def test_batches_of_a_window_are_views_of_it(split):
    loader = small(split, schema=onehot_schema(), shuffle=True, window_rows=256)
    batches = list(loader)
    assert len(batches) == 32 and loader.window_rows // loader.batch_size == 8

    def storages(batch: Batch) -> tuple[int, ...]:
        tensors = (batch.dense, batch.label, batch.sparse.values, batch.sparse.lengths)
        return tuple(t.untyped_storage().data_ptr() for t in tensors)

    for first, last in [(0, 8), (8, 16), (16, 24), (24, 31)]:  # batch 31 is the short last one
        assert len({storages(b) for b in batches[first:last]}) == 1
    assert storages(batches[0]) != storages(batches[8])
    for batch in batches:
        rows = np.array(rows_of(batch))
        assert batch.sparse.keys == ["C1", "C2", "C3"]
        assert batch.sparse.values.tolist() == np.concatenate([rows % CARD[k] for k in ("C1", "C2", "C3")]).tolist()
        assert batch.sparse.lengths.tolist() == [1] * 3 * len(rows)


def test_windows_are_read_ahead_by_the_reader_threads_and_no_further(tmp_path, monkeypatch):
    from pipeline.loader import loader as loader_module

    folder = write_split(tmp_path / "train", [0, 3000])  # 12 windows of 256 rows
    read = loader_module.read_into
    started: list[int] = []

    def recorded(split_, segments, *args, **kwargs):
        started.append(segments[0].group.first_row + segments[0].start)
        return read(split_, segments, *args, **kwargs)

    monkeypatch.setattr(loader_module, "read_into", recorded)
    loader = small(folder, window_rows=256, read_threads=2, prefetch=1)
    it = iter(loader)
    next(it)
    deadline = time.monotonic() + 10
    while len(started) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    # Window 0 (read in two parts by the 2 threads) is handed out, 1 waits in the queue, 2 waits to be queued, 3
    # and 4 are read by the 2 threads.
    assert sorted(started) == [0, 128, 256, 512, 768, 1024]
    assert [r for b in it for r in rows_of(b)] == list(range(32, 3000))
    assert sorted(started) == [0, 128, *range(256, 3000, 256)]


def test_int64_ids_give_the_batches_of_int32_ids(tmp_path, split):
    schema = make_schema()
    schema.columns[3] = Column("C1", "categorical", "int64", cardinality=CARD["C1"])
    folder = write_split(tmp_path / "train", [0, 300, 310, 1000], schema)  # the files of ``split``
    for path in folder.glob("part-*.parquet"):
        table = pq.read_table(path)
        pq.write_table(table.set_column(3, "C1", table.column("C1").cast(pa.int64())), path,
                       row_group_size=GROUP_ROWS)
    same_batches(list(small(split, shuffle=True)), list(small(folder, shuffle=True)))


def test_nulls_are_refused_also_without_checks(tmp_path):
    folder = bad_split(tmp_path)
    rewrite(folder, "C2", pa.array([None if i == 30 else 1 for i in range(100)], type=pa.int32()))
    with pytest.raises(BadInputError, match=r"'C2' has 1 null values, the first at row 30"):
        list(Loader(folder, batch_size=16, validate=False))


@pytest.mark.gpu
@pytest.mark.parametrize("shuffle, read_threads", [(False, 8), (True, 8), (True, 1)])
@pytest.mark.parametrize("multihot", [True, False])
def test_cuda_batches_equal_cpu_batches(split, shuffle, read_threads, multihot):
    # One reader thread has a pool of 2 pinned buffers for 4 windows: buffers are recycled. Without
    # the multi-hot column the order is made on the GPU, with it on the host.
    schema = None if multihot else onehot_schema()
    cpu = list(small(split, schema=schema, shuffle=shuffle, seed=4))
    gpu_loader = small(split, schema=schema, shuffle=shuffle, seed=4, device="cuda", read_threads=read_threads)
    for _ in range(2):
        gpu = list(gpu_loader)
        assert len(cpu) == len(gpu)
        for a, b in zip(cpu, gpu):
            assert b.dense.is_cuda and b.sparse.values.is_cuda and b.label.is_cuda
            assert torch.equal(a.dense, b.dense.cpu()) and torch.equal(a.label, b.label.cpu())
            assert torch.equal(a.sparse.values, b.sparse.values.cpu())
            assert torch.equal(a.sparse.lengths, b.sparse.lengths.cpu())
        cpu = list(small(split, schema=schema, shuffle=shuffle, seed=4)) if not shuffle else cpu_next_epoch(split, schema)


@pytest.mark.gpu
def test_an_arrays_read_only_buffer_goes_to_the_device_without_a_warning():
    # A multi-hot column's values as arrow reads them are its read-only buffer; torch warns, once a process (so in
    # a process of its own here), at a tensor over memory it may not write: a warning users read mid-training.
    script = """import numpy as np, pyarrow as pa, torch
from pipeline.loader.collate import _to
values = pa.array(range(10), pa.int64()).to_numpy()
assert not values.flags.writeable
assert _to(values, torch.device("cuda")).cpu().tolist() == list(range(10))
"""
    import subprocess

    done = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", script], capture_output=True, text=True,
                          timeout=120, check=False, cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr[-2000:]


def cpu_next_epoch(split, schema):
    loader = small(split, schema=schema, shuffle=True, seed=4)
    loader.set_epoch(1)
    return list(loader)


@pytest.mark.gpu
def test_cuda_early_stop_leaves_no_thread(split):
    before = threading.active_count()
    loader = small(split, device="cuda", batch_size=8, prefetch=2)
    for i, batch in enumerate(loader):
        if i == 3:
            break
    rows = rows_of(next(iter(loader)))
    assert rows == list(range(8))
    assert threading.active_count() == before


@pytest.mark.gpu
def test_cuda_window_is_one_copy_to_the_device_and_nothing_comes_back(split):
    from torch.profiler import ProfilerActivity, profile

    loader = small(split, schema=onehot_schema(), shuffle=True, device="cuda", window_rows=256)
    list(loader)  # the first epoch makes the pinned buffers
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        batches = list(loader)
        torch.cuda.synchronize()
    copies = [e.name for e in prof.events() if "Memcpy" in e.name]
    assert len(batches) == 32 and sum("HtoD" in name for name in copies) == 4, copies  # one per window
    assert not [name for name in copies if "DtoH" in name]


@pytest.mark.gpu
@pytest.mark.parametrize("stop_after", [3, 8, 13])
def test_cuda_resumes_as_the_cpu_loader_runs(split, stop_after):
    settings = {"schema": onehot_schema(), "shuffle": True, "seed": 9, "rank": 1, "world_size": 2}
    reference = list(small(split, **settings))
    same_batches(reference[stop_after:], _resumed_after(lambda: small(split, device="cuda", **settings), stop_after))


def _resumed_after(make, stop_after: int) -> list:
    """The batches of a loader from ``make()`` resumed from the state of another one stopped after ``stop_after``."""
    first = make()
    for i, _ in enumerate(first):
        if i + 1 == stop_after:
            break
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    return list(resumed)


# reader="cudf": on CPU machines its logic runs on a small stand-in for cuDF (below); on a GPU with
# the real cuDF, the GPU tests at the end compare it with the pyarrow reader.


class _FakeSeries:
    """A cuDF Series as the cudf reader uses it, over an arrow array (nulls are nulls, NaN is a value)."""

    def __init__(self, array: pa.Array) -> None:
        self._array = array

    @property
    def null_count(self) -> int:
        return self._array.null_count

    @property
    def values(self) -> np.ndarray:  # cuDF: a CuPy array, refused when the column has nulls
        if self._array.null_count:
            raise ValueError("Column must have no nulls for conversion to CuPy array")
        return np.array(self._array.to_numpy(zero_copy_only=False))

    def to_numpy(self) -> np.ndarray:
        return self.values

    def isna(self) -> _FakeSeries:
        return _FakeSeries(self._array.is_null())

    def fillna(self, value) -> _FakeSeries:
        return _FakeSeries(pc.fill_null(self._array, value))

    @property
    def list(self) -> _FakeSeries:
        return self

    def len(self) -> _FakeSeries:
        return _FakeSeries(pc.list_value_length(self._array))

    @property
    def leaves(self) -> _FakeSeries:
        return _FakeSeries(self._array.values)  # the child array, as cuDF's leaves


def fake_cudf(calls: list) -> types.ModuleType:
    module = types.ModuleType("cudf")

    def read_parquet(paths, columns=None, row_groups=None):
        # cuDF's semantics: the row groups of each source, in the order given, one after another
        assert isinstance(paths, list) and isinstance(row_groups, list) and len(row_groups) == len(paths)
        tables = []
        for path, groups in zip(paths, row_groups):
            calls.extend((Path(path).name, group) for group in groups)
            tables += [pq.ParquetFile(path).read_row_group(group, columns=columns) for group in groups]
        table = pa.concat_tables(tables)
        return {name: _FakeSeries(table.column(name).combine_chunks()) for name in columns}

    module.read_parquet = read_parquet
    return module


def fake_rmm() -> types.ModuleType:
    """RMM's device resources as cuDF's reader uses them: each device starts on plain ``cudaMalloc``."""
    module = types.ModuleType("rmm")
    mr = types.SimpleNamespace(CudaMemoryResource=type("CudaMemoryResource", (), {}),
                               CudaAsyncMemoryResource=type("CudaAsyncMemoryResource", (), {}))
    mr.current = mr.CudaMemoryResource()
    mr.get_current_device_resource = lambda: mr.current
    mr.set_current_device_resource = lambda resource: setattr(mr, "current", resource)
    module.mr = mr
    return module


@pytest.fixture
def stand_in(monkeypatch) -> list:
    """``reader="cudf"`` on the CPU, reading through the stand-in (cuDF's and RMM's); returns its calls (file, row
    group)."""
    from pipeline.loader import cudf_read

    calls: list = []
    monkeypatch.setitem(sys.modules, "cudf", fake_cudf(calls))
    monkeypatch.setitem(sys.modules, "rmm", fake_rmm())
    monkeypatch.setattr(cudf_read, "check", lambda device: None)
    monkeypatch.setattr(cudf_read, "_memory_set", set())
    return calls


def test_the_cudf_reader_moves_rmm_to_the_stream_ordered_pool_once_and_leaves_a_users_resource(stand_in):
    from pipeline.loader import cudf_read

    mr = sys.modules["rmm"].mr
    cudf_read._stream_ordered_memory(torch.device("cuda", 0))
    assert type(mr.current) is mr.CudaAsyncMemoryResource
    chosen = mr.current = object()  # the user's own resource, or one set after the first window
    cudf_read._stream_ordered_memory(torch.device("cuda", 0))
    assert mr.current is chosen
    cudf_read._memory_set.clear()
    cudf_read._stream_ordered_memory(torch.device("cuda", 0))
    assert mr.current is chosen


def same_batches(a: list[Batch], b: list[Batch]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x.dense, y.dense.cpu()) and torch.equal(x.label, y.label.cpu())
        assert x.sparse.keys == y.sparse.keys
        assert torch.equal(x.sparse.values, y.sparse.values.cpu())
        assert torch.equal(x.sparse.lengths, y.sparse.lengths.cpu())


def outcome(loader: Loader) -> list[Batch] | str:
    """The epoch's batches, or the message of the error that stopped it."""
    try:
        return list(loader)
    except BadInputError as err:
        return str(err)


def same_outcome(a: list[Batch] | str, b: list[Batch] | str) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, str):
        assert a == b
    else:
        same_batches(a, b)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("world", [1, 3])
def test_cudf_reader_on_a_stand_in_gives_the_pyarrow_batches(split, stand_in, shuffle, world):
    for rank in range(world):
        settings = {"shuffle": shuffle, "seed": 6, "rank": rank, "world_size": world}
        pyarrow_loader, cudf_loader = small(split, **settings), small(split, reader="cudf", **settings)
        for _ in range(2):  # two epochs: the second has another order
            same_batches(list(pyarrow_loader), list(cudf_loader))
    groups = {(g.file, g.index) for g in small(split)._split.groups}
    assert {(int(name[5:-8]), index) for name, index in stand_in} == groups, "every row group read by cuDF"


def test_cudf_reader_on_a_stand_in_resumes_mid_epoch(split, stand_in):
    settings = {"shuffle": True, "seed": 2, "rank": 1, "world_size": 2}
    reference = list(small(split, **settings))
    first = small(split, reader="cudf", **settings)
    for i, _ in enumerate(first):
        if i == 6:
            break
    state = first.state_dict()
    resumed = small(split, reader="pyarrow", **settings)
    resumed.load_state_dict(state)
    again = small(split, reader="cudf", **settings)
    again.load_state_dict(state)
    same_batches(reference[7:], list(again))
    same_batches(list(resumed), list(small(split, reader="cudf", **settings))[7:])


def bad_inputs() -> list:
    bags = [[1, 2]] * 100
    bags[66] = [3, MULTIHOT_CARD + 5]
    return [
        ("label", pa.array(np.where(np.arange(100) == 70, 2, 0).astype(np.float32))),
        ("label", pa.array(np.where(np.arange(100) == 3, np.nan, 1).astype(np.float32))),
        ("C2", pa.array(np.where(np.arange(100) == 9, CARD["C2"], 1).astype(np.int32))),
        ("C3", pa.array(np.where(np.arange(100) == 99, -4, 1).astype(np.int32))),
        ("M1", pa.array(bags, type=pa.list_(pa.int32()))),
        ("M1", pa.array([None if i == 80 else [1] for i in range(100)], type=pa.list_(pa.int32()))),
        ("I1", pa.array([None if i in (12, 40) else 1.0 for i in range(100)], type=pa.float32())),
        ("C1", pa.array([None if i == 70 else 1 for i in range(100)], type=pa.int32())),
        ("I1", pa.array(np.where(np.arange(100) == 77, np.inf, 1).astype(np.float32))),
        ("I1", pa.array(np.where(np.arange(100) == 20, np.nan, 1).astype(np.float32))),
        ("M1", pa.array([[1, None] if i in (45, 90) else [1] for i in range(100)], type=pa.list_(pa.int32()))),
    ]


@pytest.mark.parametrize("case", range(len(bad_inputs())))
def test_cudf_reader_on_a_stand_in_names_bad_values_as_pyarrow_does(tmp_path, stand_in, case):
    folder = bad_split(tmp_path)
    rewrite(folder, *bad_inputs()[case])
    # Two ranks: rank 1 starts inside the second row group (rows 50..99), so a bad row before 50
    # fails only rank 0, for both readers.
    for rank in range(2):
        settings = {"batch_size": 16, "rank": rank, "world_size": 2, "window_rows": 64}
        want = outcome(Loader(folder, **settings))
        same_outcome(want, outcome(Loader(folder, reader="cudf", **settings)))
    assert isinstance(outcome(Loader(folder, batch_size=16)), str), "the bad value is found by a full read"


def test_cudf_reader_checks_int64_ids_before_packing_them_as_int32(tmp_path, stand_in):
    schema = make_schema()
    schema.columns[3] = Column("C1", "categorical", "int64", cardinality=CARD["C1"])
    folder = write_split(tmp_path / "train", [0, 100], schema=schema)
    ids = np.where(np.arange(100) == 30, 2**32 + 3, 1).astype(np.int64)  # 3 once narrowed to int32
    rewrite(folder, "C1", pa.array(ids))
    want = outcome(Loader(folder, batch_size=16))
    assert isinstance(want, str) and f"holds id {2**32 + 3} at row 30" in want
    same_outcome(want, outcome(Loader(folder, batch_size=16, reader="cudf")))


def test_cudf_reader_needs_a_cuda_device_a_gpu_and_cudf(split, monkeypatch):
    from pipeline import device as device_module
    from pipeline.errors import UserError

    with pytest.raises(UserError, match=r"reader='cudf' reads into GPU memory, so it needs device='cuda' \(got 'cpu'"):
        small(split, reader="cudf")
    monkeypatch.setattr(device_module, "gpu_problem", lambda: "torch sees no CUDA device (no GPU, or no driver)")
    with pytest.raises(UserError, match="reader='cudf' needs a usable CUDA GPU, but torch sees no CUDA device"):
        small(split, reader="cudf", device="cuda")
    monkeypatch.setattr(device_module, "gpu_problem", lambda: None)
    monkeypatch.setitem(sys.modules, "cudf", None)  # import cudf raises ImportError
    with pytest.raises(UserError, match=r"reader='cudf' needs cuDF, but cudf is not importable \(ModuleNotFoundError"):
        small(split, reader="cudf", device="cuda")
    with pytest.raises(ValueError, match="reader: expected one of"):
        small(split, reader="arrow")


def test_auto_reader_is_cudf_on_a_usable_gpu_with_cudf_else_pyarrow(split, monkeypatch):
    from pipeline import device as device_module
    from pipeline.loader import cudf_read
    from pipeline.train.config import READERS

    assert READERS == cudf_read.READERS
    assert small(split, reader="auto").reader == "pyarrow"  # the CPU
    assert Loader(split, batch_size=32).reader == "pyarrow"  # auto is the default
    monkeypatch.setattr(device_module, "gpu_problem", lambda: "torch sees no CUDA device (no GPU, or no driver)")
    assert cudf_read.choose("auto", "cuda") == "pyarrow"
    monkeypatch.setattr(device_module, "gpu_problem", lambda: None)
    monkeypatch.setitem(sys.modules, "cudf", None)  # import cudf raises ImportError
    assert cudf_read.choose("auto", "cuda") == "pyarrow"
    monkeypatch.setitem(sys.modules, "cudf", fake_cudf([]))
    assert cudf_read.choose("auto", "cuda") == "cudf"
    assert cudf_read.choose("auto", "cpu") == "pyarrow"
    assert cudf_read.choose("pyarrow", "cuda") == "pyarrow"


def test_a_window_of_every_reader_is_two_million_rows_by_default(tmp_path):
    folder = write_split(tmp_path / "train", [0, 100, 200, 300, 400, 500, 600, 700, 800])
    for reader in ("pyarrow", "auto"):
        assert Loader(folder, batch_size=16, reader=reader).window_rows == 800  # capped by the rows of a rank
    assert Loader.__init__.__kwdefaults__["window_rows"] == 1 << 21


@pytest.mark.gpu
def test_cuda_cudf_reader_on_a_stand_in_gives_the_pyarrow_batches(split, stand_in):
    # The device side of the cudf reader (blocks made by reader threads, events, streams) without cuDF.
    for rank in range(2):
        settings = {"shuffle": True, "seed": 4, "rank": rank, "world_size": 2, "device": "cuda"}
        pyarrow_loader, cudf_loader = small(split, **settings), small(split, reader="cudf", **settings)
        for _ in range(2):
            got = list(cudf_loader)
            assert all(b.dense.is_cuda and b.sparse.values.is_cuda for b in got)
            same_batches([b.to("cpu") for b in pyarrow_loader], got)
    assert stand_in
    assert type(sys.modules["rmm"].mr.current).__name__ == "CudaAsyncMemoryResource"


# On a GPU with the real cuDF: python3 -m pytest -q -m gpu tests/test_loader.py


@pytest.mark.gpu
def test_cuda_loader_reads_with_cudf_by_default_where_it_imports(split, real_cudf):
    loader = Loader(split, batch_size=32, window_rows=128, device="cuda", shuffle=True, seed=3)
    assert loader.reader == "cudf"
    same_batches([b.to("cpu") for b in small(split, device="cuda", shuffle=True, seed=3)], list(loader))


@pytest.fixture
def real_cudf() -> None:
    from pipeline.loader.cudf_read import cudf_problem

    problem = cudf_problem()
    if problem:
        pytest.skip(f"needs cuDF: {problem}")


@pytest.mark.gpu
@pytest.mark.parametrize("shuffle", [False, True])
def test_cuda_cudf_reader_gives_the_pyarrow_batches(split, real_cudf, shuffle):
    for rank in range(2):
        settings = {"shuffle": shuffle, "seed": 4, "rank": rank, "world_size": 2, "device": "cuda"}
        pyarrow_loader, cudf_loader = small(split, **settings), small(split, reader="cudf", **settings)
        for _ in range(2):
            expected, got = list(pyarrow_loader), list(cudf_loader)
            assert all(b.dense.is_cuda and b.sparse.values.is_cuda and b.label.is_cuda for b in got)
            same_batches([b.to("cpu") for b in expected], got)
            for batch in got:
                check_batch(batch.to("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("stop_after", [1, 9])
def test_cuda_cudf_reader_resumes_mid_epoch(split, real_cudf, stop_after):
    settings = {"shuffle": True, "seed": 7, "rank": 1, "world_size": 2, "device": "cuda"}
    reference = list(small(split, **settings))
    same_batches([b.to("cpu") for b in reference[stop_after:]],
                 _resumed_after(lambda: small(split, reader="cudf", **settings), stop_after))


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(bad_inputs())))
def test_cuda_cudf_reader_names_bad_values_as_pyarrow_does(tmp_path, real_cudf, case):
    folder = bad_split(tmp_path)
    rewrite(folder, *bad_inputs()[case])
    for rank in range(2):
        settings = {"batch_size": 16, "rank": rank, "world_size": 2, "window_rows": 64}
        want = outcome(Loader(folder, **settings))
        got = outcome(Loader(folder, reader="cudf", device="cuda", **settings))
        assert type(want) is type(got), (want, got)
        if isinstance(want, str):
            assert want == got
        else:
            same_batches(want, [b.to("cpu") for b in got])


@pytest.mark.gpu
def test_cuda_cudf_reader_early_stop_leaves_no_thread(split, real_cudf):
    before = threading.active_count()
    loader = small(split, device="cuda", reader="cudf", batch_size=8, prefetch=2)
    for i, _ in enumerate(loader):
        if i == 3:
            break
    assert rows_of(next(iter(loader))) == list(range(8))
    loader.close()
    assert threading.active_count() == before


def raw_id(rows: np.ndarray) -> np.ndarray:
    """A row's raw 64-bit id: all over the int64 range (negative, above 2**32), one per row."""
    with np.errstate(over="ignore"):
        return rows.astype(np.int64) * np.int64(-7046029254386353131) + np.int64(5)


def dynamic_split(folder: Path) -> Path:
    """``split``'s rows with a dynamic one-hot column ``D1`` (between C1 and M1) and a dynamic multi-hot ``D2``
    (last), both of raw 64-bit ids, far beyond their cardinality."""
    schema = make_schema()
    schema.columns.insert(4, Column("D1", "categorical", "int64", cardinality=256, dynamic=True))
    schema.columns.append(Column("D2", "multihot", "list<int64>", cardinality=128, max_length=3, dynamic=True))
    write_split(folder, [0, 300, 310, 1000], schema)
    for path in folder.glob("part-*.parquet"):
        table = pq.read_table(path)
        rows = table.column("I1").to_numpy().astype(np.int64)
        table = table.add_column(4, "D1", pa.array(raw_id(rows)))
        table = table.append_column("D2", pa.array([raw_id(np.array(bag_of(int(r)), dtype=np.int64)) for r in rows],
                                                   type=pa.list_(pa.int64())))
        pq.write_table(table, path, row_group_size=GROUP_ROWS)
    return folder


def check_dynamic_batch(batch: Batch) -> None:
    rows = np.array(rows_of(batch))
    assert batch.sparse.keys == ["C1", "D1", "M1", "C2", "C3", "D2"]
    assert batch.sparse["D1"].values.tolist() == raw_id(rows).tolist()
    assert batch.sparse["D2"].values.tolist() == [int(v) for r in rows for v in raw_id(np.array(bag_of(int(r))))]
    assert batch.sparse["C3"].values.tolist() == (rows % CARD["C3"]).tolist()
    assert batch.sparse["M1"].values.tolist() == [v for r in rows for v in bag_of(int(r))]
    assert batch.sparse.length_per_key == batch.sparse.lengths.view(6, -1).sum(1).tolist()


@pytest.mark.parametrize("shuffle", [False, True])
def test_dynamic_columns_keep_their_64_bit_ids_unchecked(tmp_path, shuffle):
    folder = dynamic_split(tmp_path / "train")
    batches = list(small(folder, shuffle=shuffle, seed=3))
    assert sorted(r for b in batches for r in rows_of(b)) == list(range(ROWS))
    for batch in batches:
        check_dynamic_batch(batch)


def test_dynamic_columns_through_the_cudf_reader_on_a_stand_in(tmp_path, stand_in):
    folder = dynamic_split(tmp_path / "train")
    same_batches(list(small(folder, shuffle=True, seed=3)), list(small(folder, reader="cudf", shuffle=True, seed=3)))


@pytest.mark.gpu
@pytest.mark.parametrize("reader", ["pyarrow", "cudf"])
def test_cuda_dynamic_columns_equal_cpu_batches(tmp_path, reader):
    if reader == "cudf":
        pytest.importorskip("cudf")
    folder = dynamic_split(tmp_path / "train")
    same_batches(list(small(folder, shuffle=True, seed=3)),
                 list(small(folder, shuffle=True, seed=3, device="cuda", reader=reader)))


def test_files_differing_in_nullability_or_list_type_read_as_one_split(tmp_path):
    """A part written by plain pyarrow or pandas (nullable columns) or polars (large_list) beside the ETL's (required
    columns, list) passed each file's check and then failed the epoch: ArrowInvalid "Schema at index 1 was different"."""
    from pipeline.parquet import write_table

    folder = tmp_path / "train"
    folder.mkdir()
    make_schema().save(tmp_path / "schema.json")
    for i, (lo, hi) in enumerate([(0, 100), (100, 200), (200, 300)]):
        table = table_of(np.arange(lo, hi))
        if i == 1:
            pq.write_table(table, folder / f"part-{i}.parquet")
        elif i == 2:
            write_table(table.set_column(4, "M1", table.column("M1").cast(pa.large_list(pa.int32()))),
                        folder / f"part-{i}.parquet", 50)
        else:
            write_table(table, folder / f"part-{i}.parquet", 50)
    seen = []
    for batch in Loader(folder, 64, read_threads=1):
        check_batch(batch)
        seen += rows_of(batch)
    assert sorted(seen) == list(range(300))


def test_a_damaged_page_names_its_file(tmp_path):
    """Page damage behind an intact footer (or a file changed under the loader) gave pyarrow's bare "Couldn't
    deserialize thrift", and through `run train` a traceback."""
    folder = write_split(tmp_path / "train", [0, 300, 600])
    damaged = folder / "part-1.parquet"
    data = bytearray(damaged.read_bytes())
    at = pq.read_metadata(damaged).row_group(1).column(1).data_page_offset
    data[at: at + 6] = b"\xff" * 6
    damaged.write_bytes(bytes(data))
    with pytest.raises(BadInputError, match=rf"{damaged}: its row groups .* do not read .*: the file is damaged"):
        list(Loader(folder, 64))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_continuous_value_that_is_not_finite_is_refused_naming_its_row(tmp_path, bad):
    """A NaN passed every check: in train the run stopped as "diverged" (lower the learning rates), in test the run
    ended with a NaN log loss."""
    folder = tmp_path / "train"
    folder.mkdir()
    make_schema().save(tmp_path / "schema.json")
    table = table_of(np.arange(100))
    values = table.column("I2").to_numpy().copy()
    values[70] = bad
    pq.write_table(table.set_column(2, "I2", pa.array(values)), folder / "part-0.parquet", row_group_size=GROUP_ROWS)
    with pytest.raises(BadInputError, match=rf"part-0.parquet: continuous column 'I2' holds {bad} at row 70 "):
        list(Loader(folder, 32))
    assert len(list(Loader(folder, 32, validate=False))) == 4


def test_a_null_item_of_a_list_is_refused_naming_its_row_whatever_validate_says(tmp_path):
    """The error named row 0 and a valid id (0.0); with validate=False the id -2^63 reached the model."""
    folder = tmp_path / "train"
    folder.mkdir()
    make_schema().save(tmp_path / "schema.json")
    table = table_of(np.arange(100))
    bags = table.column("M1").to_pylist()
    bags[37] = [1, None, 2]
    pq.write_table(table.set_column(4, "M1", pa.array(bags, pa.list_(pa.int32()))), folder / "part-0.parquet",
                   row_group_size=GROUP_ROWS)
    for validate in (True, False):
        with pytest.raises(BadInputError, match="column 'M1' has 1 null items in its lists, the first in row 37 "):
            list(Loader(folder, 32, validate=validate))


def test_an_epoch_taken_batch_by_batch_to_its_last_moves_on_to_the_next(split):
    """`islice(loader, len(loader))` left the generator before its end: every epoch replayed the first's order."""
    loader = Loader(split, 100, shuffle=True, seed=1)
    first = [rows_of(b) for b in itertools.islice(loader, len(loader))]
    second = [rows_of(b) for b in itertools.islice(loader, len(loader))]
    assert first != second and loader.epoch == 1
    reference = Loader(split, 100, shuffle=True, seed=1)
    list(reference)
    assert [rows_of(b) for b in reference] == second


def test_a_file_truncated_in_place_while_the_loader_reads_it_is_an_error_not_a_crash(tmp_path):
    """Another process rewriting the processed files under a running training (an ETL run over them, a copy) leaves
    a file shorter than when the loader opened it. Mapped into memory, the pages past its new end killed the process
    with SIGBUS; read into buffers, the short read is the loader's error naming the file."""
    import subprocess
    import sys

    folder = write_split(tmp_path / "train", [0, 3000])
    script = f"""
import os
import pyarrow.parquet as pq
from pipeline.errors import BadInputError
from pipeline.loader import decode
from tests.test_loader import small

class Truncating(pq.ParquetFile):
    def read_row_groups(self, *args, **kwargs):
        path = {str(folder / "part-0.parquet")!r}
        os.truncate(path, 0)
        return super().read_row_groups(*args, **kwargs)

decode.pq.ParquetFile = Truncating
try:
    for _ in small({str(folder)!r}, batch_size=64, window_rows=1024):
        pass
except BadInputError as err:
    print("refused:", err)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "refused:" in done.stdout and "part-0.parquet" in done.stdout, done.stdout
