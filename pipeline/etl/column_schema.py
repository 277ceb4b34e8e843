"""What the workflow knows of each column: its tags (role), dtype, whether it holds lists, and the
properties its operator computed (cardinality, longest list), in the manner of merlin.dag's ColumnSchema.

The raw columns get their tags from their roles (:func:`input_schema`); each operator derives the
schema of its outputs from its inputs' (``Operator.compute_output_schema``), and
:func:`to_schema` turns the workflow's output columns into the ``schema.json`` contents.

Example::

    columns = workflow.output_schema(input_schema(roles))
    to_schema(columns, rows={"train": 800}, row_group_rows=65_536).save("processed/schema.json")
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.schema import Column, Schema

LABEL = "label"
CONTINUOUS = "continuous"
CATEGORICAL = "categorical"
KIND_TAGS = frozenset({CONTINUOUS, CATEGORICAL})
"""The tags that say what kind of feature a column is; an operator that declares one replaces the input's."""


@dataclass(frozen=True)
class ColumnSchema:
    """One column as an operator sees or makes it."""

    name: str
    tags: frozenset[str] = frozenset()
    dtype: str = ""
    """The element dtype (``int32``, ``float32``, ...); empty when not known (raw input columns)."""
    is_list: bool = False
    cardinality: int = 0
    """Embedding table size of a categorical column, reserved codes included."""
    max_length: int = 0
    """List columns: the longest list seen at fit time."""
    dynamic: bool = False
    """Raw 64-bit ids for a dynamic table (``HashIds``); ``cardinality`` is then the table's capacity."""

    def with_tags(self, tags: frozenset[str]) -> frozenset[str]:
        """This column's tags after an operator that declares ``tags``."""
        return (self.tags - KIND_TAGS) | tags if tags & KIND_TAGS else self.tags | tags


def input_schema(roles: dict) -> list[ColumnSchema]:
    """The raw columns of these roles (``{"label", "continuous", "categorical", "multihot"}``), tagged."""
    return [
        ColumnSchema(roles["label"], frozenset({LABEL})),
        *(ColumnSchema(name, frozenset({CONTINUOUS})) for name in roles["continuous"]),
        *(ColumnSchema(name, frozenset({CATEGORICAL})) for name in roles["categorical"]),
        *(ColumnSchema(name, frozenset({CATEGORICAL}), is_list=True) for name in roles.get("multihot", [])),
    ]


def to_schema(columns: list[ColumnSchema], rows: dict[str, int], row_group_rows: int, workflow: str = "") -> Schema:
    """The ``schema.json`` contents of the output columns: role from the tags, dtype, cardinality (``workflow``: the
    fingerprint of the saved workflow that wrote them)."""
    out = []
    for column in columns:
        if LABEL in column.tags:
            role = "label"
        elif CATEGORICAL in column.tags:
            role = "multihot" if column.is_list else "categorical"
        elif CONTINUOUS in column.tags:
            role = "continuous"
        else:
            raise ValueError(f"output column {column.name!r} has no role: expected one of the tags "
                             f"{[LABEL, CONTINUOUS, CATEGORICAL]}, got {sorted(column.tags)}")
        sparse = role in ("categorical", "multihot")
        out.append(Column(name=column.name, role=role,
                          dtype=f"list<{column.dtype}>" if column.is_list else column.dtype,
                          cardinality=column.cardinality if sparse else 0,
                          max_length=column.max_length if role == "multihot" else 0,
                          dynamic=column.dynamic and sparse))
    return Schema(columns=out, row_group_rows=row_group_rows, rows=rows, workflow=workflow)
