"""``TablePacking``: many embedding tables packed into one flat weight tensor, and the slots reading them.

A *slot* is one (table, feature) pair; the pooled output is the slots' columns in slot order. Tables
are stored grouped by dim (:class:`DimGroup`), so the reference can view a whole group as one 2-D
matrix; the kernels only need the offsets. See ``docs/EMBEDDING.md`` for the full contract.

Example::

    packing = TablePacking.build(tables)   # tables: objects with name, rows, dim, features, pooling
    packing.weights_offsets[t]              # element offset of table t in the flat weights
    packing.op_args()                       # (rows, dims, slot_table, slot_mean): what the ops take
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class DimGroup:
    """Tables of one dim, stored contiguously: ``weights[start : start + rows * dim].view(rows, dim)``."""

    dim: int
    start: int
    rows: int
    row_start: int
    slots: list[int]


@dataclass
class TablePacking:
    """Where every table and slot lives in the flat weights and in the pooled output."""

    table_names: list[str]
    rows: list[int]
    dims: list[int]
    weights_offsets: list[int]
    row_offsets: list[int]
    slot_table: list[int]
    slot_features: list[str]
    slot_dims: list[int]
    slot_mean: list[bool]
    output_offsets: list[int]
    groups: list[DimGroup]
    slot_group_row_base: list[int]
    """Per slot: the row of its table's row 0 within its dim group (for a group-wide 2-D view)."""
    _device_cache: dict = field(default_factory=dict, repr=False)

    @property
    def num_slots(self) -> int:
        return len(self.slot_table)

    @property
    def total_dim(self) -> int:
        return self.output_offsets[-1]

    @property
    def total_rows(self) -> int:
        return sum(self.rows)

    @property
    def total_elements(self) -> int:
        return sum(r * d for r, d in zip(self.rows, self.dims))

    def op_args(self) -> tuple[list[int], list[int], list[int], list[bool]]:
        """``(rows, dims, slot_table, slot_mean)``: the packing as the ``pipeline::`` ops take it."""
        return self.rows, self.dims, self.slot_table, self.slot_mean

    def tensors(self, device: torch.device | str) -> dict[str, torch.Tensor]:
        """The per-table and per-slot lists as int64 tensors on ``device`` (cached)."""
        key = ("tensors", str(device))
        if key not in self._device_cache:
            names = ("rows", "dims", "weights_offsets", "row_offsets", "slot_table", "slot_dims", "output_offsets",
                     "slot_group_row_base")
            out = {n: torch.tensor(getattr(self, n), dtype=torch.int64, device=device) for n in names}
            out["slot_mean"] = torch.tensor(self.slot_mean, dtype=torch.bool, device=device)
            out["slot_rows"] = out["rows"][out["slot_table"]]
            self._device_cache[key] = out
        return self._device_cache[key]

    def cached(self, key, make):
        """``make()`` once per ``key`` for this packing (per-device arrays the launchers derive from it)."""
        if key not in self._device_cache:
            self._device_cache[key] = make()
        return self._device_cache[key]

    @classmethod
    def build(cls, tables: Sequence) -> TablePacking:
        """From table configs (``name``, ``rows``, ``dim``, ``features``, ``pooling``), in the given order."""
        slot_table = [t for t, table in enumerate(tables) for _ in table.features]
        return cls.pack([t.rows for t in tables], [t.dim for t in tables], slot_table,
                        [tables[t].pooling == "mean" for t in slot_table], [t.name for t in tables],
                        [f for table in tables for f in table.features])

    @classmethod
    def pack(cls, rows: Sequence[int], dims: Sequence[int], slot_table: Sequence[int], slot_mean: Sequence[bool],
             table_names: Sequence[str] | None = None, slot_features: Sequence[str] | None = None) -> TablePacking:
        """Pack tables of ``rows[t] x dims[t]``, grouped by dim, read by slots ``slot_table`` / ``slot_mean``."""
        order = sorted(range(len(rows)), key=lambda t: dims[t])
        weights_offsets = [0] * len(rows)
        row_offsets = [0] * len(rows)
        group_row_of_table = [0] * len(rows)
        groups: list[DimGroup] = []
        elem = row = 0
        for t in order:
            dim = dims[t]
            if not groups or groups[-1].dim != dim:
                groups.append(DimGroup(dim, elem, 0, row, []))
            weights_offsets[t], row_offsets[t] = elem, row
            group_row_of_table[t] = groups[-1].rows
            groups[-1].rows += rows[t]
            elem += rows[t] * dim
            row += rows[t]
        slot_dims = [dims[t] for t in slot_table]
        output_offsets = [0]
        for d in slot_dims:
            output_offsets.append(output_offsets[-1] + d)
        group_of_dim = {g.dim: g for g in groups}
        for s, d in enumerate(slot_dims):
            group_of_dim[d].slots.append(s)
        return cls(
            table_names=list(table_names) if table_names is not None else [str(t) for t in range(len(rows))],
            rows=list(rows),
            dims=list(dims),
            weights_offsets=weights_offsets,
            row_offsets=row_offsets,
            slot_table=list(slot_table),
            slot_features=list(slot_features) if slot_features is not None else [str(s) for s in slot_table],
            slot_dims=slot_dims,
            slot_mean=[bool(m) for m in slot_mean],
            output_offsets=output_offsets,
            groups=groups,
            slot_group_row_base=[group_row_of_table[t] for t in slot_table],
        )


@functools.lru_cache(maxsize=256)
def packing_of(rows: tuple[int, ...], dims: tuple[int, ...], slot_table: tuple[int, ...],
               slot_mean: tuple[bool, ...]) -> TablePacking:
    """The packing the ops rebuild from their list arguments (once per distinct packing)."""
    return TablePacking.pack(rows, dims, slot_table, slot_mean)
