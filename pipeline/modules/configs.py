"""The configs of the embedding tables and of their fused sparse optimizer, and the tables a schema implies.

Example::

    tables = [TableConfig("t_C1", 1000, 16, ["C1"]), TableConfig("t_C2", 50, 16, ["C2"], pooling="mean")]
    EmbeddingOptimizerConfig("adagrad", lr=0.05)
    tables_from_schema(Schema.load(cfg.paths.schema), dim=16)     # one table per sparse feature
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pipeline.errors import check_range
from pipeline.schema import DYNAMIC_ROWS

POOLINGS = ("sum", "mean")
OPTIMIZERS = ("sgd", "adagrad", "adam")
WEIGHT_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class TableConfig:
    """One embedding table: ``rows x dim``, serving the listed features (several: a shared table).

    Rows start uniform in ``[-init_scale, init_scale]``; ``None``: ``1 / sqrt(rows)``, as DLRM does.
    ``dynamic``: the table takes raw int64 ids (any value) and ``rows`` is its capacity, a multiple of
    128: an id gets a row when it comes in training (after ``admit_after`` occurrences), the least
    recently used id of a full bucket is evicted (see :mod:`pipeline.modules.dynamic`).
    """

    name: str
    rows: int
    dim: int
    features: list[str]
    pooling: str = "sum"
    init_scale: float | None = None
    dynamic: bool = False
    admit_after: int = 1

    def __post_init__(self) -> None:
        if self.rows <= 0 or self.dim <= 0:
            raise ValueError(f"table {self.name}: rows and dim must be positive, got {self.rows} x {self.dim}")
        if not self.features:
            raise ValueError(f"table {self.name}: lists no features")
        if self.pooling not in POOLINGS:
            raise ValueError(f"table {self.name}: pooling must be one of {POOLINGS}, got {self.pooling!r}")
        if self.init_scale is not None and not (math.isfinite(self.init_scale) and self.init_scale >= 0):
            raise ValueError(f"table {self.name}: init_scale must be a finite number >= 0, got {self.init_scale}")
        if self.dynamic and self.rows % DYNAMIC_ROWS:
            raise ValueError(f"table {self.name}: a dynamic table's rows (its capacity) must be a multiple of "
                             f"{DYNAMIC_ROWS}, got {self.rows}")
        if self.admit_after < 1 or (self.admit_after > 1 and not self.dynamic):
            raise ValueError(f"table {self.name}: admit_after must be >= 1, and above 1 only for a dynamic table; "
                             f"got {self.admit_after}")


@dataclass
class EmbeddingOptimizerConfig:
    """The sparse optimizer fused into the backward pass (the update rules: ``docs/EMBEDDING.md``)."""

    kind: str = "adagrad"
    lr: float = 0.01
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0
    master_weights: bool = False
    """16-bit tables: keep an fp32 copy (state ``master_weights``), update it, round it into the table."""
    stochastic_rounding: bool = False
    """16-bit tables: round updated rows up or down at random, unbiased (the ``cuda`` backend only)."""

    def __post_init__(self) -> None:
        if self.kind not in OPTIMIZERS:
            raise ValueError(f"embedding optimizer: expected one of {OPTIMIZERS}, got {self.kind!r}")
        if not math.isfinite(self.lr):
            raise ValueError(f"embedding optimizer: expected a finite lr, got {self.lr}")
        check_range("embedding optimizer eps", self.eps, 0)
        check_range("embedding optimizer beta1", self.beta1, 0, 1, high_open=True)
        check_range("embedding optimizer beta2", self.beta2, 0, 1, high_open=True)
        check_range("embedding optimizer weight_decay", self.weight_decay, 0)

    def state_shapes(self, total_rows: int, total_elements: int) -> dict[str, int]:
        """Name -> length of each flat fp32 state tensor this optimizer keeps."""
        if self.kind == "adagrad":
            return {"momentum1": total_rows}
        if self.kind == "adam":
            return {"momentum1": total_elements, "momentum2": total_elements}
        return {}


def check_features(tables: Sequence[TableConfig], feature_names: Sequence[str]) -> None:
    """Every feature a table serves must be among the input features."""
    unknown = sorted({f for t in tables for f in t.features} - set(feature_names))
    if unknown:
        raise ValueError(f"tables serve features {unknown} that are not among the inputs {list(feature_names)}")


def tables_from_schema(schema, dim: int, pooling: str = "sum", shared: dict[str, list[str]] | None = None,
                       dims: dict[str, int] | None = None, prefix: str = "t_", admit_after: int = 1) -> list[TableConfig]:
    """One table per sparse feature of ``schema`` (in feature order), sized by its cardinality.

    ``shared`` maps a table name to the features it serves (sized by the largest cardinality);
    ``dims`` overrides the dim per feature; multi-hot features use ``pooling``. The dynamic columns
    of the schema (raw 64-bit ids) get dynamic tables of their cardinality, which admit an id after
    ``admit_after`` occurrences.

    Example::

        tables_from_schema(Schema.load(cfg.paths.schema), dim=16)
    """
    cards = schema.cardinalities()
    multihot = set(schema.multihot)
    dynamic = set(schema.dynamic)
    shared = shared or {}
    dims = dims or {}
    in_shared = {f: name for name, feats in shared.items() for f in feats}
    tables, done = [], set()
    for feature in schema.sparse:
        if feature in in_shared:
            name = in_shared[feature]
            if name in done:
                continue
            feats = shared[name]
            done.add(name)
            if len({f in dynamic for f in feats}) > 1:
                raise ValueError(f"table {name}: shares dynamic features (raw ids) with others; share a table "
                                 "among dynamic features only, or among static ones")
            is_dynamic = feats[0] in dynamic
            tables.append(TableConfig(name, max(cards[f] for f in feats), dims.get(feature, dim), list(feats),
                                      pooling if any(f in multihot for f in feats) else "sum", dynamic=is_dynamic,
                                      admit_after=admit_after if is_dynamic else 1))
        else:
            is_dynamic = feature in dynamic
            tables.append(TableConfig(f"{prefix}{feature}", cards[feature], dims.get(feature, dim), [feature],
                                      pooling if feature in multihot else "sum", dynamic=is_dynamic,
                                      admit_after=admit_after if is_dynamic else 1))
    return tables
