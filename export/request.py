"""The request format of the served ensemble: one tensor per kind of raw column, and the rows that fill it.

A request carries every raw column the model takes, the columns of each kind side by side in one
tensor, in the order the export wrote (:class:`RequestLayout`, the ensemble's ``layout`` parameter):

- ``INTEGERS`` ``INT64 [B, n]``: the integer raw columns (the raw layout's int64: every value as it is), and
  ``INTEGERS_MISSING`` ``BOOL [B, n]``: true where a value is missing (its place in ``INTEGERS`` is ignored);
- ``FLOATS`` ``FP64 [B, n]``: the floating raw columns, and ``FLOATS_MISSING`` ``BOOL [B, n]`` alike (a NaN
  is missing too, as the data stage reads one; JSON has no NaN, so a client over HTTP/JSON uses the mask);
- ``STRINGS`` ``UINT8 [B, m, W]``: the categorical raw columns, each value its UTF-8 bytes padded with zero bytes
  to ``W``, the widest value's length in the request; the empty value is missing;
- ``LISTS`` ``UINT8 [B, k, W]``: the multi-hot raw columns alike, each cell its values joined by the layout's
  ``list_separator``.

Text travels at a fixed width, not as Triton's ``BYTES`` (each value behind its own 4-byte length): the server and
the python backend then hand the models a request's values as one block of memory, which the models read in place
(a numpy ``S`` array: :func:`text_values`), where ``BYTES`` costs a pass over the values on each side of the wire,
at the client, in Triton and in the backend's stub. So the padding is not part of a value: a value may not end in
a zero byte (:meth:`RequestLayout.tensors` refuses one). A request whose values differ widely in length would be
mostly padding: :meth:`RequestLayout.tensors` refuses to build one more than a few times its values' bytes
(:class:`TooWide`), and the client sends its rows in parts instead.

A tensor whose kind of column the dataset lacks is not part of the request (Criteo's: ``INTEGERS``,
``INTEGERS_MISSING`` and ``STRINGS``). :meth:`RequestLayout.tensors` builds the tensors from rows given by
column name, so no one counts positions.

Example::

    layout = RequestLayout(integers=("I1", "I2"), strings=("C1",))
    tensors = layout.tensors([{"I1": 3, "C1": "68fd1e64"}, {"I2": None}])
    # {"INTEGERS": [[3, 0], [0, 0]], "INTEGERS_MISSING": [[False, True], [True, True]],
    #  "STRINGS": uint8 [2, 1, 8]}
    text_values(tensors["STRINGS"])     # [[b"68fd1e64"], [b""]]
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sized
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.data.text_format import MISSING_NUMBER_PATTERN, cells_holding
from pipeline.errors import BadInputError
from pipeline.etl.frames import column_reader

INTEGERS = "INTEGERS"
INTEGERS_MISSING = "INTEGERS_MISSING"
FLOATS = "FLOATS"
FLOATS_MISSING = "FLOATS_MISSING"
STRINGS = "STRINGS"
LISTS = "LISTS"
TEXT = (STRINGS, LISTS)
"""The tensors of text, at a fixed width."""
LAYOUT_PARAMETER = "layout"
"""The ensemble's config parameter that holds its :class:`RequestLayout` as JSON, where clients read it."""

_PADDED_FACTOR = 4
_PADDED_BYTES = 16 << 20
"""A request's fixed-width text may take up to :data:`_PADDED_FACTOR` times its values' bytes, and this much more
(:class:`TooWide`): one value of 1 MiB among a batch of 1,024 rows of 26 short ones would make it 27 GiB."""

_INT64_LOW, _INT64_END = -(2**63), 2**63
"""int64 holds the whole numbers from ``_INT64_LOW`` up to, not including, ``_INT64_END``."""


class TooWide(BadInputError):
    """Rows whose text, padded to its widest value, would be mostly padding: to be sent in parts."""


@dataclass(frozen=True)
class RequestTensor:
    """One tensor of a request: its name, Triton datatype (``INT64``, ``BOOL``, ``FP64``, ``UINT8``) and columns."""

    name: str
    datatype: str
    columns: tuple[str, ...]

    @property
    def text(self) -> bool:
        """Whether it holds text at a fixed width (``STRINGS``, ``LISTS``): ``[B, columns, W]``."""
        return self.name in TEXT

    @property
    def dims(self) -> tuple[int, ...]:
        """Its dims after the batch's: its columns, then (text) the request's width, any."""
        return (len(self.columns), -1) if self.text else (len(self.columns),)


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
    table_label: str = ""
    """The label's name in the user's table (``data.label``), taken as :attr:`label` is."""
    integer_text: tuple[str, ...] = ()
    """Text columns whose values are integers written as such: a whole-number float there is sent as its integer."""
    unread: tuple[str, ...] = ()
    """The user's table's columns that are no feature (its ``data.time_column``, where no role lists it, and
    ``data.ignore``'s): rows read from that table carry them, taken as :attr:`label` is."""

    def __post_init__(self) -> None:
        for kind in ("integers", "floats", "strings", "lists", "integer_text", "unread"):
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
                 (STRINGS, "UINT8", self.strings), (LISTS, "UINT8", self.lists))
        return [RequestTensor(name, datatype, columns) for name, datatype, columns in kinds if columns]

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> RequestLayout:
        return cls(**json.loads(text))

    def tensors(self, rows: Any, ignore: Iterable[str] = ()) -> dict[str, np.ndarray]:
        """The request tensors for ``rows``: a DataFrame, a dict of columns (name -> values), a list of dicts
        (column -> value) or TSV lines (the fields of :attr:`columns`, the label first or not; empty: missing).
        Missing values are ``None``, NaN, ``pd.NA``, an absent column, empty text in a number column (an empty field,
        as ``csv.DictReader`` gives it) or, for a floating column given as text, a word
        a table's number column reads as missing (:data:`~pipeline.data.text_format.MISSING_NUMBER_PATTERN`); a
        column neither of the layout nor the label nor :attr:`unread` (nor in ``ignore``) is an error, as a misspelt
        name would otherwise read as missing. Rows whose text would be mostly padding at one width are refused (:class:`TooWide`):
        :meth:`requests` sends them in parts."""
        return self._tensors(*self._columns(rows, {self.label, self.table_label, *self.unread, *ignore} - {""}))

    def requests(self, rows: Any, ignore: Iterable[str] = ()) -> list[dict[str, np.ndarray]]:
        """The request tensors for ``rows`` (as :meth:`tensors` takes them), in order: one request, or parts of the
        rows where their text would be mostly padding at one width (a value far longer than the others)."""
        return self._parts(*self._columns(rows, {self.label, self.table_label, *self.unread, *ignore} - {""}))

    def _parts(self, columns: dict[str, Any], batch: int) -> list[dict[str, np.ndarray]]:
        try:
            return [self._tensors(columns, batch)]
        except TooWide:
            half = batch // 2
            return [*self._parts(_rows_of(columns, 0, half), half), *self._parts(_rows_of(columns, half, batch),
                                                                                   batch - half)]

    def _tensors(self, columns: dict[str, Any], batch: int) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        if self.integers:
            out[INTEGERS], out[INTEGERS_MISSING] = _number_matrix(columns, self.integers, batch, integer=True)
        if self.floats:
            out[FLOATS], out[FLOATS_MISSING] = _number_matrix(columns, self.floats, batch, integer=False)
        if self.strings:
            out[STRINGS] = _text_matrix(columns, self.strings, batch, self.list_separator, STRINGS, self.integer_text)
        if self.lists:
            out[LISTS] = _text_matrix(columns, self.lists, batch, self.list_separator, LISTS, self.integer_text)
        return out

    def _columns(self, rows: Any, ignored: set[str]) -> tuple[dict[str, Any], int]:
        """The given columns by name, each with one value per row, and the number of rows."""
        if isinstance(rows, str):
            rows = rows.splitlines()
        if isinstance(rows, pd.Series):
            raise BadInputError("rows: a pandas Series is one row or one column, and its values were read as rows: give "
                                "a DataFrame (one row of a frame: frame.iloc[[i]]) or a dict of columns")
        if isinstance(rows, pd.DataFrame):
            repeated = sorted({str(c) for c in rows.columns if list(rows.columns).count(c) > 1})
            if repeated:
                raise BadInputError(f"the column(s) {repeated} appear more than once: give each column its own name")
            read = column_reader(rows)  # the columns' arrays, without a Series each
            columns = {str(name): read(name) for name in rows.columns}
        elif hasattr(rows, "columns") and hasattr(rows, "iloc"):
            columns = {str(name): rows[name] for name in rows.columns}
        elif isinstance(rows, Mapping):
            columns = {str(name): values for name, values in rows.items()}
            single = next((name for name, values in columns.items() if _one_value(values)), None)
            if single is not None:
                raise BadInputError(f"rows: a dict is read as columns by name, each a list of values, and {single!r} "
                                    f"holds one value ({columns[single]!r}): give one row as a list of one dict, "
                                    "[{...}]")
            indexes = [v.index for v in columns.values() if isinstance(v, pd.Series)]
            if any(not index.equals(indexes[0]) for index in indexes[1:]):
                raise BadInputError("rows: a dict of pandas Series with different indexes (their rows would pair by "
                                    "position, not by index): align them first, e.g. pd.DataFrame(rows)")
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


def _one_value(values: Any) -> bool:
    """Whether a column given by name holds one value instead of a list of them (text has a length too)."""
    return isinstance(values, (str, bytes)) or not isinstance(values, Sized) or getattr(values, "ndim", 1) == 0


def _rows_of(columns: dict[str, Any], start: int, end: int) -> dict[str, Any]:
    """The rows ``start`` to ``end`` of each column."""
    return {name: values.iloc[start:end] if hasattr(values, "iloc") else values[start:end]
            for name, values in columns.items()}


def _number_matrix(columns: Mapping[str, Any], names: tuple[str, ...], batch: int, integer: bool
                   ) -> tuple[np.ndarray, np.ndarray]:
    """The columns ``names`` side by side ``[row, column]`` as int64 (``integer``) or float64, 0 where missing, and
    where they are missing (an absent column: everywhere). The columns Arrow holds in that type are read together
    in one pass, and so are numpy floats (NaN: missing; pandas' int columns with missing values), any other one
    alone."""
    values = np.zeros((batch, len(names)), np.int64 if integer else np.float64)
    missing = np.ones((batch, len(names)), bool)
    floats = [j for j, name in enumerate(names)
              if isinstance(columns.get(name), np.ndarray) and columns[name].dtype.kind == "f"]
    if floats:
        block = np.stack([columns[names[j]] for j in floats]).astype(np.float64, copy=False)
        values[:, floats], missing[:, floats] = _float_block(block, np.isnan(block), [names[j] for j in floats],
                                                             integer)
    kind = pa.int64() if integer else pa.float64()
    together: dict[int, pa.Array] = {}
    for j, name in enumerate(names):
        if name in columns and j not in floats:
            array = _arrow(columns[name])
            if array is not None and array.type == kind:
                together[j] = array
            else:
                values[:, j], missing[:, j] = _numbers(columns[name], array, name, integer)
    if together:
        numbers, absent = _numeric(pa.concat_arrays(list(together.values())))
        numbers, absent = numbers.reshape(len(together), batch), absent.reshape(len(together), batch)
        if integer:  # int64 as it is
            values[:, list(together)], missing[:, list(together)] = np.where(absent, 0, numbers).T, absent.T
        else:
            values[:, list(together)], missing[:, list(together)] = _float_block(
                numbers, absent, [names[j] for j in together], integer)
    return values, missing


def _float_block(block: np.ndarray, absent: np.ndarray, names: list[str], integer: bool
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Float64 columns ``[column, row]`` (missing where ``absent``) as ``[row, column]`` int64 (``integer``: whole
    numbers in int64's range) or finite float64, 0 where missing, and where they are missing; the first value that is
    neither named."""
    filled = np.where(absent, 0.0, block)
    bad = ((np.floor(filled) != filled) | (filled < _INT64_LOW) | (filled >= _INT64_END)) if integer \
        else np.isinf(filled)
    if bad.any():
        k, row = (int(i[0]) for i in np.nonzero(bad))
        raise BadInputError((_not_int64 if integer else _not_finite)(names[k], row, block[k, row]))
    return (filled.astype(np.int64) if integer else filled).T, absent.T


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
    converted, absent = _float_block(numbers.astype(np.float64)[None], missing[None], [name], integer)
    return converted[:, 0], absent[:, 0]


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
        if _is_missing(value) or value in ("", b"") or (not integer and _missing_word(value)):  # "": an empty field
            missing[i] = True
        elif integer:
            out[i] = _integer(value, name, i)
        else:
            number = _float(value, name, i)
            missing[i] = math.isnan(number)  # text float() reads as NaN ("nAn", " nan"): missing, as a NaN is
            out[i] = 0.0 if missing[i] else number
    return out, missing


def _missing_word(value: Any) -> bool:
    """Whether a value is text that a table's number column reads as missing (``NA``, ``NULL``, ``nan``...), as the
    data stage read the training rows."""
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    return isinstance(value, str) and re.match(MISSING_NUMBER_PATTERN, value) is not None


def _text_matrix(columns: Mapping[str, Any], names: tuple[str, ...], batch: int, separator: str,
                 tensor: str, integer_text: tuple[str, ...] = ()) -> np.ndarray:
    """The columns ``names`` side by side as the fixed-width text tensor ``[row, column, width]`` (a multi-hot
    cell's values joined by ``separator``), empty where missing (an absent column: everywhere). A column Arrow holds
    as text or lists of text is read in one pass, any other value by value; in a column of ``integer_text`` a
    whole-number float is written as its integer."""
    parts = []
    lists = tensor == LISTS
    for name in names:
        arrow = _arrow(columns[name]) if name in columns else None
        if arrow is not None and _is_list(arrow.type):
            present = np.flatnonzero(arrow.is_valid().to_numpy(zero_copy_only=False))
            if not lists and present.size:
                raise _list_in_single_values(name, int(present[0]), arrow[int(present[0])].as_py())
            _refuse_separator_items(name, arrow, separator)
        text = _as_text(arrow, separator) if name in columns else pa.nulls(batch, pa.large_binary())
        if text is None:
            values = columns[name]
            values = values.tolist() if hasattr(values, "tolist") else values
            whole = name in integer_text
            text = pa.array([None if _is_missing(v) else _to_bytes(v, separator, name, row, whole, lists)
                             for row, v in enumerate(values)], pa.large_binary())
        parts.append(text)
    if len({part.type for part in parts}) > 1:
        parts = [part.cast(pa.large_binary()) for part in parts]
    values = pa.concat_arrays(parts).cast(pa.large_binary())  # column after column, one cast
    values = pc.fill_null(values, pa.scalar(b"", pa.large_binary())) if values.null_count else values
    offsets = np.frombuffer(values.buffers()[1], np.int64, count=len(values) + 1, offset=8 * values.offset)
    lengths = np.diff(offsets)
    data = values.buffers()[2]
    data = np.frombuffer(data, np.uint8)[offsets[0]: offsets[-1]] if data is not None else np.empty(0, np.uint8)
    present = np.flatnonzero(lengths)
    zero_ended = present[data[offsets[1:][present] - offsets[0] - 1] == 0]
    if zero_ended.size:
        k = int(zero_ended[0])
        raise BadInputError(f"column {names[k // batch]}, row {k % batch}: the value {values[k].as_py()!r} ends in "
                            f"a zero byte, which {tensor} cannot carry (its values are padded with zero bytes): drop "
                            "the trailing zero bytes or map the value to another")
    width = max(int(lengths.max(initial=0)), 1)
    if batch > 1 and width * len(lengths) > _PADDED_FACTOR * data.size + _PADDED_BYTES:
        raise TooWide(f"{tensor}: its widest value has {width} bytes, so at a fixed width the request of {batch} "
                      f"rows would take {width * len(lengths):,} bytes for {data.size:,} bytes of values: send "
                      "fewer rows per request (the client does)")
    out = np.zeros((len(names), batch, width), np.uint8)
    if present.size and (lengths[present] == width).all():
        out.reshape(-1, width)[present] = data.reshape(-1, width)
    else:
        out.reshape(-1, width)[np.arange(width) < lengths[:, None]] = data
    return np.ascontiguousarray(out.transpose(1, 0, 2))


def text_values(tensor: np.ndarray) -> np.ndarray:
    """The values of a fixed-width text tensor ``[B, columns, width]`` as the ``[B, columns]`` fixed-width bytes
    (numpy ``S``; its zero padding is no part of a value), in place where the tensor is contiguous."""
    if tensor.ndim != 3 or tensor.dtype != np.uint8:
        raise BadInputError(f"a text tensor: expected UINT8 [rows, columns, width], got {tensor.dtype} "
                            f"{list(tensor.shape)}")
    if tensor.shape[2] == 0:
        return np.zeros(tensor.shape[:2], "S1")
    return np.ascontiguousarray(tensor).view(f"S{tensor.shape[2]}").reshape(tensor.shape[:2])


def _as_text(array: pa.Array | None, separator: str) -> pa.Array | None:
    """Text, or lists of text (joined by ``separator``), as Arrow text or binary values; None for anything else."""
    if array is None:
        return None
    if pa.types.is_null(array.type):
        return pa.nulls(len(array), pa.large_binary())
    if _is_list(array.type) and _is_text(array.type.value_type) and pc.list_flatten(array).null_count == 0:
        array = pc.binary_join(array, separator)
    return array if _is_text(array.type) else None


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
    return number


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
    return value is pd.NA or value is pd.NaT


def _to_bytes(value: Any, separator: str, name: str, row: int, whole: bool, lists: bool) -> bytes:
    """A value as the text a request carries: a number or boolean as Python's ``str`` writes it, or with ``whole`` a
    whole-number float as its integer; in a column of ``lists``, a list's items joined by ``separator``."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, Iterable):
        if not lists:
            raise _list_in_single_values(name, row, value)
        if isinstance(value, Mapping) or any(isinstance(v, Iterable) and not isinstance(v, (str, bytes)) for v in value):
            raise BadInputError(f"column {name}, row {row}: {value!r} is no list of values (a cell of a multi-hot "
                                "column is one list of its values, each a number or text)")
        if any(_is_missing(v) for v in value):
            raise BadInputError(f"column {name}, row {row}: the list {value!r} holds a missing item, which a request "
                                "cannot carry: leave it out of the list")
        items = [_item_text(v, whole) for v in value]
        if any(separator in item for item in items):
            raise _separator_in_item(name, row, value, separator)
        return separator.join(items).encode()
    return _item_text(value, whole).encode()


def _list_in_single_values(name: str, row: int, value: Any) -> BadInputError:
    """A list given in a column of single values (a categorical one): it was sent as its items joined, a value the
    model does not know."""
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    return BadInputError(f"column {name}, row {row}: a list ({shown}) in a column of single values: give the value "
                         "itself (a column of lists is a multi-hot one, data.multihot)")


def _item_text(value: Any, whole: bool) -> str:
    if whole and isinstance(value, (float, np.floating)) and math.isfinite(value) and value == int(value):
        return str(int(value))
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _refuse_separator_items(name: str, lists: pa.Array, separator: str) -> None:
    """A BadInputError for the first cell of ``lists`` with an item holding ``separator``, by which the request
    joins a cell's items: the model would read it as two."""
    holding = cells_holding(lists, separator)
    if holding.size:
        row = int(holding[0])
        raise _separator_in_item(name, row, lists[row].as_py(), separator)


def _separator_in_item(name: str, row: int, cell: Any, separator: str) -> BadInputError:
    return BadInputError(f"column {name}, row {row}: an item of {cell!r} holds the list separator {separator!r}, "
                         "which joins a cell's items in the request (the model would read it as two items); no "
                         "training row held such an item (the data stage counts them as malformed)")
