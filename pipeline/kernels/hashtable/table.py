"""``HashTable``: a fixed-capacity table of 64-bit keys and float rows in one device's memory.

With ``backend="auto"`` the operations run the kernels of ``hashtable.cu`` (:mod:`.launcher`) on CUDA
where :func:`pipeline.kernels.kernels_problem` finds nothing missing, else the plain-torch
:mod:`.reference` on the table's device; ``"cuda"`` and ``"torch"`` ask for one of them. Both leave
the very same state after any sequence of calls. The layout, the order a call applies its keys in,
and the score policies are in ``docs/HASHTABLE.md``.

Example::

    table = HashTable(capacity=1 << 20, dim=64, device="cuda", policy="lru")
    placed = table.find_or_insert(ids, init=torch.randn(len(ids), 64, device="cuda") * 0.01)
    rows = table.values[placed.slots]           # the rows of the batch's ids, by slot
    write_back(placed.evicted)                  # keys, rows and scores pushed out of full buckets
    evictions += placed.evicted.count           # their number, on the device
    values, found = table.find(ids)
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from pipeline.errors import BadInputError
from pipeline.kernels.hashtable import reference
from pipeline.kernels.hashtable.reference import CUSTOM, LFU, LRU, SLOTS, Storage

POLICIES = {"lru": LRU, "lfu": LFU, "custom": CUSTOM}
BACKENDS = ("auto", "cuda", "torch")


class Evicted:
    """What a call pushed out of full buckets, in the batch order of the keys that took the slots: ``keys`` (int64
    ``[e]``), ``values`` (float32 ``[e, dim]``) and ``scores`` (int64 ``[e]``), selected on first use, which reads
    ``e`` from the device; ``count`` (``e`` as an int64 tensor on the device) reads nothing."""

    def __init__(self, taken: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor,
                 count: torch.Tensor) -> None:
        self._taken = taken  # bool [n]: at the batch position of each key that evicted another
        self._padded = keys, values, scores  # per batch position, meaningful where taken
        self.count = count

    @functools.cached_property
    def _positions(self) -> torch.Tensor:
        return self._taken.nonzero().squeeze(1)

    @property
    def keys(self) -> torch.Tensor:
        return self._padded[0][self._positions]

    @property
    def values(self) -> torch.Tensor:
        return self._padded[1][self._positions]

    @property
    def scores(self) -> torch.Tensor:
        return self._padded[2][self._positions]

    def __iter__(self):
        return iter((self.keys, self.values, self.scores))


class Inserted(NamedTuple):
    slots: torch.Tensor  # int64 [n]: each key's slot, -1 where its bucket had no room for it
    evicted: Evicted


class FoundOrInserted(NamedTuple):
    slots: torch.Tensor  # int64 [n]: each key's slot, -1 where its bucket had no room for it
    values: torch.Tensor  # float32 [n, dim]: each key's row after the call (its init row where not placed)
    was_new: torch.Tensor  # bool [n]: the key was not in the table before the call
    evicted: Evicted


@functools.cache
def _kernels_problem() -> str | None:
    from pipeline.kernels import kernels_problem

    return kernels_problem()


class HashTable:
    """``capacity`` slots (a multiple of ``SLOTS``) of an int64 key, an int64 score and ``dim`` floats.

    ``policy`` sets the score of every key a writing call touches: ``"lru"``: the call's number
    (``clock``, 1 for the first writing call); ``"lfu"``: how many times the key was given to writing
    calls; ``"custom"``: the ``scores`` given with it. A full bucket gives the slot of its lowest score
    to a new key of a strictly higher score. :attr:`values` is the ``[capacity, dim]`` row tensor that
    the slots index. ``backend``: ``"auto"``, ``"cuda"`` (the kernels) or ``"torch"`` (the reference).
    ``storage``: the table's slots, ``capacity`` of them of ``dim`` floats on ``device``, empty (a part of a
    :class:`~pipeline.kernels.hashtable.group.HashTableGroup`'s); new ones by default.
    """

    def __init__(self, capacity: int, dim: int, device: torch.device | str = "cpu", policy: str = "lru",
                 backend: str = "auto", storage: Storage | None = None) -> None:
        check_settings(capacity, dim, policy, backend)
        device = torch.device(device)
        problem = f"the CUDA kernels need a CUDA device, got {device}" if device.type != "cuda" \
            else _kernels_problem()
        if backend == "cuda" and problem:
            raise ValueError(f"hash table: backend 'cuda' cannot run here: {problem}")
        self.capacity, self.dim, self.policy = capacity, dim, policy
        self.clock = 0
        self._storage = storage if storage is not None else Storage.empty(capacity, dim, device)
        self.device = self._storage.digests.device  # "cuda" becomes "cuda:0", as the tensors given will say
        if backend == "torch" or problem:
            self._impl = reference
        else:
            from pipeline.kernels.hashtable import launcher

            self._impl = launcher

    @property
    def backend(self) -> str:
        """``"cuda"`` (the kernels) or ``"torch"`` (the reference)."""
        return "torch" if self._impl is reference else "cuda"

    @property
    def values(self) -> torch.Tensor:
        """float32 ``[capacity, dim]``: the row of slot ``s`` is ``values[s]``."""
        return self._storage.values

    def find(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 ``[n, dim]``: each key's row, zeros where it is missing; bool ``[n]``: found).
        Changes nothing, scores included."""
        keys = self._keys(keys)
        return self._impl.find(self._storage, keys)

    def locate(self, keys: torch.Tensor) -> torch.Tensor:
        """int64 ``[n]``: each key's slot, -1 where it is missing. Changes nothing, scores included."""
        return self._impl.locate(self._storage, self._keys(keys))

    def insert_or_assign(self, keys: torch.Tensor, values: torch.Tensor,
                         scores: torch.Tensor | None = None) -> Inserted:
        """Give each key its row of ``values`` ``[n, dim]`` (a repeated key: its last one, and its last
        score), inserting the missing keys where their bucket has an empty slot or a lower score to evict."""
        keys = self._keys(keys)
        placed, evicted = self._place(keys, self._rows(values, keys, "values"), scores, assign=True)
        return Inserted(placed.slots, evicted)

    def find_or_insert(self, keys: torch.Tensor, init: torch.Tensor,
                       scores: torch.Tensor | None = None) -> FoundOrInserted:
        """Each key's slot and row, inserting the missing keys as :meth:`insert_or_assign` does, with their
        row of ``init`` ``[n, dim]`` (a repeated key: its first one, and its first score). The training
        path: rows of new ids start from ``init``."""
        keys = self._keys(keys)
        init = self._rows(init, keys, "init")
        placed, evicted = self._place(keys, init, scores, assign=False)
        values = self._impl.read_rows(self._storage.values, placed.slots, init)
        return FoundOrInserted(placed.slots, values, placed.was_new, evicted)

    def erase(self, keys: torch.Tensor, where: torch.Tensor | None = None) -> torch.Tensor:
        """Remove the keys, or those of them at the positions where bool ``where`` ``[n]`` is true (a batch of a
        size known on the host, not a selection of one, which reads the device); bool ``[n]``: the key was in the
        table (and is removed)."""
        slots = self._impl.locate(self._storage, self._keys(keys))
        if where is not None:
            slots = torch.where(where, slots, -1)
        if slots.numel():
            # One write per position, no selection: a position without a key there writes 0 to the highest slot
            # cleared, or, where none is, slot 0's own digest back.
            last = slots.max()
            target = torch.where(slots >= 0, slots, last.clamp(min=0))
            self._storage.digests[target] = torch.where(last >= 0, 0, self._storage.digests[target])
        return slots >= 0

    def size(self) -> int:
        """How many keys the table holds."""
        return int(torch.count_nonzero(self._storage.digests))

    def occupied(self) -> torch.Tensor:
        """int64 ``[size]``: the slots that hold a key, ascending."""
        return self._storage.digests.nonzero().squeeze(1)

    def export(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keys int64 ``[size]``, values float32 ``[size, dim]``, scores int64 ``[size]``), by slot."""
        slots = self.occupied()
        return self._storage.keys[slots], self._storage.values[slots], self._storage.scores[slots]

    def clear(self) -> None:
        """Remove every key (the clock is kept, so later LRU scores stay above earlier ones)."""
        self._storage.digests.zero_()

    def state_dict(self) -> dict:
        """Every key with its slot, row and score, and the settings they need: loads into a table of the
        same capacity, dim and policy, into the same slots."""
        keys, values, scores = self.export()
        return {"keys": keys, "values": values, "scores": scores, "slots": self.occupied(), "capacity": self.capacity,
                "dim": self.dim, "policy": self.policy, "clock": self.clock}

    def load_state_dict(self, state: dict) -> None:
        """Replace the table's content by ``state`` (from :meth:`state_dict`), checked first."""
        mine = {"capacity": self.capacity, "dim": self.dim, "policy": self.policy}
        for name, value in mine.items():
            if state.get(name) != value:
                raise BadInputError(f"hash table state: holds a table of {name} {state.get(name)!r}, this table has "
                                    f"{value!r}; load it into a table made with the same {name}")
        keys, values, scores, slots = (state.get(k) for k in ("keys", "values", "scores", "slots"))
        n = keys.numel() if isinstance(keys, torch.Tensor) else -1
        expected = {"keys": (keys, torch.int64, (n,)), "scores": (scores, torch.int64, (n,)),
                    "slots": (slots, torch.int64, (n,)), "values": (values, torch.float32, (n, self.dim))}
        for name, (t, dtype, shape) in expected.items():
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != shape:
                found = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise BadInputError(f"hash table state: {name!r} must be {dtype} {shape} (one per key), got {found}")
        keys, slots = keys.to(self.device), slots.to(self.device)
        h = reference.mix64(keys)
        home = reference.bucket_of(h, self._storage.num_buckets)
        if n and (slots.min() < 0 or slots.max() >= self.capacity or not torch.equal(slots // SLOTS, home)):
            raise BadInputError("hash table state: a key is not in a slot of its bucket; the state is damaged or "
                                "from another table")
        if torch.unique(slots).numel() != n or torch.unique(keys).numel() != n:
            raise BadInputError("hash table state: a key or a slot appears twice; the state is damaged")
        self.clear()
        self._storage.digests[slots] = reference.digest_of(h)
        self._storage.keys[slots] = keys
        self._storage.scores[slots] = scores.to(self.device)
        self._storage.values[slots] = values.to(self.device)
        self.clock = int(state.get("clock", 0))

    def _place(self, keys: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor | None,
               assign: bool) -> tuple[reference.Placement, Evicted]:
        scores = self._scores(scores, keys)
        self.clock += 1
        placed = self._impl.place(self._storage, keys, scores, POLICIES[self.policy], self.clock, assign)
        # an evicting key's slot still holds the evicted row: copied out before the new rows are written
        evicted = Evicted(placed.evicted, placed.evicted_keys,
                          self._impl.take_rows(self._storage.values, placed.slots, placed.evicted), placed.evicted_scores,
                          placed.evictions[0])
        self._impl.write_rows(self._storage.values, placed.writers, rows)
        return placed, evicted

    def _keys(self, keys: torch.Tensor) -> torch.Tensor:
        return checked_keys(keys, self.device)

    def _rows(self, rows: torch.Tensor, keys: torch.Tensor, name: str) -> torch.Tensor:
        shape = (keys.numel(), self.dim)
        if not isinstance(rows, torch.Tensor) or rows.dtype != torch.float32 or tuple(rows.shape) != shape \
                or rows.device != self.device:
            found = f"{rows.dtype} {tuple(rows.shape)} on {rows.device}" if isinstance(rows, torch.Tensor) else \
                type(rows).__name__
            raise ValueError(f"hash table: {name} must be float32 {shape} on {self.device}, got {found}")
        return rows.contiguous()

    def _scores(self, scores: torch.Tensor | None, keys: torch.Tensor) -> torch.Tensor | None:
        return checked_scores(scores, keys, self.policy, self.device)


def check_settings(capacity: int, dim: int, policy: str, backend: str) -> None:
    """Raise ValueError saying what is wrong with a table's settings, if anything is."""
    if not isinstance(capacity, int) or capacity <= 0 or capacity % SLOTS or capacity // SLOTS >= 2**31:
        raise ValueError(f"hash table: capacity must be a positive multiple of {SLOTS} below {SLOTS * 2**31}, "
                         f"got {capacity!r}")
    if not isinstance(dim, int) or dim <= 0:
        raise ValueError(f"hash table: dim must be a positive integer, got {dim!r}")
    if policy not in POLICIES:
        raise ValueError(f"hash table: policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if backend not in BACKENDS:
        raise ValueError(f"hash table: backend must be one of {', '.join(BACKENDS)}, got {backend!r}")


def checked_keys(keys: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``keys`` contiguous, once known to be a 1-D int64 tensor on ``device``."""
    if not isinstance(keys, torch.Tensor) or keys.dtype != torch.int64 or keys.dim() != 1:
        found = f"{keys.dtype} {tuple(keys.shape)}" if isinstance(keys, torch.Tensor) else type(keys).__name__
        raise ValueError(f"hash table: keys must be a 1-D int64 tensor, got {found}")
    if keys.device != device:
        raise ValueError(f"hash table: keys must be on the table's device {device}, got {keys.device}")
    return keys.contiguous()


def checked_scores(scores: torch.Tensor | None, keys: torch.Tensor, policy: str,
                   device: torch.device) -> torch.Tensor | None:
    """``scores`` contiguous, once known to be what a writing call of ``policy`` takes: int64 ``[n]`` on ``device``
    for ``"custom"``, else None."""
    if policy != "custom":
        if scores is not None:
            raise ValueError(f"hash table: scores are given only to a table of policy 'custom', this one is "
                             f"{policy!r}")
        return None
    if not isinstance(scores, torch.Tensor) or scores.dtype != torch.int64 or tuple(scores.shape) != keys.shape \
            or scores.device != device:
        found = f"{scores.dtype} {tuple(scores.shape)} on {scores.device}" if isinstance(scores, torch.Tensor) \
            else type(scores).__name__
        raise ValueError(f"hash table: policy 'custom' needs int64 scores {tuple(keys.shape)} on {device}, "
                         f"got {found}")
    return scores.contiguous()
