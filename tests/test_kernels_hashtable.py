"""The hash table: the reference against a dict of the visible state (buckets never full) and against the
documented rules applied one key at a time in pure Python (full buckets, eviction), the edge keys,
repeated keys, empty batches, checkpoints; a group of tables, its one call for all against each table's own;
the kernels' build and launch arguments on CPU; and on a GPU (marker ``gpu``) the CUDA table and group
against the reference, state and results, after the same calls."""

from __future__ import annotations

import io
import random
import re

import pytest
import torch

from pipeline.errors import BadInputError
from pipeline.kernels._compile import KERNEL_DIR
from pipeline.kernels.hashtable import SLOTS, HashTable, HashTableGroup, launcher, reference
from tests.test_kernels_build import _CTYPE_TO_PTX, _built_ptx_params

SOURCE = "hashtable/hashtable.cu"
M64 = 2**64
EDGE_KEYS = [0, -1, 1, -(2**63), 2**63 - 1, -2]  # -1 is 0xFFFF_FFFF_FFFF_FFFF


def fmix64(key: int) -> int:
    """MurmurHash3's 64-bit finalizer on Python ints (unsigned)."""
    h = key % M64
    h ^= h >> 33
    h = h * 0xFF51AFD7ED558CCD % M64
    h ^= h >> 33
    h = h * 0xC4CEB9FE1A85EC53 % M64
    return h ^ (h >> 33)


def storage_of(table: HashTable) -> dict[str, torch.Tensor]:
    s = table._storage
    return {"digests": s.digests.cpu(), "keys": s.keys.cpu(), "scores": s.scores.cpu(), "values": s.values.cpu()}


def exported(table: HashTable) -> dict[int, tuple[list[float], int]]:
    keys, values, scores = table.export()
    return {k: (v, s) for k, v, s in zip(keys.tolist(), values.tolist(), scores.tolist())}


class RulesModel:
    """The rules of docs/HASHTABLE.md applied literally, one key at a time, in pure Python."""

    def __init__(self, capacity: int, dim: int, policy: str) -> None:
        self.buckets, self.dim, self.policy = capacity // SLOTS, dim, policy
        self.key: list[int | None] = [None] * capacity
        self.score = [0] * capacity
        self.row = [[0.0] * dim for _ in range(capacity)]
        self.clock = 0

    def home(self, key: int) -> range:
        b = (fmix64(key) >> 32) * self.buckets >> 32
        return range(b * SLOTS, (b + 1) * SLOTS)

    def slot(self, key: int) -> int:
        return next((s for s in self.home(key) if self.key[s] == key), -1)

    def new_score(self, before: int, count: int, given: int | None) -> int:
        return {"lru": self.clock, "lfu": before + count, "custom": given}[self.policy]

    def write(self, keys: list[int], rows: list[list[float]], scores: list[int] | None, assign: bool):
        """(slot per position, was_new per position, [(first position, evicted key, row, score)])."""
        self.clock += 1
        known = {k for k in keys if self.slot(k) >= 0}
        first, last, count = {}, {}, {}
        for p, k in enumerate(keys):
            first.setdefault(k, p)
            last[k] = p
            count[k] = count.get(k, 0) + 1
        touched, slot_of, evicted = set(), {}, []
        for k, at in first.items():  # the keys in the table first
            s, src = self.slot(k), last[k] if assign else at
            if s >= 0:
                self.score[s] = self.new_score(self.score[s], count[k], scores and scores[src])
                if assign:
                    self.row[s] = list(rows[src])
                touched.add(s)
                slot_of[k] = s
        for k in sorted((k for k in first if k not in known), key=fmix64):  # then the new ones, in hash order
            src = last[k] if assign else first[k]
            score = self.new_score(0, count[k], scores and scores[src])
            empty = [s for s in self.home(k) if self.key[s] is None]
            if empty:
                s = empty[0]
            else:
                s = min((t for t in self.home(k) if t not in touched), key=lambda t: (self.score[t], t), default=None)
                if s is None or score <= self.score[s]:
                    slot_of[k] = -1
                    continue
                evicted.append((first[k], self.key[s], list(self.row[s]), self.score[s]))
            self.key[s], self.score[s], self.row[s] = k, score, list(rows[src])
            touched.add(s)
            slot_of[k] = s
        return [slot_of[k] for k in keys], [k not in known for k in keys], sorted(evicted)

    def check(self, table: HashTable) -> None:
        got = storage_of(table)
        occupied = [s for s, k in enumerate(self.key) if k is not None]
        assert (got["digests"] != 0).nonzero().squeeze(1).tolist() == occupied
        assert got["keys"][occupied].tolist() == [self.key[s] for s in occupied]
        assert got["scores"][occupied].tolist() == [self.score[s] for s in occupied]
        assert got["values"][occupied].tolist() == [self.row[s] for s in occupied]
        assert table.clock == self.clock


def random_rows(n: int, dim: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(n, dim, generator=g)


def random_batch(universe: list[int], g: random.Random, most: int) -> torch.Tensor:
    n = g.randint(0, most)
    return torch.tensor([g.choice(universe) for _ in range(n)], dtype=torch.int64)


# --- the hash -------------------------------------------------------------------------------------------


def test_the_hash_is_murmur3s_finalizer_and_gives_buckets_digests_and_an_order():
    rng = random.Random(0)
    keys = EDGE_KEYS + [rng.randrange(-(2**63), 2**63) for _ in range(500)]
    h = reference.mix64(torch.tensor(keys))
    unsigned = [fmix64(k) for k in keys]
    assert [x % M64 for x in h.tolist()] == unsigned
    for buckets in (1, 7, 1000, 2**31 - 1):
        assert reference.bucket_of(h, buckets).tolist() == [(u >> 32) * buckets >> 32 for u in unsigned]
    assert reference.digest_of(h).tolist() == [(u & 0xFF) or 1 for u in unsigned]
    order = torch.sort(reference.order_keys(torch.tensor(keys))).indices.tolist()
    assert order == sorted(range(len(keys)), key=lambda i: unsigned[i])


# --- the reference against a dict of the visible state ---------------------------------------------------


@pytest.mark.parametrize("policy", ["lru", "lfu", "custom"])
def test_random_calls_keep_the_state_a_dict_keeps_while_no_bucket_fills(policy):
    """64 buckets and at most 400 keys: no bucket comes near 128 keys, so nothing is refused or evicted."""
    dim, rng, g = 5, random.Random(1), torch.Generator().manual_seed(1)
    universe = EDGE_KEYS + [rng.randrange(-(2**63), 2**63) for _ in range(394)]
    table = HashTable(64 * SLOTS, dim, policy=policy)
    rows, scores, slot_of, clock = {}, {}, {}, 0
    for _ in range(60):
        keys = random_batch(universe, rng, 50)
        ks = keys.tolist()
        op = rng.choice(["assign", "find_or_insert", "erase", "find"])
        given = torch.randint(-1000, 1000, (len(ks),), generator=g) if policy == "custom" else None
        if op == "assign":
            values = random_rows(len(ks), dim, g)
            out = table.insert_or_assign(keys, values, given)
            clock += 1
            for k in dict.fromkeys(ks):
                last = len(ks) - 1 - ks[::-1].index(k)
                rows[k] = values[last].tolist()
                scores[k] = {"lru": clock, "lfu": scores.get(k, 0) + ks.count(k),
                             "custom": given[last].item() if given is not None else None}[policy]
            assert (out.slots >= 0).all() and out.evicted.keys.numel() == 0
        elif op == "find_or_insert":
            init = random_rows(len(ks), dim, g)
            before = set(rows)
            out = table.find_or_insert(keys, init, given)
            clock += 1
            for k in dict.fromkeys(ks):
                first = ks.index(k)
                rows.setdefault(k, init[first].tolist())
                scores[k] = {"lru": clock, "lfu": scores.get(k, 0) + ks.count(k),
                             "custom": given[first].item() if given is not None else None}[policy]
            assert out.was_new.tolist() == [k not in before for k in ks]
            assert out.values.tolist() == [rows[k] for k in ks]
            assert torch.equal(table.values[out.slots], out.values) and out.evicted.keys.numel() == 0
        elif op == "erase":
            assert table.erase(keys).tolist() == [k in rows for k in ks]
            for k in ks:
                for kept in (rows, scores, slot_of):
                    kept.pop(k, None)
        else:
            values, found = table.find(keys)
            assert found.tolist() == [k in rows for k in ks]
            assert values.tolist() == [rows.get(k, [0.0] * dim) for k in ks]
        if op in ("assign", "find_or_insert"):
            for k, s in zip(ks, out.slots.tolist()):
                assert slot_of.setdefault(k, s) == s  # a key keeps its slot while it is in the table
        assert exported(table) == {k: (rows[k], scores[k]) for k in rows}
        assert table.size() == len(rows)


def test_a_batchs_distinct_keys_give_the_same_table_in_any_order():
    g = torch.Generator().manual_seed(2)
    keys = torch.randint(-(2**62), 2**62, (300,), generator=g)
    rows = random_rows(300, 3, g)
    states = []
    for perm in (torch.arange(300), torch.randperm(300, generator=g), torch.arange(299, -1, -1)):
        table = HashTable(2 * SLOTS, 3)  # 300 keys into 256 slots: some refused, which ones fixed by the hashes
        table.insert_or_assign(keys[perm], rows[perm])
        states.append(storage_of(table))
    for state in states[1:]:
        assert all(torch.equal(state[name], states[0][name]) for name in state)
    assert int((states[0]["digests"] != 0).sum()) <= 256


# --- the reference against the rules, one key at a time -----------------------------------------------------


@pytest.mark.parametrize("policy", ["lru", "lfu", "custom"])
@pytest.mark.parametrize("buckets", [1, 3])
def test_random_calls_on_full_buckets_follow_the_rules_key_by_key(policy, buckets):
    dim, rng, g = 3, random.Random(buckets), torch.Generator().manual_seed(buckets)
    universe = EDGE_KEYS + [rng.randrange(-(2**63), 2**63) for _ in range(200 * buckets)]
    table, model = HashTable(buckets * SLOTS, dim, policy=policy), RulesModel(buckets * SLOTS, dim, policy)
    evictions = 0
    for step in range(40):
        keys = random_batch(universe, rng, 120 * buckets)
        ks = keys.tolist()
        op = rng.choice(["assign", "find_or_insert", "find_or_insert", "erase", "find"]) if step > 3 else "assign"
        given = torch.randint(0, 50, (len(ks),), generator=g) if policy == "custom" else None
        if op in ("assign", "find_or_insert"):
            rows = random_rows(len(ks), dim, g)
            if op == "assign":
                out = table.insert_or_assign(keys, rows, given)
            else:
                out = table.find_or_insert(keys, rows, given)
            slots, was_new, evicted = model.write(ks, rows.tolist(), None if given is None else given.tolist(),
                                            op == "assign")
            assert out.slots.tolist() == slots
            assert out.evicted.keys.tolist() == [e[1] for e in evicted]
            assert out.evicted.values.tolist() == [e[2] for e in evicted]
            assert out.evicted.scores.tolist() == [e[3] for e in evicted]
            evictions += len(evicted)
            if op == "find_or_insert":
                assert out.was_new.tolist() == was_new
                assert out.values.tolist() == [model.row[s] if s >= 0 else r for s, r in zip(slots, rows.tolist())]
        elif op == "erase":
            assert table.erase(keys).tolist() == [model.slot(k) >= 0 for k in ks]
            for k in ks:
                if model.slot(k) >= 0:
                    model.key[model.slot(k)] = None
        else:
            values, found = table.find(keys)
            assert found.tolist() == [model.slot(k) >= 0 for k in ks]
            assert values.tolist() == [model.row[model.slot(k)] if model.slot(k) >= 0 else [0.0] * dim for k in ks]
        model.check(table)
    assert evictions > 0 or policy == "lfu"


# --- full buckets and eviction, case by case ------------------------------------------------------------------


def _by_slot(table: HashTable) -> list[int]:
    return storage_of(table)["keys"][:SLOTS].tolist()


def test_a_full_bucket_evicts_its_lowest_score_for_a_strictly_higher_one_the_lowest_slot_on_ties():
    table = HashTable(SLOTS, 2, policy="custom")
    keys = torch.arange(1000, 1000 + SLOTS)
    rows = torch.arange(2.0 * SLOTS).view(SLOTS, 2)
    out = table.insert_or_assign(keys, rows, torch.full((SLOTS,), 5))
    assert sorted(out.slots.tolist()) == list(range(SLOTS)) and table.size() == SLOTS
    before = _by_slot(table)
    for score in (4, 5):  # not higher than the lowest: refused, nothing moves
        out = table.insert_or_assign(torch.tensor([7]), torch.ones(1, 2), torch.tensor([score]))
        assert out.slots.tolist() == [-1] and out.evicted.keys.numel() == 0 and _by_slot(table) == before
    out = table.insert_or_assign(torch.tensor([7]), torch.ones(1, 2), torch.tensor([6]))
    assert out.slots.tolist() == [0]  # every score 5: the lowest slot goes
    assert out.evicted.keys.tolist() == [before[0]] and out.evicted.scores.tolist() == [5]
    assert torch.equal(out.evicted.values, rows[before[0] - 1000].view(1, 2))
    assert _by_slot(table)[0] == 7 and table.size() == SLOTS
    table.insert_or_assign(torch.tensor([before[9]]), torch.zeros(1, 2), torch.tensor([1]))  # slot 9 lowest now
    out = table.insert_or_assign(torch.tensor([8]), torch.ones(1, 2), torch.tensor([2]))
    assert out.slots.tolist() == [9] and out.evicted.keys.tolist() == [before[9]]
    assert out.evicted.scores.tolist() == [1] and out.evicted.values.tolist() == [[0.0, 0.0]]
    assert 7 in exported(table) and before[0] not in exported(table)


def test_lru_evicts_the_oldest_keys_and_never_a_key_of_the_same_call():
    table = HashTable(SLOTS, 1, policy="lru")
    old = torch.arange(SLOTS)
    table.insert_or_assign(old, torch.zeros(SLOTS, 1))  # clock 1
    table.find_or_insert(old[:100], torch.zeros(100, 1))  # clock 2 for the first 100
    new = torch.arange(10_000, 10_050)  # 50 new keys: the 28 keys of clock 1 go first, then 22 of clock 2
    out = table.find_or_insert(new, torch.ones(50, 1))
    assert (out.slots >= 0).all() and out.was_new.all() and out.values.eq(1).all()
    assert sorted(out.evicted.scores.tolist()) == [1] * 28 + [2] * 22
    assert set(range(100, SLOTS)) <= set(out.evicted.keys.tolist()) and len(set(out.evicted.keys.tolist())) == 50
    before = set(exported(table))
    # 200 new keys, every key in the table older: 128 placed, each evicting an older one; the other 72 refused,
    # as each would evict a key this call placed
    new = torch.arange(20_000, 20_200)
    out = table.insert_or_assign(new, torch.zeros(200, 1))
    placed = out.slots >= 0
    assert int(placed.sum()) == SLOTS and set(out.evicted.keys.tolist()) == before
    assert set(exported(table)) == set(new[placed].tolist())
    assert {s for _, s in exported(table).values()} == {4}


def test_lfu_counts_occurrences_and_a_new_key_needs_more_than_the_least_used():
    table = HashTable(SLOTS, 1, policy="lfu")
    keys = torch.arange(SLOTS)
    table.insert_or_assign(keys, torch.zeros(SLOTS, 1))
    table.insert_or_assign(keys, torch.zeros(SLOTS, 1))  # every count 2
    assert {s for _, s in exported(table).values()} == {2}
    out = table.find_or_insert(torch.tensor([500, 500]), torch.ones(2, 1))  # twice: not more than 2
    assert out.slots.tolist() == [-1, -1] and out.was_new.tolist() == [True, True]
    lowest, found = _by_slot(table)[0], _by_slot(table)[5]
    out = table.find_or_insert(torch.tensor([500, found, 500, 500]), torch.ones(4, 1))
    assert out.slots.tolist() == [0, 5, 0, 0] and out.evicted.keys.tolist() == [lowest]
    assert exported(table)[500][1] == 3 and exported(table)[found][1] == 3


def test_repeated_keys_take_one_slot_the_last_row_when_assigned_the_first_when_inserted():
    table = HashTable(4 * SLOTS, 2, policy="custom")
    keys = torch.tensor([5, 9, 5, 0, 5, -1, 9])
    rows = torch.arange(14.0).view(7, 2)
    out = table.insert_or_assign(keys, rows, torch.tensor([1, 2, 3, 4, 5, 6, 7]))
    slots = out.slots.tolist()
    assert slots[0] == slots[2] == slots[4] and slots[1] == slots[6] and len(set(slots)) == 4
    assert exported(table) == {5: ([8.0, 9.0], 5), 9: ([12.0, 13.0], 7), 0: ([6.0, 7.0], 4), -1: ([10.0, 11.0], 6)}
    out = table.find_or_insert(torch.tensor([3, 5, 3, 3]), -rows[:4], torch.tensor([10, 11, 12, 13]))
    assert out.was_new.tolist() == [True, False, True, True]
    assert out.slots[0] == out.slots[2] == out.slots[3]
    assert out.values.tolist() == [[-0.0, -1.0], [8.0, 9.0], [-0.0, -1.0], [-0.0, -1.0]]
    assert exported(table)[3] == ([-0.0, -1.0], 10) and exported(table)[5] == ([8.0, 9.0], 11)


def test_key_zero_all_ones_and_the_extremes_are_keys_like_any_other():
    table = HashTable(SLOTS, 1)
    zero_digest = next(k for k in range(2, 100_000) if fmix64(k) & 0xFF == 0)  # stored with digest 1, as 0 is
    keys = torch.tensor(EDGE_KEYS + [zero_digest])
    values, found = table.find(keys)
    assert not found.any() and values.eq(0).all()
    table.insert_or_assign(keys, torch.arange(7.0).view(7, 1))
    values, found = table.find(keys)
    assert found.all() and values.view(-1).tolist() == list(range(7))
    assert set(exported(table)) == set(keys.tolist())
    assert table.erase(torch.tensor([0, -1, 0])).tolist() == [True, True, True]  # in the table before the call
    values, found = table.find(keys)
    assert found.tolist() == [False, False, True, True, True, True, True] and values[:2].eq(0).all()
    assert table.size() == 5


def test_an_empty_batch_changes_nothing_and_returns_empty_results():
    table = HashTable(SLOTS, 4, policy="custom")
    table.insert_or_assign(torch.tensor([1, 2]), torch.ones(2, 4), torch.tensor([1, 1]))
    before = storage_of(table)
    empty = torch.zeros(0, dtype=torch.int64)
    values, found = table.find(empty)
    assert values.shape == (0, 4) and found.shape == (0,)
    assert table.insert_or_assign(empty, torch.zeros(0, 4), empty).slots.shape == (0,)
    out = table.find_or_insert(empty, torch.zeros(0, 4), empty)
    assert out.values.shape == (0, 4) and out.was_new.shape == (0,) and out.evicted.values.shape == (0, 4)
    assert table.erase(empty).shape == (0,)
    after = storage_of(table)
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_erase_where_removes_the_selected_positions_keys_only():
    table = HashTable(SLOTS, 1)
    table.insert_or_assign(torch.arange(10), torch.zeros(10, 1))
    first = _by_slot(table)[0]  # slot 0 cleared while keys not in the table are given too
    keys = torch.tensor([3, 4, 3, 99, first, 6, 98])
    where = torch.tensor([True, False, False, True, True, False, False])
    assert table.erase(keys, where=where).tolist() == [True, False, False, False, True, False, False]
    assert sorted(exported(table)) == sorted(set(range(10)) - {3, first})
    assert table.erase(torch.tensor([99, 98]), where=torch.tensor([True, True])).tolist() == [False, False]
    assert table.size() == 8 and table.erase(torch.tensor([4]), where=torch.tensor([False])).tolist() == [False]


def test_evictions_are_counted_on_the_device_and_selected_when_read():
    table = HashTable(SLOTS, 2, policy="lru")
    rows = torch.arange(2.0 * SLOTS).view(SLOTS, 2)
    table.insert_or_assign(torch.arange(SLOTS), rows)
    before = _by_slot(table)
    out = table.find_or_insert(torch.tensor([500, 501, 500, 502]), torch.ones(4, 2))
    assert isinstance(out.evicted.count, torch.Tensor) and out.evicted.count.item() == 3
    keys, values, scores = out.evicted
    assert sorted(keys.tolist()) == sorted(before[:3]) and scores.tolist() == [1, 1, 1]
    assert torch.equal(values, rows[keys])  # each evicted key's row, copied out before the new rows went in
    assert table.find_or_insert(torch.tensor([500]), torch.ones(1, 2)).evicted.count.item() == 0


def test_clear_empties_the_table_and_export_lists_it_by_slot():
    table = HashTable(2 * SLOTS, 2)
    table.insert_or_assign(torch.arange(50), torch.randn(50, 2))
    keys, values, scores = table.export()
    slots = table.occupied()
    assert torch.equal(keys, table._storage.keys[slots]) and torch.equal(values, table.values[slots])
    assert slots.tolist() == sorted(slots.tolist()) and scores.eq(1).all()
    table.clear()
    assert table.size() == 0 and table.export()[0].numel() == 0 and not table.find(torch.arange(50))[1].any()


# --- checkpoints ----------------------------------------------------------------------------------------------


def test_state_dict_round_trip_restores_every_slot_and_the_clock():
    g = torch.Generator().manual_seed(3)
    table = HashTable(2 * SLOTS, 3, policy="lfu")
    for _ in range(4):
        table.find_or_insert(torch.randint(0, 400, (150,), generator=g), random_rows(150, 3, g))
    table.erase(torch.arange(0, 400, 7))
    buffer = io.BytesIO()
    torch.save(table.state_dict(), buffer)
    buffer.seek(0)
    loaded = HashTable(2 * SLOTS, 3, policy="lfu")
    loaded.insert_or_assign(torch.tensor([12345]), torch.ones(1, 3))  # replaced by the load
    loaded.load_state_dict(torch.load(buffer))
    assert exported(loaded) == exported(table) and loaded.clock == table.clock
    assert torch.equal(loaded.occupied(), table.occupied())
    batch, init = torch.randint(0, 500, (200,), generator=g), random_rows(200, 3, g)
    a, b = table.find_or_insert(batch, init), loaded.find_or_insert(batch, init)
    assert torch.equal(a.slots, b.slots) and torch.equal(a.values, b.values)
    assert torch.equal(a.evicted.keys, b.evicted.keys)
    assert exported(loaded) == exported(table)


def test_a_state_that_does_not_fit_the_table_is_refused_with_what_is_wrong():
    table = HashTable(2 * SLOTS, 2)
    table.insert_or_assign(torch.arange(20), torch.zeros(20, 2))
    state = table.state_dict()
    with pytest.raises(BadInputError, match="holds a table of capacity 256, this table has 384"):
        HashTable(3 * SLOTS, 2).load_state_dict(state)
    with pytest.raises(BadInputError, match="holds a table of policy 'lru', this table has 'lfu'"):
        HashTable(2 * SLOTS, 2, policy="lfu").load_state_dict(state)
    moved = dict(state, slots=(state["slots"] + SLOTS) % (2 * SLOTS))
    with pytest.raises(BadInputError, match="a key is not in a slot of its bucket"):
        HashTable(2 * SLOTS, 2).load_state_dict(moved)
    twice = {**state, **{k: torch.cat([state[k], state[k][:1]]) for k in ("keys", "values", "scores", "slots")}}
    with pytest.raises(BadInputError, match="a key or a slot appears twice"):
        HashTable(2 * SLOTS, 2).load_state_dict(twice)
    with pytest.raises(BadInputError, match=r"'values' must be torch.float32 \(20, 2\)"):
        HashTable(2 * SLOTS, 2).load_state_dict(dict(state, values=state["values"].double()))


def test_wrong_arguments_say_what_was_expected():
    with pytest.raises(ValueError, match="capacity must be a positive multiple of 128"):
        HashTable(100, 4)
    with pytest.raises(ValueError, match="policy must be one of lru, lfu, custom"):
        HashTable(SLOTS, 4, policy="fifo")
    table = HashTable(SLOTS, 4)
    with pytest.raises(ValueError, match=r"keys must be a 1-D int64 tensor, got torch.int32 \(2,\)"):
        table.find(torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"values must be float32 \(2, 4\) on cpu"):
        table.insert_or_assign(torch.tensor([1, 2]), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="scores are given only to a table of policy 'custom'"):
        table.insert_or_assign(torch.tensor([1]), torch.zeros(1, 4), torch.tensor([3]))
    with pytest.raises(ValueError, match=r"policy 'custom' needs int64 scores \(1,\)"):
        HashTable(SLOTS, 4, policy="custom").find_or_insert(torch.tensor([1]), torch.zeros(1, 4))


def test_on_cpu_the_table_runs_the_reference_and_refuses_the_kernels():
    assert HashTable(SLOTS, 1).backend == HashTable(SLOTS, 1, backend="torch").backend == "torch"
    with pytest.raises(ValueError, match="backend 'cuda' cannot run here: the CUDA kernels need a CUDA device, got cpu"):
        HashTable(SLOTS, 1, backend="cuda")


# --- a group of tables: one call for the keys of all, each table's own result ------------------------------------

GROUP_CAPACITIES = [SLOTS, 3 * SLOTS, SLOTS, 2 * SLOTS]


def _rows_of(keys: torch.Tensor, dim: int) -> torch.Tensor:
    """Rows drawn from each key alone (as a dynamic table draws its new rows): a repeated key's are all the same."""
    return (keys[:, None] % 997 + torch.arange(dim)).float()


def _group_batch(rng: random.Random, g: torch.Generator, universe: list[int], tables: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys, tables)``: each table's keys of a batch, drawn from one universe (a key in two tables is two keys),
    some tables without any, now and then a key repeated thousands of times in one table and a few in another;
    the tables' keys interleaved at random."""
    parts = [random_batch(universe, rng, 300) if rng.random() > 0.25 else torch.zeros(0, dtype=torch.int64)
             for _ in range(tables)]
    if rng.random() < 0.4:
        hot = rng.choice(universe)
        parts[rng.randrange(tables)] = torch.cat([parts[0], torch.tensor([hot]).repeat(rng.randint(1000, 3000))])
        parts[rng.randrange(tables)] = torch.cat([parts[1], torch.tensor([hot]).repeat(5)])
    keys = torch.cat(parts)
    owner = torch.repeat_interleave(torch.arange(tables), torch.tensor([p.numel() for p in parts]))
    perm = torch.randperm(keys.numel(), generator=g)
    return keys[perm], owner[perm]


def _side_by_side() -> tuple[torch.Tensor, torch.Tensor]:
    """One key alone in tables 0 and 2 (one bucket each) and nothing in table 1: sorted by table then hash, its
    repeats of both tables are neighbours, in the same bucket number of their tables."""
    return torch.tensor([-1] * 2000 + [-1] * 300), torch.tensor([0] * 2000 + [2] * 300)


def _check_group_call(group: HashTableGroup, alone: list[HashTable], keys: torch.Tensor, owner: torch.Tensor,
                      scores: torch.Tensor | None) -> int:
    """The group's call against each table's ``find_or_insert`` of its keys, bit for bit; then the caller's part
    (the evicted rows read from their slots, the new keys' rows written) and the tables' states. Returns the
    evictions."""
    dim = group.dim
    want = [table.find_or_insert(keys[owner == t], _rows_of(keys[owner == t], dim),
                                 None if scores is None else scores[owner == t]) for t, table in enumerate(alone)]
    got = group.find_or_insert(keys, owner, scores)
    assert got.evictions.tolist() == [w.evicted.count.item() for w in want]
    for t, (w, table) in enumerate(zip(want, group.tables)):
        at = owner == t
        slots, taken = got.slots[at], got.evicted[at]
        assert torch.equal(slots, w.slots) and torch.equal(got.was_new[at], w.was_new)
        assert torch.equal(got.evicted_keys[at][taken], w.evicted.keys)
        assert torch.equal(got.evicted_scores[at][taken], w.evicted.scores)
        assert torch.equal(table.values[slots[taken]], w.evicted.values)  # still in the slots the new keys took
        new = got.was_new[at] & (slots >= 0)
        table.values[slots[new]] = _rows_of(keys[at][new], dim)
        mine, theirs = storage_of(table), storage_of(alone[t])
        assert all(torch.equal(mine[name], theirs[name]) for name in mine), t
        assert table.clock == alone[t].clock
    return sum(got.evictions.tolist())


@pytest.mark.parametrize("policy", ["lru", "lfu", "custom"])
def test_a_groups_call_places_each_key_as_its_tables_own_call_would(policy):
    """Tables of several capacities, full buckets (a universe of 600 keys for 128 to 384 slots), keys in two
    tables, the edge keys, hot keys repeated thousands of times, tables without keys, erasures between calls."""
    dim, rng, g = 3, random.Random(7), torch.Generator().manual_seed(7)
    universe = EDGE_KEYS + [rng.randrange(-(2**63), 2**63) for _ in range(600)]
    group = HashTableGroup(GROUP_CAPACITIES, dim, policy=policy)
    alone = [HashTable(c, dim, policy=policy) for c in GROUP_CAPACITIES]
    evictions = 0
    for step in range(30):
        keys, owner = _group_batch(rng, g, universe, len(alone)) if step else _side_by_side()
        if step == 5:
            keys, owner = keys[:0], owner[:0]
        scores = torch.randint(0, 40, (keys.numel(),), generator=g) if policy == "custom" else None
        evictions += _check_group_call(group, alone, keys, owner, scores)
        t = rng.randrange(len(alone))
        gone = random_batch(universe, rng, 60)
        assert torch.equal(group.tables[t].erase(gone), alone[t].erase(gone))
        probe = random_batch(universe, rng, 200)
        owners = torch.randint(0, len(alone), (probe.numel(),), generator=g)
        assert group.locate(probe, owners).tolist() == [alone[o].locate(k.view(1)).item()
                                                         for k, o in zip(probe, owners.tolist())]
    assert evictions > 0 or policy == "lfu"


def test_a_group_shares_one_clock_and_each_table_keeps_its_lru_order():
    group = HashTableGroup([SLOTS, SLOTS], 1)
    a, b = group.tables
    a.insert_or_assign(torch.arange(SLOTS), torch.zeros(SLOTS, 1))  # a alone: clock 1
    a.find_or_insert(torch.arange(64), torch.zeros(64, 1))  # clock 2 for its first 64 keys
    placed = group.find_or_insert(torch.tensor([1000, 1001, 5]), torch.tensor([0, 1, 1]))
    assert a.clock == b.clock == 3 and placed.was_new.tolist() == [True, True, True]
    assert placed.evictions.tolist() == [1, 0] and placed.evicted_scores[0].item() == 1
    assert placed.evicted_keys[0].item() in range(64, SLOTS)  # a's least recent key went
    assert exported(a)[1000][1] == exported(b)[1001][1] == exported(b)[5][1] == 3


def test_each_table_of_a_group_is_a_table_of_its_own_slots():
    group = HashTableGroup([2 * SLOTS, SLOTS, 3 * SLOTS], 2, policy="custom")
    for t, table in enumerate(group.tables):
        table.insert_or_assign(torch.arange(100) + t, torch.full((100, 2), float(t)), torch.arange(100))
    before = [storage_of(table) for table in group.tables]
    state = group.tables[1].state_dict()
    group.tables[1].clear()
    assert group.tables[1].size() == 0 and [t.size() for t in group.tables] == [100, 0, 100]
    alone = HashTable(SLOTS, 2, policy="custom")
    alone.load_state_dict(state)
    group.tables[1].load_state_dict(alone.state_dict())
    after = [storage_of(table) for table in group.tables]
    assert all(torch.equal(x[name], y[name]) for x, y in zip(before, after) for name in x)
    values, found = group.tables[2].find(torch.tensor([2, 1]))
    assert found.tolist() == [True, False] and values.tolist() == [[2.0, 2.0], [0.0, 0.0]]
    assert group.locate(torch.tensor([2, 2, 2, 1]), torch.tensor([0, 1, 2, 2])).tolist() == [
        group.tables[0].locate(torch.tensor([2])).item(), group.tables[1].locate(torch.tensor([2])).item(),
        group.tables[2].locate(torch.tensor([2])).item(), -1]


def test_a_groups_wrong_arguments_say_what_was_expected():
    with pytest.raises(ValueError, match="capacity must be a positive multiple of 128"):
        HashTableGroup([SLOTS, 100], 2)
    with pytest.raises(ValueError, match="1 to 32767 tables, got 0"):
        HashTableGroup([], 2)
    group = HashTableGroup([SLOTS, SLOTS], 2)
    with pytest.raises(ValueError, match=r"tables must be integers \(3,\) on cpu \(each key's table\), got "
                                         r"torch.float32 \(3,\)"):
        group.find_or_insert(torch.arange(3), torch.zeros(3))
    with pytest.raises(ValueError, match="scores are given only to a table of policy 'custom'"):
        group.find_or_insert(torch.arange(3), torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64))


# --- the kernels' source and launch arguments, checked on CPU ---------------------------------------------------


def test_the_constants_are_the_same_in_python_and_in_the_kernels():
    source = (KERNEL_DIR / SOURCE).read_text()
    defines = dict(re.findall(r"^#define (\w+) (\S+)", source, flags=re.MULTILINE))
    assert int(defines["SLOTS"]) == SLOTS
    assert int(defines["FIND_GROUP"]) == launcher.FIND_GROUP and int(defines["COPY_GROUP"]) == launcher.COPY_GROUP
    assert (int(defines["LRU"]), int(defines["LFU"])) == (reference.LRU, reference.LFU)


def test_launch_arguments_match_kernel_signatures(nvcc_build, monkeypatch):
    entries = _built_ptx_params(SOURCE, nvcc_build)
    launches = []
    monkeypatch.setattr(launcher, "launch", lambda source, function, device, grid, block, args:
                        launches.append((source, function, grid, block, args)))
    storage = reference.Storage.empty(2 * SLOTS, 8, "cpu")
    keys = torch.arange(10)
    launcher.find(storage, keys)
    launcher.locate(storage, keys)
    launcher.place(storage, keys, torch.zeros(10, dtype=torch.int64), reference.CUSTOM, 3, True)
    launcher.write_rows(storage.values, torch.zeros(10, dtype=torch.int64), torch.zeros(10, 8))
    launcher.read_rows(storage.values, torch.zeros(10, dtype=torch.int64), torch.zeros(10, 8))
    launcher.take_rows(storage.values, torch.zeros(10, dtype=torch.int64), torch.ones(10, dtype=torch.bool))
    tables, bucket_starts = torch.zeros(10, dtype=torch.int16), torch.tensor([0, 1, 2])  # a group of two tables
    launcher.locate(storage, keys, tables, bucket_starts)
    launcher.place(storage, keys, None, reference.LRU, 3, False, tables, bucket_starts)
    assert [f for _, f, *_ in launches] == ["find_keys", "find_keys", "hash_order_keys", "bucket_firsts", "place_keys",
                                           "copy_rows", "copy_rows", "copy_rows", "find_keys", "hash_order_keys",
                                           "bucket_firsts", "place_keys"]
    groups = {"find_keys": launcher.FIND_GROUP, "place_keys": 32, "copy_rows": launcher.COPY_GROUP,
              "hash_order_keys": 1, "bucket_firsts": 1}
    for source, function, grid, block, args in launches:
        assert source == SOURCE and function in entries, function
        assert [_CTYPE_TO_PTX[type(a).__name__] for a in args] == [t.replace("s", "u") for t in entries[function]]
        # place_keys: a warp a bucket when the batch has as many keys as the storage has buckets, else a warp a key
        units = min(10, storage.num_buckets) if function == "place_keys" else 10
        assert grid * block >= units * groups[function] > (grid - 1) * block, function


# --- on a GPU: the kernels against the reference ---------------------------------------------------------------


def _cuda_pair(capacity: int, dim: int, policy: str) -> tuple[HashTable, HashTable]:
    from pipeline.kernels import kernels_problem

    if kernels_problem():
        pytest.skip(f"the kernels cannot run here: {kernels_problem()}")
    return HashTable(capacity, dim, "cuda", policy, backend="cuda"), HashTable(capacity, dim, "cpu", policy)


def _same(a, b) -> None:
    """Equal results (tuples, named tuples, tensors), bit for bit, wherever they live."""
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
    else:
        a, b = tuple(a), tuple(b)
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)


def _same_state(cuda: HashTable, cpu: HashTable) -> None:
    got, want = storage_of(cuda), storage_of(cpu)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert cuda.clock == cpu.clock


def _run_both(cuda: HashTable, cpu: HashTable, op: str, keys: torch.Tensor, rows=None, scores=None):
    args = [keys] if op in ("find", "erase") else [keys, rows, scores]
    got = getattr(cuda, op)(*[a.cuda() if a is not None else None for a in args])
    want = getattr(cpu, op)(*args)
    _same(got, want)
    _same_state(cuda, cpu)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["lru", "lfu", "custom"])
@pytest.mark.parametrize("buckets,universe", [(64, 3000), (2, 2000), (1, 400)])
@pytest.mark.parametrize("dim", [1, 7, 8, 64, 130])
def test_cuda_table_equals_the_reference_after_random_calls(policy, buckets, universe, dim):
    """Roomy buckets (64 of them, few keys each) and full ones (1 and 2 buckets, keys evicted every call)."""
    rng, g = random.Random(buckets * dim), torch.Generator().manual_seed(dim)
    keys_of = EDGE_KEYS + [rng.randrange(-(2**63), 2**63) for _ in range(universe)]
    cuda, cpu = _cuda_pair(buckets * SLOTS, dim, policy)
    for step in range(30):
        keys = random_batch(keys_of, rng, 600)
        op = rng.choice(["insert_or_assign", "find_or_insert", "find_or_insert", "erase", "find"]) if step > 2 \
            else "insert_or_assign"
        scores = torch.randint(0, 40, (keys.numel(),), generator=g) if policy == "custom" else None
        _run_both(cuda, cpu, op, keys, random_rows(keys.numel(), dim, g), scores)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["lru", "lfu", "custom"])
def test_cuda_table_equals_the_reference_with_batches_smaller_than_its_buckets(policy):
    """Batches of fewer keys than the table has buckets (a placement warp a key, not a bucket), then larger ones."""
    rng, g = random.Random(21), torch.Generator().manual_seed(21)
    keys_of = EDGE_KEYS + [rng.randrange(-(2**63), 2**63) for _ in range(20_000)]
    cuda, cpu = _cuda_pair(512 * SLOTS, 4, policy)
    for size in (40, 300, 511, 512, 3000, 300):
        keys = torch.tensor([rng.choice(keys_of) for _ in range(size)], dtype=torch.int64)
        scores = torch.randint(0, 40, (keys.numel(),), generator=g) if policy == "custom" else None
        op = "insert_or_assign" if size % 2 else "find_or_insert"
        _run_both(cuda, cpu, op, keys, random_rows(keys.numel(), 4, g), scores)


@pytest.mark.gpu
def test_cuda_table_equals_the_reference_on_large_batches():
    g = torch.Generator().manual_seed(5)
    cuda, cpu = _cuda_pair(4096 * SLOTS, 16, "lru")
    for step in range(4):
        keys = torch.randint(-(2**63), 2**63 - 1, (200_000,), generator=g)
        keys[::3] = keys[1::3][: keys[::3].numel()]  # repeated keys
        _run_both(cuda, cpu, "insert_or_assign" if step % 2 == 0 else "find_or_insert", keys,
                  random_rows(keys.numel(), 16, g))
    present = cpu.export()[0]
    lookups = torch.cat([present[torch.randint(0, present.numel(), (150_000,), generator=g)],
                         torch.randint(-(2**63), 2**63 - 1, (50_000,), generator=g)])
    _run_both(cuda, cpu, "find", lookups)
    _run_both(cuda, cpu, "erase", lookups[::2])


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_cuda_table_equals_the_reference_on_hot_keys_repeated_thousands_of_times(policy):
    """Skewed batches, as Zipf ids give: a key repeated 127, 128, 129 and thousands of times (the warp scans a
    key's repeats 128 at a time), a hot key last in hash order (its run ends the batch), LFU counting every repeat."""
    g = torch.Generator().manual_seed(8)
    cuda, cpu = _cuda_pair(16 * SLOTS, 8, policy)
    for step in range(4):
        hot = torch.randint(-(2**63), 2**63 - 1, (6,), generator=g)
        counts = torch.tensor([1, 127, 128, 129, 5000 + step, 20_000])
        cold = torch.randint(-(2**63), 2**63 - 1, (3000,), generator=g)
        keys = torch.cat([cold, torch.repeat_interleave(hot, counts)])
        last = max(cold.tolist(), key=lambda k: fmix64(k))  # the last key in hash order: its run ends the batch's
        keys = torch.cat([keys, torch.tensor([last]).repeat(300)])
        keys = keys[torch.randperm(keys.numel(), generator=g)]
        _run_both(cuda, cpu, "find_or_insert" if step % 2 else "insert_or_assign", keys,
                  random_rows(keys.numel(), 8, g))
    _run_both(cuda, cpu, "find", keys[::7])


@pytest.mark.gpu
def test_cuda_table_edge_keys_repeats_and_empty_batches():
    cuda, cpu = _cuda_pair(SLOTS, 4, "custom")
    zero_digest = next(k for k in range(2, 100_000) if fmix64(k) & 0xFF == 0)
    keys = torch.tensor(EDGE_KEYS + [zero_digest] + EDGE_KEYS)
    n = keys.numel()
    rows = torch.arange(4.0 * n).view(n, 4)
    _run_both(cuda, cpu, "insert_or_assign", keys, rows, torch.arange(n))
    _run_both(cuda, cpu, "find_or_insert", keys.flip(0), rows, torch.arange(n))
    _run_both(cuda, cpu, "find", keys)
    empty = torch.zeros(0, dtype=torch.int64)
    for op in ("insert_or_assign", "find_or_insert", "find", "erase"):
        _run_both(cuda, cpu, op, empty, torch.zeros(0, 4), empty)
    _run_both(cuda, cpu, "erase", keys)
    assert cuda.size() == cpu.size() == 0


@pytest.mark.gpu
def test_cuda_table_state_dict_loads_into_the_reference_and_back():
    g = torch.Generator().manual_seed(6)
    cuda, cpu = _cuda_pair(8 * SLOTS, 8, "lru")
    for _ in range(3):
        keys = torch.randint(0, 3000, (1500,), generator=g)
        _run_both(cuda, cpu, "find_or_insert", keys, random_rows(1500, 8, g))
    moved = HashTable(8 * SLOTS, 8, "cuda")
    moved.load_state_dict(cpu.state_dict())
    _same((moved.occupied(), moved.export()), (cpu.occupied(), cpu.export()))
    back = HashTable(8 * SLOTS, 8, "cpu")
    back.load_state_dict(cuda.state_dict())
    _same(back.export(), cpu.export())


def _cuda_group_pair(capacities: list[int], dim: int, policy: str) -> tuple[HashTableGroup, HashTableGroup]:
    from pipeline.kernels import kernels_problem

    if kernels_problem():
        pytest.skip(f"the kernels cannot run here: {kernels_problem()}")
    return (HashTableGroup(capacities, dim, "cuda", policy, backend="cuda"),
            HashTableGroup(capacities, dim, "cpu", policy))


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["lru", "lfu", "custom"])
def test_cuda_group_equals_the_reference_group_after_random_calls(policy):
    """The group's one call for all tables: the kernels against the reference, results and every table's state,
    with full buckets, keys in two tables, hot keys repeated thousands of times, tables without keys, a table of
    one bucket beside larger ones (its first bucket follows the last of the table before it)."""
    rng, g = random.Random(11), torch.Generator().manual_seed(11)
    capacities = [SLOTS, 3 * SLOTS, SLOTS, 64 * SLOTS, 2 * SLOTS]
    universe = EDGE_KEYS + [rng.randrange(-(2**63), 2**63) for _ in range(4000)]
    cuda, cpu = _cuda_group_pair(capacities, 4, policy)
    for step in range(30):
        keys, owner = _group_batch(rng, g, universe, len(capacities)) if step else _side_by_side()
        scores = torch.randint(0, 40, (keys.numel(),), generator=g) if policy == "custom" else None
        got = cuda.find_or_insert(keys.cuda(), owner.cuda(), scores.cuda() if scores is not None else None)
        _same(got, cpu.find_or_insert(keys, owner, scores))
        for x, y in zip(cuda.tables, cpu.tables):
            _same_state(x, y)
        probe = random_batch(universe, rng, 500)
        owners = torch.randint(0, len(capacities), (probe.numel(),), generator=g)
        _same(cuda.locate(probe.cuda(), owners.cuda()), cpu.locate(probe, owners))
        t = rng.randrange(len(capacities))
        _run_both(cuda.tables[t], cpu.tables[t], "erase", random_batch(universe, rng, 100))


@pytest.mark.gpu
def test_cuda_group_equals_the_reference_group_on_large_batches():
    g = torch.Generator().manual_seed(12)
    capacities = [256 * SLOTS] * 6 + [SLOTS, 4096 * SLOTS]
    cuda, cpu = _cuda_group_pair(capacities, 2, "lru")
    for _ in range(3):
        keys = torch.randint(0, 400_000, (300_000,), generator=g)  # the same keys in several tables
        owner = torch.randint(0, len(capacities), (keys.numel(),), generator=g)
        _same(cuda.find_or_insert(keys.cuda(), owner.cuda()), cpu.find_or_insert(keys, owner))
    for x, y in zip(cuda.tables, cpu.tables):
        _same_state(x, y)
