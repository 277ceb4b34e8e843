"""What the Criteo readers share: Criteo's columns, the longest line, what makes a row of an input
malformed and how the reason reads, and the report of one input file.

The Arrow reader (:mod:`pipeline.data.readers`) and the vectorized one
(:mod:`pipeline.data.vectorized_text`) judge rows by these, so their reports are the same.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.data.time_split import YEARS, time_keys

CRITEO_CONTINUOUS = [f"I{i}" for i in range(1, 14)]
CRITEO_CATEGORICAL = [f"C{i}" for i in range(1, 27)]
EXAMPLES = 20
"""How many malformed rows are kept as examples (per file, and in the report)."""
MAX_LINE_BYTES = 1 << 20
"""A text line longer than this (its line end not counted) is a malformed line, ``line_too_long``."""
DIGITS_PATTERN = r"-?[0-9]+"
MISSING_NUMBER_PATTERN = r"^([+-]?(nan|NaN|NAN)|NA|N/A|n/a|#N/A|#N/A N/A|#NA|<NA>|NULL|null|None|-?1\.#(IND|QNAN))$"
"""A missing number written as text, as pandas' ``read_csv`` reads one by default (R writes NA, databases NULL): in a
table's number columns and in a served request's, never in a categorical column."""


@dataclass
class FileReport:
    """What reading one input file found."""

    file: str
    rows_read: int = 0
    rows_kept: int = 0
    bad: dict[str, int] = field(default_factory=dict)
    examples: list[dict] = field(default_factory=list)
    stopped_at_line: int | None = None
    error: str | None = None
    time_forms: dict[str, int] = field(default_factory=dict)
    """With a time column: each form of time seen (integer, date/time) and the first line holding it."""

    @property
    def bad_rows(self) -> int:
        return sum(self.bad.values())

    def add_bad(self, line: int, kind: str, reason: str, excerpt: bytes | str) -> None:
        self.bad[kind] = self.bad.get(kind, 0) + 1
        self.add_example(line, reason, excerpt)

    def add_example(self, line: int, reason: str, excerpt: bytes | str) -> None:
        """Keep a malformed line as an example while there are fewer than :data:`EXAMPLES` (not counted)."""
        if len(self.examples) < EXAMPLES:
            if isinstance(excerpt, bytes):
                excerpt = excerpt.decode("utf-8", errors="backslashreplace")
            excerpt = excerpt if len(excerpt) <= 100 else excerpt[:97] + "..."
            self.examples.append({"file": self.file, "line": line, "reason": reason, "excerpt": excerpt})


def too_long(length: int) -> str:
    return f"the line is longer than {MAX_LINE_BYTES} bytes ({length}{'+' if length > MAX_LINE_BYTES else ''})"


def field_count_reason(expected: int, found: int | None) -> str:
    """Why a line has the wrong number of fields (``found`` None: the line is empty)."""
    return f"expected {expected} fields, found {'an empty line' if found is None else found}"


def carriage_return_reason(at: int) -> str:
    return f"a carriage return (\\r) inside the line at byte {at}; a line ends at \\n or \\r\\n"


def utf8_reason(line: bytes) -> str | None:
    """Why ``line`` is not UTF-8; None when it is."""
    try:
        line.decode("utf-8")
    except UnicodeDecodeError as err:
        return f"invalid UTF-8 ({err.reason}) at byte {err.start} of the line"
    return None


SPACED = "spaces around it"
"""What a value's reason says of a number or label that spaces beside it made malformed."""


_UNSIGNED_NUMBER = r"([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?"
"""A decimal number without its sign, as a number column's text may write it."""


def value_problem(name: str, kind: str, value: str, time_column: str = "") -> tuple[str, str]:
    """(kind of problem, reason) of a value of column ``name`` that does not fit its ``kind`` (``time_column``: the
    column ``data.time_column`` names, if any)."""
    shown = value if len(value) <= 40 else value[:37] + "..."
    unread = "bad_label" if kind == "label" else "not_a_number"  # a label's or a number's text that is none
    if kind in ("label", "int", "float") and value.strip() == name:
        return unread, (f"{name}: found {value!r}, the column's own name: a header line inside the file (files "
                        "joined with their header lines keep every one after the first as a row)")
    if kind in ("label", "int", "float") and value != value.strip() and re.fullmatch(
            r"[01]" if kind == "label" else r"[-+]?" + _UNSIGNED_NUMBER, value.strip()):
        what = "expected 0 or 1, found" if kind == "label" else "not a number:"
        return unread, (
            f"{name}: {what} {shown!r}, {SPACED} (as in a file written with ', ' between its values: write it "
            "without spaces around the separators, or as parquet)")
    if kind == "label":
        if re.fullmatch(r"-1(\.0*)?", value.strip()):
            return "bad_label", (f"{name}: expected 0 or 1, found {value!r} (labels of -1 and 1: write the negatives as "
                                 "0; skipping them would leave the positives alone)")
        if re.fullmatch(r"\+?" + _UNSIGNED_NUMBER, value):
            return "bad_label", (f"{name}: expected 0 or 1, found {shown!r} (a label is one row's outcome: a count of "
                                 "clicks or a rate is none; give each outcome its row)")
        if re.fullmatch(r"[^\W\d_][\w -]*", value) and not re.match(MISSING_NUMBER_PATTERN, value):
            return "bad_label", (f"{name}: expected 0 or 1, found {shown!r} (a label of words: write the positive "
                                 "outcome as 1 and the other as 0, or as true and false)")
        return "bad_label", f"{name}: expected 0 or 1, found {value!r}"
    if kind == "list_text":
        return "list_as_text", (f"{name}: {shown!r} is a list written as its text (as pandas writes a list to a CSV: "
                                "join its items with data.list_separator instead, or write the table as parquet, "
                                "which keeps lists)")
    if kind == "list":
        return "separator_in_item", (f"{name}: an item of {shown} holds data.list_separator, by which a served request "
                                     "joins a cell's items (it would be served as two items)")
    if kind == "float" and is_infinite(value):
        return "out_of_range", f"{name}: {shown!r} is not a finite number"
    if kind in ("int", "float") and re.fullmatch(DIGITS_PATTERN, value):
        return "out_of_range", f"{name}: {shown!r} is outside the 64-bit integer range"
    if kind in ("int", "float") and value.strip().lower() in ("true", "false", "yes", "no"):
        return "not_a_number", (f"{name}: {value!r} is not a number (a yes / no column: name it in data.categorical, "
                                "or write it as 1 / 0)")
    if kind in ("int", "float") and re.fullmatch(DATE_OR_TIME_PATTERN, value.strip()):
        return "not_a_number", f"{name}: {shown!r} is not a number ({date_or_time_advice(name, value, time_column)})"
    return "not_a_number", f"{name}: {value!r} is not {'an integer' if kind == 'int' else 'a number'}"


DATE_OR_TIME_PATTERN = (r"[0-9]{4}-[0-9]{1,2}-[0-9]{1,2}([ T][0-9]{1,2}:[0-9]{2}(:[0-9]{2}([.,][0-9]+)?)?)?"
                        r"( ?(Z|UTC|[+-][0-9]{2}:?[0-9]{2}))?"
                        r"|[0-9]{1,2}[/.][0-9]{1,2}[/.][0-9]{2,4}( [0-9]{1,2}:[0-9]{2}(:[0-9]{2})?( ?[AaPp][Mm])?)?"
                        r"|[0-9]{1,2}:[0-9]{2}(:[0-9]{2}([.,][0-9]+)?)?( ?[AaPp][Mm])?")
"""A date, a date and time or a time of day as tables write them (ISO 8601, 12/31/2024, 31.12.2024, 23:59)."""


def date_or_time_advice(name: str, value: object = None, time_column: str = "") -> str:
    """What to do with a column of dates or times named as a number (a continuous feature or the label): ``value``, one
    of them, tells whether ``data.time_column`` reads them as they are written; ``time_column``, that setting."""
    if name == time_column:
        return (f"a date or time: data.time_column={name} orders the splits by it, but as a feature it is no number: "
                f"take {name} out of data.continuous, or write it as numbers, such as epoch seconds")
    if value is not None and not _reads_as_time(str(value)):
        return (f"a date or time, written otherwise than ISO 8601 (YYYY-MM-DD, YYYY-MM-DD HH:MM:SS), the form "
                f"data.time_column reads: rewrite it so to order the splits by it with data.time_column={name}, drop "
                f"it with data.ignore=[{name}], or write it as numbers, such as epoch seconds")
    return (f"a date or time: order the splits by it with data.time_column={name}, drop it with data.ignore=[{name}], "
            "or write it as numbers, such as epoch seconds")


_TIME_SHAPES: dict[tuple[str, bool], bool] = {}


def _reads_as_time(value: str) -> bool:
    """Whether ``data.time_column`` reads ``value`` as a time (:func:`~pipeline.data.time_split.time_keys`), judged
    once a shape (its digits as 0, and whether its year is one the keys hold): the advice is asked for each bad row of
    a column of dates, and a parse of one value costs about 0.2 ms."""
    year = re.match(r"\s*(-?[0-9]{4,})-", value)
    shape = (re.sub("[0-9]", "0", value.strip()), not year or YEARS[0] <= int(year.group(1)) <= YEARS[1])
    if shape not in _TIME_SHAPES:
        if len(_TIME_SHAPES) >= 1024:
            _TIME_SHAPES.clear()
        _TIME_SHAPES[shape] = bool(time_keys(pa.array([value]))[1][0])
    return _TIME_SHAPES[shape]


LIST_TEXT_PATTERN = r"(?s)^\[.*\]$"
"""A multi-hot cell of text that is a list written as its text (``['a', 'b']``, ``[1, 2]``, ``[]``), not items joined by
``data.list_separator``: read as one item, it would be a value of its own."""


def is_infinite(value: str) -> bool:
    try:
        return np.isinf(float(value))
    except ValueError:
        return False


def cells_holding(lists: pa.Array, separator: str) -> np.ndarray:
    """The cells of ``lists`` (ascending) with a text item that holds ``separator``: a served request joins a cell's
    items by it, so such an item would be served as two."""
    items = pc.list_flatten(lists)
    if not (pa.types.is_string(items.type) or pa.types.is_large_string(items.type)):
        return np.empty(0, np.int64)
    holding = pc.fill_null(pc.match_substring(items, separator), False).to_numpy(zero_copy_only=False).astype(bool)
    return np.unique(pc.list_parent_indices(lists).to_numpy()[holding])
