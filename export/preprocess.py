"""Raw request columns -> model features, with the saved ETL workflow: the ``preprocess`` model's work.

The wire format of a raw row, one Triton input per raw column (``RawColumns`` says which):

- continuous column: ``TYPE_FP64`` ``[1]``; NaN means missing (the workflow's fill value applies);
  an integer raw column takes whole numbers from its type's min to its max as float64 holds it (int64's
  2**63 - 1 arrives as 2.0**63, the float64 nearest it, which the ETL computes from it too).
- categorical column: ``TYPE_STRING`` (bytes) ``[1]``; the empty string means missing (the
  workflow's null index); a value never seen at fit time gets the out-of-vocabulary index.
- multi-hot column: ``TYPE_STRING`` ``[1]``, the values joined by ``list_separator``; empty: missing.

The continuous columns are checked and stacked once, into one float64 matrix ``[column, row]``
holding each value as its raw parquet type holds it (an integer column's whole numbers, in that
integer type's range; NaN: missing): each column is a row of it, the numbers the numeric operators
read of the ETL's column (``as_float64``). The string columns become Arrow arrays with the raw
parquet's own types, wrapped as pandas' arrow-backed arrays (what a column of the frame the ETL's
reader gives the workflow holds). The *same* operators as offline run on them
(``Workflow.transform_columns``: ``Workflow.transform`` without building a DataFrame in or out, the
columns of an operator computed together where it can, as it would compute each). The processed
columns become the tensors the model takes, each stacked in one copy: ``DENSE`` ``[B, n_cont]``
float32, ``CATEGORICAL_IDS`` ``[B, n_onehot]`` int64 and, with multi-hot features, ``MULTIHOT_IDS``
``[B, W]`` (each row's bags packed, then ``-1``) and ``MULTIHOT_LENGTHS`` ``[B, n_multihot]``. A
tensor whose kind of feature the schema lacks is not emitted (the configs leave it out too).

Example::

    pre = Preprocessor.load("repo/ranker/1/artifacts")
    tensors = pre({"I1": np.array([[1.0]]), "C1": np.array([[b"68fd1e64"]], dtype=object), ...})
    tensors["CATEGORICAL_IDS"].shape     # (1, 26)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from export.wire import fixed_width_fits
from pipeline.errors import BadInputError, UserError
from pipeline.schema import Schema

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

    @property
    def names(self) -> list[str]:
        return [*self.continuous, *self.categorical, *self.multihot]

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> RawColumns:
        return cls(**json.loads(Path(path).read_text()))

    @classmethod
    def from_arrow(cls, arrow_schema: pa.Schema, continuous: list[str], categorical: list[str],
                   multihot: list[str], list_separator: str = "|", label: str = "") -> RawColumns:
        """From a raw parquet file's schema and the column roles of ``meta.json``."""
        def types(names):
            return {n: str(arrow_schema.field(n).type) for n in names}

        label = types([label]) if label and label in arrow_schema.names else {}
        return cls(types(continuous), types(categorical), types(multihot), list_separator, label)


Columns = Mapping[str, Any]
"""Column name -> the column's values for every row (a numpy or pandas array, or a pandas Series)."""


class Preprocessor:
    """Applies ``transform`` (the saved workflow's ``transform_columns``) to request columns and emits the
    model tensors."""

    def __init__(self, raw: RawColumns, schema: Schema, transform: Callable[[Columns], Columns]) -> None:
        self.raw = raw
        self.schema = schema
        self.transform = transform
        multihot = set(schema.multihot)
        self.continuous = schema.continuous
        self.onehot = [c for c in schema.sparse if c not in multihot]
        self.multihot = [c for c in schema.sparse if c in multihot]
        self._types = {name: _arrow_type(t) for name, t in
                       {**raw.continuous, **raw.categorical, **raw.multihot, **raw.label}.items()}
        dtypes = [_numeric_dtype(name, self._types[name]) for name in raw.continuous]
        self._integers = np.flatnonzero([d.kind in "iu" for d in dtypes])
        # An integer column takes the float64 values of its type's integers: from its min to its max as float64
        # holds it (int64's 2**63 - 1 rounds to 2**63, the value a client sends for it and the ETL computes).
        self._low = np.array([[np.iinfo(dtypes[c]).min] for c in self._integers], np.float64)
        self._high = np.array([[np.iinfo(dtypes[c]).max] for c in self._integers], np.float64)
        # The columns of each floating raw type but float64, whose values pass through it (float32 rounds).
        self._narrow = {d: np.flatnonzero([e == d for e in dtypes])
                        for d in set(dtypes) - {np.dtype(np.float64)} if d.kind == "f"}

    @classmethod
    def load(cls, folder: str | Path) -> Preprocessor:
        """From the files export wrote: ``raw_columns.json``, ``schema.json`` and ``workflow/``."""
        from pipeline.etl.workflow import Workflow

        folder = Path(folder)
        workflow = Workflow.load(folder / "workflow", library="pandas")
        return cls(RawColumns.load(folder / "raw_columns.json"), Schema.load(folder / "schema.json"),
                   workflow.transform_columns)

    def columns(self, columns: dict[str, np.ndarray]) -> dict[str, Any]:
        """The request's raw columns as the workflow takes them: each continuous column a float64 row of one
        matrix, the others arrow-backed pandas arrays typed as the ETL reads its parquet input."""
        missing = [n for n in self.raw.names if n not in columns]
        if missing:
            raise BadInputError(f"missing raw columns {missing}; expected {self.raw.names}")
        rows = {n: np.asarray(columns[n]).reshape(-1) for n in self.raw.names}
        sizes = {n: a.shape[0] for n, a in rows.items()}
        if len(set(sizes.values())) > 1:
            raise BadInputError(f"every raw column needs the same number of rows, got {sizes}")
        if not sizes or next(iter(sizes.values())) == 0:
            raise BadInputError("empty batch: expected at least one row")
        batch = next(iter(sizes.values()))
        for name in (*self.raw.categorical, *self.raw.multihot):
            if rows[name].dtype.kind not in "OSU":
                raise BadInputError(f"column {name}: expected strings (BYTES), got dtype {rows[name].dtype}")
        arrays: dict[str, pa.Array] = {}
        categorical = list(self.raw.categorical)
        if categorical:
            strings = _strings(_concatenate_strings([rows[n] for n in categorical]))
            for k, name in enumerate(categorical):
                arrays[name] = _cast(strings.slice(k * batch, batch), self._types[name])
        for name in self.raw.multihot:
            split = pc.split_pattern(_strings(rows[name]), self.raw.list_separator)
            arrays[name] = _cast(split, self._types[name])
        numbers = self._continuous(rows) if self.raw.continuous else {}
        numbers.update((name, np.zeros(batch)) for name in self.raw.label)  # read by the workflow, not by the model
        return {**numbers, **{name: pd.arrays.ArrowExtensionArray(array) for name, array in arrays.items()}}

    def _continuous(self, rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The continuous columns, checked together (a column's first problem is named, columns in order), as
        the rows of one float64 matrix: each value as its raw type holds it, NaN where missing."""
        names = list(self.raw.continuous)
        for name in names:
            if rows[name].dtype.kind not in "fiu":
                raise BadInputError(f"column {name}: expected numbers (FP64), got dtype {rows[name].dtype}")
        values = np.array([rows[n] for n in names], dtype=np.float64)  # [column, row]
        missing = np.isnan(values)
        whole = np.where(missing, 0.0, values)
        bad = np.isinf(whole)
        if len(self._integers):
            ints = whole[self._integers]
            bad[self._integers] |= (np.floor(ints) != ints) | (ints < self._low) | (ints > self._high)
        if bad.any():
            self._refuse(names, whole, bad)
        with np.errstate(over="ignore"):  # a float32 column's values beyond its range are inf, as Arrow casts them
            for dtype, index in self._narrow.items():
                whole[index] = whole[index].astype(dtype).astype(np.float64)
        whole[self._integers] += 0.0  # an integer holds no -0: -0.0 + 0.0 is 0.0
        whole[missing] = np.nan
        return dict(zip(names, whole))

    def _refuse(self, names: list[str], whole: np.ndarray, bad: np.ndarray) -> None:
        """Name the first column with values its raw type cannot hold (``bad``): its infinite, else fractional,
        else out-of-range values."""
        c = int(np.flatnonzero(bad.any(axis=1))[0])
        column, kind = whole[c], self._types[names[c]]
        infinite = column[np.isinf(column)]
        if len(infinite):
            raise BadInputError(f"column {names[c]}: expected finite numbers or NaN (missing), got {infinite[0]}")
        fractional = column[np.floor(column) != column]
        if len(fractional):
            raise BadInputError(f"column {names[c]}: the raw column is {kind}, expected whole numbers, "
                                f"got {fractional[0]}")
        limits = np.iinfo(kind.to_pandas_dtype())
        raise BadInputError(f"column {names[c]}: the raw column is {kind}, expected whole numbers from {limits.min} "
                            f"to {limits.max}, got {_whole_number(column[bad[c]][0])}")

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

    def __call__(self, columns: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.tensors(self.transform(self.columns(columns)))


def _whole_number(value: float) -> str:
    """A whole float64 as its integer digits where they are few (2**63 as 9223372036854775808), else as 1e+300."""
    return f"{value:.0f}" if abs(value) < 1e21 else f"{value:g}"


def _arrow_type(text: str) -> pa.DataType:
    if text.startswith("list<"):
        inner = text[len("list<"):-1].split(":", 1)[-1].strip()
        return pa.list_(_arrow_type(inner))
    aliases = {"string": pa.string(), "large_string": pa.large_string()}
    return aliases.get(text) or pa.type_for_alias(text)


def _concatenate_strings(arrays: list[np.ndarray]) -> np.ndarray:
    """The string columns one after the other: one ``S`` array where its width costs little, else an object array
    (a column of long values would widen every value of every column to their length)."""
    fixed = [a for a in arrays if a.dtype.kind == "S"]
    width = max((a.dtype.itemsize for a in fixed), default=0)
    if not fixed_width_fits(width, sum(a.size for a in fixed), sum(a.nbytes for a in fixed)):
        arrays = [a.astype(object) if a.dtype.kind == "S" else a for a in arrays]
    return np.concatenate(arrays)


def _strings(values: np.ndarray) -> pa.Array:
    """The text of bytes values as an Arrow string array: the empty value missing (null), invalid UTF-8 replaced."""
    if values.dtype.kind == "S":  # Arrow reads each value up to its first NUL byte: empty where that is the first
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


def _numeric_dtype(name: str, kind: pa.DataType) -> np.dtype:
    """The numpy dtype of a continuous raw column's Arrow type: an integer or floating type (the raw layout's)."""
    if not (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
        raise UserError(f"raw_columns.json: the continuous column {name} has type {kind}; expected an integer or "
                        "floating type (the raw layout's int64 or float64): export the model again")
    return np.dtype(kind.to_pandas_dtype())


def _cast(array: pa.Array, target: pa.DataType) -> pa.Array:
    return array if array.type == target else array.cast(target)


def _matrix(processed: Columns, columns: list[str], dtype) -> np.ndarray:
    """The columns side by side, ``[row, column]`` of ``dtype``, in one copy where they are numpy arrays."""
    arrays = [values if isinstance(values, np.ndarray) else values.to_numpy(dtype=dtype) if hasattr(values, "to_numpy")
              else np.asarray(values, dtype=dtype) for values in (processed[name] for name in columns)]
    return np.stack(arrays, axis=1).astype(dtype, copy=False)


def _pack_bags(processed: Columns, columns: list[str]) -> tuple[np.ndarray, np.ndarray]:
    batch = len(processed[columns[0]])
    bags = []
    for c in columns:
        arr = pa.array(processed[c])
        values = pc.list_flatten(arr).to_numpy(zero_copy_only=False).astype(np.int64)
        lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False).astype(np.int64)
        bags.append((values, lengths))
    lengths = np.stack([b[1] for b in bags], axis=1)
    width = int(lengths.sum(axis=1).max(initial=0))
    packed = np.full((batch, max(width, 1)), -1, dtype=np.int64)
    starts = np.concatenate([np.zeros((batch, 1), np.int64), np.cumsum(lengths, axis=1)], axis=1)
    for j, (values, lens) in enumerate(bags):
        rows = np.repeat(np.arange(batch), lens)
        within = np.arange(values.size) - np.repeat(np.cumsum(lens) - lens, lens)
        packed[rows, starts[rows, j] + within] = values
    return packed, lengths
