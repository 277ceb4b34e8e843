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

from collections.abc import Callable, Sequence

import torch
from torch import nn

from pipeline.kernels.hashtable import SLOTS, HashTable
from pipeline.kernels.hashtable.reference import bucket_of, mix64

_CODE = 1 << 24  # a slot is kept in its hash table row as two floats below 2**24, exact in float32
_SEED_MIX = 0x5851F42D4C957F2D  # odd: spreads (seed, column) over the hash's input
_OWNER_SALT = 0x2545F4914F6CDD1D  # the owner's hash differs from the bucket's, so a rank fills all its buckets


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
        self.evictions = 0
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
        return {"ids": self.ids.size(), "evictions": self.evictions,
                "candidates": self.candidates.size() if self.candidates is not None else 0}

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        """int64 ``[n]``: each id's slot, -1 where it has none. Changes nothing."""
        codes, found = self.ids.find(keys)
        slots = codes[:, 0].long() * _CODE + codes[:, 1].long()
        return torch.where(found, slots, -1)

    def place(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Training: ``(slots [n], new_slots, new_keys)``: each id's slot (-1: none), and the slots that
        took a new id (distinct), with those ids, whose rows and optimizer state the caller starts."""
        unique, inverse, counts = torch.unique(keys, return_inverse=True, return_counts=True)
        admitted = self._admitted(unique, counts)
        placed = self.ids.find_or_insert(unique[admitted], torch.zeros(int(admitted.sum()), 2, device=keys.device))
        self.evictions += placed.evicted.keys.numel()
        slots = torch.full_like(unique, -1)
        slots[admitted] = placed.slots
        new = placed.was_new & (placed.slots >= 0)
        new_slots = placed.slots[new]
        self.ids.values[new_slots] = torch.stack([new_slots // _CODE, new_slots % _CODE], 1).float()
        return slots[inverse], new_slots, unique[admitted][new]

    def _admitted(self, unique: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """bool ``[n]`` over distinct ids (``counts``: their occurrences in the batch): in the table, or
        seen ``admit_after`` times with this batch."""
        if self.candidates is None:
            return torch.ones_like(unique, dtype=torch.bool)
        _, known = self.ids.find(unique)
        fresh = unique[~known]
        placed = self.candidates.find_or_insert(fresh, torch.zeros(fresh.numel(), 1, device=fresh.device))
        counted = placed.slots >= 0
        seen = placed.values[:, 0] + counts[~known]  # a candidate without a slot has this batch's sightings only
        self.candidates.values[placed.slots[counted], 0] = seen[counted]
        ready = seen >= self.admit_after
        self.candidates.erase(fresh[ready])
        admitted = known.clone()
        admitted[~known] = ready
        return admitted

    def init_rows(self, keys: torch.Tensor) -> torch.Tensor:
        """float32 ``[n, dim]``: the rows ids ``keys`` start from, uniform in ``±bound`` from a hash of
        each id, its column and the seed."""
        columns = torch.arange(self.dim, device=keys.device) * _SEED_MIX + self.seed.to(keys.device) * 2 + 1
        bits = mix64(mix64(keys)[:, None] ^ mix64(columns)[None, :])
        uniform = ((bits >> 40) & ((1 << 24) - 1)).float() / (1 << 24)  # 24 random bits in [0, 1)
        return (uniform * 2 - 1) * self.bound

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
        slots = _place_as_loaded(self.ids, ids, lambda s: torch.stack([s // _CODE, s % _CODE], 1).float())
        kept = slots >= 0
        for name, view in views.items():
            view.zero_()
            view[slots[kept]] = ids["rows"][name][kept].to(view.device, view.dtype)
        if self.candidates is not None:
            candidates = _merged([c["candidates"] for c in contents if "candidates" in c], owned)
            _place_as_loaded(self.candidates, candidates, None)
        self.evictions = sum(int(c["evictions"]) for c in contents) if owned is None else 0
        return int((~kept).sum())

    def get_extra_state(self) -> dict:
        state = {"ids": self.ids.state_dict(), "evictions": self.evictions}
        if self.candidates is not None:
            state["candidates"] = self.candidates.state_dict()
        return state

    def set_extra_state(self, state: dict) -> None:
        self.ids.load_state_dict(state["ids"])
        self.evictions = int(state["evictions"])
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
    """The dynamic tables of a collection: their ids to slots in the slot-major bags the ops take."""

    def __init__(self, tables: Sequence, packing, feature_names: Sequence[str], seeds: Sequence[int]) -> None:
        super().__init__()
        self.packing = packing
        self.tables = nn.ModuleDict({t.name: DynamicTable(t, seed) for t, seed in zip(tables, seeds)})
        self.table_ids = [packing.table_names.index(t.name) for t in tables]
        dynamic = set(self.table_ids)
        self.slots = [s for s in range(packing.num_slots) if packing.slot_table[s] in dynamic]
        mean = {t.name for t in tables if t.pooling == "mean"}
        self.mean_slots = [s for s in self.slots if packing.table_names[packing.slot_table[s]] in mean]
        self.mean_keys = [list(feature_names).index(packing.slot_features[s]) for s in self.mean_slots]

    def __getitem__(self, name: str) -> DynamicTable:
        return self.tables[name]

    def map_ids(self, values: torch.Tensor, offsets: torch.Tensor, batch_size: int, train: bool,
                views: Callable[[str], dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``values`` / ``offsets`` (slot-major) with the ids of dynamic slots replaced by their slots, the
        ids without one left out. ``train``: ids are placed (new ones admitted, their rows and optimizer state
        started in ``views(table)``, the collection's ``table_views``), else only looked up."""
        b = batch_size
        bounds = offsets[:: b].tolist() if b else [0] * (self.packing.num_slots + 1)
        values = values.clone()
        keep = torch.ones_like(values, dtype=torch.bool)
        for t, table in zip(self.table_ids, self.tables.values()):
            pieces = [(bounds[s], bounds[s + 1]) for s in self.slots if self.packing.slot_table[s] == t]
            keys = torch.cat([values[lo:hi] for lo, hi in pieces])
            if train:
                slots, new_slots, new_keys = table.place(keys)
                if new_slots.numel():  # new ids' rows from the table's init, their optimizer state zero
                    rows = table.init_rows(new_keys)
                    for name, view in views(table.name).items():
                        view[new_slots] = rows.to(view.dtype) if name in ("weight", "master_weights") else 0
            else:
                slots = table.find(keys)
            at = 0
            for lo, hi in pieces:
                values[lo:hi] = slots[at : at + hi - lo]
                at += hi - lo
            keep[torch.cat([torch.arange(lo, hi, device=values.device) for lo, hi in pieces])] = slots >= 0
        if bool(keep.all()):
            return values, offsets
        lengths = offsets[1:] - offsets[:-1]
        dropped = torch.searchsorted(offsets, (~keep).nonzero().squeeze(1), right=True) - 1
        lengths = lengths - torch.bincount(dropped, minlength=lengths.numel())
        return values[keep], torch.cat([offsets.new_zeros(1), torch.cumsum(lengths, 0)])

    def pool_means(self, pooled: torch.Tensor, lengths: torch.Tensor, batch_size: int) -> torch.Tensor:
        """``pooled`` with the ``mean`` slots of dynamic tables (pooled as sums) divided by their whole bags'
        lengths (``lengths``: the batch's, key-major)."""
        if not self.mean_slots or not batch_size:
            return pooled
        scale = torch.ones(self.packing.num_slots, batch_size, device=pooled.device)
        keys = torch.tensor(self.mean_keys, device=lengths.device)
        scale[self.mean_slots] = 1 / lengths.view(-1, batch_size)[keys].to(pooled.device).float().clamp(min=1)
        columns = torch.repeat_interleave(torch.arange(self.packing.num_slots, device=pooled.device),
                                          torch.tensor(self.packing.slot_dims, device=pooled.device))
        return pooled * scale.t()[:, columns]
