"""``HashTableGroup``: hash tables of one dim and policy made together in one storage, so that one call places the
keys of all of them.

Each table of the group is an ordinary :class:`~pipeline.kernels.hashtable.HashTable` on its own slots of the
shared storage (its part), so every operation of one table (find, erase, export, state dicts...) works on it
alone; the group adds the calls over all of them at once, each key given with its table: one sort and one
placement kernel for the lot instead of one per table, with the results each table's own call would give.
The layout and the rules are in ``docs/HASHTABLE.md``.

Example::

    group = HashTableGroup([1 << 20, 1 << 16], dim=2, device="cuda")
    keys = torch.cat([user_ids, item_ids])
    tables = torch.cat([torch.zeros_like(user_ids), torch.ones_like(item_ids)])
    placed = group.find_or_insert(keys, tables)     # slots in each key's table, was_new, evictions per table
    group.tables[1].find(item_ids)                  # a table of the group alone
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch

from pipeline.kernels.hashtable.reference import SLOTS, Storage
from pipeline.kernels.hashtable.table import POLICIES, HashTable, check_settings, checked_keys, checked_scores

MAX_TABLES = 2**15 - 1  # a key's table is an int16 for the sort and the kernels


class GroupPlacement(NamedTuple):
    """Where a call of the group put each key of its batch (position ``p`` is the batch's ``p``-th key)."""

    slots: torch.Tensor  # int64 [n]: the key's slot in its table, -1 where its bucket had no room for it
    was_new: torch.Tensor  # bool [n]: the key was not in its table before the call
    evicted: torch.Tensor  # bool [n]: true at the first position of a key that evicted another key of its table
    evicted_keys: torch.Tensor  # int64 [n]: the key evicted, where ``evicted``
    evicted_scores: torch.Tensor  # int64 [n]: its score, where ``evicted``
    evictions: torch.Tensor  # int64 [tables]: how many keys the call evicted from each table, on the device


class HashTableGroup:
    """Tables of the given ``capacities`` (each a multiple of ``SLOTS``), of one ``dim``, ``device``, ``policy`` and
    ``backend`` (as :class:`HashTable`'s), in one storage: :attr:`tables`, in that order."""

    def __init__(self, capacities: Sequence[int], dim: int, device: torch.device | str = "cpu", policy: str = "lru",
                 backend: str = "auto") -> None:
        capacities = list(capacities)
        if not 1 <= len(capacities) <= MAX_TABLES:
            raise ValueError(f"hash table group: 1 to {MAX_TABLES} tables, got {len(capacities)}")
        for capacity in capacities:
            check_settings(capacity, dim, policy, backend)
        starts = [0, *itertools.accumulate(capacities)]
        storage = Storage.empty(starts[-1], dim, device)
        self.tables = [HashTable(capacity, dim, device, policy, backend, storage=storage.part(start, start + capacity))
                       for capacity, start in zip(capacities, starts)]
        self.dim, self.policy, self.device = dim, policy, self.tables[0].device
        self._storage = storage
        self._impl = self.tables[0]._impl
        self.bucket_starts = torch.tensor([s // SLOTS for s in starts], dtype=torch.int64, device=self.device)

    @property
    def backend(self) -> str:
        """``"cuda"`` (the kernels) or ``"torch"`` (the reference)."""
        return self.tables[0].backend

    def find_or_insert(self, keys: torch.Tensor, tables: torch.Tensor,
                       scores: torch.Tensor | None = None) -> GroupPlacement:
        """Each key placed in its table ``tables[p]`` (integers ``[n]``, each in ``0 .. len(tables) - 1``, not checked,
        which would read the device) exactly as that table's :meth:`HashTable.find_or_insert` places its keys of the
        batch (in their batch order) in a call of its own: the same slots, scores and evictions. Without rows: the
        slot a key takes keeps the row it held (an evicted key's, until the caller writes the new key's there). The
        tables placed together share one clock: every one's becomes the highest of them plus one."""
        keys = checked_keys(keys, self.device)
        tables = self._tables(tables, keys)
        scores = checked_scores(scores, keys, self.policy, self.device)
        clock = max(table.clock for table in self.tables) + 1
        for table in self.tables:
            table.clock = clock
        placed = self._impl.place(self._storage, keys, scores, POLICIES[self.policy], clock, False, tables,
                                  self.bucket_starts)
        return GroupPlacement(placed.slots, placed.was_new, placed.evicted, placed.evicted_keys, placed.evicted_scores,
                              placed.evictions)

    def locate(self, keys: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """int64 ``[n]``: each key's slot in its table ``tables[p]`` (as in :meth:`find_or_insert`), -1 where it is
        missing. Changes nothing, scores included."""
        keys = checked_keys(keys, self.device)
        return self._impl.locate(self._storage, keys, self._tables(tables, keys), self.bucket_starts)

    def _tables(self, tables: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        if not isinstance(tables, torch.Tensor) or tables.dtype.is_floating_point or tables.dtype == torch.bool \
                or tables.shape != keys.shape or tables.device != self.device:
            found = f"{tables.dtype} {tuple(tables.shape)} on {tables.device}" if isinstance(tables, torch.Tensor) \
                else type(tables).__name__
            raise ValueError(f"hash table group: tables must be integers {tuple(keys.shape)} on {self.device} (each "
                             f"key's table), got {found}")
        return tables.to(torch.int16).contiguous()
