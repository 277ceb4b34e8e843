"""Raw request tensors -> model features, with the saved ETL workflow: the ``preprocess`` model's work.

A request holds one tensor per kind of raw column (:mod:`export.request`): ``INTEGERS`` and
``FLOATS`` with their ``*_MISSING`` masks, ``STRINGS`` and ``LISTS``, their columns in the order of
:attr:`RawColumns.layout`. A categorical value never seen at fit time gets the out-of-vocabulary
index; a missing one the workflow's null index; a missing number the workflow's fill value.

The numbers are checked and stacked once, into one float64 matrix ``[column, row]`` in the raw
columns' order (NaN: missing): each column is a row of it, the numbers the numeric operators read of
the ETL's column (``as_float64``: an int64 value beyond 2**53 rounds to the nearest float64 there
too). The text columns of ``STRINGS`` stay the fixed-width bytes the request carries
(:class:`~pipeline.etl.blocks.ColumnBytes`: Categorify, HashBucket and HashIds read them in place) where those
bytes are the text Arrow reads (UTF-8, no NUL byte inside a value); otherwise, and for ``LISTS``, the strings are
read in one pass, column after column, into one Arrow array whose slices are the columns, of the raw parquet's
own type. The workflow gets them kind by kind (:mod:`pipeline.etl.blocks`: the matrix, the bytes or the text
array), and any column read alone is what a column of the frame the ETL's reader gives the workflow holds (a row
of the matrix, an arrow-backed pandas array).
The *same* operators as offline run on them (``Workflow.transform_columns``: ``Workflow.transform``
without building a DataFrame in or out, the columns of an operator computed together where it can, as
it would compute each, and kept in blocks from one operator to the next). The processed columns become
the tensors the model takes, each cut from its blocks in one copy: ``DENSE`` ``[B,
n_cont]`` float32, ``CATEGORICAL_IDS`` ``[B, n_onehot]`` int64 and, with multi-hot features,
``MULTIHOT_IDS`` ``[B, W]`` (each row's bags packed, then ``-1``) and ``MULTIHOT_LENGTHS`` ``[B,
n_multihot]``. A tensor whose kind of feature the schema lacks is not emitted (the configs leave it out
too).

Example::

    pre = Preprocessor.load("repo/ensemble/1/artifacts")
    tensors = pre(pre.raw.layout.tensors(raw_rows))      # raw_rows: a DataFrame, dicts, TSV lines
    tensors["CATEGORICAL_IDS"].shape     # (B, 26)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from export.request import (
    FLOATS,
    FLOATS_MISSING,
    INTEGERS,
    INTEGERS_MISSING,
    LISTS,
    STRINGS,
    TEXT,
    RequestLayout,
    text_values,
)
from pipeline.errors import BadInputError, UserError
from pipeline.etl.blocks import BlockColumns, ColumnBytes, ColumnRows, ColumnSlices
from pipeline.etl.frames import list_lengths
from pipeline.schema import Schema

if TYPE_CHECKING:
    from pipeline.etl.workflow import Workflow

DENSE = "DENSE"
CATEGORICAL_IDS = "CATEGORICAL_IDS"
MULTIHOT_IDS = "MULTIHOT_IDS"
MULTIHOT_LENGTHS = "MULTIHOT_LENGTHS"


@dataclass
class RawColumns:
    """The raw columns a request carries, with the raw parquet's Arrow types (as strings)."""

    continuous: dict[str, str]
    categorical: dict[str, str]
    multihot: dict[str, str] = field(default_factory=dict)
    list_separator: str = "|"
    label: dict[str, str] = field(default_factory=dict)
    """The label column and its type: the workflow reads it too, so requests get a placeholder (zeros)."""
    table_label: str = ""
    """The label's name in the user's table (``data.label``), where it is not the raw name: rows read from that table
    carry it, and a request leaves it out as it leaves out the raw one."""
    integer_text: list[str] = field(default_factory=list)
    """The categorical and multi-hot columns whose training values are integers written as such (``7``): a client's
    whole-number float there (pandas reads an integer column with a blank as floats) is sent as ``7``, not ``7.0``."""
    unread: list[str] = field(default_factory=list)
    """The user's table's columns that are no feature (:attr:`RequestLayout.unread`)."""

    @property
    def layout(self) -> RequestLayout:
        """The request's tensors: the int64 continuous columns, the double ones, the categorical, the multi-hot."""
        kinds = {name: _number_kind(name, kind) for name, kind in self.continuous.items()}
        return RequestLayout(integers=[n for n, k in kinds.items() if k == "int64"],
                             floats=[n for n, k in kinds.items() if k == "double"],
                             strings=list(self.categorical), lists=list(self.multihot),
                             list_separator=self.list_separator, label=next(iter(self.label), ""),
                             table_label=self.table_label, integer_text=tuple(self.integer_text),
                             unread=tuple(self.unread))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> RawColumns:
        return cls(**json.loads(Path(path).read_text()))

    @classmethod
    def from_arrow(cls, arrow_schema: pa.Schema, continuous: list[str], categorical: list[str],
                   multihot: list[str], list_separator: str = "|", label: str = "",
                   table_label: str = "", integer_text: list[str] = (), unread: list[str] = ()) -> RawColumns:
        """From a raw parquet file's schema and the column roles of ``meta.json``."""
        def types(names):
            return {n: str(arrow_schema.field(n).type) for n in names}

        label = types([label]) if label and label in arrow_schema.names else {}
        return cls(types(continuous), types(categorical), types(multihot), list_separator, label,
                   table_label if table_label not in label else "", list(integer_text), list(unread))


Columns = Mapping[str, Any]
"""Column name -> the column's values for every row (a numpy or pandas array, or a pandas Series)."""


class Preprocessor:
    """Applies ``transform`` (the saved workflow's ``transform_columns``) to request columns and emits the
    model tensors."""

    def __init__(self, raw: RawColumns, schema: Schema, transform: Callable[[Columns], Columns],
                 workflow: Workflow | None = None) -> None:
        self.raw = raw
        self.schema = schema
        self.transform = transform
        self.workflow = workflow
        """The workflow ``transform`` runs, where it is one (:meth:`load`): what a device's preprocess plans from."""
        multihot = set(schema.multihot)
        self.continuous = schema.continuous
        self.onehot = [c for c in schema.sparse if c not in multihot]
        self.multihot = [c for c in schema.sparse if c in multihot]
        self._types = {name: _arrow_type(t) for name, t in
                       {**raw.continuous, **raw.categorical, **raw.multihot, **raw.label}.items()}
        self.layout = raw.layout
        text = [self._types[name] == pa.string() for name in self.layout.strings]
        # the STRINGS tensor's columns of the text type, and the others (numbers the workflow reads as such)
        self._strings_by_type = ([k for k, is_text in enumerate(text) if is_text],
                                 [k for k, is_text in enumerate(text) if not is_text])
        self._inputs = {t.name: (t.datatype, t.columns) for t in self.layout.inputs}
        order = {name: row for row, name in enumerate(raw.continuous)}
        # each number tensor's columns: their rows of the [column, row] matrix (a slice where they follow each other)
        self._rows = {tensor: _as_slice([order[n] for n in names])
                      for tensor, names in ((INTEGERS, self.layout.integers), (FLOATS, self.layout.floats)) if names}

    @classmethod
    def load(cls, folder: str | Path) -> Preprocessor:
        """From the files export wrote: ``raw_columns.json``, ``schema.json`` and ``workflow/``; ready to answer."""
        from pipeline.etl.workflow import Workflow

        folder = Path(folder)
        workflow = Workflow.load(folder / "workflow", library="pandas")
        preprocess = cls(RawColumns.load(folder / "raw_columns.json"), Schema.load(folder / "schema.json"),
                         workflow.transform_columns, workflow)
        # A row with every value missing: the operators build what they keep between requests (a vocabulary's
        # index: seconds for millions of values) now, not at the first request.
        preprocess(preprocess.layout.tensors([{}]))
        return preprocess

    def columns(self, tensors: Mapping[str, np.ndarray]) -> BlockColumns:
        """The request's raw columns as the workflow takes them, kind by kind (:mod:`pipeline.etl.blocks`): the
        continuous columns as the float64 rows of one matrix, the text (and list) columns one after the other in
        one Arrow array typed as the ETL reads its parquet input (or, where their types differ, each an
        arrow-backed pandas array)."""
        batch, numbers, text = self.read(tensors)
        blocks: list[Mapping[str, Any]] = []
        if numbers is not None:
            blocks.append(ColumnRows(list(self.raw.continuous), numbers))
        blocks.append({name: np.zeros(batch) for name in self.raw.label})  # read by the workflow, not by the model
        if STRINGS in text:
            blocks.append(self._strings_columns(_by_column(text[STRINGS]), batch))
        if LISTS in text:
            lists = pc.split_pattern(_strings(_by_column(text[LISTS])), self.raw.list_separator)
            blocks.append(self._typed_columns(lists, self.layout.lists, batch))
        return BlockColumns(blocks)

    def read(self, tensors: Mapping[str, np.ndarray]) -> tuple[int, np.ndarray | None, dict[str, np.ndarray]]:
        """A request's tensors, checked (:class:`~pipeline.errors.BadInputError` names what is wrong): the batch size;
        the continuous columns as the float64 rows of one matrix ``[column, row]`` in the raw columns' order (NaN:
        missing; None without continuous columns); the text tensors' values ``[B, columns]`` by name, numpy ``S``
        arrays read in place from the request's ``UINT8 [B, columns, width]``."""
        batch, text = self._check(tensors)
        return batch, self._numbers(tensors, batch) if self.raw.continuous else None, text

    def _check(self, tensors: Mapping[str, np.ndarray]) -> tuple[int, dict[str, np.ndarray]]:
        """The batch size, after checking that every tensor is there, of its dtype, its columns and that size; and
        the text tensors' values ``[B, columns]`` as numpy ``S`` arrays (read in place from the request's
        ``UINT8 [B, columns, width]``; taken as they are where given as bytes already)."""
        sizes, text = {}, {}
        for name, (datatype, columns) in self._inputs.items():
            if name not in tensors:
                raise BadInputError(f"missing input {name}; expected {list(self._inputs)}")
            array = tensors[name]
            if name in TEXT:
                if array.dtype == np.uint8:
                    if array.ndim != 3:
                        raise BadInputError(f"input {name}: expected the shape {_shape(name, columns)}, got "
                                            f"{list(array.shape)}")
                    array = text_values(array)
                elif array.dtype.kind not in "OSU":
                    raise BadInputError(f"input {name}: expected UINT8 [rows, {len(columns)}, width] (text at a "
                                        f"fixed width), got the numpy dtype {array.dtype}")
                text[name] = array
            elif array.dtype != _DTYPES[datatype]:
                raise BadInputError(f"input {name}: expected {datatype}, got the numpy dtype {array.dtype}")
            if array.ndim != 2 or array.shape[1] != len(columns):
                raise BadInputError(f"input {name}: expected the shape {_shape(name, columns)}, got "
                                    f"{list(tensors[name].shape)}")
            sizes[name] = array.shape[0]
        if len(set(sizes.values())) > 1:
            raise BadInputError(f"every input needs the same number of rows, got {sizes}")
        batch = next(iter(sizes.values()))
        if batch == 0:
            raise BadInputError("empty batch: expected at least one row")
        return batch, text

    def _numbers(self, tensors: Mapping[str, np.ndarray], batch: int) -> np.ndarray:
        """The continuous columns as the rows of one float64 matrix, in the raw columns' order: each value as its
        raw type holds it, NaN where missing."""
        matrix = np.empty((len(self.raw.continuous), batch))
        missing = np.empty(matrix.shape, dtype=bool)
        for values, mask in ((INTEGERS, INTEGERS_MISSING), (FLOATS, FLOATS_MISSING)):
            if values in self._rows:
                rows = self._rows[values]
                matrix[rows] = tensors[values].T
                missing[rows] = tensors[mask].T
        if FLOATS in self._rows:
            floats = matrix[self._rows[FLOATS]]
            infinite = np.isinf(floats) & ~missing[self._rows[FLOATS]]
            if infinite.any():
                column, row = (int(k[0]) for k in np.nonzero(infinite))
                raise BadInputError(f"input {FLOATS}, column {self.layout.floats[column]}, row {row}: expected finite "
                                    f"numbers (missing: {FLOATS_MISSING}), got {floats[column, row]}")
        matrix[missing] = np.nan
        return matrix

    def _strings_columns(self, values: np.ndarray, batch: int) -> Mapping[str, Any]:
        """The ``STRINGS`` tensor's columns (its values column after column): those of the text type as their
        fixed-width bytes where these hold the text :func:`_strings` reads (:class:`ColumnBytes`), any other as
        :meth:`_typed_columns` makes them."""
        text, others = self._strings_by_type
        if not text or not fixed_width_text(values):
            return self._typed_columns(_strings(values), self.layout.strings, batch)
        blocks = [ColumnBytes([self.layout.strings[k] for k in text], _columns_of(values, text, batch), batch)]
        if others:
            blocks.append(self._typed_columns(_strings(_columns_of(values, others, batch)),
                                              tuple(self.layout.strings[k] for k in others), batch))
        return blocks[0] if len(blocks) == 1 else BlockColumns(blocks)

    def _typed_columns(self, values: pa.Array, names: tuple[str, ...], batch: int) -> Mapping[str, Any]:
        """The columns one after the other in ``values`` (Arrow strings or lists): as they are where each has their
        type, else each as the pandas array of its own type that the workflow reads."""
        if all(self._types[name] == values.type for name in names):
            return ColumnSlices(list(names), values, batch)
        return {name: pd.arrays.ArrowExtensionArray(_cast(values.slice(k * batch, batch), self._types[name]))
                for k, name in enumerate(names)}

    def tensors(self, processed: Columns) -> dict[str, np.ndarray]:
        """The processed columns (or a processed DataFrame) as the tensors of the lookup and the dense part."""
        out = {}
        if self.continuous:
            out[DENSE] = _matrix(processed, self.continuous, np.float32)
        if self.onehot:
            out[CATEGORICAL_IDS] = _matrix(processed, self.onehot, np.int64)
        if self.multihot:
            out[MULTIHOT_IDS], out[MULTIHOT_LENGTHS] = _pack_bags(processed, self.multihot)
        return out

    def __call__(self, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The model's tensors for a request's tensors (:mod:`export.request`)."""
        return self.tensors(self.transform(self.columns(tensors)))


def _arrow_type(text: str) -> pa.DataType:
    if text.startswith("list<"):
        inner = text[len("list<"):-1].split(":", 1)[-1].strip()
        return pa.list_(_arrow_type(inner))
    aliases = {"string": pa.string(), "large_string": pa.large_string()}
    return aliases.get(text) or pa.type_for_alias(text)


def _strings(values: np.ndarray) -> pa.Array:
    """The text of bytes values as an Arrow string array: the empty value missing (null), invalid UTF-8 replaced."""
    if values.dtype.kind == "S" and _nul_inside(values):  # Arrow would read each value up to its first NUL byte
        values = np.array(values.tolist(), dtype=object)
    if values.dtype.kind == "S":  # empty where the first byte is the padding's
        empty = np.ascontiguousarray(values).view(np.uint8)[:: values.dtype.itemsize] == 0
        try:
            return pa.array(values, type=pa.binary(), mask=empty).cast(pa.string())
        except pa.ArrowInvalid:
            pass  # not UTF-8: replaced below
    try:
        array = pa.array(values, type=pa.binary()).cast(pa.string())
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        array = pa.array([v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in values],
                         type=pa.string())
    return pc.if_else(pc.equal(array, ""), pa.scalar(None, pa.string()), array)


def fixed_width_text(values: np.ndarray) -> bool:
    """Whether the values of a numpy array are fixed-width bytes that :func:`_strings` reads as they are: an ``S``
    array of UTF-8 whose values hold no NUL byte before their zero padding (Arrow's text of a value ends at its
    first NUL)."""
    if values.dtype.kind != "S" or not values.size or _nul_inside(values):
        return False
    width = values.dtype.itemsize
    flat = np.ascontiguousarray(values).view(np.uint8)
    if flat.max() < 0x80:  # ASCII
        return True
    ended = np.zeros((len(values), width + 1), dtype=np.uint8)  # a zero after each value: none runs on
    ended[:, :-1] = flat.reshape(len(values), width)
    try:
        ended.tobytes().decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _nul_inside(values: np.ndarray) -> bool:
    """Whether a value of an ``S`` array holds a NUL byte before its last byte that is not one (its padding's come
    after)."""
    width = values.dtype.itemsize
    flat = np.ascontiguousarray(values).view(np.uint8)
    follows_a_nul = (flat[:-1] == 0) & (flat[1:] != 0)
    follows_a_nul[width - 1:: width] = False  # a value's first byte after the one before it
    return bool(follows_a_nul.any())


def _number_kind(name: str, kind: str) -> str:
    """``int64`` or ``double``: the raw layout's types of a continuous column."""
    if kind not in ("int64", "double"):
        raise UserError(f"raw_columns.json: the continuous column {name} has type {kind}; expected int64 or double "
                        "(the raw layout's): make the raw data again (python -m pipeline data) and export again")
    return kind


_DTYPES = {"INT64": np.dtype(np.int64), "FP64": np.dtype(np.float64), "BOOL": np.dtype(bool)}
"""The numpy dtype of each request datatype but text's."""


def _shape(name: str, columns: tuple[str, ...]) -> str:
    """The shape the input ``name`` takes, its columns named (the first two and the last of many): for the error that
    names a wrong one, so not built for a request that has none."""
    named = ", ".join(columns) if len(columns) <= 4 else f"{columns[0]}, {columns[1]}, ..., {columns[-1]}"
    return f"[rows, {len(columns)}{', width' * (name in TEXT)}] (columns {named})"


def _as_slice(rows: list[int]) -> slice | list[int]:
    """``rows`` as a slice where they follow each other (a view of the matrix, not a copy), else as they are."""
    return slice(rows[0], rows[-1] + 1) if rows == list(range(rows[0], rows[-1] + 1)) else rows


def _by_column(values: np.ndarray) -> np.ndarray:
    """A ``[rows, columns]`` tensor's values column after column, flat (one copy)."""
    return np.ascontiguousarray(values.T).reshape(-1)


def _columns_of(values: np.ndarray, columns: list[int], batch: int) -> np.ndarray:
    """The columns ``columns`` of a tensor's values column after column (``batch`` each), one after the other."""
    if columns == list(range(len(values) // batch)):
        return values
    return np.concatenate([values[k * batch: (k + 1) * batch] for k in columns])


def _cast(array: pa.Array, target: pa.DataType) -> pa.Array:
    return array if array.type == target else array.cast(target)


def _matrix(processed: Columns, columns: list[str], dtype) -> np.ndarray:
    """The columns side by side, ``[row, column]`` of ``dtype``, in one copy where they are rows of blocks or numpy
    arrays."""
    if isinstance(processed, BlockColumns):
        matrix = processed.matrix(columns, dtype)
        if matrix is not None:
            return matrix
    arrays = [values if isinstance(values, np.ndarray) else values.to_numpy(dtype=dtype) if hasattr(values, "to_numpy")
              else np.asarray(values, dtype=dtype) for values in (processed[name] for name in columns)]
    return np.stack(arrays, axis=1).astype(dtype, copy=False)


def _pack_bags(processed: Columns, columns: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The multi-hot columns' bags as ``MULTIHOT_IDS`` (each row's bags one after the other, then -1) and
    ``MULTIHOT_LENGTHS`` ``[row, column]``, all columns' values placed in one step."""
    lists = _lists(processed, columns)
    batch = len(lists) // len(columns)
    by_column = list_lengths(lists)  # the bags column after column, each column's row after row
    lengths = np.ascontiguousarray(by_column.reshape(len(columns), batch).T)
    values = pc.list_flatten(lists).to_numpy(zero_copy_only=False).astype(np.int64)
    packed = np.full((batch, max(int(lengths.sum(axis=1).max(initial=0)), 1)), -1, dtype=np.int64)
    bag = np.repeat(np.arange(len(by_column)), by_column)  # each value's bag: column * batch + row
    row, column = bag % batch, bag // batch
    first = np.cumsum(by_column) - by_column  # each bag's first value
    within_row = np.cumsum(lengths, axis=1) - lengths  # where each bag starts in its row
    packed[row, within_row[row, column] + np.arange(len(values)) - first[bag]] = values
    return packed, lengths


def _lists(processed: Columns, columns: list[str]) -> pa.Array:
    """The columns' lists of ids one after the other in one Arrow array: the block that holds them as it is, else
    each column's (as int64 lists where their types differ)."""
    if isinstance(processed, BlockColumns):
        block = processed.select(columns)
        if isinstance(block, ColumnSlices):
            return block.array
    arrays = [pa.array(processed[name]) for name in columns]
    if len({array.type for array in arrays}) > 1:
        arrays = [array.cast(pa.list_(pa.int64())) for array in arrays]
    return pa.concat_arrays(arrays)
