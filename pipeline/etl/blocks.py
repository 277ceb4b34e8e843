"""Columns of one kind held together, so that the operators that compute many columns at once take them so.

The serving path gets a request's columns kind by kind (:mod:`export.preprocess`: a matrix of its numbers, one
Arrow array of its strings). Handed over column by column, each column would cost Python calls of its own in
every operator; as blocks, an operator's ``transform_many`` computes all of them in one step:

- :class:`ColumnRows`: numeric columns, each a row of one 2-D array ``[column, row]`` (numpy, or CuPy): what the
  numeric operators compute on (their ``transform_rows``), and what they answer with;
- :class:`ColumnSlices`: text columns one after the other in one Arrow array, each ``rows`` long: Categorify looks
  all of them up in one pass; :class:`ColumnBytes`: the same as the fixed-width bytes a request brings, the Arrow
  array made only for an operator that asks for it;
- :class:`BlockColumns`: several blocks (or plain dicts of columns) side by side, by name.

Each is a read-only mapping of column name -> the column as a frame would hold it (a row of the matrix; an
arrow-backed pandas array), so any operator or code that reads columns one by one sees what it would see
without blocks. :meth:`select` takes some columns of a block as a block (a selection of the workflow's graph),
and :meth:`BlockColumns.matrix` gives columns side by side ``[row, column]`` in one step where they are rows of
blocks.

Example::

    numbers = ColumnRows(["I1", "I2"], np.array([[1.0, np.nan], [3.0, 4.0]]))   # two columns of two rows
    strings = ColumnSlices(["C1", "C2"], pa.array(["a", None, "b", "c"]), rows=2)
    columns = BlockColumns([numbers, strings])
    workflow.transform_columns(columns).matrix(["I1", "I2"], np.float32)   # [2 rows, 2 columns], or None
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from functools import cached_property
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa


class ColumnRows(Mapping):
    """Columns ``names``, each a row of ``matrix`` ``[column, row]``."""

    def __init__(self, names: list[str], matrix: Any) -> None:
        self.names = list(names)
        self.matrix = matrix
        self._rows: dict[str, int] | None = None

    @property
    def _row(self) -> dict[str, int]:
        if self._rows is None:  # made when a column is read by name: a block that goes through whole needs none
            self._rows = {name: k for k, name in enumerate(self.names)}
        return self._rows

    @property
    def rows(self) -> int:
        return self.matrix.shape[1]

    def __getitem__(self, name: str) -> Any:
        return self.matrix[self._row[name]]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def select(self, names: list[str]) -> ColumnRows:
        """The columns ``names`` as a block: this one where they are all of it, in order."""
        if names == self.names:
            return self
        return ColumnRows(names, self.matrix[_positions([self._row[name] for name in names])])


class ColumnSlices(Mapping):
    """Columns ``names`` of ``rows`` values each, one after the other in the Arrow array ``array``."""

    def __init__(self, names: list[str], array: pa.Array, rows: int) -> None:
        self.names = list(names)
        self.array = array
        self.rows = rows
        self._at = {name: k for k, name in enumerate(self.names)}

    def arrow(self, name: str) -> pa.Array:
        """The column ``name`` as an Arrow array (a slice: no copy)."""
        return self.array.slice(self._at[name] * self.rows, self.rows)

    def __getitem__(self, name: str) -> Any:
        return pd.arrays.ArrowExtensionArray(self.arrow(name))

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def select(self, names: list[str]) -> ColumnSlices:
        if names == self.names:
            return self
        return ColumnSlices(names, pa.concat_arrays([self.arrow(name) for name in names]), self.rows)


class ColumnBytes(ColumnSlices):
    """Text columns ``names`` of ``rows`` values each, one after the other in the numpy ``S`` array ``fixed_width``, as
    a request brings them: each value's text is its bytes up to the array's zero padding (UTF-8 holding no NUL
    byte), an empty value is missing. An operator that takes text in one pass reads ``fixed_width``; the Arrow array
    of the strings, what any other reader of a column gets, is made the first time one asks, from the bytes' buffers
    (no pass per value)."""

    def __init__(self, names: list[str], fixed_width: np.ndarray, rows: int) -> None:
        self.names = list(names)
        self.fixed_width = fixed_width
        self.rows = rows
        self._at = {name: k for k, name in enumerate(self.names)}

    @cached_property
    def lengths(self) -> np.ndarray:
        """The bytes of each value (0: missing)."""
        return fixed_width_lengths(self.fixed_width)

    @cached_property
    def array(self) -> pa.Array:  # type: ignore[override]
        values = np.ascontiguousarray(self.fixed_width)
        flat, lengths = values.view(np.uint8), self.lengths
        offsets = np.zeros(len(values) + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        present = lengths > 0
        validity = None if present.all() else pa.py_buffer(np.packbits(present, bitorder="little"))
        return pa.Array.from_buffers(pa.string(), len(values), [validity, pa.py_buffer(offsets),
                                                                pa.py_buffer(flat[flat != 0])])

    def select(self, names: list[str]) -> ColumnBytes:
        """The columns ``names`` as a block: this one where they are all of it, in order; a view of its bytes where
        they follow each other."""
        if names == self.names:
            return self
        at = _positions([self._at[name] for name in names])
        if isinstance(at, slice):
            return ColumnBytes(names, self.fixed_width[at.start * self.rows: at.stop * self.rows], self.rows)
        parts = [self.fixed_width[k * self.rows: (k + 1) * self.rows] for k in at]
        return ColumnBytes(names, np.concatenate(parts), self.rows)


class BlockColumns(Mapping):
    """Several blocks of columns (or plain mappings of them), side by side by name; no name in two of them."""

    def __init__(self, blocks: list[Mapping]) -> None:
        self.blocks = [inner for block in blocks for inner in (block.blocks if isinstance(block, BlockColumns)
                                                               else [block]) if len(inner)]
        self._block_of = {name: block for block in self.blocks for name in block}

    def __getitem__(self, name: str) -> Any:
        column = self._block_of[name][name]
        return column.array if isinstance(column, pd.Series) else column  # the array, as in a frame's column

    def __iter__(self) -> Iterator[str]:
        return iter(self._block_of)

    @property
    def rows(self) -> int:
        """The number of rows of its columns (read off the first block, without making a column of it)."""
        for block in self.blocks:
            return block.rows if hasattr(block, "rows") else len(next(iter(block.values())))
        return 0

    def __len__(self) -> int:
        return len(self._block_of)

    def select(self, names: list[str]) -> Mapping:
        """The columns ``names`` by block: each run of them that one block holds as that block's selection."""
        parts = [block.select(run) if hasattr(block, "select") else {name: block[name] for name in run}
                 for block, run in self._runs(names)]
        return parts[0] if len(parts) == 1 else BlockColumns(parts)

    def matrix(self, names: list[str], dtype: Any) -> np.ndarray | None:
        """The columns ``names`` side by side, ``[row, column]`` of ``dtype``, in one copy from the matrices of the
        blocks that hold them; None unless every run of them is rows of one :class:`ColumnRows`."""
        runs = self._runs(names)
        if not all(isinstance(block, ColumnRows) and isinstance(block.matrix, np.ndarray) for block, _ in runs):
            return None
        parts = [block.select(run).matrix for block, run in runs]
        return np.ascontiguousarray((parts[0] if len(parts) == 1 else np.concatenate(parts)).T, dtype=dtype)

    def _runs(self, names: list[str]) -> list[tuple[Mapping, list[str]]]:
        """``names`` cut into runs that one block holds, in order (a whole block's names compared at once)."""
        runs, at = [], 0
        while at < len(names):
            block = self._block_of[names[at]]
            whole = block.names if isinstance(block, (ColumnRows, ColumnSlices)) else list(block)
            end = at + len(whole)
            if names[at:end] != whole:
                end = at + 1
                while end < len(names) and self._block_of[names[end]] is block:
                    end += 1
            runs.append((block, names[at:end]))
            at = end
        return runs


_LOW7 = np.uint64(0x7F7F7F7F7F7F7F7F)
_HIGH = np.uint64(0x8080808080808080)
_ONES = np.uint64(0x0101010101010101)


def fixed_width_words(values: np.ndarray) -> np.ndarray:
    """The values of a numpy ``S`` array as rows of little-endian 64-bit words ``[n, W]``, zero after each value's
    bytes (a view of them where their width is a multiple of 8 bytes)."""
    n, width = len(values), values.dtype.itemsize
    raw = np.ascontiguousarray(values).view(np.uint8).reshape(n, width)
    if width % 8:
        padded = np.zeros((n, -(-width // 8) * 8), dtype=np.uint8)
        padded[:, :width] = raw
        raw = padded
    return raw.view("<u8")


def fixed_width_lengths(values: np.ndarray) -> np.ndarray:
    """The length of each value of a numpy ``S`` array whose values hold no NUL byte (int64): its count of nonzero
    bytes, found with a few operations on 64-bit words (a byte's high bit set where it is nonzero, the marks added by a
    multiply), which cost numpy far less than a reduction along each value's few bytes."""
    words = fixed_width_words(values)
    counts = np.zeros(len(words), dtype=np.int64)
    for k in range(words.shape[1]):
        word = words[:, k]
        marks = ((((word & _LOW7) + _LOW7) | word) & _HIGH) >> np.uint64(7)
        counts += ((marks * _ONES) >> np.uint64(56)).astype(np.int64)
    return counts


def _positions(rows: list[int]) -> slice | list[int]:
    """``rows`` as a slice where they follow each other (a view of the matrix, not a copy), else as they are."""
    return slice(rows[0], rows[-1] + 1) if rows == list(range(rows[0], rows[-1] + 1)) else rows
