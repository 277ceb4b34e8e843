"""The request format of the served ensemble: one tensor per kind of raw column, and the rows that fill it.

A request carries every raw column the model takes, the columns of each kind side by side in one
tensor, in the order the export wrote (:class:`RequestLayout`, the ensemble's ``layout`` parameter):

- ``INTEGERS`` ``INT64 [B, n]``: the integer raw columns (the raw layout's int64: every value as it is), and
  ``INTEGERS_MISSING`` ``BOOL [B, n]``: true where a value is missing (its place in ``INTEGERS`` is ignored);
- ``FLOATS`` ``FP64 [B, n]``: the floating raw columns, and ``FLOATS_MISSING`` ``BOOL [B, n]`` alike (a NaN
  is missing too, as the data stage reads one; JSON has no NaN, so a client over HTTP/JSON uses the mask);
- ``STRINGS`` ``BYTES [B, m]``: the categorical raw columns, UTF-8; the empty value is missing;
- ``LISTS`` ``BYTES [B, k]``: the multi-hot raw columns, each cell its values joined by the layout's
  ``list_separator``; the empty value is missing.

A tensor whose kind of column the dataset lacks is not part of the request (Criteo's: ``INTEGERS``,
``INTEGERS_MISSING`` and ``STRINGS``). :meth:`RequestLayout.tensors` builds the tensors from rows given by
column name, so no one counts positions.

Example::

    layout = RequestLayout(integers=("I1", "I2"), strings=("C1",))
    layout.tensors([{"I1": 3, "C1": "68fd1e64"}, {"I2": None}])
    # {"INTEGERS": [[3, 0], [0, 0]], "INTEGERS_MISSING": [[False, True], [True, True]],
    #  "STRINGS": [[b"68fd1e64"], [b""]]}
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.errors import BadInputError

INTEGERS = "INTEGERS"
INTEGERS_MISSING = "INTEGERS_MISSING"
FLOATS = "FLOATS"
FLOATS_MISSING = "FLOATS_MISSING"
STRINGS = "STRINGS"
LISTS = "LISTS"
LAYOUT_PARAMETER = "layout"
"""The ensemble's config parameter that holds its :class:`RequestLayout` as JSON, where clients read it."""

_INT64_LOW, _INT64_END = -(2**63), 2**63
"""int64 holds the whole numbers from ``_INT64_LOW`` up to, not including, ``_INT64_END``."""


@dataclass(frozen=True)
class RequestTensor:
    """One tensor of a request: its name, Triton datatype (``INT64``, ``BOOL``, ``FP64``, ``BYTES``) and columns."""

    name: str
    datatype: str
    columns: tuple[str, ...]


@dataclass(frozen=True)
class RequestLayout:
    """The raw columns of each kind, in their order inside the kind's tensor."""

    integers: tuple[str, ...] = ()
    floats: tuple[str, ...] = ()
    strings: tuple[str, ...] = ()
    lists: tuple[str, ...] = ()
    list_separator: str = "|"
    label: str = ""
    """The raw label column: not part of a request; rows that still carry it are taken."""

    def __post_init__(self) -> None:
        for kind in ("integers", "floats", "strings", "lists"):
            object.__setattr__(self, kind, tuple(getattr(self, kind)))

    @property
    def columns(self) -> list[str]:
        """Every raw column, tensor after tensor (also the fields of a TSV line after its optional label)."""
        return [*self.integers, *self.floats, *self.strings, *self.lists]

    @property
    def inputs(self) -> list[RequestTensor]:
        """The request's tensors, those of the kinds of column the dataset has."""
        kinds = ((INTEGERS, "INT64", self.integers), (INTEGERS_MISSING, "BOOL", self.integers),
                 (FLOATS, "FP64", self.floats), (FLOATS_MISSING, "BOOL", self.floats),
                 (STRINGS, "BYTES", self.strings), (LISTS, "BYTES", self.lists))
        return [RequestTensor(name, datatype, columns) for name, datatype, columns in kinds if columns]

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> RequestLayout:
        return cls(**json.loads(text))

    def tensors(self, rows: Any, ignore: Iterable[str] = ()) -> dict[str, np.ndarray]:
        """The request tensors for ``rows``: a DataFrame, a dict of columns (name -> values), a list of dicts
        (column -> value) or TSV lines (the fields of :attr:`columns`, the label first or not; empty: missing).
        Missing values are ``None``, NaN, ``pd.NA`` or an absent column; a column neither of the layout nor the
        label (nor in ``ignore``) is an error, as a misspelt name would otherwise read as missing."""
        columns, batch = self._columns(rows, {self.label, *ignore} - {""})
        out: dict[str, np.ndarray] = {}
        if self.integers:
            out[INTEGERS], out[INTEGERS_MISSING] = _number_matrix(columns, self.integers, batch, integer=True)
        if self.floats:
            out[FLOATS], out[FLOATS_MISSING] = _number_matrix(columns, self.floats, batch, integer=False)
        if self.strings:
            out[STRINGS] = _text_matrix(columns, self.strings, batch, self.list_separator)
        if self.lists:
            out[LISTS] = _text_matrix(columns, self.lists, batch, self.list_separator)
        return out

    def _columns(self, rows: Any, ignored: set[str]) -> tuple[dict[str, Any], int]:
        """The given columns by name, each with one value per row, and the number of rows."""
        if isinstance(rows, str):
            rows = rows.splitlines()
        if hasattr(rows, "columns") and hasattr(rows, "iloc"):
            columns = {str(name): rows[name] for name in rows.columns}
        elif isinstance(rows, Mapping):
            columns = {str(name): values for name, values in rows.items()}
        else:
            rows = list(rows)
            if rows and all(isinstance(r, (str, bytes)) for r in rows):
                columns = self._from_tsv(rows)
            elif all(isinstance(r, Mapping) for r in rows):
                names = {k for r in rows for k in r}
                columns = {str(name): [r.get(name) for r in rows] for name in names}
                if not columns:
                    return {}, len(rows)
            else:
                raise BadInputError("rows: expected a DataFrame, a dict of columns, a list of dicts or TSV lines, "
                                    f"got a list of {type(next(r for r in rows if not isinstance(r, Mapping))).__name__}")
        unknown = sorted(set(columns) - set(self.columns) - ignored)
        if unknown:
            raise BadInputError(f"unknown columns {unknown}; the model takes {self.columns}")
        sizes = {name: len(values) for name, values in columns.items()}
        if len(set(sizes.values())) > 1:
            raise BadInputError(f"every column needs the same number of rows, got {sizes}")
        return columns, next(iter(sizes.values()), 0)

    def _from_tsv(self, lines: list[str | bytes]) -> dict[str, list]:
        n = len(self.columns)
        fields = []
        for number, line in enumerate(lines, 1):
            text = line.decode() if isinstance(line, bytes) else line
            parts = text.rstrip("\r\n").split("\t")
            if len(parts) == n + 1:
                parts = parts[1:]
            elif len(parts) != n:
                raise BadInputError(f"TSV line {number}: expected {n} fields (or {n + 1} with the label first), "
                                    f"found {len(parts)}")
            fields.append(parts)
        return {name: [f[k] if f[k] != "" else None for f in fields] for k, name in enumerate(self.columns)}


def _number_matrix(columns: Mapping[str, Any], names: tuple[str, ...], batch: int, integer: bool
                   ) -> tuple[np.ndarray, np.ndarray]:
    """The columns ``names`` side by side ``[row, column]`` as int64 (``integer``) or float64, 0 where missing, and
    where they are missing (an absent column: everywhere). The columns Arrow holds in that type are read together
    in one pass, any other one alone."""
    values = np.zeros((batch, len(names)), np.int64 if integer else np.float64)
    missing = np.ones((batch, len(names)), bool)
    kind = pa.int64() if integer else pa.float64()
    together: dict[int, pa.Array] = {}
    for j, name in enumerate(names):
        if name in columns:
            array = _arrow(columns[name])
            if array is not None and array.type == kind:
                together[j] = array
            else:
                values[:, j], missing[:, j] = _numbers(columns[name], array, name, integer)
    if together:
        numbers, absent = _numeric(pa.concat_arrays(list(together.values())))
        numbers, absent = numbers.reshape(len(together), batch), absent.reshape(len(together), batch)
        if not integer and np.isinf(numbers).any():
            k, row = (int(i[0]) for i in np.nonzero(np.isinf(numbers)))
            raise BadInputError(_not_finite(names[list(together)[k]], row, numbers[k, row]))
        values[:, list(together)] = np.where(absent, 0, numbers).T
        missing[:, list(together)] = absent.T
    return values, missing


def _numbers(values: Any, array: pa.Array | None, name: str, integer: bool) -> tuple[np.ndarray, np.ndarray]:
    """One column's values (``array``: as Arrow holds them, if it does) as int64 (``integer``) or float64, 0 where
    missing, and where they are missing."""
    read = None if array is None else _numeric(array)
    if read is None:
        return _numbers_one_by_one(values, name, integer)
    numbers, missing = read
    if numbers.dtype.kind in "iub" and integer:
        if numbers.dtype == np.uint64 and (numbers[~missing] >= _INT64_END).any():
            row = int(np.flatnonzero(~missing & (numbers >= _INT64_END))[0])
            raise BadInputError(_not_int64(name, row, numbers[row]))
        return np.where(missing, 0, numbers).astype(np.int64), missing
    floats = np.where(missing, 0.0, numbers.astype(np.float64))
    if integer:
        bad = (np.floor(floats) != floats) | (floats < _INT64_LOW) | (floats >= _INT64_END)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise BadInputError(_not_int64(name, row, numbers[row]))
        return floats.astype(np.int64), missing
    if np.isinf(floats).any():
        row = int(np.flatnonzero(np.isinf(floats))[0])
        raise BadInputError(_not_finite(name, row, numbers[row]))
    return floats, missing


def _numeric(array: pa.Array) -> tuple[np.ndarray, np.ndarray] | None:
    """An Arrow array of numbers as numpy (0 where null) and where they are missing (null or NaN); None where it
    does not hold numbers."""
    kind = array.type
    if pa.types.is_null(kind):
        return np.zeros(len(array)), np.ones(len(array), bool)
    if not (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)):
        return None
    missing = array.is_null().to_numpy(zero_copy_only=False) if array.null_count else np.zeros(len(array), bool)
    numbers = pc.fill_null(array, False if pa.types.is_boolean(kind) else pa.scalar(0, kind))
    numbers = numbers.to_numpy(zero_copy_only=False)
    if numbers.dtype.kind == "f":
        missing = missing | np.isnan(numbers)
    return numbers, missing


def _numbers_one_by_one(values: Any, name: str, integer: bool) -> tuple[np.ndarray, np.ndarray]:
    values = values.tolist() if hasattr(values, "tolist") else list(values)
    out = np.zeros(len(values), np.int64 if integer else np.float64)
    missing = np.zeros(len(values), bool)
    for i, value in enumerate(values):
        if _is_missing(value):
            missing[i] = True
        elif integer:
            out[i] = _integer(value, name, i)
        else:
            out[i] = _float(value, name, i)
    return out, missing


def _text_matrix(columns: Mapping[str, Any], names: tuple[str, ...], batch: int, separator: str) -> np.ndarray:
    """The columns ``names`` side by side ``[row, column]`` as UTF-8 bytes (a multi-hot cell's values joined by
    ``separator``), empty where missing (an absent column: everywhere). The columns Arrow holds as text or lists of
    text are read together in one pass, any other one value by value."""
    out = np.full((batch, len(names)), b"", dtype=object)
    together: dict[int, pa.Array] = {}
    for j, name in enumerate(names):
        if name in columns:
            text = _as_text(_arrow(columns[name]), separator)
            if text is not None:
                together[j] = text
            else:
                values = columns[name]
                values = values.tolist() if hasattr(values, "tolist") else values
                out[:, j] = [b"" if _is_missing(v) else _to_bytes(v, separator) for v in values]
    if together:
        joined = pc.fill_null(pa.concat_arrays(list(together.values())), pa.scalar(b"", pa.large_binary()))
        out[:, list(together)] = joined.to_numpy(zero_copy_only=False).reshape(len(together), batch).T
    return out


def _as_text(array: pa.Array | None, separator: str) -> pa.Array | None:
    """Text, or lists of text (joined by ``separator``), as large binary values; None for anything else."""
    if array is None:
        return None
    if pa.types.is_null(array.type):
        return pa.nulls(len(array), pa.large_binary())
    if _is_list(array.type) and _is_text(array.type.value_type) and pc.list_flatten(array).null_count == 0:
        array = pc.binary_join(array, separator)
    return array.cast(pa.large_binary()) if _is_text(array.type) else None


def _is_text(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind) \
        or pa.types.is_large_binary(kind)


def _is_list(kind: pa.DataType) -> bool:
    return pa.types.is_list(kind) or pa.types.is_large_list(kind)


def _arrow(values: Any) -> pa.Array | None:
    """The values (a pandas Series or array, a numpy array, a list) as one Arrow array, NaN as null where numpy holds
    them; None where Arrow cannot hold them in one type."""
    array = getattr(values, "array", values)  # a Series' own array: Arrow takes an arrow-backed one as it is
    try:
        if hasattr(array, "__arrow_array__"):
            converted = pa.array(array)
        else:
            converted = pa.array(np.asarray(array) if hasattr(array, "dtype") else array, from_pandas=True)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        return None
    return converted.combine_chunks() if isinstance(converted, pa.ChunkedArray) else converted


def _integer(value: Any, name: str, row: int) -> int:
    if isinstance(value, (bool, np.bool_)):
        return int(value)
    if isinstance(value, (str, bytes)):
        text = value.decode() if isinstance(value, bytes) else value
        try:
            value = int(text)
        except ValueError:
            try:
                value = float(text)
            except ValueError:
                raise BadInputError(f"column {name}, row {row}: expected a whole number or missing, got {value!r}") \
                    from None
    if isinstance(value, (float, np.floating)):
        if not math.isfinite(value) or value != math.floor(value):
            raise BadInputError(_not_int64(name, row, value))
        value = int(value)
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise BadInputError(f"column {name}, row {row}: expected a whole number or missing, got {value!r}") from None
    if number != value or not _INT64_LOW <= number < _INT64_END:  # a Decimal's fraction too
        raise BadInputError(_not_int64(name, row, value))
    return number


def _float(value: Any, name: str, row: int) -> float:
    try:
        number = float(value.decode() if isinstance(value, bytes) else value)
    except (TypeError, ValueError):
        raise BadInputError(f"column {name}, row {row}: expected a number or missing, got {value!r}") from None
    if math.isinf(number):
        raise BadInputError(f"column {name}, row {row}: expected a finite number or missing, got {value!r}")
    return 0.0 if math.isnan(number) else number


def _not_finite(name: str, row: int, value: Any) -> str:
    return f"column {name}, row {row}: expected a finite number or missing, got {_shown(value)}"


def _not_int64(name: str, row: int, value: Any) -> str:
    return (f"column {name}, row {row}: the raw column is int64, expected a whole number from {_INT64_LOW} to "
            f"{_INT64_END - 1} or missing, got {_shown(value)}")


def _shown(value: Any) -> str:
    """A value as the user wrote it: numpy's scalars as the Python numbers they hold."""
    return repr(value.item() if isinstance(value, np.generic) else value)


def _is_missing(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, (float, np.floating)) and math.isnan(value):
        return True
    import pandas as pd

    return value is pd.NA or value is pd.NaT


def _to_bytes(value: Any, separator: str) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, Iterable):
        return separator.join(str(v) for v in value).encode()
    return str(value).encode()
