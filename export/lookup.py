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

The one-hot ids of a batch go to the caches in one request (``export.cache.make_caches``; one per
dim where the tables' dims differ, and one per multi-hot feature): the ``lru`` and ``lfu`` caches
find and gather the rows of all those tables in one vectorised step, and ``gpu-lru`` / ``gpu-lfu`` (a
``KIND_GPU`` instance's) in one step on the GPU, waiting for it once.

A new store version is picked up by :meth:`refresh` (called before each batch): the caches keep
their hot ids and re-read those rows from the new version, and a batch is always computed from
one version.

Example::

    lookup = EmbeddingLookup("repo/embedding/store", LookupConfig.load("repo/embedding/layout.json"))
    pooled = lookup(np.array([[3, 7]]))          # [1, total_dim] float32
    lookup.stats()["hit_rate"]
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from export.cache import TableCaches, make_caches
from export.store import StoreVersion, current_stamp, current_version, open_current
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
    """Pooled embeddings of a batch through ``policy`` caches (``lru`` | ``lfu`` | ``none`` | registered)."""

    def __init__(self, store_root: str | Path, config: LookupConfig, policy: str = "lru",
                 cache_fraction: float = 0.25, min_cache_rows: int = 1024) -> None:
        self.store_root = Path(store_root)
        self.config = config
        self.policy = policy
        self.cache_fraction = cache_fraction
        self.min_cache_rows = min_cache_rows
        self.refreshes = 0
        self._stamp = current_stamp(self.store_root)
        store = open_current(self.store_root)
        self.version = store.version
        self.caches: TableCaches = make_caches(
            policy, store.tables, {name: self._capacity(table.shape[0]) for name, table in store.tables.items()})
        missing = sorted(set(config.slot_tables) - set(store.tables))
        if missing:
            raise ValueError(f"the store at {self.store_root} has no tables {missing}")
        self._table_of = dict(zip(config.slot_features, config.slot_tables))
        self._set_rows(store)
        self._column_of = {f: i for i, f in enumerate(config.categorical)}
        self._multihot_of = {f: i for i, f in enumerate(config.multihot)}
        kinds: dict[tuple, list[int]] = {}
        for k, (table, feature) in enumerate(zip(config.slot_tables, config.slot_features)):
            if feature in self._column_of:
                kinds.setdefault((store.tables[table].shape[1], store.tables[table].dtype.str), []).append(k)
        self._onehot_groups = list(kinds.values())

    def _set_rows(self, store: StoreVersion) -> None:
        self._rows = {name: table.shape[0] for name, table in store.tables.items()}
        self._widths = {name: (table.shape[1], table.dtype) for name, table in store.tables.items()}
        self._keys = store.keys
        self._column_rows = np.array([self._rows[self._table_of[f]] for f in self.config.categorical], dtype=np.int64)

    def _capacity(self, rows: int) -> int:
        return cache_rows(rows, self.cache_fraction, self.min_cache_rows)

    def refresh(self) -> bool:
        """Switch to the store's current version if it changed; True when it did.

        A version that does not open, or whose tables are not the served ones (by name, width and dtype), raises
        before anything changes, and is not tried again until ``CURRENT`` names another."""
        stamp = current_stamp(self.store_root)
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
        """Raise a ValueError naming the first table of ``store`` that is not as the served one, or missing."""
        if sorted(store.tables) != sorted(self._widths):
            raise ValueError(f"store version {store.version} has the tables {sorted(store.tables)}, "
                             f"the served one {sorted(self._widths)}")
        for name, table in store.tables.items():
            if (table.shape[1], table.dtype) != self._widths[name]:
                dim, dtype = self._widths[name]
                raise ValueError(f"store version {store.version}: table {name} has rows of {table.shape[1]} "
                                 f"{table.dtype}, the served one of {dim} {dtype}")

    def __call__(self, categorical: np.ndarray | None, multihot_ids: np.ndarray | None = None,
                 multihot_lengths: np.ndarray | None = None) -> np.ndarray:
        batch = _batch_size(categorical, multihot_lengths, len(self.config.categorical))
        categorical = np.asarray(categorical) if categorical is not None else np.zeros((batch, 0), np.int64)
        bags = _unpack_multihot(multihot_ids, multihot_lengths, batch, len(self.config.multihot))
        slots = list(zip(self.config.slot_tables, self.config.slot_features, self.config.slot_mean))
        if not slots:
            return np.zeros((batch, 0), dtype=np.float32)
        categorical, bags = self._find_keys(categorical, bags)
        self._check(categorical, bags)
        pieces: list[np.ndarray] = [np.empty(0)] * len(slots)
        for group in self._onehot_groups:  # the one-hot slots whose tables share a dim: one lookup
            rows = self.caches.lookup([slots[k][0] for k in group],
                                      categorical[:, [self._column_of[slots[k][1]] for k in group]])
            if group == list(range(len(slots))):  # every slot, in order: the rows are the answer as they are
                return rows.reshape(batch, -1).astype(np.float32, copy=False)
            for j, k in enumerate(group):
                pieces[k] = rows[:, j]
        for k, (table, feature, mean) in enumerate(slots):
            if feature in self._multihot_of:
                rows_of_value, ids = bags[self._multihot_of[feature]]
                pieces[k] = _pool(self.caches.lookup([table], ids[:, None])[:, 0], rows_of_value, batch, mean)
        return np.concatenate(pieces, axis=1, dtype=np.float32)

    def _find_keys(self, categorical: np.ndarray,
                   bags: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
        """The dynamic tables' raw ids replaced by their rows (an id the store does not hold by the last row)."""
        if not self._keys:
            return categorical, bags
        categorical = categorical.copy()
        for c, feature in enumerate(self.config.categorical):
            if self._table_of[feature] in self._keys:
                categorical[:, c] = self._rows_of_keys(categorical[:, c], self._keys[self._table_of[feature]])
        bags = [(rows, self._rows_of_keys(ids, self._keys[self._table_of[feature]]))
                if self._table_of[feature] in self._keys else (rows, ids)
                for feature, (rows, ids) in zip(self.config.multihot, bags)]
        return categorical, bags

    @staticmethod
    def _rows_of_keys(ids: np.ndarray, keys: np.ndarray) -> np.ndarray:
        at = np.searchsorted(keys, ids)
        found = at < len(keys)
        found[found] = keys[at[found]] == ids[found]
        return np.where(found, at, len(keys))

    def _check(self, categorical: np.ndarray, bags: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """Every id within its table (the one-hot ones in one step); the first one outside is named."""
        named = []
        if categorical.size:
            bad = np.flatnonzero(((categorical < 0) | (categorical >= self._column_rows)).any(axis=0))
            named += [(self.config.categorical[c], categorical[:, c]) for c in bad[:1]]
        for feature, (_, ids) in zip(self.config.multihot, bags):
            if ids.size and (ids.min() < 0 or ids.max() >= self._rows[self._table_of[feature]]):
                named.append((feature, ids))
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


def cache_rows(rows: int, fraction: float, min_rows: int = 1024) -> int:
    """Rows of a table of ``rows`` that an instance's cache holds: ``fraction`` of them, at least ``min_rows``."""
    return min(rows, max(min_rows, int(rows * fraction)))


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


def _unpack_multihot(ids: np.ndarray | None, lengths: np.ndarray | None, batch: int,
                     features: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per multi-hot feature: (row of each value, the values), from the packed ``[B, W]`` form."""
    if features == 0:
        return []
    if ids is None or lengths is None:
        raise BadInputError(f"expected multi-hot ids and lengths for {features} features, got none")
    ids = np.asarray(ids, dtype=np.int64).reshape(batch, -1)
    lengths = np.asarray(lengths, dtype=np.int64).reshape(batch, features)
    if (lengths < 0).any():
        raise BadInputError("multi-hot lengths must be >= 0")
    ends = np.cumsum(lengths, axis=1)
    if batch and ends[:, -1].max(initial=0) > ids.shape[1]:
        raise BadInputError(f"multi-hot lengths add up to {ends[:, -1].max()} but rows hold {ids.shape[1]} ids")
    position = np.arange(ids.shape[1])
    feature_of = (position[None, :, None] >= ends[:, None, :]).sum(-1)
    out = []
    for j in range(features):
        rows, cols = np.nonzero(feature_of == j)
        out.append((rows, ids[rows, cols]))
    return out


def _pool(rows: np.ndarray, row_of_value: np.ndarray, batch: int, mean: bool) -> np.ndarray:
    out = np.zeros((batch, rows.shape[1]), dtype=np.float32)
    np.add.at(out, row_of_value, rows.astype(np.float32, copy=False))
    if mean:
        counts = np.bincount(row_of_value, minlength=batch).astype(np.float32)
        out /= np.maximum(counts, 1)[:, None]
    return out
