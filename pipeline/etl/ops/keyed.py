"""Categorical values counted and looked up by 64-bit keys (hashes of their text), each checked by a second one.

Categorify's cuDF path works here. libcudf's string ``value_counts`` and merge on strings hash and
compare every string inside a hash table, column by column; here each string is hashed twice
(:func:`value_keys`: xxHash64 with two seeds, one GPU thread a row) and the rest is integer work:

- :func:`count_columns`: the value counts of all categorical columns of a partition from ONE stable
  radix sort of 64-bit words, each a column's index in the top bits above its value's key, instead of
  a ``value_counts`` per column, as ONE frame for all columns (:class:`ColumnCounts`);
- :func:`merge_columns`: such counts of several partitions merged by key, all columns in one sort too (a
  tree of them builds the vocabularies);
- :func:`key_table` and :func:`look_up`: a vocabulary's keys sorted once, each value found by a binary
  search (``searchsorted``) of its key instead of a string merge.

A hash is not one-to-one, so no key is trusted alone: each value also has a check key (the same hash
with another seed). Counting, each row's check key is compared with that of the first row of its key;
where they differ, the rows of that key are grouped by (key, check key) instead, so two values that
share a key are never merged. Looking up, the check key of the value found for a key must equal the
looked-up value's, so a value unseen at fit that shares a vocabulary value's key is absent, not that
value. Two different values are taken for one only when both 64-bit hashes collide (about 2^-128 for a
pair, and 2^-64 even for values crafted against one seed); comparing the text instead would move every
row's string through memory once more, the largest cost of the look-ups. A vocabulary holding two
values of one key (``KeyTable.exact`` false) is left to the caller to look up by strings.

Why hashes rather than other integer keys: cuDF's parquet reader gives strings, not the files'
dictionary codes (libcudf 26.10 can transcode parquet dictionaries only through a C++ reader option
that ``cudf.read_parquet`` does not expose), and ``Series.str.htoi`` reads hex text as a number but
is not one-to-one ("0a" and "a", or any text that is not hex).

The code is written once for CuPy with cuDF and numpy with pandas, so the CPU tests run it on
pandas; only :func:`string_keys`, :func:`~pipeline.etl.frames.array_module` and the small helpers at
the end tell the libraries apart.

Example::

    counts_of_part_1 = count_columns([strings_c1, strings_c2])   # ColumnCounts: one frame (key, check, count, value)
    merged = merge_columns([counts_of_part_1, counts_of_part_2])  # ColumnCounts of both partitions
    first_column = merged.column(0)
    table = key_table(vocabulary_values)
    positions = look_up(table, strings_c1)                     # -1: absent or missing
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from pipeline.etl.frames import array_module, cudf_frame, is_cudf

CHECK_SEED = 0x5EEDC0DE
"""The seed of the check keys (:func:`value_keys`); the keys have seed 0."""


def string_keys(strings: Any, seed: int = 0) -> Any:
    """A 64-bit hash (uint64) of each value of a Series of strings, with ``seed``, any hash for a missing one.

    cuDF: libcudf's xxHash64 of the UTF-8 bytes (``Series.hash_values(method="xxhash64")``); pandas:
    pandas' 64-bit hash of values (its hash key made from ``seed``). Either gives equal hashes to equal
    strings of its library.
    """
    if is_cudf(strings):
        return strings.hash_values(method="xxhash64", seed=seed).values
    return pd.util.hash_pandas_object(strings, index=False, hash_key=f"{seed:016x}"[-16:] if seed else
                                      "0123456789123456").to_numpy()


def value_keys(strings: Any) -> tuple[Any, Any]:
    """The key and the check key (uint64 each) of each value of a Series of strings."""
    return string_keys(strings), string_keys(strings, CHECK_SEED)


def distinct_by_key(keys: Any, checks: Any, weights: Any = None) -> tuple[Any, Any]:
    """The distinct values of rows given by their ``keys`` and check keys: a row of each and the sum of its rows' weights.

    ``keys``, ``checks``: arrays of one uint64 per row, equal for equal values; ``weights``: int64 per row
    (None: 1 each). Rows are grouped by a stable sort of the keys; each row's check key is compared with
    that of the first row of its key, and where any differs all rows are grouped by (key, check key)
    instead. Returns ``(rows, counts)``: for each distinct value the first row holding it and its total
    weight, in no particular order.
    """
    xp = array_module(keys)
    n = len(keys)
    if not n:
        return xp.zeros(0, dtype=xp.int64), xp.zeros(0, dtype=xp.int64)
    order = _stable_argsort(keys)
    starts_mask = _run_starts(keys[order])
    starts = xp.flatnonzero(starts_mask)
    group = xp.empty(n, dtype=xp.int64)
    group[order] = xp.cumsum(starts_mask) - 1
    if not bool((checks == checks[order[starts]][group]).all()):  # two values of one key: by both keys
        order = xp.lexsort(xp.stack([checks, keys]))
        starts_mask = _run_starts(keys[order]) | _run_starts(checks[order])
        starts = xp.flatnonzero(starts_mask)
    return order[starts], _run_sums(weights, order, starts, n, xp)


def _run_starts(ordered: Any) -> Any:
    """Whether each value of a sorted array starts a run of equal values."""
    xp = array_module(ordered)
    return xp.concatenate([xp.ones(1, dtype=bool), ordered[1:] != ordered[:-1]])


def _run_sums(weights: Any, order: Any, starts: Any, n: int, xp: Any) -> Any:
    """The weights summed over each run of sorted rows (run lengths when there are no weights), exact in int64."""
    ends = xp.concatenate([starts[1:], xp.full(1, n, dtype=starts.dtype)])
    if weights is None:
        return (ends - starts).astype(xp.int64)
    totals = xp.concatenate([xp.zeros(1, dtype=xp.int64), xp.cumsum(weights[order].astype(xp.int64))])
    return totals[ends] - totals[starts]


@dataclass
class ColumnCounts:
    """The value counts of several columns in one frame ``(key, check, count, value)``, one row per distinct value:
    column ``c``'s values are the rows ``bounds[c]:bounds[c + 1]`` (ordered by key). One frame, so that a merge, a
    transfer or a copy to the host is one call for all columns, not one a column."""

    frame: Any
    bounds: list[int]

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def __iter__(self):
        return (self.column(c) for c in range(len(self)))

    def column(self, index: int) -> Any:
        """Column ``index``'s counts, a frame numbered from 0."""
        return self.frame.iloc[self.bounds[index]:self.bounds[index + 1]].reset_index(drop=True)


def count_columns(columns: list[Any]) -> ColumnCounts:
    """The value counts of several columns of strings (Series of one library) of one partition, all in one sort;
    missing values left out. Only the distinct values' strings are gathered."""
    pairs = [value_keys(strings) for strings in columns]
    xp = array_module(pairs[0][0])
    keys, checks = xp.concatenate([k for k, _ in pairs]), xp.concatenate([c for _, c in pairs])
    tag_bits = (len(columns) - 1).bit_length()
    words = xp.concatenate([_tagged(k, xp.uint64(index), tag_bits) for index, (k, _) in enumerate(pairs)])
    kept = xp.flatnonzero(xp.concatenate([~missing(strings) for strings in columns]))
    if len(kept) < len(words):
        rows, counts = distinct_by_key(words[kept], checks[kept])
        rows = kept[rows]
    else:
        rows, counts = distinct_by_key(words, checks)
    bounds = _bounds(words[rows], len(columns), tag_bits)
    offsets = np.cumsum([0] + [len(strings) for strings in columns]).tolist()
    values = _concat([strings.take(rows[start:end] - offset).reset_index(drop=True)
                      for strings, offset, start, end in zip(columns, offsets, bounds, bounds[1:])])
    return ColumnCounts(_frame(values, {"key": keys[rows], "check": checks[rows], "count": counts, "value": values}),
                        bounds)


def merge_columns(parts: list[ColumnCounts]) -> ColumnCounts:
    """:class:`ColumnCounts` of the same columns from several partitions merged, all columns in one sort: counts of
    equal values summed, values of one key told apart by their check keys."""
    if len(parts) == 1:
        return parts[0]
    frame = _concat([part.frame for part in parts])
    keys, checks, counts = _array(frame["key"]), _array(frame["check"]), _array(frame["count"])
    xp = array_module(keys)
    columns = len(parts[0])
    tag_bits = (columns - 1).bit_length()
    part_starts = np.cumsum([0] + [len(part.frame) for part in parts]).tolist()
    starts = xp.asarray([first + bound for first, part in zip(part_starts, parts) for bound in part.bounds[:-1]],
                        dtype=xp.int64)
    segment = xp.searchsorted(starts, xp.arange(len(keys)), side="right") - 1  # the (part, column) of each row
    words = _tagged(keys, (segment % columns).astype(xp.uint64), tag_bits)
    rows, totals = distinct_by_key(words, checks, counts)
    frame = frame.take(rows).reset_index(drop=True)
    frame["count"] = totals
    return ColumnCounts(frame, _bounds(words[rows], columns, tag_bits))


def _tagged(keys: Any, tag: Any, tag_bits: int) -> Any:
    """Keys with ``tag`` (a column's index, or an array of them) in their top ``tag_bits`` bits, above the rest of the
    key: sorted, the words of each column come together, in column order."""
    if not tag_bits:
        return keys
    xp = array_module(keys)
    return (keys >> xp.uint64(tag_bits)) | (tag << xp.uint64(64 - tag_bits))


def _bounds(words: Any, columns: int, tag_bits: int) -> list[int]:
    """Where each column's words start in sorted words of :func:`_tagged` (and the end)."""
    if not tag_bits:
        return [0, len(words)]
    xp = array_module(words)
    tags = words >> xp.uint64(64 - tag_bits)
    return xp.searchsorted(tags, xp.arange(columns + 1, dtype=xp.uint64)).tolist()


@dataclass(frozen=True)
class KeyTable:
    """A vocabulary ready for :func:`look_up`: its keys sorted, the check key and the position of each."""

    keys: Any
    checks: Any
    positions: Any
    exact: bool
    """False when two of its values share a key: :func:`look_up` cannot tell them apart."""


def key_table(values: Any) -> KeyTable:
    """The :class:`KeyTable` of a vocabulary, a Series of distinct strings without missing ones."""
    keys, checks = value_keys(values)
    xp = array_module(keys)
    order = _stable_argsort(keys)
    ordered = keys[order]
    exact = not bool((ordered[1:] == ordered[:-1]).any()) if len(ordered) > 1 else True
    return KeyTable(ordered, checks[order], order.astype(xp.int64), exact)


def look_up(table: KeyTable, strings: Any) -> Any:
    """The vocabulary position of each value of a Series of strings; -1 where absent or missing.

    The key of each value is searched among the table's sorted keys; the key found there and its check
    key must both equal the value's. The table must be exact.
    """
    return look_up_codes(table, strings, 0, -1, -1).astype(np.int64)


def look_up_codes(table: KeyTable, strings: Any, offset: int, absent: int, missing_code: int) -> Any:
    """int32 codes of a Series of strings: ``offset`` plus the vocabulary position of each value found (as
    :func:`look_up` finds it), ``absent`` where not found, ``missing_code`` where missing.

    On CuPy what follows the search is one kernel (:func:`_codes_kernel`): the same steps as array operations cost a
    dozen passes over memory and as many kernel launches a column."""
    keys, checks = value_keys(strings)
    xp = array_module(keys)
    if not table.exact:
        raise ValueError("look_up: the vocabulary holds values of one key; look it up by its strings")
    gone = missing(strings)
    if not len(table.keys):
        return xp.where(gone, missing_code, absent).astype(xp.int32)
    at = xp.searchsorted(table.keys, keys)
    if xp is not np:
        return _codes_kernel()(keys, checks, gone, at, table.keys, table.checks, table.positions, len(table.keys),
                               offset, absent, missing_code)
    at = np.minimum(at, len(table.keys) - 1)
    found = (table.keys[at] == keys) & (table.checks[at] == checks)
    codes = np.where(found, table.positions[at] + offset, absent)
    return np.where(gone, missing_code, codes).astype(np.int32)


@functools.cache
def _codes_kernel() -> Any:
    """The CuPy kernel of :func:`look_up_codes` after the search: each row's code from the position ``at`` found
    for its key among the table's ``size`` sorted keys (``n``, ``i`` and names from ``_`` are CuPy's own)."""
    import cupy

    return cupy.ElementwiseKernel(
        "uint64 key, uint64 check, bool gone, int64 at, raw uint64 keys, raw uint64 checks, raw int64 positions, "
        "int64 size, int32 offset, int32 absent, int32 missing_code",
        "int32 code",
        """
        if (gone) {
            code = missing_code;
        } else if (at < size && keys[at] == key && checks[at] == check) {
            code = (int)positions[at] + offset;
        } else {
            code = absent;
        }
        """,
        "pipeline_keyed_codes",
    )


def _stable_argsort(keys: Any) -> Any:
    """The positions that sort ``keys``, equal keys in their order (CuPy's sort is always stable: a radix
    sort of integers; numpy's must be asked)."""
    xp = array_module(keys)
    return xp.argsort(keys, kind="stable") if xp is np else xp.argsort(keys)


def missing(values: Any) -> Any:
    """Whether each value of a Series is missing, as an array (CuPy for cuDF, numpy for pandas)."""
    return _array(values.isna())


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
