"""A block's values checked against their columns' kinds and converted to the raw layout's types: what the text and
parquet readers (:mod:`pipeline.data.readers`) do with every block they read, whatever parsed it.

A column's kind is ``label`` (0 / 1, ``1.0``, ``True`` / ``False``), ``int`` or ``float`` (a continuous feature),
``string`` (categorical), ``list`` (multi-hot) or ``time`` (read for the split only). A value that does not fit makes
its row malformed, reported with its line and the reason :func:`pipeline.data.text_format.value_problem` gives; the
rows kept are converted (empty text is missing; a categorical number is the text Python's ``str`` gives it)::

    table, lines = check_and_convert(table, lines, {"label": "label", "price": "float", "user": "string"}, "|",
                                     report, quote)
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.data.text_format import (
    LIST_TEXT_PATTERN,
    MISSING_NUMBER_PATTERN,
    FileReport,
    cells_holding,
    value_problem,
)
from pipeline.data.time_split import FORMS, TIME_KEY, time_keys, time_problem

_INT_PATTERN = r"^(-?[0-9]+)?$"  # empty is missing; the int64 range is checked apart
_INT64_DIGITS = 19
_FLOAT_PATTERN = r"^([+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?)?$"
_LABEL_PATTERN = r"^([01](\.0*)?|(?i:true|false))$"  # a table's text labels: 0 / 1, or pandas' True / False


def check_and_convert(table: pa.Table, lines: np.ndarray, kinds: dict[str, str], separator: str,
                       report: FileReport, quote, time: str = "") -> tuple[pa.Table, np.ndarray]:
    """Report rows whose values do not fit the column kinds, drop them, and type the rest.

    ``quote(i)`` gives the text to show for row ``i`` in the report. With a ``time`` column, a row
    without a usable time is bad too, and the rest get their time keys as column ``TIME_KEY``; a
    column of kind ``time`` is not in the output.
    """
    table = pa.Table.from_arrays([_plain(c) for c in table.columns], names=table.column_names)
    bad = np.zeros(table.num_rows, dtype=bool)
    for name, kind in kinds.items():
        column = table.column(name)
        ok = _values_ok(column, kind, separator)
        if ok is None:
            continue
        checked = "list_text" if kind == "list" and is_text(column.type) else kind
        for i in np.flatnonzero(~ok & ~bad):
            value = column[int(i)].as_py()
            what, reason = value_problem(name, checked, "" if value is None else str(value), time)
            report.add_bad(int(lines[i]), what, reason, quote(int(i)))
        bad |= ~ok
    if time:
        keys, ok, dated = time_keys(table.column(time))
        for i in np.flatnonzero(~ok & ~bad):
            value = table.column(time)[int(i)].as_py()
            reason = time_problem(time, value)
            report.add_bad(int(lines[i]), "bad_time", reason, quote(int(i)))
        bad |= ~ok
        for form, found in zip(FORMS, (~bad & ~dated, ~bad & dated)):
            if found.any() and form not in report.time_forms:
                report.time_forms[form] = int(lines[np.argmax(found)])
    if bad.any():
        table, lines = table.filter(pa.array(~bad)), lines[~bad]
    names = [name for name, kind in kinds.items() if kind != "time"]
    columns = [_convert(table.column(name), kinds[name], separator) for name in names]
    if time:
        columns.append(pa.array(keys[~bad]))
        names.append(TIME_KEY)
    return pa.Table.from_arrays(columns, names=names), lines


def _plain(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """A column as the values it holds: a dictionary's values, a decimal's as float64 through its text, so each is
    the nearest double, as the same digits read from a CSV (Arrow's cast scales in floating point: 3.03 became
    3.0300000000000002)."""
    if pa.types.is_dictionary(column.type):
        column = pc.cast(column, column.type.value_type)
    if pa.types.is_decimal(column.type):
        column = pc.cast(pc.cast(column, pa.string()), pa.float64())
    return column


def is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _values_ok(column: pa.ChunkedArray, kind: str, separator: str) -> np.ndarray | None:
    """Which values fit ``kind`` (None: all do). Text is checked by pattern; typed labels by value; the items of
    typed lists for ``separator``, by which a served request joins a cell's items (an item holding it would be
    served as two)."""
    if kind == "label" and not is_text(column.type):
        values = pc.cast(column, pa.float64()).to_numpy(zero_copy_only=False)
        return (values == 0) | (values == 1)  # a null (NaN) label is bad too
    if kind == "float" and pa.types.is_floating(column.type):
        return ~pc.fill_null(pc.is_inf(column), False).to_numpy(zero_copy_only=False).astype(bool)
    if kind in ("int", "float") and pa.types.is_uint64(column.type):  # the raw layout's integers are int64
        return pc.fill_null(pc.less_equal(column, pa.scalar(2**63 - 1, pa.uint64())), True).to_numpy(
            zero_copy_only=False).astype(bool)
    if kind == "list" and (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
        return _items_without(column, separator)
    if not is_text(column.type):
        return None
    if kind == "label":
        ok = pc.match_substring_regex(column, _LABEL_PATTERN)
    elif kind == "int":
        ok = pc.fill_null(pc.match_substring_regex(column, _INT_PATTERN), False).to_numpy(zero_copy_only=False)
        ok = ok.astype(bool)
        long = np.flatnonzero(ok & (pc.fill_null(pc.utf8_length(column), 0).to_numpy(zero_copy_only=False)
                                    >= _INT64_DIGITS))
        for i in long:
            digits = column[int(i)].as_py()
            negative = digits.startswith("-")
            digits = digits.lstrip("-").lstrip("0")
            ok[i] = len(digits) <= _INT64_DIGITS and (int(digits or "0") <= (2**63 if negative else 2**63 - 1))
        return ok
    elif kind == "list":
        ok = pc.fill_null(pc.invert(pc.match_substring_regex(column, LIST_TEXT_PATTERN)), True)  # a missing list
    elif kind == "float":
        number = pc.and_(pc.match_substring_regex(column, _FLOAT_PATTERN), pc.not_equal(column, ""))
        values = pc.cast(pc.if_else(number, column, pa.scalar(None, column.type)), pa.float64())
        ok = pc.and_(pc.or_(pc.match_substring_regex(column, _FLOAT_PATTERN),
                            pc.match_substring_regex(column, MISSING_NUMBER_PATTERN)),
                     pc.invert(pc.fill_null(pc.is_inf(values), False)))
    else:
        return None
    return pc.fill_null(ok, False).to_numpy(zero_copy_only=False).astype(bool)


def _items_without(lists: pa.ChunkedArray, separator: str) -> np.ndarray | None:
    """Which list cells have no item holding ``separator`` (None: all)."""
    holding = cells_holding(lists.combine_chunks() if isinstance(lists, pa.ChunkedArray) else lists, separator)
    if not holding.size:
        return None
    ok = np.ones(len(lists), dtype=bool)
    ok[holding] = False
    return ok


def _python_text(column: pa.ChunkedArray) -> pa.Array:
    """Numbers and booleans of a categorical column as the text Python's ``str`` gives them, what a client sends for
    them and what pandas writes to a CSV (a float id 3.0 is "3.0", True "True"); a NaN is missing."""
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_boolean(column.type):
        return pc.if_else(column, "True", "False")
    if not pa.types.is_floating(column.type):
        return pc.cast(column, pa.string())
    values = pc.cast(column, pa.float64()).to_numpy(zero_copy_only=False)
    # whole numbers below 1e16 are their integer and ".0" (-0.0 keeps its sign); the rest value by value
    whole = (values == np.floor(values)) & (np.abs(values) < 1e15) & ~((values == 0) & np.signbit(values))
    text = np.where(whole, np.char.add(np.where(whole, values, 0).astype(np.int64).astype(str), ".0"), None)
    for i in np.flatnonzero(~whole & ~np.isnan(values)):
        text[i] = str(float(values[i]))
    return pa.array(text, pa.string())


def _convert(column: pa.ChunkedArray, kind: str, separator: str) -> pa.ChunkedArray | pa.Array:
    """Checked values to the raw layout's types (empty text is missing)."""
    t = column.type
    if kind == "label":
        if is_text(t):
            lowered = pc.utf8_lower(column)
            column = pc.if_else(pc.equal(lowered, "true"), "1", pc.if_else(pc.equal(lowered, "false"), "0", column))
            column = pc.cast(column, pa.float64())
        return pc.cast(column, pa.int8())
    if is_text(t):
        missing = pc.equal(column, "")
        if kind == "float":
            missing = pc.or_(missing, pc.match_substring_regex(column, MISSING_NUMBER_PATTERN))
        column = pc.if_else(missing, pa.scalar(None, t), column)
        if kind == "int":
            return pc.cast(column, pa.int64())
        if kind == "float":
            return pc.cast(column, pa.float64())
        if kind == "list":
            return _drop_empty_items(pc.split_pattern(column, separator))
        return pc.cast(column, pa.string())
    if kind in ("int", "float"):
        if pa.types.is_floating(t):
            column = pc.cast(column, pa.float64())
            return pc.if_else(pc.is_nan(column), pa.scalar(None, pa.float64()), column)
        return pc.cast(column, pa.int64())
    if kind == "string":
        return _python_text(column)
    return _drop_empty_items(column)


def _drop_empty_items(lists: pa.ChunkedArray | pa.Array) -> pa.Array:
    lists = lists.combine_chunks() if isinstance(lists, pa.ChunkedArray) else lists
    lists = pc.cast(lists, pa.list_(pa.string()))
    flat = pc.list_flatten(lists)
    parents = pc.list_parent_indices(lists).to_numpy()
    keep = pc.not_equal(flat, "").to_numpy(zero_copy_only=False).astype(bool)
    counts = np.bincount(parents[keep], minlength=len(lists))
    offsets = pa.array(np.r_[0, np.cumsum(counts)].astype(np.int32))
    return pa.ListArray.from_arrays(offsets, flat.filter(pa.array(keep)), mask=lists.is_null())
