"""The hash table's layout and operations in plain torch: the CPU path and the oracle of the CUDA kernels.

A table of ``capacity`` slots (a multiple of ``SLOTS``) is four tensors (:class:`Storage`): per slot a
digest byte (0: empty), a 64-bit key, a 64-bit score, and a row of ``dim`` floats. A key's hash
``h = mix64(key)`` picks its bucket (``SLOTS`` consecutive slots) and its digest; a key lives in its
bucket or nowhere. No key value is reserved, so key 0 and ``0xFFFF_FFFF_FFFF_FFFF`` (-1) are keys like
any other: emptiness is the digest byte's, and a key whose hash has a low byte of 0 gets digest 1.

A writing call (:func:`place`) first finds its keys that are in the table: they keep their slots, get
their scores, and no key of the call evicts them. Then it places its new keys one at a time in the order
of their hashes (:func:`order_keys`, unsigned): the bucket's lowest empty slot, else, if the key's score
is higher than the lowest score among the bucket's slots the call has not touched, that slot (the
lowest slot on ties), whose key is evicted; else nowhere. Where a key goes depends only on the keys of
its own bucket before it, so the kernels give every bucket to one warp that walks its keys in that
order, and this reference walks all buckets at once in rounds (round ``r``: the ``r``-th new key of
each bucket). The rules are in ``docs/HASHTABLE.md``.

Several tables can share one storage (a group, :mod:`.group`): table ``t`` holds buckets ``bucket_starts[t]`` to
``bucket_starts[t + 1] - 1`` of it, and a call given each key's table (``tables``) places or finds every key among
its own table's buckets, as that table's own call would, with slots counted from its table's first.

Example::

    storage = Storage.empty(capacity=1024, dim=8, device="cpu")
    placed = place(storage, keys, None, policy=LRU, clock=1, assign=True)
    write_rows(storage.values, placed.writers, rows)
    values, found = find(storage, keys)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

SLOTS = 128  # slots per bucket; as SLOTS in hashtable.cu
LRU, LFU, CUSTOM = 0, 1, 2  # score policies; as in hashtable.cu
CHUNK = 1 << 14  # keys (or buckets) per gather of whole buckets: bounds the memory of one step
_MIX1 = 0xFF51AFD7ED558CCD - 2**64  # MurmurHash3's 64-bit finalizer constants, as int64
_MIX2 = 0xC4CEB9FE1A85EC53 - 2**64
_SIGN = -(2**63)
_MAX_SCORE = 2**63 - 1


@dataclass
class Storage:
    """The slots of a table; slot ``s`` is in bucket ``s // SLOTS``."""

    digests: torch.Tensor  # uint8 [capacity]: 0 for an empty slot, else its key's digest (1..255)
    keys: torch.Tensor  # int64 [capacity]
    scores: torch.Tensor  # int64 [capacity]
    values: torch.Tensor  # float32 [capacity, dim]

    @classmethod
    def empty(cls, capacity: int, dim: int, device: torch.device | str) -> Storage:
        return cls(torch.zeros(capacity, dtype=torch.uint8, device=device),
                   torch.zeros(capacity, dtype=torch.int64, device=device),
                   torch.zeros(capacity, dtype=torch.int64, device=device),
                   torch.zeros(capacity, dim, dtype=torch.float32, device=device))

    @property
    def num_buckets(self) -> int:
        return self.digests.numel() // SLOTS

    def part(self, start: int, end: int) -> Storage:
        """Slots ``start`` to ``end - 1`` (whole buckets), as a storage of their own that shares these tensors."""
        return Storage(self.digests[start:end], self.keys[start:end], self.scores[start:end], self.values[start:end])


class Placement(NamedTuple):
    """Where a writing call put each key of its batch (position ``p`` is the batch's ``p``-th key)."""

    slots: torch.Tensor  # int64 [n]: the key's slot after the call (in its table), -1 where it could not be placed
    was_new: torch.Tensor  # bool [n]: the key was not in the table before the call
    writers: torch.Tensor  # int64 [n]: the slot of the storage the row given at position p goes to, -1 for none
    evicted: torch.Tensor  # bool [n]: true at the first position of a key that evicted another
    evicted_keys: torch.Tensor  # int64 [n]: the key evicted, where ``evicted``
    evicted_scores: torch.Tensor  # int64 [n]: its score, where ``evicted``
    evictions: torch.Tensor  # int64 [tables]: how many keys the call evicted from each table (one: a lone table)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical shift of int64 bit patterns (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(keys: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 64-bit finalizer of int64 keys, as int64 bit patterns (a bijection: distinct keys
    have distinct hashes)."""
    h = keys ^ _shift_right(keys, 33)
    h = h * _MIX1
    h = h ^ _shift_right(h, 33)
    h = h * _MIX2
    return h ^ _shift_right(h, 33)


def bucket_of(h: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """The bucket of hashes ``h``: the high 32 bits scaled to ``[0, num_buckets)``."""
    return (_shift_right(h, 32) * num_buckets) >> 32


def digest_of(h: torch.Tensor) -> torch.Tensor:
    """The digest of hashes ``h``: the low byte, or 1 where it is 0 (0 marks an empty slot)."""
    low = h & 0xFF
    return torch.where(low == 0, 1, low).to(torch.uint8)


def order_keys(keys: torch.Tensor) -> torch.Tensor:
    """int64 keys whose signed order is the unsigned order of the keys' hashes: sorted, they are grouped
    by bucket (ascending) and equal keys are neighbours."""
    return mix64(keys) ^ _SIGN


def home_buckets(h: torch.Tensor, num_buckets: int, tables: torch.Tensor | None = None,
                 bucket_starts: torch.Tensor | None = None) -> torch.Tensor:
    """The bucket of the storage that hashes ``h`` live in: of a lone table's ``num_buckets``, or, given ``tables``
    (each hash's table) and ``bucket_starts`` (int64 ``[tables + 1]``), among the buckets of table ``tables[i]``."""
    if tables is None:
        return bucket_of(h, num_buckets)
    table = tables.long()
    first = bucket_starts[table]
    return first + bucket_of(h, bucket_starts[table + 1] - first)


def _bucket_slots(buckets: torch.Tensor) -> torch.Tensor:
    """``[m, SLOTS]``: the slots of each of ``buckets``."""
    return buckets[:, None] * SLOTS + torch.arange(SLOTS, device=buckets.device)


def _locate_in(storage: Storage, keys: torch.Tensor, buckets: torch.Tensor) -> torch.Tensor:
    """int64 ``[n]``: the slot of the storage holding each key in bucket ``buckets[i]``, -1 where it is not there."""
    out = torch.full_like(keys, -1)
    for start in range(0, keys.numel(), CHUNK):
        part = keys[start : start + CHUNK]
        slots = _bucket_slots(buckets[start : start + CHUNK])
        match = (storage.digests[slots] == digest_of(mix64(part))[:, None]) & (storage.keys[slots] == part[:, None])
        pos = match.to(torch.uint8).argmax(1, keepdim=True)
        out[start : start + CHUNK] = torch.where(match.any(1), slots.gather(1, pos).squeeze(1), -1)
    return out


def _in_table(slots: torch.Tensor, tables: torch.Tensor | None, bucket_starts: torch.Tensor | None) -> torch.Tensor:
    """Slots of the storage (-1: none) as slots of each one's table, counted from the table's first."""
    if tables is None:
        return slots
    return torch.where(slots >= 0, slots - bucket_starts[tables.long()] * SLOTS, -1)


def locate(storage: Storage, keys: torch.Tensor, tables: torch.Tensor | None = None,
           bucket_starts: torch.Tensor | None = None) -> torch.Tensor:
    """int64 ``[n]``: the slot of each key, -1 where it is not in the table (with ``tables``: in its table, see
    :func:`home_buckets`)."""
    slots = _locate_in(storage, keys, home_buckets(mix64(keys), storage.num_buckets, tables, bucket_starts))
    return _in_table(slots, tables, bucket_starts)


def find(storage: Storage, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 ``[n, dim]``: each key's row, zeros where it is missing; bool ``[n]``: found)."""
    slots = locate(storage, keys)
    found = slots >= 0
    values = storage.values[slots.clamp(min=0)]
    return values.masked_fill_(~found[:, None], 0.0), found


def read_rows(values: torch.Tensor, slots: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """``[n, dim]``: row ``slots[p]`` of ``values``, or ``fallback[p]`` where ``slots[p] < 0``."""
    return torch.where((slots >= 0)[:, None], values[slots.clamp(min=0)], fallback)


def take_rows(values: torch.Tensor, slots: torch.Tensor, taken: torch.Tensor) -> torch.Tensor:
    """``[n, dim]``: row ``slots[p]`` of ``values`` where ``taken[p]`` (there ``slots[p] >= 0``); the other rows are
    unspecified (zeros here)."""
    return torch.where(taken[:, None], values[slots.clamp(min=0)], 0.0)


def write_rows(values: torch.Tensor, writers: torch.Tensor, rows: torch.Tensor) -> None:
    """``values[writers[p]] = rows[p]`` where ``writers[p] >= 0`` (distinct slots)."""
    mask = writers >= 0
    values[writers[mask]] = rows[mask]


def sort_order(keys: torch.Tensor, tables: torch.Tensor | None = None) -> torch.Tensor:
    """The positions of ``keys`` by table (given ``tables``), then by hash (unsigned), a key's repeats in batch order:
    so each bucket's keys are together in hash order. Two stable sorts, not one of a key packing both: the hash
    takes all 64 bits."""
    _, order = torch.sort(order_keys(keys), stable=True)
    if tables is not None:
        order = order[torch.sort(tables[order], stable=True).indices]
    return order


def place(storage: Storage, keys: torch.Tensor, scores: torch.Tensor | None, policy: int, clock: int,
          assign: bool, tables: torch.Tensor | None = None, bucket_starts: torch.Tensor | None = None) -> Placement:
    """Decide the slot of every key of a writing call and write the slots' digests, keys and scores (not
    the rows: the caller copies what was evicted first, then writes them with :func:`write_rows`).

    ``assign``: insert-or-assign (a key's row and custom score come from its last position) or, if
    false, find-or-insert (from its first position, and the row is written only for a key that is new).
    The score a key gets: ``LRU``: ``clock``; ``LFU``: its score before (0 if new) plus its
    occurrences in the batch; ``CUSTOM``: ``scores`` at the position above. With ``tables`` and
    ``bucket_starts``, the tables of a group at once (see :func:`home_buckets`): a key and its repeats in
    one table are a key of that table alone.
    """
    n = keys.numel()
    order = sort_order(keys, tables)
    ordered = keys[order]
    run_start = torch.ones(n, dtype=torch.bool, device=keys.device)
    run_start[1:] = ordered[1:] != ordered[:-1]
    if tables is not None:
        ordered_tables = tables[order]
        run_start[1:] |= ordered_tables[1:] != ordered_tables[:-1]
    run_end = torch.ones_like(run_start)
    run_end[:-1] = run_start[1:]
    first, last = order[run_start], order[run_end]
    starts = run_start.nonzero().squeeze(1)
    count = torch.diff(starts, append=starts.new_tensor([n]))
    source = last if assign else first
    h = mix64(keys[first])
    run_table = tables[first] if tables is not None else None
    run = _Runs(keys[first], count, None if scores is None else scores[source],
                home_buckets(h, storage.num_buckets, run_table, bucket_starts), digest_of(h))
    segment, _ = _groups(run.bucket)  # the runs of one bucket are consecutive
    touched = torch.zeros(int(segment[-1]) + 1 if n else 0, SLOTS, dtype=torch.bool, device=keys.device)

    # The keys in the table first: each keeps its slot, gets its score, and no key of the call evicts it.
    run.slot = _locate_in(storage, run.keys, run.bucket)
    run.found = run.slot >= 0
    held = run.found.nonzero().squeeze(1)
    slot = run.slot[held]
    if policy == LRU:
        storage.scores[slot] = clock
    elif policy == LFU:
        storage.scores[slot] += run.count[held]
    else:
        storage.scores[slot] = run.given[held]
    touched[segment[held], slot % SLOTS] = True
    # Then the new keys, one at a time in each bucket: round r places the r-th new key of every bucket.
    new = (~run.found).nonzero().squeeze(1)
    new_segment = segment[new]
    rank = torch.arange(new.numel(), device=keys.device) - _groups(new_segment)[1]
    for r in range(int(rank.max()) + 1 if rank.numel() else 0):
        for part in (rank == r).nonzero().squeeze(1).split(CHUNK):
            _place_new(storage, run, new[part], new_segment[part], touched, policy, clock)

    run_of = run_start.cumsum(0) - 1  # the run of each ordered position
    slots = torch.empty_like(keys)
    slots[order] = _in_table(run.slot, run_table, bucket_starts)[run_of]
    was_new = torch.empty_like(run_start)
    was_new[order] = ~run.found[run_of]
    writes = run.slot >= 0 if assign else (run.slot >= 0) & ~run.found
    writers = torch.full_like(keys, -1)
    writers[source[writes]] = run.slot[writes]
    evicted = torch.zeros_like(run_start)
    evicted[first] = run.evicted
    evicted_keys, evicted_scores = torch.zeros_like(keys), torch.zeros_like(keys)
    evicted_keys[first], evicted_scores[first] = run.evicted_key, run.evicted_score
    evictions = torch.zeros(1 if tables is None else bucket_starts.numel() - 1, dtype=torch.int64, device=keys.device)
    evictions.index_add_(0, run_table.long() if tables is not None else torch.zeros_like(run.keys), run.evicted.long())
    return Placement(slots, was_new, writers, evicted, evicted_keys, evicted_scores, evictions)


def _groups(sorted_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each element of ``sorted_ids``, its group (0, 1, ...: runs of equal values) and where that starts."""
    new = torch.ones_like(sorted_ids, dtype=torch.bool)
    new[1:] = sorted_ids[1:] != sorted_ids[:-1]
    group = new.cumsum(0) - 1
    return group, new.nonzero().squeeze(1)[group]


@dataclass
class _Runs:
    """The distinct keys of a call in hash order (each a run of equal keys once sorted), and what each got."""

    keys: torch.Tensor
    count: torch.Tensor  # occurrences in the batch
    given: torch.Tensor | None  # custom score
    bucket: torch.Tensor
    digest: torch.Tensor
    slot: torch.Tensor = field(init=False)  # -1: not placed
    found: torch.Tensor = field(init=False)  # in the table before the call
    evicted: torch.Tensor = field(init=False)
    evicted_key: torch.Tensor = field(init=False)
    evicted_score: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.evicted = torch.zeros_like(self.keys, dtype=torch.bool)
        self.evicted_key = torch.zeros_like(self.keys)
        self.evicted_score = torch.zeros_like(self.keys)


def _place_new(storage: Storage, run: _Runs, part: torch.Tensor, segment: torch.Tensor, touched: torch.Tensor,
               policy: int, clock: int) -> None:
    """Place the new keys ``part`` (each of a different bucket), as one step of each bucket's walk."""
    slots = _bucket_slots(run.bucket[part])
    digests, scores = storage.digests[slots], storage.scores[slots]
    empty = digests == 0
    has_empty = empty.any(1)
    evictable = torch.where(touched[segment], _MAX_SCORE, scores)
    lowest = evictable.min(1).values
    pos = torch.where(has_empty, empty.to(torch.uint8).argmax(1), evictable.argmin(1))
    if policy == LRU:
        score = torch.full_like(lowest, clock)
    else:
        score = run.count[part] if policy == LFU else run.given[part]
    stored = has_empty | (score > lowest)
    evict = stored & ~has_empty
    slot = slots.gather(1, pos[:, None]).squeeze(1)

    run.slot[part] = torch.where(stored, slot, -1)
    run.evicted[part] = evict
    run.evicted_key[part] = torch.where(evict, storage.keys[slot], 0)
    run.evicted_score[part] = torch.where(evict, lowest, 0)
    written = slot[stored]
    storage.digests[written] = run.digest[part][stored]
    storage.keys[written] = run.keys[part][stored]
    storage.scores[written] = score[stored]
    touched[segment[stored], pos[stored]] = True
