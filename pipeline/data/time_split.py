"""Splitting rows by time (``data.time_column``): the time of each row, and the cut times.

A time becomes an int64 *key* that orders the rows: an integer as it is (epoch seconds or
milliseconds: one unit for all rows), a whole-number float as that integer, ISO 8601 text (a date,
or a date and time, with or without a zone; without one it is read as UTC) or a parquet timestamp
or date as nanoseconds since 1970 (UTC). Integers and dates cannot be compared, so a column holds
one form or the other.

:meth:`TimeCuts.of` finds the cuts from every row's key: exact order statistics (``np.partition``,
8 bytes a row). Test is the latest ``test_fraction`` of the rows, valid the ``valid_fraction`` just
before; every row of the time at a cut goes to the later split, so a split never parts one time.

Example::

    keys, ok, dated = time_keys(pa.array(["2024-01-05", "2024-01-06T10:00:00Z", "yesterday"]))
    cuts = TimeCuts.of(keys[ok], valid_fraction=0.1, test_fraction=0.1, column="ts", dated=True)
    cuts.codes(keys[ok])          # 0 train, 1 valid, 2 test
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.errors import BadInputError

TIME_KEY = "__time__"
"""The column of time keys a reader adds to its tables when the roles name a time column."""
FORMS = ("integer", "date/time")
_INTEGER = r"^-?[0-9]+(\.0*)?$"
"""An integer time written as text, also with a zero fraction (``1704067200.0``: pandas writes an integer column
widened by a missing value so)."""
YEARS = (1678, 2261)
"""The years a date/time key holds (nanoseconds since 1970 in an int64)."""
_ZONE = r"(Z|[+-][0-9]{2}:?[0-9]{2})$"


def time_keys(column: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each value's key (int64), whether it is a usable time, and whether it is a date/time (else an integer)."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_dictionary(array.type):
        array = array.dictionary_decode()
    kind = array.type
    n = len(array)
    keys, ok, dated = np.zeros(n, np.int64), np.zeros(n, bool), np.zeros(n, bool)
    if pa.types.is_integer(kind):
        keys, ok = _cast(array, pa.int64())
    elif pa.types.is_floating(kind):
        values = array.to_numpy(zero_copy_only=False).astype(np.float64)
        ok = np.isfinite(values) & (np.floor(values) == values) & (np.abs(values) < 2.0**63)
        keys[ok] = values[ok].astype(np.int64)
    elif pa.types.is_timestamp(kind) or pa.types.is_date(kind):
        keys, ok = _cast(array, pa.timestamp("ns", getattr(kind, "tz", None)))
        dated[:] = True
    elif pa.types.is_string(kind) or pa.types.is_large_string(kind):
        integer = _matches(array, _INTEGER)
        zoned = _matches(array, _ZONE) & ~integer
        for mask, to in ((integer, pa.int64()), (zoned, pa.timestamp("ns", "UTC")),
                         (~integer & ~zoned, pa.timestamp("ns"))):
            at = np.flatnonzero(mask)
            values = array.take(pa.array(at))
            if to == pa.int64():
                values = pc.replace_substring_regex(values, r"\.0*$", "")
            keys[at], ok[at] = _cast(values, to)
        dated = ~integer
    return keys, ok, dated & ok


def time_problem(name: str, value: object) -> str:
    """Why ``value`` of the time column ``name`` is no time the keys hold (:func:`time_keys` refused it)."""
    text = "" if value is None else str(value)
    if text == "":
        return f"{name}: the time is missing"
    year = re.match(r"\s*(-?[0-9]{4,})-[0-9]{1,2}-[0-9]{1,2}", text)
    if year and not YEARS[0] <= int(year.group(1)) <= YEARS[1]:
        return (f"{name}: {text[:40]!r} is outside the years {YEARS[0]} to {YEARS[1]} that times are kept in (a "
                "placeholder date, such as 9999-12-31? write it as missing)")
    if re.fullmatch(r"[0-9]{1,2}[/.][0-9]{1,2}[/.][0-9]{2,4}.*|[0-9]{1,2}:[0-9]{2}.*|.*[0-9] ?[A-Za-z]{3,}", text.strip()):
        return (f"{name}: {text[:40]!r} is not a time as they are read: write it in ISO 8601 (YYYY-MM-DD, "
                "YYYY-MM-DD HH:MM:SS, with Z or +HH:MM for a zone)")
    return f"{name}: {text[:40]!r} is not a time (an integer, or an ISO 8601 date or date and time)"


def _matches(strings: pa.Array, pattern: str) -> np.ndarray:
    return pc.fill_null(pc.match_substring_regex(strings, pattern), False).to_numpy(zero_copy_only=False).astype(bool)


def _cast(values: pa.Array, to: pa.DataType) -> tuple[np.ndarray, np.ndarray]:
    """The values cast to ``to`` as int64, and which cast (the whole array at once, else value by value)."""
    try:
        cast = pc.cast(values, to)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        keys, ok = np.zeros(len(values), np.int64), np.zeros(len(values), bool)
        for i in range(len(values)):
            try:
                key = pc.cast(values.slice(i, 1), to).cast(pa.int64())[0].as_py()
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                continue
            if key is not None:
                keys[i], ok[i] = key, True
        return keys, ok
    cast = cast.cast(pa.int64())
    return pc.fill_null(cast, 0).to_numpy(zero_copy_only=False), cast.is_valid().to_numpy(zero_copy_only=False)


EPOCH_UNITS = {"seconds": 1, "milliseconds": 10**3, "microseconds": 10**6, "nanoseconds": 10**9}
EPOCH_SPAN = (10**9, 10**10)
"""Epoch seconds from September 2001 to 2286; times in another unit of :data:`EPOCH_UNITS` span it times that unit."""


def _one_unit(keys: np.ndarray, column: str) -> None:
    """A :class:`BadInputError` where integer times are epoch times of more than one unit (files of two systems
    joined, say): each unit's rows would sort as one block, and the latest ``data.test_fraction`` of them would be
    rows of one unit rather than the latest period."""
    found = []
    for unit, scale in EPOCH_UNITS.items():
        inside = (keys >= EPOCH_SPAN[0] * scale) & (keys < min(EPOCH_SPAN[1] * scale, np.iinfo(np.int64).max))
        if inside.any():
            found.append(f"{int(inside.sum()):,} of epoch {unit} (as {int(keys[inside.argmax()])})")
    if len(found) > 1:
        raise BadInputError(f"data.time_column={column}: its integer times mix units: " + ", ".join(found) +
                            "; write every time in one unit (or as ISO 8601 text)")


def shown(key: int, dated: bool) -> str | int:
    """A key as the user wrote such times: an integer, or ISO 8601 (UTC)."""
    return str(np.datetime_as_string(np.datetime64(key, "ns"), unit="auto")) if dated else int(key)


@dataclass(frozen=True)
class TimeCuts:
    """Rows at or after ``test`` go to test, at or after ``valid`` (before ``test``) to valid, the rest to
    train; ``None``: no such cut."""

    valid: int | None
    test: int | None
    dated: bool

    @classmethod
    def of(cls, keys: np.ndarray, valid_fraction: float, test_fraction: float, column: str,
           dated: bool) -> TimeCuts:
        """The cuts that give test the latest ``test_fraction`` of ``keys`` and valid the ``valid_fraction``
        before; a :class:`BadInputError` when ties at a cut would leave no row for training."""
        if not dated:
            _one_unit(keys, column)
        rows = len(keys)
        first_test = rows - round(rows * test_fraction)
        first_valid = max(first_test - round(rows * valid_fraction), 0)
        wanted = [i for i in dict.fromkeys((first_valid, first_test)) if i < rows]
        ordered = np.partition(keys, wanted) if wanted else keys
        test = int(ordered[first_test]) if first_test < rows else None
        valid = int(ordered[first_valid]) if first_valid < first_test else test
        cuts = cls(valid, test, dated)
        if valid is not None and rows and not np.any(keys < valid):
            raise BadInputError(
                f"data.time_column={column}: the first {'valid' if valid != test else 'test'} time is "
                f"{shown(valid, dated)}, the earliest of the rows, so no row is left for training (the rows of "
                "the time at a cut all go to the later split); use a finer time, or smaller data.valid_fraction "
                "and data.test_fraction")
        if valid_fraction and test is not None and not np.any((keys >= valid) & (keys < test)):
            raise BadInputError(
                f"data.time_column={column}: no row is left for validation: the data.valid_fraction={valid_fraction} "
                f"of the rows before the first test time, {shown(test, dated)}, share that time (the rows of the "
                "time at a cut all go to the later split); use a finer time, or a larger data.valid_fraction")
        return cuts

    def codes(self, keys: np.ndarray) -> np.ndarray:
        """0 (train), 1 (valid) or 2 (test) for each key."""
        codes = np.zeros(len(keys), dtype=np.int8)
        if self.valid is not None:
            codes[keys >= self.valid] = 1
        if self.test is not None:
            codes[keys >= self.test] = 2
        return codes

    def record(self) -> dict:
        """The cuts as ``meta.json`` keeps them: the first valid and the first test time."""
        return {split: None if key is None else shown(key, self.dated)
                for split, key in (("valid", self.valid if self.valid != self.test else None), ("test", self.test))}
