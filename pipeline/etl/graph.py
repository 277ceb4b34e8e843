"""The operator graph: ``columns >> Op() >> Op()`` chains, combined with ``+``.

A :class:`Node` is either a selection of input columns, an operator applied to its parents' output
columns, or (after ``+``) the union of several nodes' outputs. Nodes are immutable once built.

Example::

    cats = ["C1", "C2"] >> Categorify(freq_threshold=2)
    conts = ["I1"] >> FillMissing() >> Clip(min_value=0) >> LogOp() >> Normalize()
    features = cats + conts + ["label"]
    features.output_columns    # ["C1", "C2", "I1", "label"]
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol, Union, runtime_checkable

ColumnsLike = Union["Node", str, Iterable[str]]


@runtime_checkable
class GraphOperator(Protocol):
    """What a node needs of its operator (``pipeline.etl.ops.Operator`` is the implementation)."""

    def output_columns(self, columns: list[str]) -> list[str]: ...

    def transform(self, df: Any) -> Any: ...


class Node:
    """One step of the graph: input columns, an operator on its parents, or a union of nodes."""

    def __init__(self, parents: list[Node] = (), op: GraphOperator | None = None, columns: list[str] | None = None):
        self.parents = list(parents)
        self.op = op
        if columns is not None:
            repeated = sorted({c for c in columns if list(columns).count(c) > 1})
            if repeated:
                raise ValueError(f"the selection {list(columns)} names {repeated} more than once: name each column once")
            self.input_columns = list(columns)
            self.output_columns = list(columns)
        else:
            if op is None:
                _refuse_duplicates(self.parents)
            self.input_columns = _union([p.output_columns for p in self.parents])
            self.output_columns = op.output_columns(self.input_columns) if op else self.input_columns
        if not self.output_columns:
            raise ValueError("a node needs at least one column")

    @classmethod
    def of(cls, value: ColumnsLike) -> Node:
        """A node from a node, a column name, or a list of column names."""
        if isinstance(value, Node):
            return value
        if isinstance(value, str):
            return cls(columns=[value])
        columns = list(value)
        if not all(isinstance(c, str) for c in columns):
            raise TypeError(f"expected column names (str), got {columns!r}")
        return cls(columns=columns)

    @property
    def is_selection(self) -> bool:
        return self.op is None and not self.parents

    def __rshift__(self, op: GraphOperator) -> Node:
        if isinstance(op, (Node, type)) or not isinstance(op, GraphOperator):
            raise TypeError(f"expected an operator after >>, got {type(op).__name__}")
        return Node([self], op=op)

    @property
    def is_union(self) -> bool:
        return self.op is None and bool(self.parents)

    def __add__(self, other: ColumnsLike) -> Node:
        return Node(_union_parents(self) + _union_parents(Node.of(other)))

    def __radd__(self, other: ColumnsLike) -> Node:
        return Node(_union_parents(Node.of(other)) + _union_parents(self))

    def walk(self) -> Iterator[Node]:
        """Every node this one depends on, parents before children, each once."""
        seen: set[int] = set()
        order: list[Node] = []

        def visit(node: Node) -> None:
            if id(node) in seen:
                return
            seen.add(id(node))
            for parent in node.parents:
                visit(parent)
            order.append(node)

        visit(self)
        return iter(order)

    def raw_columns(self) -> list[str]:
        """The input columns the whole graph reads."""
        return _union([n.output_columns for n in self.walk() if n.is_selection])

    def __repr__(self) -> str:
        what = type(self.op).__name__ if self.op else ("select" if self.is_selection else "+")
        return f"Node({what} -> {self.output_columns})"


def _union_parents(node: Node) -> list[Node]:
    """``a + b + c`` is one union of three nodes, not a union of a union."""
    return list(node.parents) if node.is_union else [node]


def _union(lists: list[list[str]]) -> list[str]:
    seen: dict[str, None] = {}
    for cols in lists:
        for c in cols:
            seen.setdefault(c, None)
    return list(seen)


def _refuse_duplicates(parents: list[Node]) -> None:
    seen: dict[str, Node] = {}
    for parent in parents:
        for c in parent.output_columns:
            if c in seen and seen[c] is not parent:
                raise ValueError(f"column {c!r} would come out twice, from {seen[c]} and from {parent}")
            seen[c] = parent
