"""Dynamic embedding tables: raw 64-bit ids placed by a hash table, trained by the fused optimizers."""

import io

import pytest
import torch
import torch.nn.functional as F

from pipeline.kernels.hashtable import SLOTS, HashTable, reference
from pipeline.modules.collection import EmbeddingCollection
from pipeline.modules.configs import EmbeddingOptimizerConfig, TableConfig
from pipeline.modules.dynamic import slot_codes
from pipeline.schema import DYNAMIC_ROWS
from pipeline.sparse import KeyedJaggedTensor

FEATURES = ["U", "T"]
VOCAB = 40


def _raw(ids: torch.Tensor) -> torch.Tensor:
    """Vocabulary codes as raw int64 ids all over the 64 bits (negative ones too), one to one."""
    return ids * -7046029254386353131 + 12345  # odd multiplier: a bijection of the int64s


def _tables(dynamic: bool, rows: int = VOCAB, admit_after: int = 1, init_scale: float | None = 0.0):
    extra = {"dynamic": True, "admit_after": admit_after} if dynamic else {}
    return [TableConfig("u", rows, 4, ["U"], init_scale=init_scale, **extra),
            TableConfig("t", rows, 3, ["T"], pooling="mean", init_scale=init_scale, **extra)]


def _batches(steps: int, batch: int = 16, vocab: int = VOCAB, seed: int = 0):
    """One-hot U and multi-hot T (bags of 0 to 3 ids, empty ones included), codes below ``vocab``, and labels."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        u = torch.randint(0, vocab, (batch,), generator=gen)
        lengths = torch.randint(0, 4, (batch,), generator=gen)
        t = torch.randint(0, vocab, (int(lengths.sum()),), generator=gen)
        label = (u % 2).float()
        out.append((u, t, lengths, label))
    return out


def _kjt(u, t, lengths, raw: bool) -> KeyedJaggedTensor:
    values = torch.cat([u, t])
    return KeyedJaggedTensor(FEATURES, _raw(values) if raw else values, torch.cat([torch.ones_like(u), lengths]))


def _fit(emb, batches, raw: bool) -> list[float]:
    head = torch.linspace(-1, 1, emb.output_dim)
    losses = []
    for u, t, lengths, label in batches:
        loss = F.binary_cross_entropy_with_logits(emb(_kjt(u, t, lengths, raw)) @ head, label)
        loss.backward()
        losses.append(loss.item())
    return losses


def _rows(emb, name: str, codes: torch.Tensor, raw: bool, key: str = "weight") -> torch.Tensor:
    """The rows (or the optimizer state ``key``, by row) of ``codes`` in table ``name``."""
    t = emb.packing.table_names.index(name)
    rows, dim = emb.packing.rows[t], emb.packing.dims[t]
    flat = emb.weights if key == "weight" else emb.optimizer_state()[key]
    if flat.numel() == emb.packing.total_rows and key != "weight":
        table = flat[emb.packing.row_offsets[t] : emb.packing.row_offsets[t] + rows]
    else:
        table = flat[emb.packing.weights_offsets[t] : emb.packing.weights_offsets[t] + rows * dim].view(rows, dim)
    if not raw:
        return table[codes]
    slots = emb.dynamic[name].find(_raw(codes))
    assert (slots >= 0).all()
    return table[slots]


@pytest.mark.parametrize("kind, dtype", [("sgd", "fp32"), ("adagrad", "fp32"), ("adam", "fp32"), ("adagrad", "bf16")])
def test_a_dynamic_table_trains_as_the_static_table_when_every_id_gets_a_row(kind, dtype):
    optimizer = EmbeddingOptimizerConfig(kind, lr=0.1, master_weights=dtype != "fp32")
    static = EmbeddingCollection(_tables(False), FEATURES, optimizer, weights_dtype=dtype)
    dynamic = EmbeddingCollection(_tables(True, rows=4 * SLOTS), FEATURES, optimizer, weights_dtype=dtype)
    batches = _batches(12)
    assert _fit(dynamic, batches, raw=True) == _fit(static, batches, raw=False)
    codes = torch.arange(VOCAB)
    for name in ("u", "t"):
        assert dynamic.dynamic[name].stats() == {"ids": VOCAB, "evictions": 0, "candidates": 0}
        for key in ["weight", *static.optimizer_state()]:
            assert torch.equal(_rows(dynamic, name, codes, True, key), _rows(static, name, codes, False, key)), key


def test_new_ids_start_from_the_tables_init_and_evaluation_places_nothing():
    def make():
        return EmbeddingCollection(_tables(True, rows=SLOTS, init_scale=0.5), FEATURES,
                                   generator=torch.Generator().manual_seed(1))

    emb = make()
    table = emb.dynamic["u"]
    ids = torch.tensor([-(2**63), -1, 0, 7, 2**63 - 1])
    both = KeyedJaggedTensor(FEATURES, torch.cat([ids, ids]), torch.ones(10, dtype=torch.int64))
    emb.eval()
    with torch.no_grad():
        pooled = emb(both)
    assert torch.equal(pooled, torch.zeros(5, 7)) and table.stats()["ids"] == 0  # unknown ids read zeros
    emb.train()
    emb(both)
    rows = emb.table_weight("u")[table.find(ids)]
    assert torch.equal(rows, table.init_rows(ids)) and rows.abs().max() <= 0.5 and rows.std() > 0.1
    # a row is drawn from its id alone: in any batch, and in another collection made with the same seed
    order = torch.tensor([3, 0, 4, 1, 2])
    assert torch.equal(table.init_rows(ids[order]), rows[order])
    assert torch.equal(make().dynamic["u"].init_rows(ids), rows)


def test_a_full_table_evicts_the_least_recent_ids_and_a_returning_id_starts_fresh():
    emb = EmbeddingCollection(_tables(True, rows=SLOTS), FEATURES, EmbeddingOptimizerConfig("adagrad", lr=0.1))
    first = _batches(6, vocab=30, seed=1)
    _fit(emb, first, raw=True)
    table = emb.dynamic["u"]
    old = torch.arange(30)
    assert (table.find(_raw(old)) >= 0).any() and table.stats()["evictions"] == 0
    later = [(u + 1000, t + 1000, lengths, label) for u, t, lengths, label in _batches(40, vocab=4000, seed=2)]
    losses = _fit(emb, later, raw=True)
    stats = table.stats()
    assert stats["ids"] == SLOTS and stats["evictions"] > 0 and all(map(torch.isfinite, torch.tensor(losses)))
    gone = old[table.find(_raw(old)) < 0]
    assert gone.numel()  # the early ids, least recently used, left first
    back = gone[:1]
    emb(KeyedJaggedTensor(FEATURES, _raw(torch.cat([back, back])), torch.ones(2, dtype=torch.int64)))
    slot = table.find(_raw(back))
    assert torch.equal(emb.table_weight("u")[slot], table.init_rows(_raw(back)))
    t = emb.packing.table_names.index("u")
    momentum = emb.state_momentum1[emb.packing.row_offsets[t] : emb.packing.row_offsets[t] + SLOTS]
    assert momentum[slot].item() == 0


def test_an_id_gets_its_row_at_its_nth_occurrence_until_then_a_zero_row_counted_by_mean():
    emb = EmbeddingCollection(_tables(True, rows=SLOTS, admit_after=3, init_scale=0.5), FEATURES)
    known, fresh = _raw(torch.tensor([5])), _raw(torch.tensor([9]))
    emb(KeyedJaggedTensor(FEATURES, known.repeat(5), torch.tensor([1, 1, 2, 1])))
    table = emb.dynamic["t"]
    assert (table.find(known) >= 0).all()  # three occurrences in one batch
    assert emb.dynamic["u"].find(known).item() == -1 and emb.dynamic["u"].stats()["candidates"] == 1  # two
    for seen in (1, 2):
        row = emb.table_weight("t")[table.find(known)].clone()  # updated by each backward
        # U: the fresh id alone; T: a mean bag of the admitted id and the fresh one
        kjt = KeyedJaggedTensor(FEATURES, torch.cat([fresh, known, fresh]), torch.tensor([1, 2]))
        pooled = emb(kjt)
        assert table.find(fresh).item() == -1 and emb.dynamic["u"].stats()["candidates"] == 2
        assert torch.equal(pooled[0, :4], torch.zeros(4))
        torch.testing.assert_close(pooled[0, 4:], row[0] / 2)  # the zero row counts in the mean
        pooled.sum().backward()
    assert emb.dynamic["u"].find(fresh).item() == -1
    emb(KeyedJaggedTensor(FEATURES, torch.cat([fresh, fresh]), torch.ones(2, dtype=torch.int64)))
    assert (emb.dynamic["u"].find(fresh) >= 0).all() and emb.dynamic["u"].stats()["candidates"] == 1


def test_a_checkpoint_resumes_exactly_ids_scores_rows_and_optimizer_state():
    def make():
        return EmbeddingCollection(_tables(True, rows=SLOTS, admit_after=2, init_scale=None), FEATURES,
                                   EmbeddingOptimizerConfig("adam", lr=0.05), generator=torch.Generator().manual_seed(3))

    batches = _batches(40, vocab=200, seed=4)
    whole = make()
    _fit(whole, batches, raw=True)
    first = make()
    _fit(first, batches[:23], raw=True)
    saved = io.BytesIO()
    torch.save(first.state_dict(), saved)
    saved.seek(0)
    resumed = make()
    resumed.load_state_dict(torch.load(saved, weights_only=True))
    _fit(resumed, batches[23:], raw=True)
    assert whole.dynamic["u"].stats()["evictions"] > 0
    a, b = whole.state_dict(), resumed.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        if key.endswith("_extra_state"):
            for part in ("ids", "candidates"):
                assert a[key][part].keys() == b[key][part].keys()
                for name, value in a[key][part].items():
                    assert torch.equal(value, b[key][part][name]) if isinstance(value, torch.Tensor) \
                        else value == b[key][part][name], (key, part, name)
            assert a[key]["evictions"] == b[key]["evictions"]
        else:
            assert torch.equal(a[key], b[key]), key


def test_the_ids_of_all_tables_are_placed_by_one_call_each_as_its_own_table_would(monkeypatch):
    """Four dynamic tables (one with two features, one admitting after 2, a static one between them), every
    training batch's ids placed by one placement for all the tables (and one of each admitting table's
    candidates), each table ending as a hash table of its own given its ids batch after batch would: the same
    ids, slots, scores and clock. Some batches hold no id of a table."""
    features = ["A", "B", "S", "C", "D"]
    tables = [TableConfig("ab", 2 * SLOTS, 4, ["A", "B"], dynamic=True), TableConfig("s", 50, 4, ["S"]),
              TableConfig("c", SLOTS, 2, ["C"], dynamic=True),
              TableConfig("d", 3 * SLOTS, 4, ["D"], dynamic=True, admit_after=2)]
    emb = EmbeddingCollection(tables, features, EmbeddingOptimizerConfig("adagrad", lr=0.1))
    alone = {"ab": HashTable(2 * SLOTS, 2), "c": HashTable(SLOTS, 2), "d": HashTable(3 * SLOTS, 2)}
    placements = []
    place = reference.place
    monkeypatch.setattr(reference, "place", lambda *a, **k: placements.append(1) or place(*a, **k))
    gen = torch.Generator().manual_seed(9)
    for step in range(12):
        ids = {f: _raw(torch.randint(0, 600, (int(torch.randint(0, 40, (1,), generator=gen)),), generator=gen))
               for f in features if f != "S"}
        if step % 4 == 1:
            ids["C"] = ids["C"][:0]
        lengths = {f: torch.zeros(8, dtype=torch.int64) for f in features}
        for f, v in ids.items():  # each feature's ids in one bag of its own, the other bags empty
            lengths[f][step % 8] = v.numel()
        kjt = KeyedJaggedTensor(features, torch.cat([ids["A"], ids["B"], torch.zeros(0, dtype=torch.int64),
                                                     ids["C"], ids["D"]]),
                                torch.cat([lengths[f] for f in features]))
        placements.clear()
        emb(kjt).sum().backward()
        assert len(placements) == 2  # the group's one, and the admitting table's candidates'
        admitted = emb.dynamic["d"].find(ids["D"]) >= 0  # placed now, or before
        for name, keys in (("ab", torch.cat([ids["A"], ids["B"]])), ("c", ids["C"]), ("d", ids["D"][admitted])):
            alone[name].find_or_insert(keys, torch.zeros(keys.numel(), 2))
    for name, table in alone.items():
        state, want = emb.dynamic[name].get_extra_state()["ids"], table.state_dict()
        for key in ("keys", "slots", "scores"):
            assert torch.equal(state[key], want[key]), (name, key)
        assert state["clock"] == want["clock"] == 12
        assert torch.equal(state["values"], slot_codes(state["slots"]))  # the checkpoint's format, as before
    assert emb.dynamic["c"].stats()["evictions"] > 0


def _evicting_batches(steps: int, admit_after: int, seed: int):
    """Batches whose U holds 80 ids never seen before, each ``admit_after`` times (placed at once: in a table of 128
    slots they evict ids of the batch before), and 40 ids of a small vocabulary (counted toward admission over the
    batches); T bags of 0 to 2 ids of a vocabulary of 300."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        fresh = torch.randint(0, 2**40, (80,), generator=gen)
        u = torch.cat([fresh.repeat(admit_after), torch.randint(0, 60, (40,), generator=gen)])
        lengths = torch.randint(0, 3, (u.numel(),), generator=gen)
        t = torch.randint(0, 300, (int(lengths.sum()),), generator=gen)
        out.append((u, t, lengths, (u % 2).float()))
    return out


def _train_ahead(emb, batches, ahead: bool) -> tuple[list[torch.Tensor], int]:
    """The pooled outputs of training ``emb`` on ``batches`` (raw ids); ``ahead``: each next batch prefetched before
    this one's lookup and update, the most a side stream can run ahead of the compute stream. Checks, as it goes,
    that a prefetch evicted ids of the batch training (returned last: how many times)."""
    head = torch.linspace(-1, 1, emb.output_dim)
    kjts = [_kjt(u, t, lengths, raw=True) for u, t, lengths, _ in batches]
    outputs, evicting = [], 0
    current = emb.prefetch(kjts[0]) if ahead else None
    for step, (kjt, (_, _, _, label)) in enumerate(zip(kjts, batches)):
        if ahead:
            placed = emb.dynamic["u"].find(kjt.values[: label.numel()]) >= 0
            following = emb.prefetch(kjts[step + 1]) if step + 1 < len(kjts) else None
            evicting += int((placed & (emb.dynamic["u"].find(kjt.values[: label.numel()]) < 0)).any())
            kjt, current = current, following
        pooled = emb(kjt)
        F.binary_cross_entropy_with_logits(pooled @ head, label).backward()
        outputs.append(pooled.detach())
    return outputs, evicting


@pytest.mark.parametrize("kind, admit_after", [("sgd", 1), ("sgd", 3), ("adagrad", 2)])
def test_ids_placed_a_step_ahead_train_as_ids_placed_at_their_lookup(kind, admit_after):
    """Tables of one bucket, batches of 80 new ids and 40 others for U (with admission, the ids not admitted yet find
    no slot): each placement evicts ids of the batch before, whose update is still to come when the placement runs
    ahead. The rows the evicted ids' slots take are started at the lookup, after that update, so every step's
    output, the rows, the optimizer state and the hash tables (ids, slots, scores, candidates, evictions) equal
    those of each batch placed at its lookup, bit for bit."""

    def make():
        return EmbeddingCollection(_tables(True, rows=SLOTS, admit_after=admit_after, init_scale=None), FEATURES,
                                   EmbeddingOptimizerConfig(kind, lr=0.1), generator=torch.Generator().manual_seed(5))

    batches = _evicting_batches(8, admit_after, seed=8)
    at_lookup, ahead = make(), make()
    expected, _ = _train_ahead(at_lookup, batches, ahead=False)
    got, evicting = _train_ahead(ahead, batches, ahead=True)
    assert evicting == len(batches) - 1
    for want, have in zip(expected, got):
        assert torch.equal(want, have)
    a, b = at_lookup.state_dict(), ahead.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        if key.endswith("_extra_state"):
            assert a[key]["evictions"] == b[key]["evictions"] > 0, key
            for part in ("ids", "candidates") if admit_after > 1 else ("ids",):
                for name, value in a[key][part].items():
                    assert torch.equal(value, b[key][part][name]) if isinstance(value, torch.Tensor) \
                        else value == b[key][part][name], (key, part, name)
        else:
            assert torch.equal(a[key], b[key]), key
    if admit_after > 1:
        assert ahead.dynamic["u"].stats()["candidates"] > 0


def test_a_batch_prefetched_before_a_state_dict_was_loaded_is_refused():
    emb = EmbeddingCollection(_tables(True, rows=SLOTS), FEATURES)
    u, t, lengths, _ = _batches(1)[0]
    prefetched = emb.prefetch(_kjt(u, t, lengths, raw=True))
    emb.load_state_dict(emb.state_dict())
    with pytest.raises(RuntimeError, match="prefetched before a state dict was loaded"):
        emb(prefetched)
    emb(emb.prefetch(_kjt(u, t, lengths, raw=True))).sum().backward()


def test_dynamic_table_settings_are_checked():
    with pytest.raises(ValueError, match="multiple of 128"):
        TableConfig("u", 1000, 4, ["U"], dynamic=True)
    with pytest.raises(ValueError, match="admit_after"):
        TableConfig("u", 1000, 4, ["U"], admit_after=2)
    assert DYNAMIC_ROWS == SLOTS


def test_a_collection_with_dynamic_tables_is_not_host_cached():
    from pipeline.errors import UserError
    from pipeline.modules.cached_collection import HostCachedCollection

    tables = [*_tables(True, rows=SLOTS), TableConfig("s", 50, 4, ["S"])]
    with pytest.raises(UserError, match=r"tables \['s'\] would be host-cached beside the dynamic tables u, t"):
        HostCachedCollection(tables, [*FEATURES, "S"], {"s": 10})


@pytest.mark.gpu
def test_on_a_gpu_ids_take_the_slots_and_rows_they_take_on_the_cpu():
    def make(device):
        return EmbeddingCollection(_tables(True, rows=SLOTS, admit_after=2, init_scale=None), FEATURES,
                                   EmbeddingOptimizerConfig("adagrad", lr=0.1),
                                   generator=torch.Generator().manual_seed(3)).to(device)

    cpu, gpu = make("cpu"), make("cuda")
    assert gpu.dynamic["u"].ids.backend == "cuda" and gpu.backend.name == "cuda"
    head = torch.linspace(-1, 1, cpu.output_dim)
    for u, t, lengths, label in _batches(25, vocab=300, seed=6):
        for emb in (cpu, gpu):
            kjt = _kjt(u, t, lengths, raw=True).to(emb.weights.device)
            out = emb(kjt) @ head.to(emb.weights.device)
            F.binary_cross_entropy_with_logits(out, label.to(out.device)).backward()
    assert cpu.dynamic["t"].stats()["evictions"] > 0
    for name in ("u", "t"):
        a, b = cpu.dynamic[name].get_extra_state(), gpu.dynamic[name].get_extra_state()
        assert a["evictions"] == b["evictions"]
        for part in ("ids", "candidates"):
            for key in ("keys", "slots", "scores"):
                assert torch.equal(a[part][key], b[part][key].cpu()), (name, part, key)
        # the fused CUDA update sums each row's gradients in another order than the reference
        torch.testing.assert_close(gpu.table_weight(name).cpu(), cpu.table_weight(name), atol=1e-5, rtol=1e-4)
