"""``schema.json``: what the ETL wrote, read by every later stage.

The schema names each output column with its role, dtype and (for categorical columns) the
cardinality, i.e. the embedding table size including the reserved indices. A *dynamic* column
holds raw 64-bit ids (``int64``, any value, no vocabulary: hashes of the raw values) and its
cardinality is the capacity of the dynamic embedding table that learns them. The order of
``categorical`` is the order of the sparse features everywhere after the ETL (loader, embedding
tables, export).

Example::

    schema = Schema.load("data/synthetic/processed/schema.json")
    schema.cardinalities()   # {"C1": 1462, ...}
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipeline.files import FileLock, read_json, write_json

SCHEMA_VERSION = 1
ROLES = ("label", "continuous", "categorical", "multihot")
DYNAMIC_ROWS = 128
"""A dynamic column's cardinality (its table's capacity) is a multiple of this: whole buckets of the
table's hash table (``pipeline.kernels.hashtable.SLOTS``)."""
MAX_BUCKETS = 2**31 - 2
"""The most buckets a hashed column may have: its codes are int32, 0 for a missing value and 1..buckets."""


class SchemaError(ValueError):
    """A schema file, or data that does not match its schema."""


@dataclass
class Column:
    """One output column."""

    name: str
    role: str
    dtype: str
    cardinality: int = 0
    """Embedding table size (categorical and multihot only), reserved indices included; a dynamic
    column's: the capacity of its table."""
    max_length: int = 0
    """Multihot only: the longest list seen at fit time."""
    dynamic: bool = False
    """Categorical and multihot only: raw int64 ids (any value, not ``< cardinality``) for a dynamic table."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise SchemaError(f"column {self.name}: role must be one of {ROLES}, got {self.role!r}")
        if self.role in ("categorical", "multihot") and self.cardinality <= 0:
            raise SchemaError(f"column {self.name}: a {self.role} column needs a positive cardinality")
        if self.dynamic and (self.role not in ("categorical", "multihot") or "int64" not in self.dtype
                             or self.cardinality % DYNAMIC_ROWS):
            raise SchemaError(f"column {self.name}: a dynamic column is categorical or multihot, of int64 ids, with "
                              f"a cardinality that is a multiple of {DYNAMIC_ROWS}; this one is {self.role} "
                              f"{self.dtype} of {self.cardinality}")


@dataclass
class Schema:
    """Column roles, dtypes and cardinalities of the ETL output."""

    columns: list[Column]
    row_group_rows: int = 0
    rows: dict[str, int] = field(default_factory=dict)
    """Rows per split, as written."""
    version: int = SCHEMA_VERSION
    workflow: str = ""
    """The fingerprint of the saved workflow that wrote the output (``Workflow.fingerprint``): a model trained on it
    is served with that workflow only."""

    def __post_init__(self) -> None:
        labels = [c.name for c in self.columns if c.role == "label"]
        if len(labels) != 1:
            raise SchemaError(f"expected exactly one label column, got {labels}")
        names = [c.name for c in self.columns]
        if len(set(names)) != len(names):
            raise SchemaError(f"duplicate column names in schema: {names}")

    @property
    def label(self) -> str:
        return next(c.name for c in self.columns if c.role == "label")

    @property
    def continuous(self) -> list[str]:
        return [c.name for c in self.columns if c.role == "continuous"]

    @property
    def sparse(self) -> list[str]:
        """The sparse features (categorical and multi-hot), in feature order."""
        return [c.name for c in self.columns if c.role in ("categorical", "multihot")]

    @property
    def multihot(self) -> list[str]:
        return [c.name for c in self.columns if c.role == "multihot"]

    @property
    def dynamic(self) -> list[str]:
        """The sparse features of raw 64-bit ids (dynamic tables), in feature order."""
        return [c.name for c in self.columns if c.dynamic]

    def column(self, name: str) -> Column:
        for c in self.columns:
            if c.name == name:
                return c
        raise SchemaError(f"no column {name!r} in the schema; it has {[c.name for c in self.columns]}")

    def cardinalities(self) -> dict[str, int]:
        return {c.name: c.cardinality for c in self.columns if c.role in ("categorical", "multihot")}

    def to_dict(self) -> dict:
        """The ``schema.json`` contents; ``dynamic`` appears on the dynamic columns only."""
        out = asdict(self)
        for column in out["columns"]:
            if not column["dynamic"]:
                del column["dynamic"]
        return out

    def save(self, path: str | Path) -> None:
        write_json(path, self.to_dict())

    @classmethod
    def from_dict(cls, d: dict) -> Schema:
        if not isinstance(d, dict):
            raise SchemaError(f"a schema is a JSON object, not {type(d).__name__}; rerun the ETL")
        version = d.get("version")
        if version != SCHEMA_VERSION:
            raise SchemaError(f"schema version {version} is not supported (expected {SCHEMA_VERSION}); rerun the ETL")
        return cls(
            columns=[Column(**c) for c in d["columns"]],
            row_group_rows=d.get("row_group_rows", 0),
            rows=d.get("rows", {}),
            version=version,
            workflow=d.get("workflow", ""),
        )

    @classmethod
    def load(cls, path: str | Path) -> Schema:
        path = Path(path)
        if not path.is_file():
            raise SchemaError(f"no schema at {path}: run `python -m pipeline run etl` first")
        return cls.from_dict(read_json(path, "run `python -m pipeline run etl` again"))


def processed_lock(processed: str | Path, shared: bool) -> FileLock:
    """The lock on an ETL output folder (``processed/``, a file beside it): the ETL writes it under an exclusive one,
    a training run reads it under a shared one, so neither starts while the other runs (two ETLs at once left a
    schema.json beside a split of the other, and an ETL under a training made its reads fail mid-run)."""
    processed = Path(processed)
    busy = (f"{processed} is being written by an ETL, or read by a training run, in another process now: wait for it "
            "to end" if not shared else f"an ETL is writing {processed} in another process now: wait for it to end, "
            "then train")
    return FileLock(processed.with_name(f".{processed.name}.lock"), busy, shared=shared)
