"""Host-cached tables train exactly as tables kept whole in device memory, for caches of 1% to 100% of them.

A :class:`HostCachedCollection` and the plain collection it was made from train on the same batches
(Zipf-skewed ids, multi-hot mean-pooled bags, a table shared by two features, a second table on one
feature, a table left in device memory): every step's output and the final rows and optimizer state
must be equal, bit for bit with SGD, while the small caches evict and write rows back. Then: a
prefetch run one batch ahead never evicts the rows of the batch still training; the state dict is the
plain collection's and resumes into another cache size; the cache's least-recently-used order and
write-back, and the error of a batch that does not fit.
"""

import gc

import pytest
import torch

from pipeline.modules.cached_collection import HostCachedCollection
from pipeline.modules.collection import EmbeddingCollection
from pipeline.modules.configs import EmbeddingOptimizerConfig, TableConfig
from pipeline.modules.host_cache import NO_ROW, CachedTable, CacheStats, CacheTooSmall, Placement, RowCache
from pipeline.modules.side_stream import SideStream
from pipeline.sparse import KeyedJaggedTensor

FEATURES = ["A", "B", "C", "D"]
TABLES = [
    TableConfig("big", 20_000, 8, ["A"]),
    TableConfig("shared", 20_000, 4, ["B", "C"], pooling="mean"),   # B multi-hot, C one-hot
    TableConfig("small", 50, 8, ["D"]),                             # stays in device memory
    TableConfig("wide", 5_000, 16, ["A"]),                          # a second table on feature A
]
CACHED = ("big", "shared", "wide")
ROWS = {t.name: t.rows for t in TABLES}
BATCH = 16
STEPS = 30


def batch(step: int, size: int = BATCH) -> tuple[KeyedJaggedTensor, torch.Tensor]:
    """Zipf-like ids (most of them on a few hundred rows), B with 0 to 3 ids per sample."""
    g = torch.Generator().manual_seed(step)
    bags = []
    for f, limit in zip(FEATURES, (5_000, 20_000, 20_000, 50)):
        lengths = torch.randint(0, 4, (size,), generator=g) if f == "B" else torch.ones(size, dtype=torch.int64)
        ids = (torch.rand(int(lengths.sum()), generator=g) ** 4 * limit).long()
        bags.append([chunk.tolist() for chunk in ids.split(lengths.tolist())])
    target = torch.randn(size, 8 + 4 + 4 + 8 + 16, generator=g)
    kjt = KeyedJaggedTensor.from_lists(FEATURES, bags)  # each key's number of ids known, as the loader's batches
    return KeyedJaggedTensor(FEATURES, kjt.values, kjt.lengths, [sum(map(len, bag)) for bag in bags]), target


def plain(opt: str, weights_dtype: str = "fp32", master: bool = False, backend: str = "torch") -> EmbeddingCollection:
    optimizer = EmbeddingOptimizerConfig(opt, lr=0.05, master_weights=master)
    return EmbeddingCollection(TABLES, FEATURES, optimizer, weights_dtype=weights_dtype, backend=backend,
                               generator=torch.Generator().manual_seed(7))


def cache_rows(fraction: float) -> dict[str, int]:
    return {name: max(1, int(fraction * ROWS[name])) for name in CACHED}


def train(ec, steps: range, ahead: bool = False) -> list[torch.Tensor]:
    """``steps`` batches; ``ahead``: each next batch prefetched before this one's lookup and update."""
    outputs = []
    prefetched = ec.prefetch(batch(steps[0])[0]) if ahead else None
    for step in steps:
        kjt, target = batch(step)
        if ahead:
            current, prefetched = prefetched, (ec.prefetch(batch(step + 1)[0]) if step + 1 < steps.stop else None)
            kjt = current
        out = ec(kjt)
        (out * target).sum().backward()
        outputs.append(out.detach())
    return outputs


def assert_same(a, b, exact: bool) -> None:
    b = b.to(a.device)  # a host-cached collection's state is its host tables, wherever its caches are
    if exact:
        assert torch.equal(a, b)
    else:
        torch.testing.assert_close(a, b)


def assert_same_state(reference: EmbeddingCollection, other: EmbeddingCollection, exact: bool) -> None:
    expected, got = reference.state_dict(), other.state_dict()
    assert list(got) == list(expected)
    for key in expected:
        assert_same(expected[key], got[key], exact)


def through_the_host(cached: HostCachedCollection) -> HostCachedCollection:
    """Rows moved as on a GPU whose kernels cannot address host memory: gathered and scattered by the host."""
    cached._mapped = False
    return cached


@pytest.mark.parametrize("opt", ["sgd", "adagrad", "adam"])
@pytest.mark.parametrize("fraction", [0.01, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("moved", ["directly", "through the host"])
def test_host_cached_tables_train_like_tables_in_device_memory(opt, fraction, moved):
    reference = plain(opt)
    cached = HostCachedCollection.from_collection(plain(opt), cache_rows(fraction))
    if moved == "through the host":
        through_the_host(cached)
    exact = opt == "sgd"
    for want, got in zip(train(reference, range(STEPS)), train(cached, range(STEPS))):
        assert_same(want, got, exact)
    assert_same_state(reference, cached, exact)
    stats = cached.cache_stats()
    assert sorted(stats) == sorted(CACHED)
    assert cached.weights.numel() < reference.weights.numel() or fraction == 1.0
    for name, s in stats.items():
        assert 0 < s.hits < s.rows
        if fraction == 0.01:
            assert s.evictions > 0 and s.writebacks > 0, name
        if fraction == 1.0:
            assert s.evictions == 0, name
    # A lookup outside training with more distinct rows than a cache holds goes in halves of its samples.
    reference.eval()
    cached.eval()
    with torch.no_grad():
        kjt, _ = batch(1000, size=2000)
        assert_same(reference(kjt), cached(kjt), exact)


def test_sixteen_bit_tables_with_master_weights_train_alike():
    reference = plain("adagrad", "bf16", master=True)
    cached = HostCachedCollection.from_collection(plain("adagrad", "bf16", master=True), cache_rows(0.01))
    for want, got in zip(train(reference, range(STEPS)), train(cached, range(STEPS))):
        torch.testing.assert_close(want, got)
    assert "state_master_weights" in cached.state_dict()
    assert_same_state(reference, cached, exact=False)


def test_a_prefetch_one_batch_ahead_spares_the_rows_of_the_batch_still_training():
    reference = plain("adagrad")
    cached = HostCachedCollection.from_collection(plain("adagrad"), cache_rows(0.01))
    for want, got in zip(train(reference, range(STEPS)), train(cached, range(STEPS), ahead=True)):
        torch.testing.assert_close(want, got)
    assert_same_state(reference, cached, exact=False)
    assert all(s.evictions > 0 for s in cached.cache_stats().values())


def test_a_batch_prefetched_during_the_step_before_trains_alike_through_state_dicts_taken_in_between():
    # As the training pipeline runs it: batch i + 1 prefetched once batch i's lookup is done, before its backward;
    # a state dict (a checkpoint) between the steps writes every dirty row back but leaves the rows of the batch
    # prefetched dirty, since its update is still to come.
    reference = plain("sgd")
    cached = HostCachedCollection.from_collection(plain("sgd"), cache_rows(0.01))
    prefetched = cached.prefetch(batch(0)[0])
    for step in range(STEPS):
        kjt, target = batch(step)
        want = reference(kjt)
        (want * target).sum().backward()
        got = cached(prefetched)
        if step + 1 < STEPS:
            prefetched = cached.prefetch(batch(step + 1)[0])
        (got * target).sum().backward()
        assert_same(want.detach(), got.detach(), exact=True)
        cached.state_dict()
    assert_same_state(reference, cached, exact=True)
    assert all(s.evictions > 0 for s in cached.cache_stats().values())


def test_the_state_dict_is_the_plain_collections_and_resumes_into_another_cache_size():
    reference = plain("adam")
    cached = HostCachedCollection.from_collection(plain("adam"), cache_rows(0.01))
    train(reference, range(10))
    train(cached, range(10))
    saved = {k: v.clone() for k, v in cached.state_dict().items()}
    assert_same_state(reference, cached, exact=False)
    train(reference, range(10, 20))
    for other in (HostCachedCollection(TABLES, FEATURES, cache_rows(0.5), reference.optimizer, backend="torch"),
                  HostCachedCollection(TABLES, FEATURES, cache_rows(0.01), reference.optimizer, backend="torch"),
                  EmbeddingCollection(TABLES, FEATURES, reference.optimizer, backend="torch")):
        other.load_state_dict(saved)
        train(other, range(10, 20))
        assert_same_state(reference, other, exact=False)
    # Rows written through a cached table's views are what the next lookup reads.
    views = cached.table_views("big")
    with torch.no_grad():
        views["weight"][batch(10)[0]["A"].values] = 3.0
    assert torch.all(cached(batch(10)[0])[:, :8] == 3.0)


def stepper(cache: RowCache):
    def step(rows: list[int], training: bool):
        placement = cache.place(torch.tensor(rows))
        counts = placement.counts.tolist()
        cache.admit(counts)
        moves = placement.moves(sum(counts[0]), sum(counts[4]))
        cache.commit(placement, moves, training)
        return placement.slot[placement.inverse].tolist(), moves
    return step


def test_the_least_recently_used_row_goes_and_a_dirty_one_is_written_back():
    cache = RowCache([CachedTable("t", rows=10, slots=3, first_row=0)])
    step = stepper(cache)

    slots, _ = step([1, 2, 1], training=True)
    assert slots[0] == slots[2] != slots[1]
    step([3], training=False)  # the empty slot
    _, moves = step([4], training=True)  # rows 1, 2 spared: row 3 goes, clean
    assert moves.written_back_slots.tolist() == [] and moves.missing_rows.tolist() == [4]
    _, moves = step([5], training=True)  # rows 1 and 2 the least recent, row 1's slot first: row 1 goes, dirty
    assert moves.written_back_slots.tolist() == [slots[0]] == moves.victims.tolist()
    assert cache.stats["t"] == CacheStats(rows=4, hits=0, evictions=2, writebacks=1)
    assert cache.index.find(torch.tensor([1, 2, 4, 5])).ge(0).tolist() == [False, True, True, True]
    with pytest.raises(CacheTooSmall, match="table t: a batch needs 3 rows copied into its device cache of 3 rows, but "
                                            r"only 2 slots.*larger cache \(distributed.memory_per_rank_mb, or its "
                                            r"cache_rows in distributed.plan_file\), or lower train.batch_size$"):
        step([6, 7, 8], training=True)


def test_a_row_found_in_the_cache_stays_while_rows_seen_once_go_up_to_the_protected_share():
    cache = RowCache([CachedTable("t", rows=100, slots=5, first_row=0), CachedTable("u", rows=100, slots=5,
                                                                                     first_row=100)])
    step = stepper(cache)
    held = lambda rows: cache.index.find(torch.tensor(rows)).ge(0).tolist()
    for rows in ([1], [1], [2], [3], [4], [5]):  # 1 found again: protected; 2 to 5 seen once
        step(rows, training=False)
    step([6], training=False)  # least recently used: 1; but it is protected, so 2 goes
    assert held([1, 2, 3]) == [True, False, True]
    for rows in ([3], [4], [5], [6]):  # 5 rows found again: the limit is 4 (0.8 x 5)
        step(rows, training=False)
    assert cache.protected[:5].sum().item() == 4   # 1, the least recent of them, protected no more
    step([7], training=False)
    assert held([1, 3, 4, 5, 6, 7]) == [False, True, True, True, True, True]
    assert not cache.protected[5:].any()    # the other table's books untouched
    step([100, 100 + 1], training=False)
    assert held([100, 101, 1]) == [True, True, False]


def test_the_books_traced_whole_as_a_gpu_compiles_them_keep_the_same_caches():
    """On a GPU the books (place, moves, commit) run compiled: each traces into one graph, no break, and the graphs
    keep the caches as the eager code does, through evictions, write-backs, evaluation batches, a batch that does
    not fit, and moves of exact sizes (the host read the counts) or padded ones (it did not)."""
    tables = [CachedTable("t", rows=500, slots=90, first_row=0), CachedTable("u", rows=900, slots=60, first_row=500)]
    eager, traced = RowCache(tables), RowCache(tables)
    graph = {name: torch.compile(getattr(cls, name).__wrapped__, backend="aot_eager", fullgraph=True)
             for cls, name in ((RowCache, "place"), (RowCache, "commit"), (Placement, "moves"))}
    g = torch.Generator().manual_seed(3)
    for step in range(12):
        in_u = 30 if step != 7 else 120  # batch 7 does not fit table u
        rows = torch.cat([(torch.rand(30, generator=g) ** 3 * 500).long(),
                          500 + (torch.rand(in_u, generator=g) ** 3 * 900).long(), torch.full((5,), NO_ROW)])
        rows = rows[torch.randperm(rows.numel(), generator=g)]
        training, exact = step % 4 != 3, step % 2 == 0
        books = []
        for cache, place, moves, commit in ((eager, RowCache.place, Placement.moves, RowCache.commit),
                                            (traced, graph["place"], graph["moves"], graph["commit"])):
            placement = place(cache, rows)
            counts = placement.counts.tolist()
            moved = moves(placement, *((sum(counts[0]), sum(counts[4])) if exact else ()))
            commit(cache, placement, moved, training)
            books.append([placement.slot[placement.inverse.clamp(min=0)], *vars(moved).values(), cache.order,
                          cache.index.sorted_rows, cache.index.slot_rows, cache.dirty, cache.protected, cache.spared,
                          cache.totals, cache.overflow])
        for want, have in zip(*books):
            assert torch.equal(want, have), step
    assert eager.overflow[0].tolist() == [0, 1] and eager.totals[3].sum() > 0 and eager.totals[4].sum() > 0


class CountedWaits(SideStream):
    """A side stream counting the host's waits for the device (every read back goes through ``wait``)."""

    waits = 0

    def wait(self, event) -> None:
        self.waits += 1
        super().wait(event)


def waits_per_batch(cached: HostCachedCollection, batches, training: bool = True) -> list[int]:
    cached.side = side = CountedWaits(replaced=cached.cache.buffers)
    waits = []
    for kjt, target in batches:
        before = side.waits
        if training:
            (cached(kjt) * target).sum().backward()
        else:
            with torch.no_grad():
                cached(kjt)
        waits.append(side.waits - before)
    return waits


def test_a_training_step_never_waits_for_the_device_and_a_lookup_outside_it_waits_once_for_all_its_tables():
    cached = HostCachedCollection.from_collection(plain("adagrad"), cache_rows(0.1))
    assert waits_per_batch(cached, (batch(0), batch(1), batch(1))) == [0, 0, 0]
    assert waits_per_batch(cached, (batch(2), batch(2)), training=False) == [1, 1]


def test_where_rows_move_through_the_host_a_step_waits_twice_for_all_its_tables_and_once_when_none_is_missing():
    cached = through_the_host(HostCachedCollection.from_collection(plain("adagrad"), cache_rows(0.1)))
    assert waits_per_batch(cached, (batch(0), batch(1), batch(1))) == [2, 2, 1]  # the third: every row held


@pytest.mark.parametrize("moved", ["directly", "through the host"])
def test_a_training_batch_larger_than_a_cache_is_refused_naming_the_table(moved):
    cached = HostCachedCollection.from_collection(plain("sgd"), {"big": 40})
    if moved == "through the host":
        through_the_host(cached)
    kjt, _ = batch(0, size=100)
    with pytest.raises(CacheTooSmall, match="table big: a batch needs 81 rows copied into its device cache of 40 rows, but only 40 slots"):
        cached(kjt)


def test_rows_move_as_whole_words_and_host_tables_are_mapped_only_for_a_gpu():
    from pipeline.kernels.host_rows import copy_rows, map_to_device, rows_movable

    assert rows_movable(torch.zeros(4, 6, dtype=torch.bfloat16)) and rows_movable(torch.zeros(4))
    assert not rows_movable(torch.zeros(4, 3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="4-byte words"):
        copy_rows(torch.zeros(4, 3, dtype=torch.bfloat16), torch.arange(2), torch.zeros(4, 3, dtype=torch.bfloat16),
                  torch.arange(2))
    with pytest.raises(ValueError, match="contiguous"):
        copy_rows(torch.zeros(4, 8).t(), torch.arange(2), torch.zeros(8, 4), torch.arange(2))
    if not torch.cuda.is_available():
        assert not map_to_device(torch.zeros(10, 4), torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("blocks_per_sm", [0.5, 1e-6, 100], ids=["half the SMs", "1 block", "a group a row"])
@pytest.mark.parametrize("dtype,shape", [(torch.float32, (5000, 12)), (torch.bfloat16, (5000, 6)),
                                         (torch.float32, (5000,)), (torch.float16, (5000, 130))])
def test_on_a_gpu_rows_move_between_device_memory_and_mapped_host_tables_as_indexing_moves_them(dtype, shape,
                                                                                             blocks_per_sm, monkeypatch):
    """Also with fewer blocks launched than rows need (each group then copies several rows in turn)."""
    from pipeline.kernels import host_rows
    from pipeline.kernels.host_rows import copy_rows, map_to_device

    monkeypatch.setattr(host_rows, "HOST_COPY_BLOCKS_PER_SM", blocks_per_sm)

    g = torch.Generator().manual_seed(3)
    host = torch.randn(shape, generator=g).to(dtype)
    assert map_to_device(host, torch.device("cuda")) and map_to_device(host, torch.device("cuda"))
    gc.collect()  # the mapping lives as long as the tensor: registering it again is refused as done already
    from cupy.cuda import runtime

    with pytest.raises(runtime.CUDARuntimeError):
        runtime.hostRegister(host.data_ptr(), host.numel() * host.element_size(), 0)
    cache = torch.zeros((300, *shape[1:]), dtype=dtype, device="cuda")
    rows, slots = torch.randperm(5000, generator=g)[:200], torch.randperm(300, generator=g)[:200]
    copy_rows(cache, slots.cuda(), host, rows.cuda())
    torch.cuda.synchronize()
    assert torch.equal(cache[slots.cuda()].cpu(), host[rows])
    cache[slots.cuda()] = (cache[slots.cuda()].float() * 2 + 1).to(dtype)
    copy_rows(host, rows.cuda(), cache, slots.cuda())
    torch.cuda.synchronize()
    assert torch.equal(host[rows], cache[slots.cuda()].cpu())


@pytest.mark.gpu
def test_on_a_gpu_memory_registered_elsewhere_is_not_mapped_again_and_leaves_no_error_behind():
    """A refused registration is reported as False (the rows then move through the host), and the CUDA error it
    raised is cleared: the next operation on the device runs."""
    from cupy.cuda import runtime

    from pipeline.kernels.host_rows import map_to_device

    host = torch.zeros(4096, 8)
    runtime.hostRegister(host.data_ptr(), host.numel() * host.element_size(), 0)
    try:
        assert not map_to_device(host, torch.device("cuda"))
        assert torch.ones(3, device="cuda").sum().item() == 3
    finally:
        runtime.hostUnregister(host.data_ptr())


@pytest.mark.gpu
def test_on_a_gpu_a_step_ahead_host_cached_tables_train_alike_and_sync_nothing_but_their_events():
    """The prefetch of each next batch runs after the step before was queued, its side stream waiting for an
    event recorded before that step, as the training pipeline runs it; after the first steps (kernels
    compiled, the step counter read), ``set_sync_debug_mode("error")`` sees no sync: the prefetch's host
    waits are event waits on its side stream."""
    reference = plain("adagrad", backend="cuda").cuda()
    cached = HostCachedCollection.from_collection(plain("adagrad", backend="cuda"), cache_rows(0.01)).cuda()
    for ec in (reference, cached):
        ec.validate_ids = False
    data = [(kjt.to("cuda"), target.cuda()) for kjt, target in map(batch, range(STEPS))]
    expected = []
    for kjt, target in data:
        out = reference(kjt)
        (out * target).sum().backward()
        expected.append(out.detach())
    stream = torch.cuda.current_stream()
    got = []
    read_at = stream.record_event()
    ahead, read_at = cached.prefetch(data[0][0], after=read_at), stream.record_event()
    try:
        for step, (_, target) in enumerate(data):
            if step == 2:
                torch.cuda.set_sync_debug_mode("error")
            out = cached(ahead)
            (out * target).sum().backward()
            got.append(out.detach())
            if step + 1 < STEPS:
                ahead, read_at = cached.prefetch(data[step + 1][0], after=read_at), stream.record_event()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for want, have in zip(expected, got):
        torch.testing.assert_close(want, have)
    assert_same_state(reference, cached, exact=False)
    assert all(s.evictions > 0 and s.writebacks > 0 for s in cached.cache_stats().values())


@pytest.mark.gpu
def test_on_a_gpu_the_books_given_their_inputs_event_run_during_the_step_before_and_the_copies_after_it():
    """``prefetch(kjt, after, inputs)``, as the training pipeline calls it for the next batch: its books (the side
    stream's event) end while the step before still runs (a long sleep between ``inputs`` and ``after``), its copies
    only after that step."""
    cached = HostCachedCollection.from_collection(plain("adagrad"), cache_rows(0.01)).cuda()
    cached.validate_ids = False
    first, second = (batch(step)[0].to("cuda") for step in (0, 1))
    cached(cached.prefetch(first))  # the books compiled, the host tables mapped
    stream = torch.cuda.current_stream()
    torch.cuda.synchronize()
    inputs = stream.record_event()
    torch.cuda._sleep(1_000_000_000)  # the step before: about half a second
    after = stream.record_event()
    books, copies = cached.prefetch(second, after=after, inputs=inputs).ready
    books.synchronize()
    assert not after.query() and not copies.query()
    copies.synchronize()
    assert after.query()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_training_pipeline_prefetching_ahead_trains_alike_with_lookups_and_state_dicts_between_steps(device):
    """Each next batch prefetched by the pipeline before the step before it; between steps, an evaluation's lookups
    and state dicts, with a batch prefetched ahead: the outputs, the evaluations and the trained tables are the plain
    collection's."""
    from pipeline.distributed.train_pipeline import PrefetchPipeline
    from pipeline.loader import Batch
    from tests.test_distributed_pipeline import Holding

    backend = "cuda" if device == "cuda" else "torch"
    reference = plain("adagrad", backend=backend).to(device)
    cached = HostCachedCollection.from_collection(plain("adagrad", backend=backend), cache_rows(0.01)).to(device)
    for ec in (reference, cached):
        ec.validate_ids = False
    data = [batch(step) for step in range(STEPS)]
    evaluated = batch(1000, size=64)[0].to(device)
    batches = [Batch(target, kjt.to(device), target.to(device)) for kjt, target in data]
    steps = PrefetchPipeline(Holding(cached), device)(iter(batches))
    for step, got_batch in enumerate(steps):
        want = reference(batches[step].sparse)
        (want * batches[step].label).sum().backward()
        got = cached(got_batch.sparse)
        (got * got_batch.label).sum().backward()
        assert_same(want.detach(), got.detach(), exact=False)
        if step % 2:
            with torch.no_grad():
                assert_same(reference(evaluated), cached(evaluated), exact=False)
        if step % 5 == 3:
            assert_same_state(reference, cached, exact=False)
    steps.close()
    assert_same_state(reference, cached, exact=False)
    stats = cached.cache_stats().values()  # (the state dicts' flushes leave some tables nothing to write back)
    assert all(s.evictions > 0 for s in stats) and any(s.writebacks > 0 for s in stats)
