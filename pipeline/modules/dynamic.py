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
size known on the host: a training step waits for the device once for them all, three times with
admission, and on a GPU the hash table's kernels do the placing.

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

import torch
from torch import nn

from pipeline.kernels.hashtable import SLOTS, HashTable
from pipeline.kernels.hashtable.reference import bucket_of, mix64

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
    """float32 ``[n, 2]``: the row of a dynamic table's hash table that holds each slot, exactly (two floats below
    2**24), so that ``find`` answers the slot."""
    return torch.stack([slots // _CODE, slots % _CODE], 1).float()


def owner_rank(keys: torch.Tensor, world: int) -> torch.Tensor:
    """int64 ``[n]``: the rank that holds each id's row when its dynamic table is sharded row-wise over ``world``
    ranks (a hash of the id, independent of the bucket it takes there)."""
    return bucket_of(mix64(keys ^ _OWNER_SALT), world)


class DynamicTable(nn.Module):
    """The ids of one dynamic table (``config.rows`` slots) and their slots; ``seed`` draws new rows."""

    def __init__(self, config, seed: int) -> None:
        super().__init__()
        self.name, self.capacity, self.dim = config.name, config.rows, config.dim
        self.admit_after = config.admit_after
        self.bound = config.init_scale if config.init_scale is not None else config.rows ** -0.5
        self.register_buffer("seed", torch.tensor(seed, dtype=torch.int64))  # moves with .to(): the tables follow
        self.evictions = torch.zeros((), dtype=torch.int64)  # counted on the device, read by stats()
        self.ids = self._table(2)
        self.candidates = self._table(1) if self.admit_after > 1 else None

    def _table(self, dim: int) -> HashTable:
        return HashTable(self.capacity, dim, device=self.seed.device, policy="lru")

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        if self.seed.device != self.ids.device:
            state = self.get_extra_state()
            self.ids = self._table(2)
            self.candidates = self._table(1) if self.admit_after > 1 else None
            self.set_extra_state(state)
        return out

    def stats(self) -> dict[str, int]:
        """``ids``: ids holding a slot; ``evictions``: ids evicted so far; ``candidates``: ids counted
        toward admission."""
        return {"ids": self.ids.size(), "evictions": int(self.evictions),
                "candidates": self.candidates.size() if self.candidates is not None else 0}

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        """int64 ``[n]``: each id's slot, -1 where it has none. Changes nothing."""
        codes, found = self.ids.find(keys)  # an id's row of ``ids`` holds its slot (see slot_codes)
        slots = codes[:, 0].long() * _CODE + codes[:, 1].long()
        return torch.where(found, slots, -1)

    def insert(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Training: place admitted ids ``keys`` (repeats allowed) with one ``find_or_insert``. ``(slots [n],
        was_new [n])``: each id's slot (-1: its bucket is full of ids of this call), and whether the id was new to
        the table (where it has a slot, it took it now: its row and optimizer state are the caller's to start, and
        the slot's row of ``ids`` is the caller's to write, :func:`slot_codes`). Reads nothing from the device."""
        placed = self.ids.find_or_insert(keys, torch.zeros(keys.numel(), 2, device=keys.device))
        self.evictions += placed.evicted.count
        return placed.slots, placed.was_new

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
        self.evictions = torch.tensor(sum(int(c["evictions"]) for c in contents) if owned is None else 0,
                                      device=self.seed.device)
        return int((~kept).sum())

    def get_extra_state(self) -> dict:
        state = {"ids": self.ids.state_dict(), "evictions": int(self.evictions)}
        if self.candidates is not None:
            state["candidates"] = self.candidates.state_dict()
        return state

    def set_extra_state(self, state: dict) -> None:
        self.ids.load_state_dict(state["ids"])
        self.evictions = torch.tensor(int(state["evictions"]), device=self.seed.device)
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

    A batch is mapped in one pass over all the tables, every size known on the host: a table's ids are pieces
    of the batch (cut by each slot's number of ids, which comes with the batch or else is read from the device),
    placed by one ``find_or_insert`` of its hash table; the rows of the ids placed anew in the tables of one dim
    are then drawn and written together, and the ids without a slot left out. Nothing in it waits for the
    device but one read of a few numbers for all the tables (how many rows to start, how many ids have no
    slot), and, with admission, two reads before it (how many ids to count, how many are admitted)."""

    def __init__(self, tables: Sequence, packing, feature_names: Sequence[str], seeds: Sequence[int]) -> None:
        super().__init__()
        self.packing = packing
        self.tables = nn.ModuleDict({t.name: DynamicTable(t, seed) for t, seed in zip(tables, seeds)})
        self.table_ids = [packing.table_names.index(t.name) for t in tables]
        self.table_slots = [[s for s in range(packing.num_slots) if packing.slot_table[s] == t] for t in self.table_ids]
        self.slots = sorted(s for slots in self.table_slots for s in slots)
        # The dim groups of the flat storage that hold dynamic tables, with those tables (positions in ``tables``):
        # the new rows of a group are drawn and written together.
        self.groups = [(g, [i for i, t in enumerate(self.table_ids) if packing.dims[t] == g.dim])
                       for g in packing.groups if g.dim in {packing.dims[t] for t in self.table_ids}]
        mean = {t.name for t in tables if t.pooling == "mean"}
        self.mean_slots = [s for s in self.slots if packing.table_names[packing.slot_table[s]] in mean]
        self.mean_keys = [list(feature_names).index(packing.slot_features[s]) for s in self.mean_slots]

    def __getitem__(self, name: str) -> DynamicTable:
        return self.tables[name]

    def map_ids(self, values: torch.Tensor, offsets: torch.Tensor, batch_size: int, train: bool,
                flat: dict[str, torch.Tensor], slot_counts: Sequence[int] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``values`` / ``offsets`` (slot-major) with the ids of dynamic slots replaced by their slots, the ids
        without one left out. ``train``: ids are placed (new ones admitted, their rows and optimizer state started
        in ``flat``: the collection's weights and optimizer state by name, laid out by ``packing``), else only
        looked up. ``slot_counts``: each slot's number of ids, when known on the host."""
        b = batch_size
        if slot_counts is not None:
            starts = [0, *itertools.accumulate(slot_counts)]
        else:
            starts = offsets[::b].tolist() if b else [0] * (self.packing.num_slots + 1)
        tables = list(self.tables.values())
        keys = [_cat([values[starts[s] : starts[s + 1]] for s in slots]) for slots in self.table_slots]
        if train:
            slots, was_new = self._place(tables, keys)
            new_by_group = [_cat([was_new[i] for i in members]) & (_cat([slots[i] for i in members]) >= 0)
                            for _, members in self.groups]
        else:
            slots, new_by_group = [table.find(k) for table, k in zip(tables, keys)], []
        lost, *started = _read([(_cat(slots) < 0).sum(), *(n.sum() for n in new_by_group)])
        for group, (new, count) in enumerate(zip(new_by_group, started)):
            if count:
                self._start_rows(group, keys, slots, new, count, offsets, b, flat)

        parts, used = [], [0] * len(tables)
        table_of = {s: i for i, slots_of in enumerate(self.table_slots) for s in slots_of}
        for s in range(self.packing.num_slots):
            if s in table_of:
                i, size = table_of[s], starts[s + 1] - starts[s]
                parts.append(slots[i][used[i] : used[i] + size])
                used[i] += size
            else:
                parts.append(values[starts[s] : starts[s + 1]])
        mapped = _cat(parts)
        if not lost:
            return mapped, offsets
        dynamic = torch.repeat_interleave(self._device_tensors(values.device)["slot_dynamic"],
                                          _slot_sizes(offsets, b), output_size=mapped.numel())
        keep = ~dynamic | (mapped >= 0)
        kept = torch.cat([offsets.new_zeros(1), torch.cumsum(keep, 0)])  # ids kept before each position
        return mapped[_positions(keep, mapped.numel() - lost)], kept[offsets]

    def _place(self, tables: list[DynamicTable], keys: list[torch.Tensor]) -> tuple[list, list]:
        """Per table, ``(slots, was_new)`` of its ids (see :meth:`DynamicTable.insert`), an id not admitted yet
        without a slot; each placed id's row of its table's ``ids`` written with its slot. The tables that admit
        after N occurrences first look their ids up, count the others and place the admitted ones: two reads of
        the device for all of them."""
        admitting = [i for i, table in enumerate(tables) if table.candidates is not None]
        admitted: dict[int, torch.Tensor] = {}
        if admitting:
            known = {i: tables[i].find(keys[i]) >= 0 for i in admitting}
            for i, fresh in zip(admitting, _read([(~known[i]).sum() for i in admitting])):
                at = _positions(~known[i], fresh)
                known[i] = known[i].index_put((at,), tables[i].count(keys[i][at]))
            admitted = {i: _positions(known[i], count)
                        for i, count in zip(admitting, _read([known[i].sum() for i in admitting]))}
        slots, was_new = [], []
        for i, (table, k) in enumerate(zip(tables, keys)):
            if i not in admitted:
                placed, fresh = table.insert(k)
            else:
                at = admitted[i]
                placed_at, fresh_at = table.insert(k[at])
                placed = torch.full_like(k, -1).index_put((at,), placed_at)
                fresh = torch.zeros_like(k, dtype=torch.bool).index_put((at,), fresh_at)
            slots.append(placed)
            was_new.append(fresh)
        # Each placed id's row holds its slot, rewritten where it did already; an id without a slot writes slot 0's
        # own code to slot 0, so no two positions write different rows.
        held = _cat(slots).clamp(min=0)
        codes, start = slot_codes(held), 0
        for table, placed in zip(tables, slots):
            table.ids.values[held[start : start + placed.numel()]] = codes[start : start + placed.numel()]
            start += placed.numel()
        return slots, was_new

    def _start_rows(self, group: int, keys: list[torch.Tensor], slots: list[torch.Tensor], new: torch.Tensor,
                    count: int, offsets: torch.Tensor, batch_size: int, flat: dict[str, torch.Tensor]) -> None:
        """Start the rows of the ids that took their slot in this batch in the tables of dim group ``group``
        (``new``: where, over those tables' ids; ``count`` of them, a repeated id each time): drawn from each
        table's init, their optimizer state zero."""
        stored, members = self.groups[group]
        group_slots, slot_member, row_offsets, bounds = self._device_tensors(new.device)["groups"][group]
        at = _positions(new, count)
        ends = torch.cumsum(_slot_sizes(offsets, batch_size)[group_slots], 0)  # of each slot's ids in the group's
        member = slot_member[torch.searchsorted(ends, at, right=True)]
        tables = list(self.tables.values())
        hashes = column_hashes(torch.stack([tables[i].seed for i in members]), stored.dim)
        rows = draw_rows(_cat([keys[i] for i in members])[at], hashes[member], bounds[member][:, None])
        row = row_offsets[member] + _cat([slots[i] for i in members])[at]  # of the collection's row-wise state
        packing = self.packing
        for name, tensor in flat.items():
            if packing.total_rows != packing.total_elements and tensor.numel() == packing.total_rows:
                tensor.index_fill_(0, row, 0)
                continue
            view = tensor[stored.start : stored.start + stored.rows * stored.dim].view(stored.rows, stored.dim)
            if name in ("weight", "master_weights"):
                view.index_put_((row - stored.row_start,), rows.to(view.dtype))
            else:
                view.index_fill_(0, row - stored.row_start, 0)

    def _device_tensors(self, device: torch.device) -> dict:
        """What the mapping indexes with, made once per device (a tensor made from host values in a step would
        wait for the device)."""

        def make() -> dict:
            p, tables = self.packing, list(self.tables.values())

            def tensor(values, dtype=torch.int64):
                return torch.tensor(values, dtype=dtype, device=device)

            groups = []  # per dim group: its tables' slots in order, each slot's table, the tables' rows and bounds
            for _, members in self.groups:
                groups.append((tensor([s for i in members for s in self.table_slots[i]]),
                               tensor([j for j, i in enumerate(members) for _ in self.table_slots[i]]),
                               tensor([p.row_offsets[self.table_ids[i]] for i in members]),
                               tensor([tables[i].bound for i in members], torch.float32)))
            return {"slot_dynamic": tensor([s in self.slots for s in range(p.num_slots)], torch.bool), "groups": groups,
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


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _read(numbers: list[torch.Tensor]) -> list[int]:
    """Numbers computed on the device, read to the host at once (one wait for the device)."""
    return torch.stack(numbers).tolist() if numbers else []


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
