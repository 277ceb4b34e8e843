"""Hierarchical embedding lookup at serving time: cache tier -> memory-mapped host store -> pooled rows.

It computes exactly what :class:`pipeline.modules.EmbeddingCollection` computes in eval mode (the
pooled bags of every slot, concatenated in slot order, ``sum`` or ``mean``, an empty bag pooling to
zeros), from the tables export wrote to the store, with caches of their hot rows in front of it (each
table keeping its own capacity and counters, all of them checked in one step; see below). The raw
ids of a dynamic table are found among the store's ids of that table first; an id it does not hold
reads the table's last row, zeros (and counts in a mean, as in training).

Inputs, as the ``preprocess`` model emits them: ``categorical`` ``[B, C]`` int64 ids (one per
one-hot feature, in ``config.categorical`` order; None when there is none) and, when the schema has multi-hot features,
``multihot_ids`` ``[B, W]`` (each row's bags packed feature after feature, then padding) with
``multihot_lengths`` ``[B, M]``.

The one-hot ids and the multi-hot bags of a batch go to the caches in one request
(``export.cache.make_caches``, ``lookup_parts``; one per dim where the tables' dims differ): the caches
find the rows of all those tables in one vectorised step of their index on the host, and gather them
where they keep them. The ``lru`` and ``lfu`` caches answer with numpy; ``gpu-lru`` / ``gpu-lfu`` (a
``KIND_GPU`` instance's, on its GPU) with a tensor on their device, never waiting for it: the bags are
pooled there too (all multi-hot features in one step), and the dense part of the same process takes the
answer as it is. :meth:`EmbeddingLookup.rows_or_pooled` answers a batch of one-hot ids of tables of one dim
that such a cache keeps with the cache's rows and each id's slot instead (the missed rows fetched into the cache
first), for the dense part to gather them in its CUDA graph: the lookup is then the index's work on the host and
the missed rows' copy.

A new store version is picked up by :meth:`refresh` (called before each batch): the caches keep
their hot ids and re-read those rows from the new version, and a batch is always computed from
one version.

Example::

    lookup = EmbeddingLookup("repo/embedding/store", LookupConfig.load("repo/embedding/layout.json"))
    pooled = lookup(np.array([[3, 7]]))          # [1, total_dim] float32
    EmbeddingLookup(store, config, policy="gpu-lru", device="cuda:0")(ids)   # a tensor on cuda:0
    lookup.stats()["hit_rate"]
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from export.cache import Rows, TableCaches, make_caches
from export.store import CURRENT, StoreVersion, current_version, file_stamp, open_current
from pipeline.errors import BadInputError


@dataclass
class LookupConfig:
    """The lookup model's configuration: which table and pooling serve each slot, and which input
    carries each feature (saved as the model version's ``layout.json``)."""

    slot_tables: list[str]
    slot_features: list[str]
    slot_mean: list[bool]
    categorical: list[str]
    multihot: list[str] = field(default_factory=list)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> LookupConfig:
        return cls(**json.loads(Path(path).read_text()))

    @classmethod
    def from_collection(cls, collection, schema) -> LookupConfig:
        """From a trained ``EmbeddingCollection`` and the schema (which features are multi-hot)."""
        packing = collection.packing
        multihot = set(schema.multihot)
        return cls(
            slot_tables=[packing.table_names[t] for t in packing.slot_table],
            slot_features=list(packing.slot_features),
            slot_mean=[collection.tables[t].pooling == "mean" for t in packing.slot_table],
            categorical=[f for f in collection.feature_names if f not in multihot],
            multihot=[f for f in collection.feature_names if f in multihot],
        )


class EmbeddingLookup:
    """Pooled embeddings of a batch through ``policy`` caches (``lru`` | ``lfu`` | ``none`` | registered);
    ``device``: where a ``gpu-`` policy keeps its rows (default: the current CUDA device). The answer is numpy,
    or a tensor on that device."""

    def __init__(self, store_root: str | Path, config: LookupConfig, policy: str = "lru",
                 cache_fraction: float = 0.25, min_cache_rows: int = 1024, device: str | None = None,
                 whole_mb: float = 0.0) -> None:
        self.store_root = Path(store_root)
        self.config = config
        self.policy = policy
        self.refreshes = 0
        self._current = os.fspath(self.store_root / CURRENT)  # checked before every batch: a plain string
        self._stamp = file_stamp(self._current)
        store = open_current(self.store_root)
        self.version = store.version
        self._dense = store.dense
        self.caches: TableCaches = make_caches(
            policy, store.tables, capacities(store.tables, cache_fraction, min_cache_rows,
                                             _whole_mb(whole_mb, device) if policy.startswith("gpu-") else 0.0),
            **({} if device is None else {"device": device}))
        missing = sorted(set(config.slot_tables) - set(store.tables))
        if missing:
            raise ValueError(f"the store at {self.store_root} has no tables {missing}")
        self._table_of = dict(zip(config.slot_features, config.slot_tables))
        self._groups = _groups(config, store.tables)
        self._multihot_tables = [self._table_of[f] for f in config.multihot]
        self._set_rows(store)

    def _set_rows(self, store: StoreVersion) -> None:
        self._rows = {name: table.shape[0] for name, table in store.tables.items()}
        self._widths = {name: (table.shape[1], table.dtype) for name, table in store.tables.items()}
        self._keys = store.keys
        self._column_rows = np.array([self._rows[self._table_of[f]] for f in self.config.categorical], dtype=np.int64)
        self._multihot_rows = np.array([self._rows[t] for t in self._multihot_tables], dtype=np.int64)

    def refresh(self) -> bool:
        """Switch to the store's current version if it changed; True when it did.

        A version that does not open, or whose tables are not the served ones (by name, width and dtype), raises
        before anything changes, and is not tried again until ``CURRENT`` names another."""
        stamp = file_stamp(self._current)
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        if current_version(self.store_root) == self.version:
            return False
        store = open_current(self.store_root)
        self._check_like_served(store)
        self.caches.refill(store.tables)
        self._set_rows(store)
        self.version = store.version
        self.refreshes += 1
        return True

    def _check_like_served(self, store: StoreVersion) -> None:
        """Raise a ValueError naming the first table of ``store`` that is not as the served one, or missing, or when
        ``store`` is of another dense part than the served one (a full export replaced the repository: its tables with
        the served dense part would answer for neither model)."""
        if store.dense != self._dense:
            raise ValueError(f"store version {store.version} is of another model than the one served (a full export "
                             "replaced the repository): restart serving (`python -m pipeline run serve`) to serve it")
        if sorted(store.tables) != sorted(self._widths):
            raise ValueError(f"store version {store.version} has the tables {sorted(store.tables)}, "
                             f"the served one {sorted(self._widths)}")
        for name, table in store.tables.items():
            if (table.shape[1], table.dtype) != self._widths[name]:
                dim, dtype = self._widths[name]
                raise ValueError(f"store version {store.version}: table {name} has rows of {table.shape[1]} "
                                 f"{table.dtype}, the served one of {dim} {dtype}")

    def __call__(self, categorical: np.ndarray | None, multihot_ids: np.ndarray | None = None,
                 multihot_lengths: np.ndarray | None = None) -> Rows:
        batch = _batch_size(categorical, multihot_lengths, len(self.config.categorical))
        if not self.config.slot_tables:
            return np.zeros((batch, 0), dtype=np.float32)
        categorical = np.asarray(categorical) if categorical is not None else np.zeros((batch, 0), np.int64)
        bags = _unpack_multihot(multihot_ids, multihot_lengths, batch, len(self.config.multihot))
        categorical, bags = self._find_keys(categorical, bags)
        self._check(categorical, bags)
        pieces = [group.pooled(self.caches, categorical, bags, batch) for group in self._groups]
        if len(pieces) == 1 and self._groups[0].in_slot_order:
            return pieces[0]
        by_slot = sorted((slot, piece[:, k * group.dim: (k + 1) * group.dim])
                         for group, piece in zip(self._groups, pieces) for k, slot in enumerate(group.slots))
        return _concatenated([piece for _, piece in by_slot])

    def rows_or_pooled(self, categorical: np.ndarray | None, multihot_ids: np.ndarray | None = None,
                       multihot_lengths: np.ndarray | None = None):
        """The batch's embeddings for a consumer that gathers a device cache's rows itself: where its one-hot ids
        are all of tables of one dim kept by a device cache, the cache's rows and each id's slot, in slot order
        (:class:`export.cache_torch.CachedRows`; the missed rows fetched into the cache first, and the lookup
        counted as one); else what :meth:`__call__` answers (a cache on the host, multi-hot features, tables of
        several dims, or a missed row with no room in its table's cache)."""
        group = self._groups[0] if len(self._groups) == 1 else None
        if (group is None or not group.in_slot_order or group.multihot_tables or categorical is None
                or not hasattr(self.caches, "rows_or_lookup") or multihot_ids is not None or multihot_lengths is not None):
            return self(categorical, multihot_ids, multihot_lengths)
        categorical, _ = self._find_keys(np.asarray(categorical), _NO_BAGS)
        self._check(categorical, _NO_BAGS)
        ids = categorical if group.onehot_columns is None else categorical[:, group.onehot_columns]
        found = self.caches.rows_or_lookup(group.onehot_tables, ids)
        return found if hasattr(found, "slots") else _float32(found.reshape(len(categorical), -1))

    def resident(self) -> ResidentRows | None:
        """Where a device cache holds every row of the one-hot tables (one dim, in slot order, no multi-hot and no
        dynamic table, each table's capacity its rows: :func:`capacities`' ``whole_mb``): every row fetched into it, and
        where each is, for a consumer
        that finds a batch's rows on the device by their ids alone; else None. The cache never evicts then, so the
        places hold until a :meth:`refresh` to tables of other shapes (which starts the caches anew)."""
        group = self._groups[0] if len(self._groups) == 1 else None
        if (group is None or not group.in_slot_order or group.onehot_columns is not None or group.multihot_tables
                or self._keys or not group.onehot_tables or not hasattr(self.caches, "rows_or_lookup")):
            return None
        held = self.caches.stats()
        if any(held[table]["capacity"] < self._rows[table] for table in group.onehot_tables):
            return None
        slots = []
        for table in group.onehot_tables:
            found = self.caches.rows_or_lookup([table], np.arange(self._rows[table], dtype=np.int64)[:, None])
            if not hasattr(found, "slots"):
                return None
            slots.append(found.slots.reshape(-1))
        rows = np.array([self._rows[table] for table in group.onehot_tables], dtype=np.int64)
        return ResidentRows(found.rows, np.concatenate(slots), np.cumsum(rows) - rows, rows)

    def count_resident(self, batch: int) -> None:
        """A batch of ``batch`` rows served from :meth:`resident`'s rows: each of its ids a hit of its table."""
        self.caches.count_hits(self._groups[0].onehot_tables, batch)

    def _find_keys(self, categorical: np.ndarray, bags: Bags) -> tuple[np.ndarray, Bags]:
        """The dynamic tables' raw ids replaced by their rows (an id the store does not hold by the last row)."""
        if not self._keys:
            return categorical, bags
        categorical = categorical.copy()
        for c, feature in enumerate(self.config.categorical):
            if self._table_of[feature] in self._keys:
                categorical[:, c] = self._rows_of_keys(categorical[:, c], self._keys[self._table_of[feature]])
        ids = bags.ids.copy()
        for j, table in enumerate(self._multihot_tables):
            if table in self._keys:
                of_j = slice(bags.starts[j], bags.starts[j + 1])
                ids[of_j] = self._rows_of_keys(ids[of_j], self._keys[table])
        return categorical, bags._replace(ids=ids)

    @staticmethod
    def _rows_of_keys(ids: np.ndarray, keys: np.ndarray) -> np.ndarray:
        at = np.searchsorted(keys, ids)
        found = at < len(keys)
        found[found] = keys[at[found]] == ids[found]
        return np.where(found, at, len(keys))

    def _check(self, categorical: np.ndarray, bags: Bags) -> None:
        """Every id within its table (the one-hot ones in one step, the multi-hot ones in another); the first one
        outside is named."""
        named = []
        if categorical.size and not _all_below(categorical, self._column_rows):
            bad = np.flatnonzero(((categorical < 0) | (categorical >= self._column_rows)).any(axis=0))
            named += [(self.config.categorical[c], categorical[:, c]) for c in bad[:1]]
        if bags.ids.size:
            feature = np.repeat(np.arange(len(self.config.multihot)), np.diff(bags.starts))
            bad = np.flatnonzero((bags.ids < 0) | (bags.ids >= self._multihot_rows[feature]))
            named += [(self.config.multihot[feature[i]], bags.ids[i: i + 1]) for i in bad[:1]]
        if named:
            feature, ids = named[0]
            table = self._table_of[feature]
            rows = self._rows[table]
            raise BadInputError(f"feature {feature}: id {ids[(ids < 0) | (ids >= rows)][0]} is outside table {table} "
                                f"(expected 0 <= id < {rows})")

    def stats(self) -> dict:
        """Counters per table and in total, the hit rate over distinct ids, and the store version."""
        tables = self.caches.stats()
        hits = sum(s["hits"] for s in tables.values())
        misses = sum(s["misses"] for s in tables.values())
        return {
            "version": self.version, "policy": self.policy, "refreshes": self.refreshes,
            "hits": hits, "misses": misses, "evictions": sum(s["evictions"] for s in tables.values()),
            "hit_rate": hits / (hits + misses) if hits + misses else 0.0, "tables": tables,
        }


class ResidentRows(NamedTuple):
    """Every row of a batch's one-hot tables in a device cache's ``rows``: column ``c``'s id ``i`` at the slot
    ``slots[offsets[c] + i]``, for ``0 <= i < table_rows[c]``."""

    rows: Any
    slots: np.ndarray
    offsets: np.ndarray
    table_rows: np.ndarray


class Bags(NamedTuple):
    """A batch's multi-hot values, feature after feature (``starts[j]``: where feature ``j``'s begin, ``starts[-1]``
    their number), each feature's in row order: their ids and rows."""

    ids: np.ndarray
    rows: np.ndarray
    starts: np.ndarray


_NO_BAGS = Bags(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(1, np.int64))


@dataclass
class _Group:
    """The slots whose tables share a dim and dtype: looked up in one step of the caches, then pooled."""

    dim: int
    slots: list[int]
    """The group's slots, in slot order: its output holds their pooled rows side by side in this order."""
    onehot_tables: list[str]
    onehot_columns: list[int] | None
    """The columns of the categorical ids that hold the one-hot slots' ids; None: all of them, in order."""
    multihot_tables: list[str]
    multihot_features: list[int]
    multihot_mean: np.ndarray
    onehot_at: np.ndarray
    multihot_at: np.ndarray
    in_slot_order: bool
    """Whether the group holds every slot: its output is then the whole answer."""
    _on_device: dict = field(default_factory=dict)

    def pooled(self, caches: TableCaches, categorical: np.ndarray, bags: Bags, batch: int) -> Rows:
        """``[batch, len(slots) * dim]`` float32: the group's pooled rows."""
        parts = []
        if self.onehot_tables:
            ids = categorical if self.onehot_columns is None else categorical[:, self.onehot_columns]
            parts.append((self.onehot_tables, ids))
        parts += [([table], bags.ids[bags.starts[j]: bags.starts[j + 1], None])
                  for table, j in zip(self.multihot_tables, self.multihot_features)]
        rows = caches.lookup_parts(parts)
        if not self.multihot_tables:
            return _float32(rows[0].reshape(batch, -1))
        out = _empty_like(rows[0], (batch, len(self.slots), self.dim))
        onehot_at, multihot_at = self._places(out)
        if self.onehot_tables:
            out[:, onehot_at] = _float32(rows[0])
        out[:, multihot_at] = _pool([part[:, 0] for part in rows[len(rows) - len(self.multihot_tables):]], bags,
                                    self.multihot_features, self.multihot_mean, batch)
        return out.reshape(batch, -1)

    def _places(self, out: Rows) -> tuple[Rows, Rows]:
        """Where the one-hot and the multi-hot slots go in the group's output, as indices of its array library
        (on its device: indexing a device tensor with host indices would copy them there and wait)."""
        if isinstance(out, np.ndarray):
            return self.onehot_at, self.multihot_at
        places = self._on_device.get(out.device)
        if places is None:
            import torch

            places = self._on_device[out.device] = (torch.from_numpy(self.onehot_at).to(out.device),
                                                    torch.from_numpy(self.multihot_at).to(out.device))
        return places


def _groups(config: LookupConfig, tables: dict[str, np.ndarray]) -> list[_Group]:
    """The slots grouped by the dim and dtype of their tables, in the order of their first slots."""
    column_of = {f: i for i, f in enumerate(config.categorical)}
    multihot_of = {f: i for i, f in enumerate(config.multihot)}
    kinds: dict[tuple, list[int]] = {}
    for k, table in enumerate(config.slot_tables):
        kinds.setdefault((tables[table].shape[1], tables[table].dtype.str), []).append(k)
    groups = []
    for (dim, _), slots in kinds.items():
        onehot = [k for k in slots if config.slot_features[k] in column_of]
        multihot = [k for k in slots if config.slot_features[k] in multihot_of]
        columns = [column_of[config.slot_features[k]] for k in onehot]
        groups.append(_Group(
            dim=dim, slots=slots, onehot_tables=[config.slot_tables[k] for k in onehot],
            onehot_columns=None if columns == list(range(len(config.categorical))) else columns,
            multihot_tables=[config.slot_tables[k] for k in multihot],
            multihot_features=[multihot_of[config.slot_features[k]] for k in multihot],
            multihot_mean=np.array([config.slot_mean[k] for k in multihot], dtype=bool),
            onehot_at=np.array([slots.index(k) for k in onehot], dtype=np.int64),
            multihot_at=np.array([slots.index(k) for k in multihot], dtype=np.int64),
            in_slot_order=slots == list(range(len(config.slot_tables)))))
    return groups


def cache_rows(rows: int, fraction: float, min_rows: int = 1024) -> int:
    """Rows of a table of ``rows`` that an instance's cache holds: ``fraction`` of them, at least ``min_rows``."""
    return min(rows, max(min_rows, int(rows * fraction)))


def _whole_mb(whole_mb: float, device: str | None) -> float:
    """``whole_mb``, and on a CUDA device at most a quarter of its free memory: the other instances of the model
    load their own copies beside it."""
    if not whole_mb or device is None or not str(device).startswith("cuda"):
        return whole_mb
    import torch

    free, _ = torch.cuda.mem_get_info(torch.device(device))
    return min(whole_mb, free / 4 / 2**20)


def capacities(tables: dict[str, np.ndarray], fraction: float, min_rows: int = 1024,
               whole_mb: float = 0.0) -> dict[str, int]:
    """The rows of each table an instance's cache holds: all of every table where together they take at most
    ``whole_mb`` MiB, else :func:`cache_rows` of each."""
    if sum(t.shape[0] * t.shape[1] * t.dtype.itemsize for t in tables.values()) <= whole_mb * 2**20:
        return {name: table.shape[0] for name, table in tables.items()}
    return {name: cache_rows(table.shape[0], fraction, min_rows) for name, table in tables.items()}


def _batch_size(categorical: np.ndarray | None, multihot_lengths: np.ndarray | None, onehot: int) -> int:
    if onehot:
        if categorical is None:
            raise BadInputError(f"expected categorical ids for {onehot} one-hot features, got none")
        return np.asarray(categorical).shape[0]
    if categorical is not None:
        return np.asarray(categorical).shape[0]
    if multihot_lengths is None:
        raise BadInputError("expected categorical ids or multi-hot lengths, got neither")
    return np.asarray(multihot_lengths).shape[0]


def _unpack_multihot(ids: np.ndarray | None, lengths: np.ndarray | None, batch: int, features: int) -> Bags:
    """The values of the packed ``[B, W]`` multi-hot ids (each row's bags feature after feature, then padding),
    grouped by feature (:class:`Bags`), in one step for all features."""
    if features == 0:
        return _NO_BAGS
    if ids is None or lengths is None:
        raise BadInputError(f"expected multi-hot ids and lengths for {features} features, got none")
    ids = np.asarray(ids, dtype=np.int64).reshape(batch, -1)
    lengths = np.asarray(lengths, dtype=np.int64).reshape(batch, features)
    if (lengths < 0).any():
        raise BadInputError("multi-hot lengths must be >= 0")
    ends = np.cumsum(lengths, axis=1)
    if batch and ends[:, -1].max(initial=0) > ids.shape[1]:
        raise BadInputError(f"multi-hot lengths add up to {ends[:, -1].max()} but rows hold {ids.shape[1]} ids")
    rows, columns = np.nonzero(np.arange(ids.shape[1]) < ends[:, -1:])
    feature = (columns[:, None] >= ends[rows]).sum(axis=1)
    order = np.argsort(feature, kind="stable")
    starts = np.concatenate([[0], np.cumsum(np.bincount(feature, minlength=features))])
    return Bags(ids[rows, columns][order], rows[order], starts)


def _pool(rows: list[Rows], bags: Bags, features: list[int], mean: np.ndarray, batch: int) -> Rows:
    """``[batch, len(features), dim]`` float32: the rows of each of ``features``' values summed over each bag (their
    mean where ``mean``), an empty bag giving zeros; all features in one step."""
    slot = np.repeat(np.arange(len(features)), [bags.starts[j + 1] - bags.starts[j] for j in features])
    rows_of = np.concatenate([bags.rows[bags.starts[j]: bags.starts[j + 1]] for j in features])
    target = rows_of * len(features) + slot
    counts = np.bincount(target, minlength=batch * len(features)).reshape(batch, len(features))
    divisor = np.where(mean, np.maximum(counts, 1), 1).astype(np.float32)
    if isinstance(rows[0], np.ndarray):
        out = np.zeros((batch * len(features), rows[0].shape[1]), dtype=np.float32)
        np.add.at(out, target, np.concatenate(rows).astype(np.float32, copy=False))
        out = out.reshape(batch, len(features), -1)
        return out / divisor[:, :, None] if mean.any() else out
    import torch

    device = rows[0].device
    out = torch.zeros((batch * len(features), rows[0].shape[1]), dtype=torch.float32, device=device)
    out.index_add_(0, torch.from_numpy(target).to(device, non_blocking=True), torch.cat(rows).float())
    out = out.view(batch, len(features), -1)
    return out / torch.from_numpy(divisor).to(device, non_blocking=True)[:, :, None] if mean.any() else out


def _all_below(ids: np.ndarray, rows: np.ndarray) -> bool:
    """Whether every id is within ``0 <= id < rows`` of its column, in one comparison (a negative id read as
    unsigned is above every row count)."""
    if ids.dtype != np.int64:
        ids = ids.astype(np.int64)
    return bool(np.less(ids.view(np.uint64), rows.view(np.uint64)).all())


def _float32(rows: Rows) -> Rows:
    return rows.astype(np.float32, copy=False) if isinstance(rows, np.ndarray) else rows.float()


def _empty_like(rows: Rows, shape: tuple[int, ...]) -> Rows:
    if isinstance(rows, np.ndarray):
        return np.empty(shape, dtype=np.float32)
    import torch

    return torch.empty(shape, dtype=torch.float32, device=rows.device)


def _concatenated(pieces: list[Rows]) -> Rows:
    if isinstance(pieces[0], np.ndarray):
        return np.concatenate(pieces, axis=1)
    import torch

    return torch.cat(pieces, dim=1)
