"""Dynamic embedding tables: rows for raw 64-bit ids, given as the ids come, taken back by eviction.

A table declared ``TableConfig(..., dynamic=True)`` takes any int64 id (a hashed string, a user id)
and keeps ``rows`` slots (its capacity, a multiple of 128) in the collection's flat storage, where the
fused lookups and the sparse optimizer read and update them as they do a static table's rows. A
:class:`~pipeline.kernels.hashtable.HashTable` of the same capacity maps each id to its slot:

- in training (a forward that will be followed by the fused update), the batch's ids are placed with
  ``find_or_insert``: an id in the table keeps its slot and becomes the most recent (LRU); a new id
  gets a slot of its bucket, the empty one or the least recently used one, whose id is evicted. With
  ``admit_after=N`` an id gets a slot at its N-th occurrence in training batches only; until then it
  is counted in a second hash table of candidates (LRU too: the candidates seen least recently leave
  it when a bucket is full, and start over);
- a new id's row starts from the table's init, drawn from the id itself (uniform in
  ``±init_scale``, by default ``±rows**-0.5``, from a hash of the id and the table's seed): the same
  row wherever and whenever the id comes, on every device. Its optimizer state starts at zero. An
  evicted id loses its row and its state; when it comes back it is a new id (admission counts again);
- outside training, ids are only looked up: nothing is inserted or counted.

An id without a slot (not admitted yet, or its bucket full of ids of this batch) reads a zero row: it
adds nothing to its bag and gets no update, and a ``mean`` bag still counts it. The collection drops
such ids from the bags it gives the ops (whose dynamic slots therefore pool sums) and divides the
``mean`` slots by their whole bags' lengths after the lookup.

The ids of all the dynamic tables of a collection are mapped in one pass (:class:`DynamicTables`), every
size known on the host: their hash tables are made together (a
:class:`~pipeline.kernels.hashtable.HashTableGroup`), so one call places the ids of them all (on a GPU, one
sort by hash, one by table and one placement kernel), and a training step waits for the device once for
them all, three times with admission. On a GPU the mapping runs on the collection's side stream
(:mod:`pipeline.modules.side_stream`), and those waits are for that stream only.

A batch's mapping is two parts. The placement (:meth:`DynamicTables.place`: the hash tables' find-or-insert,
the admission counts, the counts read back, the ids replaced by slots, the new rows drawn) changes the hash
tables and nothing else. The start of the new rows (:meth:`DynamicTables.start_rows`: their weights written,
their optimizer state zeroed in the collection's flat tensors) is queued on the compute stream when the batch
is looked up. So the placement may run a step ahead, while the batch before still computes
(:meth:`~pipeline.modules.collection.EmbeddingCollection.prefetch`): batch ``i``'s placement on the side stream
beside step ``i - 1``'s forward, backward and update. That gives the same rows and hash tables as placing each
batch at its lookup, because:

- step ``i - 1`` reads and updates the slots its own placement gave it, held in its bags; batch ``i``'s
  placement changes which id holds a slot, not the rows, so it cannot change what step ``i - 1`` computes;
- an id of batch ``i - 1`` that batch ``i``'s placement evicts gives its slot to a new id of batch ``i``. The
  new id's row is written at batch ``i``'s lookup, on the compute stream, so after step ``i - 1``'s update of
  that slot: the update lands on the old id's row, which the new row then replaces, as when batch ``i`` is
  placed after step ``i - 1``. Written at the placement instead, the new row would take step ``i - 1``'s
  update of the old id;
- the placements run in the batches' order, each once (admission counts each batch once), and the rows they
  draw depend on the ids alone, so the hash tables and the new rows are those of the batches placed at their
  lookups;
- a batch is placed when the training loop asks for it (after the step before was queued, evaluated and
  checkpointed), so an evaluation or a checkpoint between two steps sees the tables as a loop without the
  step ahead does.

The hash tables' content (ids, slots, scores, the clock) is the module's extra state, so a
checkpoint of the collection holds it beside the rows and their optimizer state, and a resumed run
places ids as the uninterrupted one does.

Example::

    tables = [TableConfig("t_user", 1 << 20, 16, ["user"], dynamic=True, admit_after=2)]
    emb = EmbeddingCollection(tables, ["user"])
    emb(KeyedJaggedTensor.from_lists(["user"], [[[-7361], [2**40 + 5]]]))   # any int64 id
    emb.dynamic["t_user"].stats()             # {"ids": ..., "evictions": ..., "candidates": ...}
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import nn

from pipeline.kernels.hashtable import SLOTS, HashTable, HashTableGroup
from pipeline.kernels.hashtable.reference import bucket_of, mix64
from pipeline.modules.side_stream import SideStream

_CODE = 1 << 24  # a slot is kept in its hash table row as two floats below 2**24, exact in float32
_SEED_MIX = 0x5851F42D4C957F2D  # odd: spreads (seed, column) over the hash's input
_OWNER_SALT = 0x2545F4914F6CDD1D  # the owner's hash differs from the bucket's, so a rank fills all its buckets


def column_hashes(seeds: torch.Tensor, dim: int) -> torch.Tensor:
    """int64 ``[len(seeds), dim]``: what the row of an id is drawn from besides the id, per table seed and column."""
    return mix64(torch.arange(dim, device=seeds.device) * _SEED_MIX + seeds[:, None] * 2 + 1)


def draw_rows(keys: torch.Tensor, hashes: torch.Tensor, bound: float | torch.Tensor) -> torch.Tensor:
    """float32 ``[n, dim]``: the rows ids ``keys`` start from, uniform in ``±bound`` (a number, or per id ``[n, 1]``),
    from 24 bits of a hash of each id and its column's ``hashes`` (``[dim]``, or per id ``[n, dim]``)."""
    bits = mix64(mix64(keys)[:, None] ^ hashes)
    uniform = ((bits >> 40) & ((1 << 24) - 1)).float() / (1 << 24)  # 24 random bits in [0, 1)
    return (uniform * 2 - 1) * bound


def slot_codes(slots: torch.Tensor) -> torch.Tensor:
    """float32 ``[n, 2]``: the row of a dynamic table's hash table at each slot, the slot itself, exactly (two floats
    below 2**24): what its state dict holds beside each id, as ``find`` of the id would answer it."""
    return torch.stack([slots // _CODE, slots % _CODE], 1).float()


def owner_rank(keys: torch.Tensor, world: int) -> torch.Tensor:
    """int64 ``[n]``: the rank that holds each id's row when its dynamic table is sharded row-wise over ``world``
    ranks (a hash of the id, independent of the bucket it takes there)."""
    return bucket_of(mix64(keys ^ _OWNER_SALT), world)


class NewRows(NamedTuple):
    """The rows that ids placed anew in tables of one dim group take: where, and what they start from."""

    group: int  # the dim group of the collection's flat storage
    rows: torch.Tensor  # int64 [n]: the rows of the collection's row-wise state (table offset + slot)
    weights: torch.Tensor  # float32 [n, dim]: their weights, drawn from each table's init


class DynamicTable(nn.Module):
    """The ids of one dynamic table (``config.rows`` slots) and their slots; ``seed`` draws new rows. Its hash table
    ``ids`` and its count of ``evictions`` are its collection's (:class:`DynamicTables`), which places the ids of
    all its tables at once."""

    def __init__(self, config, seed: int, ids: HashTable, evictions: torch.Tensor) -> None:
        super().__init__()
        self.name, self.capacity, self.dim = config.name, config.rows, config.dim
        self.admit_after = config.admit_after
        self.bound = config.init_scale if config.init_scale is not None else config.rows ** -0.5
        self.register_buffer("seed", torch.tensor(seed, dtype=torch.int64, device=ids.device))
        self._hold(ids, evictions)

    def _hold(self, ids: HashTable, evictions: torch.Tensor) -> None:
        """Take ``ids`` (empty, its rows the codes of their own slots, :func:`slot_codes`) and ``evictions`` (a zero
        on the same device, counted in place), and new empty admission candidates there."""
        self.ids, self.evictions = ids, evictions
        self.candidates = HashTable(self.capacity, 1, device=ids.device, policy="lru") if self.admit_after > 1 else None

    def stats(self) -> dict[str, int]:
        """``ids``: ids holding a slot; ``evictions``: ids evicted so far; ``candidates``: ids counted
        toward admission."""
        return {"ids": self.ids.size(), "evictions": int(self.evictions),
                "candidates": self.candidates.size() if self.candidates is not None else 0}

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        """int64 ``[n]``: each id's slot, -1 where it has none. Changes nothing."""
        return self.ids.locate(keys)

    def count(self, keys: torch.Tensor) -> torch.Tensor:
        """Training with ``admit_after > 1``: count ids ``keys`` (ids without a slot, repeats allowed) as candidates.
        bool ``[n]``: the id's occurrences, this batch's included, reach ``admit_after``: it is admitted now and
        leaves the candidates. Reads nothing from the device."""
        ordered = torch.sort(keys).values
        now = torch.searchsorted(ordered, keys, right=True) - torch.searchsorted(ordered, keys)
        before, _ = self.candidates.find(keys)  # 0 where not a candidate
        seen = before + now[:, None]  # a candidate that finds no slot keeps this batch's occurrences only
        self.candidates.insert_or_assign(keys, seen)
        ready = seen[:, 0] >= self.admit_after
        self.candidates.erase(keys, where=ready)
        return ready

    def init_rows(self, keys: torch.Tensor) -> torch.Tensor:
        """float32 ``[n, dim]``: the rows ids ``keys`` start from, uniform in ``±bound`` from a hash of
        each id, its column and the seed."""
        return draw_rows(keys, column_hashes(self.seed.to(keys.device).view(1), self.dim), self.bound)

    def content(self, views: dict[str, torch.Tensor]) -> dict:
        """What the table holds, by id, for a table of any capacity to take (:meth:`load_content`); ``views``:
        the table's rows and optimizer state by slot (see :func:`content_of`)."""
        return content_of(self.get_extra_state(), views)

    def load_content(self, views: dict[str, torch.Tensor], contents: Sequence[dict],
                     owned: Callable[[torch.Tensor], torch.Tensor] | None = None) -> int:
        """Replace the table's ids by those of ``contents`` (:meth:`content` of tables of any capacity) that
        ``owned`` keeps (a bool mask of keys; default all), their rows and state written to ``views``. Each id
        takes a slot of its bucket, the most recent first; those a full bucket cannot take are dropped, and
        counted in the result. Scores and the clock are kept, so ids leave in the order they would have;
        ``evictions`` is the sum of the contents' where all their ids are taken, else it starts at 0."""
        ids = _merged(contents, owned)
        slots = _place_as_loaded(self.ids, ids, slot_codes)
        kept = slots >= 0
        for name, view in views.items():
            view.zero_()
            view[slots[kept]] = ids["rows"][name][kept].to(view.device, view.dtype)
        if self.candidates is not None:
            candidates = _merged([c["candidates"] for c in contents if "candidates" in c], owned)
            _place_as_loaded(self.candidates, candidates, None)
        self.evictions.fill_(sum(int(c["evictions"]) for c in contents) if owned is None else 0)
        return int((~kept).sum())

    def get_extra_state(self) -> dict:
        state = {"ids": self.ids.state_dict(), "evictions": int(self.evictions)}
        if self.candidates is not None:
            state["candidates"] = self.candidates.state_dict()
        return state

    def set_extra_state(self, state: dict) -> None:
        self.ids.load_state_dict(state["ids"])
        self.evictions.fill_(int(state["evictions"]))
        if self.candidates is not None:
            self.candidates.load_state_dict(state["candidates"])


def content_of(state: dict, views: dict[str, torch.Tensor]) -> dict:
    """A dynamic table's content by id from its extra state and ``views`` (its rows and optimizer state by
    slot, as a checkpoint holds them): ``keys``, their ``scores``, ``rows`` (each of ``views`` at their
    slots), the ``clock`` and ``evictions``, and the admission ``candidates`` (keys, scores, clock, counts)."""
    ids = state["ids"]
    out = {"keys": ids["keys"], "scores": ids["scores"], "clock": ids["clock"], "evictions": state["evictions"],
           "rows": {name: view[ids["slots"].to(view.device)] for name, view in views.items()}}
    if "candidates" in state:
        c = state["candidates"]
        out["candidates"] = {"keys": c["keys"], "scores": c["scores"], "clock": c["clock"],
                             "rows": {"count": c["values"]}}
    return out


def _merged(contents: Sequence[dict], owned: Callable[[torch.Tensor], torch.Tensor] | None) -> dict:
    """The ids of several :meth:`DynamicTable.content` (or of their candidates) that ``owned`` keeps, as one."""
    keep = [owned(c["keys"]) if owned is not None else torch.ones_like(c["keys"], dtype=torch.bool) for c in contents]

    def cat(part: Callable[[dict], torch.Tensor]) -> torch.Tensor:
        return torch.cat([part(c)[m] for c, m in zip(contents, keep)])

    return {"keys": cat(lambda c: c["keys"]), "scores": cat(lambda c: c["scores"]),
            "clock": max(int(c["clock"]) for c in contents),
            "rows": {name: cat(lambda c, name=name: c["rows"][name]) for name in contents[0]["rows"]}}


def _place_as_loaded(table: HashTable, ids: dict, code: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
    """Load ``ids`` (keys, scores, clock, rows) into ``table``, each in the first free slot of its bucket taken
    in order of recency (ties: by key), a bucket's overflow dropped; its rows are ``code(slot)``, or the ids'
    ``count`` row. Returns each id's slot, -1 where dropped."""
    keys = ids["keys"].to(table.device)
    scores = ids["scores"].to(table.device)
    bucket = bucket_of(mix64(keys), table.capacity // SLOTS)
    order = torch.argsort(keys)
    order = order[torch.argsort(-scores[order], stable=True)]
    order = order[torch.argsort(bucket[order], stable=True)]
    ordered = bucket[order]
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[1:] = ordered[1:] != ordered[:-1]
    position = torch.arange(keys.numel(), device=keys.device)
    start = torch.where(first, position, 0).cummax(0).values if keys.numel() else position
    within = position - start
    slots = torch.full_like(keys, -1)
    slots[order] = torch.where(within < SLOTS, ordered * SLOTS + within, -1)
    kept = slots >= 0
    values = code(slots[kept]) if code is not None else ids["rows"]["count"].to(table.device)[kept]
    table.load_state_dict({"keys": keys[kept], "values": values, "scores": scores[kept], "slots": slots[kept],
                           "capacity": table.capacity, "dim": table.dim, "policy": table.policy,
                           "clock": ids["clock"]})
    return slots


class DynamicTables(nn.Module):
    """The dynamic tables of a collection: their ids to slots in the slot-major bags the ops take.

    Their hash tables are made together, one :class:`~pipeline.kernels.hashtable.HashTableGroup`, so a batch's
    ids of all the tables are placed by one call (:meth:`place`): the ids of the dynamic slots in slot order (a
    table's slots are consecutive), each with its table, one sort and one placement kernel for them all. The rows
    of the ids placed anew in the tables of one dim are then drawn together, and the ids without a slot left out;
    :meth:`start_rows` writes the new rows later, at the batch's lookup (see the module for why). Nothing in it
    waits for the device but one read of a few numbers for all the tables (how many rows to start, how many ids
    have no slot), and, with admission, two reads before it (how many ids to count, how many are admitted)."""

    def __init__(self, tables: Sequence, packing, feature_names: Sequence[str], seeds: Sequence[int]) -> None:
        super().__init__()
        self.packing = packing
        self.ids, self.evictions = _hash_tables([t.rows for t in tables], torch.device("cpu"))
        self.tables = nn.ModuleDict({t.name: DynamicTable(t, seed, ids, self.evictions[i])
                                     for i, (t, seed, ids) in enumerate(zip(tables, seeds, self.ids.tables))})
        self.table_ids = [packing.table_names.index(t.name) for t in tables]
        self.table_slots = [[s for s in range(packing.num_slots) if packing.slot_table[s] == t] for t in self.table_ids]
        self.slots = [s for slots in self.table_slots for s in slots]  # ascending: the packing's tables in order
        dynamic = set(self.slots)
        # The slots in runs of consecutive dynamic or static ones: (first, end, dynamic).
        edges = [s for s in range(1, packing.num_slots) if (s in dynamic) != (s - 1 in dynamic)]
        self.runs = [(a, e, a in dynamic) for a, e in zip([0, *edges], [*edges, packing.num_slots])]
        # The dim groups of the flat storage that hold dynamic tables: the new rows of a group are drawn and written
        # together.
        self.groups = [g for g in packing.groups if g.dim in {packing.dims[t] for t in self.table_ids}]
        mean = {t.name for t in tables if t.pooling == "mean"}
        self.mean_slots = [s for s in self.slots if packing.table_names[packing.slot_table[s]] in mean]
        self.mean_keys = [list(feature_names).index(packing.slot_features[s]) for s in self.mean_slots]

    def __getitem__(self, name: str) -> DynamicTable:
        return self.tables[name]

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        tables = list(self.tables.values())
        device = tables[0].seed.device
        if device != self.ids.device:
            states = [table.get_extra_state() for table in tables]
            self.ids, self.evictions = _hash_tables([table.capacity for table in tables], device)
            for i, (table, ids, state) in enumerate(zip(tables, self.ids.tables, states)):
                table._hold(ids, self.evictions[i])
                table.set_extra_state(state)
        return out

    def place(self, values: torch.Tensor, offsets: torch.Tensor, batch_size: int, train: bool,
              slot_counts: Sequence[int] | None, side: SideStream) -> tuple[torch.Tensor, torch.Tensor, list[NewRows]]:
        """``values`` / ``offsets`` (slot-major) with the ids of dynamic slots replaced by their slots, the ids
        without one left out, and the rows that ids placed anew take (for :meth:`start_rows`). ``train``: ids are
        placed (new ones admitted), else only looked up (no new rows). ``slot_counts``: each slot's number of ids,
        when known on the host. Changes the hash tables only, never the collection's rows; reads the device through
        ``side`` (the collection's :class:`~pipeline.modules.side_stream.SideStream`, on whose stream it runs)."""
        b = batch_size
        if slot_counts is not None:
            starts = [0, *itertools.accumulate(slot_counts)]
        else:
            starts = side.read(offsets[::b], "dynamic starts").tolist() if b else [0] * (self.packing.num_slots + 1)
        keys = _cat([values[starts[first] : starts[end]] for first, end, dynamic in self.runs if dynamic])
        on = self._device_tensors(values.device)
        owner = torch.repeat_interleave(on["slot_tables"], _slot_sizes(offsets, b)[on["slots"]],
                                        output_size=keys.numel()) if b else torch.zeros_like(keys)  # each id's table
        if train:
            slots, was_new = self._place(keys, owner, starts, side)
            new = was_new & (slots >= 0)
            new_by_group = [new] if len(self.groups) == 1 else \
                [new & (on["table_groups"][owner] == group) for group in range(len(self.groups))]
        else:
            slots, new_by_group = self.ids.locate(keys, owner), []
        lost, *started = _read(side, [(slots < 0).sum(), *(new.sum() for new in new_by_group)])
        new_rows = [self._new_rows(group, keys, slots, owner, _positions(new, count))
                    for group, (new, count) in enumerate(zip(new_by_group, started)) if count]

        parts, at = [], 0
        for first, end, dynamic in self.runs:
            size = starts[end] - starts[first]
            parts.append(slots[at : at + size] if dynamic else values[starts[first] : starts[end]])
            at += size if dynamic else 0
        mapped = _cat(parts)
        if not lost:
            return mapped, offsets, new_rows
        dynamic = torch.repeat_interleave(on["slot_dynamic"], _slot_sizes(offsets, b), output_size=mapped.numel())
        keep = ~dynamic | (mapped >= 0)
        kept = torch.cat([offsets.new_zeros(1), torch.cumsum(keep, 0)])  # ids kept before each position
        return mapped[_positions(keep, mapped.numel() - lost)], kept[offsets], new_rows

    def _place(self, keys: torch.Tensor, owner: torch.Tensor, starts: list[int],
               side: SideStream) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slots, was_new)`` of the ids ``keys`` of tables ``owner`` (as :meth:`HashTableGroup.find_or_insert`
        gives them), placed by one call of the tables' group, an id not admitted yet without a slot. The tables
        that admit after N occurrences first look their ids up and count the others: two reads of the device for
        all of them (how many to count, how many to place)."""
        tables = list(self.tables.values())
        admitting = [i for i, table in enumerate(tables) if table.candidates is not None]
        if not admitting:
            placed = self.ids.find_or_insert(keys, owner)
            self.evictions += placed.evictions
            return placed.slots, placed.was_new
        bounds = [0, *itertools.accumulate(starts[slots[-1] + 1] - starts[slots[0]] for slots in self.table_slots)]
        placing = (self.ids.locate(keys, owner) >= 0) | self._device_tensors(keys.device)["admit_all"][owner]
        for i, fresh in zip(admitting, _read(side, [(~placing[bounds[i] : bounds[i + 1]]).sum() for i in admitting])):
            mine = placing[bounds[i] : bounds[i + 1]]  # a view: the admitted ids join the placed in place
            at = _positions(~mine, fresh)
            mine.index_put_((at,), tables[i].count(keys[bounds[i] : bounds[i + 1]][at]))
        [count] = _read(side, [placing.sum()])
        at = _positions(placing, count)
        placed = self.ids.find_or_insert(keys[at], owner[at])
        self.evictions += placed.evictions
        return (torch.full_like(keys, -1).index_put_((at,), placed.slots),
                torch.zeros_like(placing).index_put_((at,), placed.was_new))

    def _new_rows(self, group: int, keys: torch.Tensor, slots: torch.Tensor, owner: torch.Tensor,
                  at: torch.Tensor) -> NewRows:
        """The rows of the ids at positions ``at``, which took their slot in this batch in tables of dim group
        ``group`` (a repeated id each time), drawn from each table's init."""
        on = self._device_tensors(keys.device)
        table = owner[at]
        hashes = column_hashes(torch.stack([t.seed for t in self.tables.values()]), self.groups[group].dim)
        weights = draw_rows(keys[at], hashes[table], on["bounds"][table][:, None])
        return NewRows(group, on["row_offsets"][table] + slots[at], weights)

    def start_rows(self, new_rows: Sequence[NewRows], flat: dict[str, torch.Tensor]) -> None:
        """Write ``new_rows`` (of :meth:`place`) into ``flat`` (the collection's weights and optimizer state by name,
        laid out by ``packing``), on the current stream: each row's weights, its optimizer state zero."""
        packing = self.packing
        for group, row, weights in new_rows:
            stored = self.groups[group]
            for name, tensor in flat.items():
                if packing.total_rows != packing.total_elements and tensor.numel() == packing.total_rows:
                    tensor.index_fill_(0, row, 0)
                    continue
                view = tensor[stored.start : stored.start + stored.rows * stored.dim].view(stored.rows, stored.dim)
                if name in ("weight", "master_weights"):
                    view.index_put_((row - stored.row_start,), weights.to(view.dtype))
                else:
                    view.index_fill_(0, row - stored.row_start, 0)

    def _device_tensors(self, device: torch.device) -> dict:
        """What the mapping indexes with, made once per device (a tensor made from host values in a step would
        wait for the device)."""

        def make() -> dict:
            p, tables = self.packing, list(self.tables.values())

            def tensor(values, dtype=torch.int64):
                return torch.tensor(values, dtype=dtype, device=device)

            dims = [g.dim for g in self.groups]
            return {"slot_dynamic": tensor([s in self.slots for s in range(p.num_slots)], torch.bool),
                    "slots": tensor(self.slots), "slot_tables": tensor([i for i, s in enumerate(self.table_slots)
                                                                        for _ in s]),
                    "table_groups": tensor([dims.index(p.dims[t]) for t in self.table_ids]),
                    "admit_all": tensor([t.candidates is None for t in tables], torch.bool),
                    "row_offsets": tensor([p.row_offsets[t] for t in self.table_ids]),
                    "bounds": tensor([t.bound for t in tables], torch.float32),
                    "mean_slots": tensor(self.mean_slots), "mean_keys": tensor(self.mean_keys),
                    "columns": tensor([s for s in range(p.num_slots) for _ in range(p.slot_dims[s])])}

        return self.packing.cached(("dynamic", str(device)), make)

    def pool_means(self, pooled: torch.Tensor, lengths: torch.Tensor, batch_size: int) -> torch.Tensor:
        """``pooled`` with the ``mean`` slots of dynamic tables (pooled as sums) divided by their whole bags'
        lengths (``lengths``: the batch's, key-major)."""
        if not self.mean_slots or not batch_size:
            return pooled
        on = self._device_tensors(pooled.device)
        scale = torch.ones(self.packing.num_slots, batch_size, device=pooled.device)
        whole = lengths.view(-1, batch_size)[self._device_tensors(lengths.device)["mean_keys"]]
        scale[on["mean_slots"]] = 1 / whole.to(pooled.device).float().clamp(min=1)
        return pooled * scale.t()[:, on["columns"]]


def _hash_tables(capacities: list[int], device: torch.device) -> tuple[HashTableGroup, torch.Tensor]:
    """The hash tables of dynamic tables of ``capacities``, made together on ``device``, empty, each row the code
    of its own slot (:func:`slot_codes`); and their evictions, int64 zeros."""
    group = HashTableGroup(capacities, 2, device, "lru")
    for table in group.tables:
        slots = torch.arange(table.capacity, device=device)
        table.values[:, 0], table.values[:, 1] = slots // _CODE, slots % _CODE
    return group, torch.zeros(len(capacities), dtype=torch.int64, device=device)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _read(side: SideStream, numbers: list[torch.Tensor]) -> list[int]:
    """Numbers computed on the device, read to the host at once (one wait for the side stream)."""
    return side.read(torch.stack(numbers), "dynamic counts").tolist() if numbers else []


def _positions(mask: torch.Tensor, count: int) -> torch.Tensor:
    """int64 ``[count]``: the positions where ``mask`` is true, ascending, ``count`` being their number known on
    the host: written in place rather than selected, which would read the number from the device."""
    out = torch.empty(count + 1, dtype=torch.int64, device=mask.device)  # the last one takes the other positions
    out[torch.where(mask, torch.cumsum(mask, 0) - 1, count)] = torch.arange(mask.numel(), device=mask.device)
    return out[:count]


def _slot_sizes(offsets: torch.Tensor, batch_size: int) -> torch.Tensor:
    """int64 ``[slots]`` on the device: each slot's number of ids."""
    starts = offsets[::batch_size]
    return starts[1:] - starts[:-1]
