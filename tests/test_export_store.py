"""The serving-side embedding path without a server: versioned store, cache tiers, pooled lookup."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from export.cache import LfuCache, LruCache, NoCache, make_caches, make_tier
from export.lookup import EmbeddingLookup, LookupConfig
from export.store import CURRENT, current_version, file_stamp, open_current, write_version
from pipeline.errors import BadInputError
from pipeline.modules import EmbeddingCollection, TableConfig
from pipeline.schema import Column, Schema
from pipeline.sparse import KeyedJaggedTensor


def _table(rows=100, dim=4, seed=0):
    return np.random.default_rng(seed).standard_normal((rows, dim)).astype(np.float32)


def test_versions_are_written_whole_and_old_ones_pruned(tmp_path):
    root = tmp_path / "store"
    assert current_version(root) == 0
    assert write_version(root, {"t": _table(seed=1)}) == 1
    first = open_current(root)
    assert write_version(root, {"t": _table(seed=2)}) == 2
    assert write_version(root, {"t": _table(seed=3)}) == 3
    store = open_current(root)
    assert store.version == 3
    np.testing.assert_array_equal(store.tables["t"], _table(seed=3))
    assert sorted(p.name for p in root.glob("v*")) == ["v000002", "v000003"]
    np.testing.assert_array_equal(first.tables["t"], _table(seed=1))  # still mapped after pruning


def test_every_new_version_changes_the_stamp_of_current(tmp_path):
    current = str(tmp_path / CURRENT)
    assert file_stamp(current) is None
    write_version(tmp_path, {"t": _table(seed=1)})
    first = file_stamp(current)
    assert first is not None and file_stamp(current) == first
    write_version(tmp_path, {"t": _table(seed=2)})
    assert file_stamp(current) != first


def test_any_table_name_is_stored_and_read_back(tmp_path):
    names = ["t_a/b", "t_" + "L" * 300, "t_prix é", "t_.."]
    tables = {name: _table(rows=10 + k, seed=k) for k, name in enumerate(names)}
    ids = np.arange(9, dtype=np.int64) * 3  # one per row of the first table but its last
    write_version(tmp_path, tables, keys={"t_a/b": ids})
    store = open_current(tmp_path)
    assert list(store.tables) == names and list(store.keys) == ["t_a/b"]
    for name, table in tables.items():
        np.testing.assert_array_equal(store.tables[name], table)
    np.testing.assert_array_equal(store.keys["t_a/b"], ids)
    assert all(p.name.isascii() for p in (tmp_path / "v000001").iterdir())


def test_store_rejects_a_table_that_is_not_2d(tmp_path):
    with pytest.raises(ValueError, match="expected a \\[rows, dim\\] array"):
        write_version(tmp_path, {"t": np.zeros(5, np.float32)})


@pytest.mark.parametrize("policy", [LruCache, LfuCache, NoCache])
def test_every_tier_returns_the_store_rows(policy):
    table = _table(rows=500)
    cache = policy(table, 50)
    rng = np.random.default_rng(0)
    for _ in range(20):
        ids = rng.zipf(1.3, size=300) % 500
        np.testing.assert_array_equal(cache.lookup(ids), table[ids])
    stats = cache.stats()
    assert stats["size"] <= 50
    if policy is not NoCache:
        assert stats["hits"] > 0 and stats["evictions"] > 0


def test_lru_counts_hits_misses_evictions_over_distinct_ids():
    table = _table(rows=10)
    cache = LruCache(table, 2)
    cache.lookup(np.array([1, 1, 2]))
    assert cache.stats() == {"hits": 0, "misses": 2, "evictions": 0, "size": 2, "capacity": 2}
    cache.lookup(np.array([1]))  # 1 is now more recent than 2
    cache.lookup(np.array([3]))  # evicts 2
    assert sorted(cache.cached_ids().tolist()) == [1, 3]
    assert cache.stats()["evictions"] == 1
    cache.lookup(np.array([1, 3]))
    assert cache.stats()["hits"] == 3


def test_lfu_keeps_the_frequent_rows():
    cache = LfuCache(_table(rows=10), 2)
    cache.lookup(np.array([1, 1, 1, 2]))
    cache.lookup(np.array([1, 2, 2]))
    cache.lookup(np.array([3]))  # 1 was seen 4 times, 2 three times: 2 goes
    assert sorted(cache.cached_ids().tolist()) == [1, 3]


def test_a_tie_evicts_the_lower_slots():
    from export.cache_torch import TorchLfuCache, TorchLruCache

    for tier in (LruCache(_table(rows=40), 21), LfuCache(_table(rows=40), 21),
                 TorchLruCache(_table(rows=40), 21, device="cpu"), TorchLfuCache(_table(rows=40), 21, device="cpu")):
        tier.lookup(np.arange(20, -1, -1))  # ids 0..20 in slots 0..20, all of one priority
        tier.lookup(np.arange(0, 21, 3))    # every third one looked up again
        tier.lookup(np.arange(21, 28))      # 7 rows out: the lowest slots of the lower priority
        assert sorted(set(range(28)) - set(tier.cached_ids().tolist())) == [1, 2, 4, 5, 7, 8, 10]
        assert tier.stats()["evictions"] == 7


def test_more_misses_than_capacity_never_evicts_rows_of_the_same_batch():
    table = _table(rows=100)
    cache = LruCache(table, 4)
    cache.lookup(np.array([1, 2]))
    rows = cache.lookup(np.arange(1, 20))
    np.testing.assert_array_equal(rows, table[1:20])
    assert set(cache.cached_ids().tolist()) >= {1, 2}


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_one_lookup_of_many_tables_keeps_each_tables_cache_as_its_own_tier_would(policy):
    tables = {"a": _table(rows=300, seed=1), "b": _table(rows=40, seed=2), "c": _table(rows=1000, seed=3)}
    capacities = {"a": 50, "b": 40, "c": 20}
    caches = make_caches(policy, tables, capacities)
    alone = {name: make_tier(policy, table, capacities[name]) for name, table in tables.items()}
    rng = np.random.default_rng(0)
    for batch in (1, 64, 7, 300, 64, 64):
        ids = np.stack([rng.zipf(1.3, size=batch) % len(tables[n]) for n in ("c", "a", "b")], axis=1)
        rows = caches.lookup(["c", "a", "b"], ids)
        for j, name in enumerate(("c", "a", "b")):
            np.testing.assert_array_equal(rows[:, j], tables[name][ids[:, j]])
            np.testing.assert_array_equal(alone[name].lookup(ids[:, j]), tables[name][ids[:, j]])
    assert caches.stats() == {name: tier.stats() for name, tier in alone.items()}
    assert caches.stats()["c"]["evictions"] > 0 and caches.stats()["b"]["hits"] > 0
    for name, tier in alone.items():
        assert sorted(caches.cached_ids(name).tolist()) == sorted(tier.cached_ids().tolist())
    caches.refill({name: table + 1 for name, table in tables.items()})
    np.testing.assert_array_equal(caches.lookup(["b"], np.array([[3], [5]]))[:, 0], tables["b"][[3, 5]] + 1)


def test_tables_of_other_dims_are_cached_apart_and_other_tiers_one_by_one():
    tables = {"wide": _table(rows=30, dim=1), "deep": _table(rows=30, dim=4)}
    for policy in ("lru", "none"):
        caches = make_caches(policy, tables, {"wide": 10, "deep": 10})
        ids = np.array([[1, 2], [3, 3]])
        np.testing.assert_array_equal(caches.lookup(["deep"], ids[:, :1])[:, 0], tables["deep"][[1, 3]])
        np.testing.assert_array_equal(caches.lookup(["wide"], ids[:, 1:])[:, 0], tables["wide"][[2, 3]])
    with pytest.raises(ValueError, match="differ in dim"):
        make_caches("lru", tables, {"wide": 10, "deep": 10}).lookup(["deep", "wide"], ids)


def test_unknown_policy_is_named():
    with pytest.raises(ValueError, match="cache policy 'mru' is not registered; available: .*lru"):
        make_tier("mru", _table(), 4)


def test_tiers_are_registered_by_module_and_name_and_imported_on_use():
    from export.cache import TIERS, register_tier

    assert TIERS["gpu-lru"] == "export.cache_torch:TorchLruCache"
    register_tier("lru-again", "export.cache:LruCache")
    assert isinstance(make_tier("lru-again", _table(), 4), LruCache)
    del TIERS["lru-again"]
    with pytest.raises(ValueError, match="module:attr"):
        register_tier("bad", "LruCache")


def _collection_and_schema():
    schema = Schema([
        Column("label", "label", "int8"),
        Column("C1", "categorical", "int64", cardinality=40),
        Column("C2", "categorical", "int64", cardinality=30),
        Column("M1", "multihot", "int64", cardinality=20, max_length=4),
        Column("C3", "categorical", "int64", cardinality=40),
    ])
    tables = [
        TableConfig("t_C1", 40, 8, ["C1", "C3"]),  # a shared table
        TableConfig("t_C2", 30, 4, ["C2"]),
        TableConfig("t_M1", 20, 8, ["M1"], pooling="mean"),
    ]
    collection = EmbeddingCollection(tables, ["C1", "C2", "M1", "C3"], generator=torch.Generator().manual_seed(0))
    return collection.eval(), schema


def test_lookup_equals_the_embedding_collection(tmp_path):
    collection, schema = _collection_and_schema()
    config = LookupConfig.from_collection(collection, schema)
    assert config.categorical == ["C1", "C2", "C3"] and config.multihot == ["M1"]
    write_version(tmp_path, {n: collection.table_weight(n).numpy() for n in collection.packing.table_names})
    lookup = EmbeddingLookup(tmp_path, config, cache_fraction=0.1, min_cache_rows=3)

    rng = np.random.default_rng(0)
    batch = 33
    cat = np.stack([rng.integers(0, 40, batch), rng.integers(0, 30, batch), rng.integers(0, 40, batch)], axis=1)
    bags = [list(rng.integers(0, 20, rng.integers(0, 5))) for _ in range(batch)]
    lengths = np.array([[len(b)] for b in bags])
    packed = np.full((batch, 4), -1)
    for i, b in enumerate(bags):
        packed[i, : len(b)] = b
    kjt = KeyedJaggedTensor.from_lists(
        ["C1", "C2", "M1", "C3"], [[[v] for v in cat[:, 0]], [[v] for v in cat[:, 1]], bags, [[v] for v in cat[:, 2]]])
    with torch.no_grad():
        expected = collection(kjt).numpy()
    for _ in range(3):  # cold, then warm cache
        np.testing.assert_allclose(lookup(cat, packed, lengths), expected, rtol=0, atol=1e-6)
    stats = lookup.stats()
    assert stats["hits"] > 0 and stats["misses"] > 0 and 0 < stats["hit_rate"] < 1

    with pytest.raises(BadInputError, match="feature C2: id 30 is outside table t_C2"):
        lookup(np.array([[0, 30, 0]]), np.zeros((1, 1)), np.zeros((1, 1)))


def test_lookup_of_raw_ids_equals_the_dynamic_tables_unknown_ids_reading_zeros_counted_by_mean(tmp_path):
    from export.repository import embedding_tables

    schema = Schema([Column("label", "label", "int8"), Column("U", "categorical", "int64", cardinality=256, dynamic=True),
                     Column("M1", "multihot", "list<int64>", cardinality=128, max_length=4, dynamic=True)])
    tables = [TableConfig("t_U", 256, 8, ["U"], dynamic=True), TableConfig("t_M1", 128, 4, ["M1"], pooling="mean",
                                                                          dynamic=True, admit_after=2)]
    collection = EmbeddingCollection(tables, ["U", "M1"], generator=torch.Generator().manual_seed(0))
    rng = np.random.default_rng(0)
    vocabulary = rng.integers(-(2**63), 2**63 - 1, 50)
    for _ in range(5):  # training places the ids it meets (those of M1 at their second occurrence)
        bags = [list(vocabulary[rng.integers(0, 50, rng.integers(0, 4))]) for _ in range(16)]
        collection(KeyedJaggedTensor.from_lists(["U", "M1"], [[[v] for v in vocabulary[rng.integers(0, 50, 16)]],
                                                               bags])).sum().backward()
    collection.eval()
    tables, keys = embedding_tables(SimpleNamespace(embedding=collection))
    assert tables["t_U"].shape[0] == keys["t_U"].shape[0] + 1 and not tables["t_U"][-1].any()
    write_version(tmp_path, tables, keys=keys)
    lookup = EmbeddingLookup(tmp_path, LookupConfig.from_collection(collection, schema), min_cache_rows=4)

    batch = 40
    seen_or_not = np.concatenate([vocabulary, rng.integers(-(2**63), 2**63 - 1, 20)])  # 20 never seen
    cat = seen_or_not[rng.integers(0, 70, batch)][:, None]
    bags = [list(seen_or_not[rng.integers(0, 70, rng.integers(0, 5))]) for _ in range(batch)]
    packed = np.full((batch, 4), -1)
    for i, b in enumerate(bags):
        packed[i, : len(b)] = b
    kjt = KeyedJaggedTensor.from_lists(["U", "M1"], [[[v] for v in cat[:, 0]], bags])
    with torch.no_grad():
        expected = collection(kjt).numpy()
    for _ in range(2):
        np.testing.assert_allclose(lookup(cat, packed, np.array([[len(b)] for b in bags])), expected, rtol=0, atol=1e-6)


def test_refresh_switches_version_and_keeps_hot_rows(tmp_path):
    config = LookupConfig(["t"], ["C1"], [False], ["C1"])
    write_version(tmp_path, {"t": _table(seed=1)})
    lookup = EmbeddingLookup(tmp_path, config, min_cache_rows=10)
    ids = np.array([[3], [4], [5]])
    np.testing.assert_array_equal(lookup(ids), _table(seed=1)[[3, 4, 5]])
    assert not lookup.refresh()
    write_version(tmp_path, {"t": _table(seed=2)})
    assert lookup.refresh() and lookup.version == 2
    hits = lookup.stats()["hits"]
    np.testing.assert_array_equal(lookup(ids), _table(seed=2)[[3, 4, 5]])
    assert lookup.stats()["hits"] == hits + 3


def test_a_broken_new_version_leaves_the_served_one_untouched(tmp_path):
    config = LookupConfig(["t"], ["C1"], [False], ["C1"])
    write_version(tmp_path, {"t": _table(seed=1)})
    lookup = EmbeddingLookup(tmp_path, config, min_cache_rows=10)
    write_version(tmp_path, {"t": _table(seed=2)})
    (tmp_path / "v000002" / "00000.npy").write_bytes(b"not an array")
    with pytest.raises(ValueError):
        lookup.refresh()
    assert lookup.version == 1
    np.testing.assert_array_equal(lookup(np.array([[3]])), _table(seed=1)[[3]])
    assert not lookup.refresh(), "a version that does not open is tried once, not at every batch"
    write_version(tmp_path, {"t": _table(seed=3)})
    assert lookup.refresh() and lookup.version == 3


def test_a_version_written_for_another_dense_part_is_refused(tmp_path):
    """A full export over a served repository starts its store anew at version 1: a server that had taken updates up
    to version 2 took it as new, and served the new tables with the old dense part (neither model)."""
    config = LookupConfig(["t"], ["C1"], [False], ["C1"])
    write_version(tmp_path, {"t": _table(seed=1)}, dense="a")
    lookup = EmbeddingLookup(tmp_path, config, min_cache_rows=10)
    write_version(tmp_path, {"t": _table(seed=2)}, dense="a")
    assert lookup.refresh() and lookup.version == 2
    write_version(tmp_path, {"t": _table(seed=3)}, dense="b")
    with pytest.raises(ValueError, match=r"store version 3 is of another model than the one served .*restart serving"):
        lookup.refresh()
    assert lookup.version == 2
    np.testing.assert_array_equal(lookup(np.array([[3]])), _table(seed=2)[[3]])


def test_a_new_version_with_other_tables_is_refused_whole(tmp_path):
    """A table of another width, or one missing: refused before any cache holds a row of it, not served half."""
    config = LookupConfig(["t", "u"], ["C1", "C2"], [False, False], ["C1", "C2"])
    first = {"t": _table(seed=1), "u": _table(seed=2)}
    write_version(tmp_path, first)
    lookup = EmbeddingLookup(tmp_path, config, min_cache_rows=10)
    ids = np.array([[3, 4], [5, 6]])
    served = np.concatenate([first["t"][[3, 5]], first["u"][[4, 6]]], axis=1)
    np.testing.assert_array_equal(lookup(ids), served)
    wider = np.concatenate([_table(seed=4), _table(seed=4)], axis=1)
    for tables, message in (({"t": _table(seed=3), "u": wider}, "table u has rows of 8 float32, the served one of 4"),
                            ({"t": _table(seed=3)}, r"has the tables \['t'\], the served one \['t', 'u'\]")):
        write_version(tmp_path, tables)
        with pytest.raises(ValueError, match=message):
            lookup.refresh()
        assert lookup.version == 1
        np.testing.assert_array_equal(lookup(ids), served)


def _same_as_the_numpy_tiers(device, steps=120):
    """The torch tiers of all tables in one step, and of each table on its own, against the numpy ``for_tables``:
    the same answers, counters, evictions and cached ids after every lookup of a random sequence (repeated ids,
    full caches, tables of different sizes and capacities, one of capacity 0, empty requests), then after a
    new version of the tables (hot ids kept) and one of another shape (cold)."""
    from export.cache_torch import TorchLfuCache, TorchLruCache

    capacities = {"a": 50, "b": 40, "c": 20, "d": 0, "e": 3}
    order = ["c", "a", "e", "b", "d"]
    for torch_tier, numpy_tier in ((TorchLruCache, LruCache), (TorchLfuCache, LfuCache)):
        tables = {"a": _table(rows=300, seed=1), "b": _table(rows=40, seed=2), "c": _table(rows=1000, seed=3),
                  "d": _table(rows=9, seed=4), "e": _table(rows=500, seed=5)}
        ours = torch_tier.for_tables(tables, capacities, device=device)
        alone = {name: torch_tier(table, capacities[name], device=device) for name, table in tables.items()}
        expected = numpy_tier.for_tables(tables, capacities)
        rng = np.random.default_rng(0)
        for step in range(steps):
            if step == steps // 2:
                tables = {name: table + 1 for name, table in tables.items()}
                for caches in (ours, expected):
                    caches.refill(tables)
                for name, tier in alone.items():
                    tier.refill(tables[name])
            batch = int(rng.choice([0, 1, 2, 7, 32, 64]))
            ids = np.stack([rng.zipf(1.3, size=batch) % len(tables[n]) for n in order], axis=1)
            rows = ours.lookup(order, ids)
            assert isinstance(rows, torch.Tensor) and rows.device.type == torch.device(device).type
            rows = rows.cpu().numpy()
            np.testing.assert_array_equal(rows, expected.lookup(order, ids))
            np.testing.assert_array_equal(rows, np.stack([tables[n][ids[:, j]] for j, n in enumerate(order)], axis=1))
            for j, name in enumerate(order):
                np.testing.assert_array_equal(alone[name].lookup(ids[:, j]).cpu().numpy(), rows[:, j])
            assert ours.stats() == expected.stats() == {name: tier.stats() for name, tier in alone.items()}, step
            for name in order:
                assert ours.cached_ids(name).tolist() == expected.cached_ids(name).tolist() \
                    == alone[name].cached_ids().tolist()
        stats = ours.stats()
        assert stats["c"]["evictions"] > 0 and stats["e"]["evictions"] > 0 and stats["b"]["hits"] > 0
        assert stats["d"] == {"hits": 0, "misses": stats["d"]["misses"], "evictions": 0, "size": 0, "capacity": 0}
        tables["b"] = _table(rows=60, seed=6)
        ours.refill(tables)
        assert ours.stats()["b"]["size"] == ours.stats()["a"]["size"] == 0
        np.testing.assert_array_equal(ours.lookup(["b"], np.array([[55]]))[:, 0].cpu().numpy(), tables["b"][[55]])


def test_torch_tiers_on_the_cpu_answer_count_and_evict_as_the_numpy_tiers():
    _same_as_the_numpy_tiers("cpu")


@pytest.mark.parametrize("misses", [False, True])
def test_a_torch_lookup_of_many_tables_reads_nothing_back_from_the_device(misses):
    """On the CPU, no operation that would wait for a GPU (see tests/test_train_syncs.py) and no copy to the host,
    for 3 tables as for 26: the index is on the host, and the answer stays a tensor on the device."""
    from export.cache_torch import TorchLruCache
    from tests.test_train_syncs import HostCopies, HostReads

    rng = np.random.default_rng(0)
    for count in (3, 26):
        tables = {f"t{i}": _table(rows=int(rows), seed=i) for i, rows in enumerate(rng.integers(5, 500, count))}
        caches = TorchLruCache.for_tables(tables, {name: 4 if misses else len(t) for name, t in tables.items()},
                                          device="cpu")
        ids = np.stack([rng.integers(0, len(t), 32) for t in tables.values()], axis=1)
        caches.lookup(list(tables), ids)
        if misses:
            ids = np.stack([rng.integers(0, len(t), 32) for t in tables.values()], axis=1)
        before = caches.stats()
        with HostReads() as reads, HostCopies() as copies:
            rows = caches.lookup(list(tables), ids)
        assert reads.seen == [] and copies.seen == [], (count, reads.seen, copies.seen)
        assert isinstance(rows, torch.Tensor) and rows.shape == (32, count, 4)
        np.testing.assert_array_equal(rows.numpy(), np.stack([t[ids[:, j]] for j, t in enumerate(tables.values())], 1))
        stats = caches.stats()
        if misses:
            assert all(stats[name]["evictions"] > before[name]["evictions"] for name in tables)
        else:
            assert stats == {name: {**s, "hits": stats[name]["hits"]} for name, s in before.items()}


@pytest.mark.gpu
def test_torch_tiers_on_the_gpu_answer_count_and_evict_as_the_numpy_tiers():
    _same_as_the_numpy_tiers("cuda")
    caches = make_caches("gpu-lfu", {"t": _table(rows=100)}, {"t": 10})
    assert caches.device.type == "cuda"


@pytest.mark.gpu
def test_a_gpu_lookup_of_many_tables_never_waits_for_the_device():
    """No lookup, with misses or not, waits for the GPU, whatever the number of tables: the answer stays there."""
    import warnings

    rng = np.random.default_rng(0)
    tables = {f"t{i}": _table(rows=int(rows), seed=i) for i, rows in enumerate(rng.integers(5, 500, 26))}
    caches = make_caches("gpu-lru", tables, {name: 64 for name in tables})
    requests = [np.stack([rng.integers(0, len(t), 32) for t in tables.values()], axis=1) for _ in range(4)]
    caches.lookup(list(tables), requests[0])
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.filterwarnings("always", message=".*synchronizing CUDA operation")
            answers = [caches.lookup(list(tables), ids) for ids in requests[1:]]  # misses and evictions
            misses = sum(s["misses"] for s in caches.stats().values())
            answers.append(caches.lookup(list(tables), requests[-1]))  # every id hits
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in seen if "synchronizing CUDA operation" in str(w.message)]
    assert syncs == [], [f"{w.filename}:{w.lineno} {w.message}" for w in syncs]
    for ids, rows in zip(requests[1:] + requests[-1:], answers):
        assert rows.device.type == "cuda"
        np.testing.assert_array_equal(rows.cpu().numpy(), np.stack([t[ids[:, j]] for j, t in enumerate(tables.values())], 1))
    stats = caches.stats().values()
    assert sum(s["misses"] for s in stats) == misses and sum(s["evictions"] for s in stats) > 0


def _lookups_compared(tmp_path, device):
    """The lookup through ``gpu-lru`` caches on ``device`` against the one through numpy ``lru`` caches, over one-hot
    ids and multi-hot bags (mean pooled, empty ones too), cold and warm caches, evictions, then a new store version:
    the same answers (a float32 tensor on the device against numpy), the same counters, and nothing read back from
    the device on the way (on the CPU, no operation that would wait for a GPU and no copy to the host)."""
    from tests.test_train_syncs import HostCopies, HostReads

    collection, schema = _collection_and_schema()
    config = LookupConfig.from_collection(collection, schema)
    write_version(tmp_path, {n: collection.table_weight(n).numpy() for n in collection.packing.table_names})
    lookups = {policy: EmbeddingLookup(tmp_path, config, policy=policy, cache_fraction=0.1, min_cache_rows=3,
                                       device=device if policy == "gpu-lru" else None) for policy in ("lru", "gpu-lru")}
    rng = np.random.default_rng(0)

    def compare(batch):
        cat = np.stack([rng.integers(0, 40, batch), rng.integers(0, 30, batch), rng.integers(0, 40, batch)], axis=1)
        lengths = rng.integers(0, 5, (batch, 1))
        packed = rng.integers(0, 20, (batch, 4))
        with HostReads() as reads, HostCopies() as copies:
            on_device = lookups["gpu-lru"](cat, packed, lengths)
        if device == "cpu":
            assert reads.seen == [] and copies.seen == [], (reads.seen, copies.seen)
        assert isinstance(on_device, torch.Tensor) and on_device.device.type == torch.device(device).type
        assert on_device.dtype == torch.float32 and on_device.shape == (batch, config_width)
        expected = lookups["lru"](cat, packed, lengths)
        np.testing.assert_allclose(on_device.cpu().numpy(), expected, rtol=0, atol=1e-6)
        return cat, expected

    config_width = sum(collection.tables[t].dim for t in collection.packing.slot_table)
    for batch in (1, 32, 7, 32, 64):
        compare(batch)
    stats = [lookup.stats() for lookup in lookups.values()]
    assert stats[0]["tables"] == stats[1]["tables"] and stats[1]["evictions"] > 0 and stats[1]["hits"] > 0
    tables = {n: collection.table_weight(n).numpy() + 1 for n in collection.packing.table_names}
    write_version(tmp_path, tables)
    assert all(lookup.refresh() for lookup in lookups.values())
    cat, expected = compare(16)
    np.testing.assert_array_equal(expected[:, :8], tables["t_C1"][cat[:, 0]])  # the new version's rows
    assert lookups["lru"].stats()["tables"] == lookups["gpu-lru"].stats()["tables"]


def test_the_lookup_through_torch_caches_on_the_cpu_answers_and_counts_as_through_numpy_caches(tmp_path):
    _lookups_compared(tmp_path, "cpu")


@pytest.mark.gpu
def test_the_lookup_through_gpu_caches_answers_as_through_numpy_caches(tmp_path):
    _lookups_compared(tmp_path, "cuda")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_batch_of_one_hot_ids_is_answered_with_a_device_caches_rows_and_slots_and_counted_as_its_lookup(
        tmp_path, device):
    """``rows_or_pooled``: a device cache's rows and each id's slot, the missed rows fetched into the cache first,
    gathering to the lookup's answer; the counters stay those of numpy caches given the same batches. A batch with
    more distinct missed ids of a table than its cache holds is answered as the lookup answers it; caches on the
    host and lookups with multi-hot features answer as ``__call__``."""
    from export.cache_torch import CachedRows

    schema = Schema([Column("label", "label", "int8")]
                    + [Column(f"C{k}", "categorical", "int64", cardinality=4000) for k in (1, 2, 3)])
    tables = [TableConfig("t_C1", 4000, 8, ["C1", "C3"]), TableConfig("t_C2", 4000, 8, ["C2"])]
    collection = EmbeddingCollection(tables, ["C1", "C2", "C3"], generator=torch.Generator().manual_seed(0)).eval()
    config = LookupConfig.from_collection(collection, schema)
    write_version(tmp_path, {n: collection.table_weight(n).numpy() for n in collection.packing.table_names})
    lookups = {policy: EmbeddingLookup(tmp_path, config, policy=policy, cache_fraction=0.25,  # 1,024 rows a table
                                       device=device if policy == "gpu-lru" else None) for policy in ("lru", "gpu-lru")}
    rng = np.random.default_rng(0)
    for step in range(10):
        rows = 1200 if step == 6 else 16  # step 6: more distinct ids of t_C1 than its cache holds
        cat = rng.integers(0, 60 if step < 4 else 4000, (rows, 3))
        found = lookups["gpu-lru"].rows_or_pooled(cat)
        if step == 6:
            assert isinstance(found, torch.Tensor) and found.shape == (rows, 24)
            on_device = found
        else:
            assert isinstance(found, CachedRows) and found.rows.device.type == device and found.slots.shape == (rows, 3)
            on_device = found.gathered()
        np.testing.assert_array_equal(on_device.cpu().numpy(), lookups["lru"].rows_or_pooled(cat))
        assert lookups["gpu-lru"].stats()["tables"] == lookups["lru"].stats()["tables"]
    assert lookups["lru"].stats()["tables"]["t_C1"]["evictions"] > 0

    # a dynamic table's raw ids are found among its stored ids first (an id never stored reads its last row, zeros)
    from export.repository import embedding_tables

    dynamic_schema = Schema([Column("label", "label", "int8"),
                             Column("U", "categorical", "int64", cardinality=256, dynamic=True)])
    dynamic = EmbeddingCollection([TableConfig("t_U", 256, 8, ["U"], dynamic=True)], ["U"],
                                  generator=torch.Generator().manual_seed(0))
    vocabulary = rng.integers(-(2**63), 2**63 - 1, 50)
    dynamic(KeyedJaggedTensor.from_lists(["U"], [[[v] for v in vocabulary]])).sum().backward()
    tables, keys = embedding_tables(SimpleNamespace(embedding=dynamic.eval()))
    write_version(tmp_path / "dynamic", tables, keys=keys)
    by_keys = {policy: EmbeddingLookup(tmp_path / "dynamic", LookupConfig.from_collection(dynamic, dynamic_schema),
                                       policy=policy, cache_fraction=1.0, device=device if policy == "gpu-lru" else None)
               for policy in ("lru", "gpu-lru")}
    raw = np.concatenate([vocabulary, rng.integers(-(2**63), 2**63 - 1, 5)])[rng.integers(0, 55, (20, 1))]
    found = by_keys["gpu-lru"].rows_or_pooled(raw)
    np.testing.assert_array_equal(found.gathered().cpu().numpy(), by_keys["lru"](raw))

    multihot, multihot_schema = _collection_and_schema()
    write_version(tmp_path / "multihot", {n: multihot.table_weight(n).numpy() for n in multihot.packing.table_names})
    lookup = EmbeddingLookup(tmp_path / "multihot", LookupConfig.from_collection(multihot, multihot_schema),
                             policy="gpu-lru", cache_fraction=1.0, device=device)
    cat, packed, lengths = np.zeros((2, 3), np.int64), np.zeros((2, 4), np.int64), np.ones((2, 1), np.int64)
    for _ in range(2):
        answer = lookup.rows_or_pooled(cat, packed, lengths)
        assert isinstance(answer, torch.Tensor)
        np.testing.assert_array_equal(answer.cpu().numpy(), lookup(cat, packed, lengths).cpu().numpy())


@pytest.mark.parametrize("kind", ["CPU", pytest.param("GPU", marks=pytest.mark.gpu)])
def test_an_instance_hands_its_dense_part_the_rows_its_gpu_cache_holds_under_its_lock(tmp_path, kind):
    """``LookupInstance.scored``: the dense part gets the lookup's answer on a CPU instance, and on a GPU instance the
    cache's rows and slots (``CachedRows``, the missed rows fetched in first): the same embeddings. It runs under the
    instance's lock (no refresh rewrites the rows before it has read them), and the instance's counters time both
    phases."""
    import time

    from export.cache_torch import CachedRows
    from export.instance import STATS_EVERY_S, LookupInstance, live_stats
    from export.preprocess import CATEGORICAL_IDS

    schema = Schema([Column("label", "label", "int8")]
                    + [Column(f"C{k}", "categorical", "int64", cardinality=40) for k in (1, 2)])
    collection = EmbeddingCollection([TableConfig("t_C1", 40, 8, ["C1"]), TableConfig("t_C2", 40, 8, ["C2"])],
                                     ["C1", "C2"], generator=torch.Generator().manual_seed(0)).eval()
    model_dir = tmp_path / "ensemble"
    (model_dir / "1").mkdir(parents=True)
    config = LookupConfig.from_collection(collection, schema)
    config.save(model_dir / "1" / "layout.json")
    write_version(model_dir / "store", {n: collection.table_weight(n).numpy() for n in collection.packing.table_names})
    expected = EmbeddingLookup(model_dir / "store", config, policy="none")
    args = {"model_repository": str(model_dir), "model_version": "1", "model_instance_kind": kind,
            "model_instance_device_id": "0"}
    errors = []
    instance = LookupInstance(args, {"cache_fraction": "1.0"}, errors.append)
    handed = []

    def dense_part(embeddings):
        assert instance._lock.locked()
        handed.append(type(embeddings))
        rows = embeddings.gathered() if isinstance(embeddings, CachedRows) else embeddings
        return rows.cpu().numpy() if isinstance(rows, torch.Tensor) else rows

    try:
        cat = np.random.default_rng(0).integers(0, 40, (16, 2))
        for _ in range(3):
            np.testing.assert_array_equal(instance.scored({CATEGORICAL_IDS: cat}, dense_part), expected(cat))
        time.sleep(3 * STATS_EVERY_S)
        phases = live_stats(model_dir)[0]["phases_ns"]
    finally:
        instance.close()
    assert handed == ([CachedRows] * 3 if kind == "GPU" else [np.ndarray] * 3)
    assert phases["lookup"] > 0 and phases["dense"] > 0 and not errors
