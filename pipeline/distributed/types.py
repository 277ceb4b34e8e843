"""The sharding plan (where every table of an embedding collection lives, saved as JSON) and awaitables.

Three ways to place a table (torchrec's names):

- ``table_wise``: the whole table on one rank (``ranks == [owner]``); its features' bags travel to
  the owner, the pooled vectors travel back (all-to-all both ways).
- ``row_wise``: rows split in contiguous ranges over all ranks (``row_ranges[i]`` on ``ranks[i]``);
  each id travels to the rank holding its row, every rank pools what it holds, and the partial
  pools are summed where the sample lives.
- ``data_parallel``: a copy of the table on every rank; lookups stay local and the row gradients of
  all ranks are summed (all-reduce) before the one identical update of every copy.

A table-wise or row-wise table may also be *host-cached* (``cache_rows > 0``, TorchRec's
``fused_uvm_caching``): each part of it stays in its rank's host memory, and that many of its rows
live in a device cache (:mod:`pipeline.modules.cached_collection`).

Example::

    plan = ShardingPlan(2, {"t_C1": ParameterSharding.table_wise("t_C1", 1000, rank=1),
                            "t_C2": ParameterSharding.row_wise("t_C2", 10**7, world_size=2)})
    print(plan.describe(tables))
    plan.save("plan.json"); ShardingPlan.load("plan.json") == plan   # True

An :class:`Awaitable` (torchrec's) is a result whose collective may still be running: ``wait()``
blocks until it is there and returns it, so a caller can launch an exchange and compute meanwhile.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Generic, TypeVar

from pipeline.files import write_text
from pipeline.schema import DYNAMIC_ROWS

PLAN_VERSION = 1

W = TypeVar("W")
V = TypeVar("V")


class Awaitable(abc.ABC, Generic[W]):
    """A result that may still be in flight: ``wait()`` blocks until it is there, then returns it."""

    @abc.abstractmethod
    def wait(self) -> W: ...

    def then(self, fn: Callable[[W], V]) -> Awaitable[V]:
        """An awaitable of ``fn(self.wait())``: ``fn`` runs when the new one is waited on."""
        return _Then(self, fn)


class NoWait(Awaitable[W]):
    """A result that is there already."""

    def __init__(self, value: W) -> None:
        self.value = value

    def wait(self) -> W:
        return self.value


class AwaitableList(Awaitable[list]):
    """Several awaitables; ``wait()`` waits for each, in order, and returns their results."""

    def __init__(self, awaitables: Sequence[Awaitable]) -> None:
        self.awaitables = list(awaitables)

    def wait(self) -> list:
        return [a.wait() for a in self.awaitables]


class _Then(Awaitable[V]):
    def __init__(self, first: Awaitable[W], fn: Callable[[W], V]) -> None:
        self.first, self.fn = first, fn

    def wait(self) -> V:
        return self.fn(self.first.wait())


class ShardingType(str, Enum):
    TABLE_WISE = "table_wise"
    ROW_WISE = "row_wise"
    DATA_PARALLEL = "data_parallel"


class PlanError(ValueError):
    """A plan that does not match the tables or the world it is used with."""


def even_row_ranges(rows: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering ``rows``; the first ``rows % parts`` are one row longer."""
    if rows < parts:
        raise PlanError(f"cannot split {rows} rows over {parts} ranks row-wise (needs at least one row per rank)")
    q, rem = divmod(rows, parts)
    ranges, lo = [], 0
    for r in range(parts):
        hi = lo + q + (1 if r < rem else 0)
        ranges.append((lo, hi))
        lo = hi
    return ranges


@dataclass
class ParameterSharding:
    """Placement of one table: the sharding type, the ranks and (per rank) the global rows held; with
    ``cache_rows``, each part in host memory behind a device cache of that many rows (at most the part's)."""

    table: str
    sharding_type: ShardingType
    ranks: list[int]
    row_ranges: list[tuple[int, int]]
    cache_rows: int = 0

    def __post_init__(self) -> None:
        self.sharding_type = ShardingType(self.sharding_type)
        self.row_ranges = [(int(lo), int(hi)) for lo, hi in self.row_ranges]
        if len(self.ranks) != len(self.row_ranges):
            raise PlanError(f"table {self.table}: {len(self.ranks)} ranks but {len(self.row_ranges)} row ranges")

    @classmethod
    def table_wise(cls, table: str, rows: int, rank: int, cache_rows: int = 0) -> ParameterSharding:
        return cls(table, ShardingType.TABLE_WISE, [rank], [(0, rows)], cache_rows)

    @classmethod
    def row_wise(cls, table: str, rows: int, world_size: int, cache_rows: int = 0) -> ParameterSharding:
        return cls(table, ShardingType.ROW_WISE, list(range(world_size)), even_row_ranges(rows, world_size), cache_rows)

    @classmethod
    def data_parallel(cls, table: str, rows: int, world_size: int) -> ParameterSharding:
        return cls(table, ShardingType.DATA_PARALLEL, list(range(world_size)), [(0, rows)] * world_size)

    def rows_on(self, rank: int) -> tuple[int, int] | None:
        """The global row range ``[lo, hi)`` this table keeps on ``rank``, or None."""
        return self.row_ranges[self.ranks.index(rank)] if rank in self.ranks else None

    def cache_rows_on(self, rank: int) -> int:
        """The device cache rows of this table's part on ``rank`` (0: the part lives in device memory)."""
        lo, hi = self.rows_on(rank) or (0, 0)
        return min(self.cache_rows, hi - lo)

    def to_dict(self) -> dict:
        return {"table": self.table, "sharding_type": self.sharding_type.value, "ranks": list(self.ranks),
                "row_ranges": [list(r) for r in self.row_ranges], "cache_rows": self.cache_rows}


def _check_dynamic(table, p: ParameterSharding) -> None:
    """A dynamic table (its rows follow its ids, placed by a hash table) is table-wise, or row-wise in whole
    buckets of its hash table per rank; a copy per rank (data-parallel) would place ids apart on each."""
    if p.sharding_type == ShardingType.DATA_PARALLEL:
        raise PlanError(f"table {table.name} is dynamic (its rows follow its ids): it cannot be data_parallel, whose "
                        "copies would place ids apart on each rank; place it table_wise or row_wise")
    if p.cache_rows:
        raise PlanError(f"table {table.name} is dynamic (its rows follow its ids, placed by a hash table on the "
                        "device): it cannot be host-cached; place it table_wise or row_wise in device memory")
    if p.sharding_type == ShardingType.ROW_WISE and any((hi - lo) % DYNAMIC_ROWS for lo, hi in p.row_ranges):
        raise PlanError(f"table {table.name} is dynamic: row-wise, each rank needs a multiple of {DYNAMIC_ROWS} "
                        f"rows (whole buckets of its hash table), got ranges {p.row_ranges}; give it a capacity "
                        f"that is a multiple of {DYNAMIC_ROWS} x {len(p.ranks)} ranks, or place it table_wise")


@dataclass
class ShardingPlan:
    """Every table's :class:`ParameterSharding` for a world of ``world_size`` ranks."""

    world_size: int
    tables: dict[str, ParameterSharding] = field(default_factory=dict)

    def __getitem__(self, table: str) -> ParameterSharding:
        return self.tables[table]

    def by_type(self, kind: ShardingType) -> list[str]:
        return [name for name, p in self.tables.items() if p.sharding_type == kind]

    def validate(self, tables: Sequence, world_size: int | None = None) -> None:
        """Check the plan covers exactly ``tables`` (TableConfig-like) for ``world_size`` ranks."""
        if world_size is not None and world_size != self.world_size:
            raise PlanError(f"the plan is for {self.world_size} ranks, this world has {world_size}")
        names = [t.name for t in tables]
        if sorted(names) != sorted(self.tables):
            raise PlanError(f"the plan places tables {sorted(self.tables)}, the model has {sorted(names)}")
        for key, p in self.tables.items():
            if p.table != key:
                raise PlanError(f"the plan's entry {key!r} describes table {p.table!r}")
        for t in tables:
            p = self.tables[t.name]
            if any(r < 0 or r >= self.world_size for r in p.ranks):
                raise PlanError(f"table {t.name}: ranks {p.ranks} outside 0..{self.world_size - 1}")
            if p.sharding_type == ShardingType.ROW_WISE:
                if p.ranks != list(range(self.world_size)):
                    raise PlanError(f"table {t.name}: row-wise tables span all ranks in order, got {p.ranks}")
                los = [lo for lo, _ in p.row_ranges]
                his = [hi for _, hi in p.row_ranges]
                if los[0] != 0 or his[-1] != t.rows or los[1:] != his[:-1] or any(h <= lo for lo, h in p.row_ranges):
                    raise PlanError(f"table {t.name}: row ranges {p.row_ranges} do not tile 0..{t.rows} "
                                    "with a non-empty range per rank")
            elif p.row_ranges and any(r != (0, t.rows) for r in p.row_ranges):
                raise PlanError(f"table {t.name}: a {p.sharding_type.value} table holds rows 0..{t.rows}, "
                                f"got {p.row_ranges}")
            if p.sharding_type == ShardingType.TABLE_WISE and len(p.ranks) != 1:
                raise PlanError(f"table {t.name}: a table-wise table lives on one rank, got {p.ranks}")
            if p.sharding_type == ShardingType.DATA_PARALLEL and p.ranks != list(range(self.world_size)):
                raise PlanError(f"table {t.name}: a data-parallel table lives on every rank, got {p.ranks}")
            if p.cache_rows and (p.sharding_type == ShardingType.DATA_PARALLEL or not 0 < p.cache_rows <= t.rows):
                raise PlanError(f"table {t.name}: a device cache of {p.cache_rows} rows for a {p.sharding_type.value} "
                                f"table of {t.rows} rows (host-cached tables are table-wise or row-wise, their cache "
                                "1 row to all of them)")
            if getattr(t, "dynamic", False):
                _check_dynamic(t, p)

    def describe(self, tables: Sequence | None = None, storage: dict[str, float] | None = None) -> str:
        """A table of the placements, for the log."""
        dims = {t.name: (t.rows, t.dim) for t in tables} if tables is not None else {}
        lines = [f"sharding plan for {self.world_size} rank(s):",
                 f"  {'table':<20} {'rows x dim':>18} {'sharding':<14} ranks (rows)"]
        for name, p in self.tables.items():
            shape = "x".join(map(str, dims[name])) if name in dims else "?"
            if p.sharding_type == ShardingType.ROW_WISE:
                where = ", ".join(f"{r}:[{lo},{hi})" for r, (lo, hi) in zip(p.ranks, p.row_ranges))
            elif p.sharding_type == ShardingType.DATA_PARALLEL:
                where = "all"
            else:
                where = str(p.ranks[0])
            if p.cache_rows:
                where += f", host-cached: {p.cache_rows:,} rows in device memory"
            lines.append(f"  {name:<20} {shape:>18} {p.sharding_type.value:<14} {where}")
        if storage:
            lines.append("  storage per rank (MiB): " + ", ".join(f"{r}: {v / 2**20:.1f}" for r, v in storage.items()))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"version": PLAN_VERSION, "world_size": self.world_size,
                "tables": [p.to_dict() for p in self.tables.values()]}

    @classmethod
    def from_dict(cls, d: dict) -> ShardingPlan:
        if d.get("version") != PLAN_VERSION:
            raise PlanError(f"sharding plan version {d.get('version')} is not supported (expected {PLAN_VERSION})")
        tables = {}
        for item in d["tables"]:
            p = ParameterSharding(item["table"], ShardingType(item["sharding_type"]), list(item["ranks"]),
                                  [tuple(r) for r in item["row_ranges"]], int(item.get("cache_rows", 0)))
            tables[p.table] = p
        return cls(int(d["world_size"]), tables)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> ShardingPlan:
        return cls.from_dict(json.loads(Path(path).read_text()))
