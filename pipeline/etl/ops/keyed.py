"""Categorical values counted and looked up by 64-bit keys (hashes of their text), checked against the text.

Categorify's cuDF path works here. libcudf's string ``value_counts`` and merge on strings hash and
compare every string inside a hash table, column by column; here each string is hashed once
(:func:`string_keys`: xxHash64, one GPU thread a row) and the rest is integer work:

- :func:`count_columns`: the value counts of all categorical columns of a partition from ONE stable
  radix sort of 64-bit words, each a column's index in the top bits above its value's key, instead of
  a ``value_counts`` per column;
- :func:`merge_counts`: partial counts merged by key (a tree of them builds a vocabulary);
- :func:`key_table` and :func:`look_up`: a vocabulary's keys sorted once, each value found by a binary
  search (``searchsorted``) of its key instead of a string merge.

A hash is not one-to-one, so no key is trusted alone. Counting, each value is compared with the first
value of its key (a gather from the distinct values and one string comparison per row); where two values
share a key, the rows of that key are counted by value instead (:func:`distinct_by_key`), so two
values are never merged. Looking up, the value found for a key is compared with the value looked up,
so a value unseen at fit that shares a vocabulary value's key is absent, not that value; a vocabulary
holding two values of one key (``KeyTable.exact`` false) is left to the caller to look up by strings.

Why hashes rather than other integer keys: cuDF's parquet reader gives strings, not the files'
dictionary codes (libcudf 26.10 can transcode parquet dictionaries only through a C++ reader option
that ``cudf.read_parquet`` does not expose), and ``Series.str.htoi`` reads hex text as a number but
is not one-to-one ("0a" and "a", or any text that is not hex).

The code is written once for CuPy with cuDF and numpy with pandas, so the CPU tests run it on
pandas; only :func:`string_keys`, :func:`~pipeline.etl.frames.array_module` and the small helpers at
the end tell the libraries apart.

Example::

    counts = count_columns([strings_c1, strings_c2])          # one frame (key, count, value) per column
    vocab = merge_counts([counts_from_part_1, counts_from_part_2])
    table = key_table(vocabulary_values)
    positions = look_up(table, strings_c1)                     # -1: absent or missing
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np
import pandas as pd

from pipeline.etl.frames import array_module, cudf_frame, is_cudf


def string_keys(strings: Any) -> Any:
    """The 64-bit key (uint64) of each value of a Series of strings, any key for a missing one.

    cuDF: libcudf's xxHash64 of the UTF-8 bytes (``Series.hash_values(method="xxhash64")``); pandas:
    pandas' 64-bit hash of values. Either gives equal keys to equal strings of its library.
    """
    if is_cudf(strings):
        return strings.hash_values(method="xxhash64").values
    return pd.util.hash_pandas_object(strings, index=False).to_numpy()


def distinct_by_key(keys: Any, values: Any, weights: Any = None) -> tuple[Any, Any]:
    """The distinct values of ``values`` found through ``keys``: a row of each and the sum of its rows' weights.

    ``values``: a Series of strings without missing ones; ``keys``: an array of one uint64 per value,
    equal for equal values; ``weights``: int64 per row (None: 1 each). Rows are grouped by a stable
    sort of the keys; each row's value is compared with the first value of its key, and the rows of a
    key holding several values are grouped by value instead. Returns ``(rows, counts)``: for each
    distinct value the first row holding it and its total weight, in no particular order.
    """
    xp = array_module(keys)
    n = len(keys)
    if not n:
        return xp.zeros(0, dtype=xp.int64), xp.zeros(0, dtype=xp.int64)
    order = _stable_argsort(keys)
    ordered = keys[order]
    starts_mask = xp.concatenate([xp.ones(1, dtype=bool), ordered[1:] != ordered[:-1]])
    starts = xp.flatnonzero(starts_mask)
    first = order[starts]
    group = xp.empty(n, dtype=xp.int64)
    group[order] = xp.cumsum(starts_mask) - 1
    counts = _run_sums(weights, order, starts, n, xp)
    # The distinct keys' first values gathered first, then one per row: each gather reads a small column.
    same = _equal(values, values.take(first).take(group))
    if bool(same.all()):
        return first, counts
    shared = xp.zeros(len(starts), dtype=bool)
    shared[group[~same]] = True
    rows = xp.flatnonzero(shared[group])
    row_weights = xp.ones(len(rows), dtype=xp.int64) if weights is None else weights[rows]
    by_value = _frame(values, {"value": values.take(rows), "row": rows, "count": row_weights})
    by_value = by_value.groupby("value", sort=False).agg({"row": "min", "count": "sum"})
    kept = ~shared
    return (xp.concatenate([first[kept], _array(by_value["row"]).astype(xp.int64)]),
            xp.concatenate([counts[kept], _array(by_value["count"]).astype(xp.int64)]))


def _run_sums(weights: Any, order: Any, starts: Any, n: int, xp: Any) -> Any:
    """The weights summed over each run of sorted rows (run lengths when there are no weights), exact in int64."""
    ends = xp.concatenate([starts[1:], xp.full(1, n, dtype=starts.dtype)])
    if weights is None:
        return (ends - starts).astype(xp.int64)
    totals = xp.concatenate([xp.zeros(1, dtype=xp.int64), xp.cumsum(weights[order].astype(xp.int64))])
    return totals[ends] - totals[starts]


def count_columns(columns: list[Any]) -> list[Any]:
    """The value counts of several columns of strings of one partition, all in one sort.

    ``columns``: Series of strings (of one library), missing values left out of the counts. Each
    column's keys lose their top bits to the column's index, so one sort of all columns' words groups
    each column's values; the counts are checked against the strings (:func:`distinct_by_key`).
    Returns one frame per column: ``key`` (its value's full key), ``count``, ``value``, one row per
    distinct value.
    """
    if not columns:
        return []
    all_keys = [string_keys(strings) for strings in columns]
    xp = array_module(all_keys[0])
    tag_bits = (len(columns) - 1).bit_length()
    words, present = [], []
    for index, (strings, keys) in enumerate(zip(columns, all_keys)):
        if tag_bits:
            keys = (keys >> xp.uint64(tag_bits)) | xp.uint64(index << (64 - tag_bits))
        words.append(keys)
        present.append(~missing(strings))
    offsets = np.cumsum([0] + [len(strings) for strings in columns]).tolist()
    words, present = xp.concatenate(words), xp.concatenate(present)
    values = _concat(columns)
    kept = xp.flatnonzero(present)
    if len(kept) < len(values):
        words, values = words[kept], values.take(kept)
    rows, counts = distinct_by_key(words, values)
    by_row = xp.argsort(rows)
    rows, counts = rows[by_row], counts[by_row]
    firsts = values.take(rows).reset_index(drop=True)
    bounds = xp.searchsorted(kept[rows], xp.asarray(offsets)).tolist()
    out = []
    for start, end in pairwise(bounds):
        distinct = firsts.iloc[start:end]
        out.append(_frame(distinct, {"key": string_keys(distinct), "count": counts[start:end], "value": distinct}))
    return out


def merge_counts(parts: list[Any]) -> Any:
    """Frames of :func:`count_columns` (or of this function) for one column, merged into one: counts of equal
    values summed, values of one key told apart by their strings."""
    merged = _concat(parts) if len(parts) > 1 else parts[0]
    keys, values = _array(merged["key"]), merged["value"].reset_index(drop=True)
    rows, counts = distinct_by_key(keys, values, _array(merged["count"]))
    distinct = values.take(rows).reset_index(drop=True)
    return _frame(distinct, {"key": keys[rows], "count": counts, "value": distinct})


@dataclass(frozen=True)
class KeyTable:
    """A vocabulary ready for :func:`look_up`: its keys sorted, the position of each, and its values."""

    keys: Any
    positions: Any
    values: Any
    exact: bool
    """False when two of its values share a key: :func:`look_up` cannot tell them apart."""


def key_table(values: Any) -> KeyTable:
    """The :class:`KeyTable` of a vocabulary, a Series of distinct strings without missing ones."""
    keys = string_keys(values)
    xp = array_module(keys)
    order = _stable_argsort(keys)
    ordered = keys[order]
    exact = not bool((ordered[1:] == ordered[:-1]).any()) if len(ordered) > 1 else True
    return KeyTable(ordered, order.astype(xp.int64), values.reset_index(drop=True), exact)


def look_up(table: KeyTable, strings: Any) -> Any:
    """The vocabulary position of each value of a Series of strings; -1 where absent or missing.

    The key of each value is searched among the table's sorted keys and the value found there is
    compared with it, so only the same string gives a position. The table must be exact.
    """
    keys = string_keys(strings)
    xp = array_module(keys)
    if not table.exact:
        raise ValueError("look_up: the vocabulary holds values of one key; look it up by its strings")
    if not len(table.keys):
        return xp.full(len(keys), -1, dtype=xp.int64)
    at = xp.minimum(xp.searchsorted(table.keys, keys), len(table.keys) - 1)
    positions = table.positions[at]
    return xp.where(_equal(strings, table.values.take(positions)), positions, -1)


def _stable_argsort(keys: Any) -> Any:
    """The positions that sort ``keys``, equal keys in their order (CuPy's sort is always stable: a radix
    sort of integers; numpy's must be asked)."""
    xp = array_module(keys)
    return xp.argsort(keys, kind="stable") if xp is np else xp.argsort(keys)


def missing(values: Any) -> Any:
    """Whether each value of a Series is missing, as an array (CuPy for cuDF, numpy for pandas)."""
    return _array(values.isna())


def _equal(left: Any, right: Any) -> Any:
    """Whether two equally long Series hold the same value at each position (missing: False), as an array."""
    same = left.reset_index(drop=True) == right.reset_index(drop=True)
    if is_cudf(same):
        return same.fillna(False).values
    return same.to_numpy(dtype=bool, na_value=False)


def _array(series: Any) -> Any:
    """The values of a Series without missing ones as an array (CuPy for cuDF, numpy for pandas)."""
    return series.values if is_cudf(series) else series.to_numpy()


def _concat(items: list[Any]) -> Any:
    """Series (or frames) of one library one after the other, numbered 0..n-1.

    cuDF Series take the first one's dtype: a cuDF string column is of the object or the ``str`` dtype
    (numbers turned to text are object), and cuDF finds no common type of the two.
    """
    if is_cudf(items[0]):
        import cudf

        if isinstance(items[0], cudf.Series):
            dtype = items[0].dtype
            items = [item if item.dtype == dtype else item.astype(dtype) for item in items]
        return cudf.concat(items, ignore_index=True)
    return pd.concat(items, ignore_index=True)


def _frame(like: Any, columns: dict[str, Any]) -> Any:
    """A frame of ``like``'s library from equally long Series and arrays, put together by position."""
    if is_cudf(like):
        return cudf_frame(columns)
    return pd.DataFrame({name: column.reset_index(drop=True) if isinstance(column, pd.Series) else column
                         for name, column in columns.items()})
