"""Hierarchical embedding lookup at serving time: cache tier -> memory-mapped host store -> pooled rows.

It computes exactly what :class:`pipeline.modules.EmbeddingCollection` computes in eval mode (the
pooled bags of every slot, concatenated in slot order, ``sum`` or ``mean``, an empty bag pooling to
zeros), from the tables export wrote to the store, one cache tier per table in front of it. The raw
ids of a dynamic table are found among the store's ids of that table first; an id it does not hold
reads the table's last row, zeros (and counts in a mean, as in training).

Inputs, as the ``preprocess`` model emits them: ``categorical`` ``[B, C]`` int64 ids (one per
one-hot feature, in ``config.categorical`` order; None when there is none) and, when the schema has multi-hot features,
``multihot_ids`` ``[B, W]`` (each row's bags packed feature after feature, then padding) with
``multihot_lengths`` ``[B, M]``.

A new store version is picked up by :meth:`refresh` (called before each batch): the tiers keep
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

from export.cache import CacheTier, make_tier
from export.store import current_version, open_current
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
        store = open_current(self.store_root)
        self.version = store.version
        self.tiers: dict[str, CacheTier] = {
            name: make_tier(policy, table, self._capacity(table.shape[0])) for name, table in store.tables.items()
        }
        missing = sorted(set(config.slot_tables) - set(self.tiers))
        if missing:
            raise ValueError(f"the store at {self.store_root} has no tables {missing}")
        self._rows = {name: table.shape[0] for name, table in store.tables.items()}
        self._keys = store.keys
        self._column_of = {f: i for i, f in enumerate(config.categorical)}
        self._multihot_of = {f: i for i, f in enumerate(config.multihot)}

    def _capacity(self, rows: int) -> int:
        return min(rows, max(self.min_cache_rows, int(rows * self.cache_fraction)))

    def refresh(self) -> bool:
        """Switch to the store's current version if it changed; True when it did."""
        if current_version(self.store_root) == self.version:
            return False
        store = open_current(self.store_root)
        for name, tier in self.tiers.items():
            tier.refill(store.tables[name])
            self._rows[name] = store.tables[name].shape[0]
        self._keys = store.keys
        self.version = store.version
        self.refreshes += 1
        return True

    def __call__(self, categorical: np.ndarray | None, multihot_ids: np.ndarray | None = None,
                 multihot_lengths: np.ndarray | None = None) -> np.ndarray:
        batch = _batch_size(categorical, multihot_lengths, len(self.config.categorical))
        categorical = np.asarray(categorical) if categorical is not None else np.zeros((batch, 0), np.int64)
        bags = _unpack_multihot(multihot_ids, multihot_lengths, batch, len(self.config.multihot))
        pieces = []
        for table, feature, mean in zip(self.config.slot_tables, self.config.slot_features, self.config.slot_mean):
            if feature in self._column_of:
                ids = self._rows_of(categorical[:, self._column_of[feature]], feature, table)
                pieces.append(self.tiers[table].lookup(ids).astype(np.float32, copy=False))
            else:
                rows_of_value, ids = bags[self._multihot_of[feature]]
                ids = self._rows_of(ids, feature, table)
                pieces.append(_pool(self.tiers[table].lookup(ids), rows_of_value, batch, mean))
        if not pieces:
            return np.zeros((batch, 0), dtype=np.float32)
        return np.concatenate(pieces, axis=1)

    def _rows_of(self, ids: np.ndarray, feature: str, table: str) -> np.ndarray:
        """The rows of ``ids`` in ``table``: the ids themselves, checked, or a dynamic table's rows of its raw ids."""
        keys = self._keys.get(table)
        if keys is None:
            self._check(ids, feature, table)
            return ids
        at = np.searchsorted(keys, ids)
        found = at < len(keys)
        found[found] = keys[at[found]] == ids[found]
        return np.where(found, at, len(keys))

    def _check(self, ids: np.ndarray, feature: str, table: str) -> None:
        if ids.size and (ids.min() < 0 or ids.max() >= self._rows[table]):
            bad = ids[(ids < 0) | (ids >= self._rows[table])][0]
            raise BadInputError(f"feature {feature}: id {bad} is outside table {table} "
                                f"(expected 0 <= id < {self._rows[table]})")

    def stats(self) -> dict:
        """Counters per table and in total, the hit rate over distinct ids, and the store version."""
        tables = {name: tier.stats() for name, tier in self.tiers.items()}
        hits = sum(s["hits"] for s in tables.values())
        misses = sum(s["misses"] for s in tables.values())
        return {
            "version": self.version, "policy": self.policy, "refreshes": self.refreshes,
            "hits": hits, "misses": misses, "evictions": sum(s["evictions"] for s in tables.values()),
            "hit_rate": hits / (hits + misses) if hits + misses else 0.0, "tables": tables,
        }


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
