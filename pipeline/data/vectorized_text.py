"""Text tables parsed with array operations only, on numpy (CPU) or CuPy (GPU).

:func:`parse_block` takes a block of whole lines (what ``line_blocks.line_blocks`` cuts a plain or compressed file
into), what the lines hold (a :class:`TextLayout`: Criteo's, :data:`CRITEO`, or a table's from its header line,
:func:`text_layout`) and an array module ``xp``, and gives what the Arrow path of
:mod:`pipeline.data.readers` gives for it: the same table (Criteo: label int8, I1..I13 int64, C1..C26 string; a
table: label int8, numbers float64, categories string, lists of strings; empty = null), the same line numbers and the
same report. The block goes to ``xp`` once as bytes; line ends, delimiters, UTF-8 and the values
(:mod:`pipeline.data.vectorized_values`) are then checked for every line at once, with no Python loop over lines or
fields, so the same code runs on the GPU with ``xp=cupy``. In a quoted format (CSV) a value wrapped whole in quotes
(``"a, b"``, as pandas and Arrow write text) is read here; a block with any other use of quotes (an escaped ``""``,
a quote inside a value, a value left open) is not (None): that quoting is the Arrow path's.

A malformed line has the first problem the Arrow path finds, in its order: an empty line, a line
over ``MAX_LINE_BYTES``, a ``\\r`` inside the line, broken UTF-8, the wrong number of fields, then the first of
the checked columns (label, numbers, in the output's order) whose value does not fit. The counts by kind are array
reductions; the examples (at most ``EXAMPLES`` a file, in the Arrow path's order) are written on the host from the
readers' own reason functions, from the few lines they quote.
Only the output leaves ``xp``: every buffer of the table (typed columns, validity bitmaps, string
offsets and bytes) is made there, packed into one array and copied back at once (into pinned memory
for CuPy, as the block came), and the pyarrow table is views of that copy, as the Arrow path's.

Example::

    report = FileReport("day_0.gz")
    for table, lines in read_criteo("day_0.gz", 250_000, report, xp=cupy):
        ...
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import pyarrow as pa

from pipeline.data import vectorized_values as values
from pipeline.data.text_format import (
    CRITEO_CATEGORICAL,
    CRITEO_CONTINUOUS,
    EXAMPLES,
    MAX_LINE_BYTES,
    FileReport,
    carriage_return_reason,
    field_count_reason,
    too_long,
    utf8_reason,
    value_problem,
)
from pipeline.data.time_split import FORMS, TIME_KEY, time_keys, time_problem
from pipeline.data.vectorized_values import to_host

KINDS = ["wrong_field_count", "line_too_long", "carriage_return", "invalid_utf8", "bad_label", "not_a_number",
         "out_of_range", "list_as_text", "bad_time"]
# A malformed line's first problem, numbered in the order the Arrow path looks (0: none). The problem
# VALUE + k is the layout's k-th checked column (TextLayout.checked); the one after them, a time that is not one.
EMPTY, LONG, CARRIAGE, UTF8, FIELD_COUNT, VALUE = 1, 2, 3, 4, 5, 6
NL, CR, QUOTE, OPEN, CLOSE = 10, 13, 34, 91, 93
CHECKED = ("label", "int", "float", "list")
_LONE_CR = re.compile(rb"\r(?!\n)")


@dataclass(frozen=True)
class TextLayout:
    """What the lines of a text file hold: every field of a line in order, the columns given back with their kinds
    (``label``, ``int``, ``float``, ``string``, ``list``; ``time``: read for the rows' times only) in the output's
    order, the delimiter, whether values may be quoted, the byte that separates a list's items, and the column of
    the rows' times (a table split by time: its keys are the output's last column,
    :data:`~pipeline.data.time_split.TIME_KEY`)."""

    fields: tuple[str, ...]
    kinds: tuple[tuple[str, str], ...]
    delimiter: int
    quoting: bool = False
    separator: int = ord("|")
    time: str = ""

    @property
    def checked(self) -> list[tuple[str, str]]:
        """The columns whose values can make a row malformed, in the order the Arrow path checks them."""
        return [(name, kind) for name, kind in self.kinds if kind in CHECKED]

    def problem_kinds(self) -> list[int]:
        """The kind (an index of :data:`KINDS`) of each problem number."""
        return [-1] + [KINDS.index(kind) for kind in (
            "wrong_field_count", "line_too_long", "carriage_return", "invalid_utf8", "wrong_field_count",
            *({"label": "bad_label", "list": "list_as_text"}.get(kind, "not_a_number") for _, kind in self.checked),
            "bad_time")]


def text_layout(fields: list[str], kinds: dict[str, str], delimiter: str, quoting: bool = False, separator: str = "|",
                time: str = "") -> TextLayout | None:
    """The layout of a file's lines, from its ``fields`` (a table's header), the ``kinds`` of the columns given back
    and the ``time`` column; None where the Arrow path is the one to read it (a list separator of more than one
    byte)."""
    if "list" in kinds.values() and len(separator.encode()) != 1:
        return None
    return TextLayout(tuple(fields), tuple(kinds.items()), ord(delimiter), quoting, separator.encode()[0], time)


CRITEO = text_layout(["label", *CRITEO_CONTINUOUS, *CRITEO_CATEGORICAL],
                     {"label": "label", **dict.fromkeys(CRITEO_CONTINUOUS, "int"),
                      **dict.fromkeys(CRITEO_CATEGORICAL, "string")}, "\t")
"""Criteo TSV's layout: what :func:`pipeline.data.readers.read_criteo` parses."""


def parse_block(xp: ModuleType, layout: TextLayout, block: bytes | memoryview, first_line: int, report: FileReport
                ) -> tuple[pa.Table, np.ndarray, int] | None:
    """The valid lines of ``block`` as a table, their line numbers, and the number of lines in the
    block; the malformed ones go to ``report``. ``block`` holds whole lines, each ending in ``\\n``.
    None (and nothing reported) for a block whose quoting is not of the simple kind :func:`_outside_quotes` takes
    (where values may be quoted): the Arrow path parses it."""
    host = np.frombuffer(block, dtype=np.uint8)
    data = xp.asarray(host)
    fields = len(layout.fields)
    index = xp.int32 if len(block) < 2**31 else xp.int64  # positions in the block: half the memory traffic
    ends = xp.flatnonzero(data == NL).astype(index)
    starts = xp.concatenate([xp.zeros(1, ends.dtype), ends + 1])[:-1]
    crlf = (ends > starts) & (data[xp.maximum(ends - 1, 0)] == CR)
    stops = ends - crlf.astype(ends.dtype)  # a \r\n line's \r is not content
    problem = xp.zeros(ends.size, dtype=xp.int32)  # VALUE + k: a table may check hundreds of columns

    def mark(lines, code: int) -> None:
        """The lines of the mask or indices ``lines`` without an earlier problem get problem ``code``."""
        found = xp.zeros(ends.size, dtype=bool)
        found[lines] = True
        problem[found & (problem == 0)] = code

    mark(stops == starts, EMPTY)
    mark(stops - starts > MAX_LINE_BYTES, LONG)
    returns = xp.flatnonzero(data == CR)
    mark(xp.searchsorted(ends, returns[data[returns + 1] != NL]), CARRIAGE)  # the block ends in \n, not \r
    mark(_lines_not_utf8(xp, data, ends), UTF8)
    cuts = xp.flatnonzero(data == layout.delimiter).astype(index)
    quotes = xp.flatnonzero(data == QUOTE).astype(index) if layout.quoting else None
    if quotes is not None and quotes.size:
        cuts = _outside_quotes(xp, data, quotes, cuts, starts, ends, stops, layout.delimiter)
        if cuts is None:
            return None
    cuts_before_end = xp.searchsorted(cuts, ends)
    cut_counts = cuts_before_end - xp.concatenate([xp.zeros(1, cuts_before_end.dtype), cuts_before_end[:-1]])
    mark(cut_counts != fields - 1, FIELD_COUNT)

    rows = xp.flatnonzero(problem == 0)
    at_cut = cuts[(cuts_before_end[rows] - (fields - 1))[:, None] + xp.arange(fields - 1)]
    field_starts = xp.concatenate([starts[rows][:, None], at_cut + 1], axis=1)
    field_ends = xp.concatenate([at_cut, stops[rows][:, None]], axis=1)
    if quotes is not None and quotes.size:  # a quoted value is what its quotes hold
        quoted = (field_ends - field_starts >= 2) & (data[xp.minimum(field_starts, data.size - 1)] == QUOTE)
        field_starts, field_ends = field_starts + quoted, field_ends - quoted
    columns, fits, beyond = _values(xp, layout, data, host, field_starts, field_ends)
    if fits:
        bad = ~xp.stack(fits)
        first_bad = xp.argmax(bad, axis=0)  # each row's first bad checked column
        row_problem = xp.where(bad.any(axis=0), VALUE + first_bad, 0)
        out_of_range = (row_problem > 0) & xp.stack(beyond)[first_bad, xp.arange(rows.size)]
    else:
        row_problem, out_of_range = xp.zeros(rows.size, dtype=xp.int32), xp.zeros(rows.size, dtype=bool)
    keys = None
    if layout.time:  # the times of the rows without another problem, read on the host as the Arrow path reads them
        keys, row_problem = _times(xp, layout, host, field_starts, field_ends, row_problem, rows + first_line, report)
    problem[rows] = row_problem.astype(xp.int32)
    kind = xp.asarray(layout.problem_kinds(), dtype=xp.int32)[problem]
    kind[rows[out_of_range]] = KINDS.index("out_of_range")
    _report(xp, layout, block, first_line, report, starts, ends, problem, kind)

    good = xp.flatnonzero(row_problem == 0)
    table, lines = _table(xp, layout, data, {name: tuple(a[good] for a in arrays) for name, arrays in columns.items()},
                          field_starts[good], field_ends[good], rows[good].astype(xp.int64) + first_line)
    if keys is not None:
        table = pa.Table.from_arrays([*table.columns, pa.array(keys[to_host(good)])],
                                     names=[*table.column_names, TIME_KEY])
    return table, lines, int(ends.size)


def _times(xp: ModuleType, layout: TextLayout, host: np.ndarray, field_starts, field_ends, row_problem, lines,
           report: FileReport):
    """The time keys of the rows (int64, on the host; meaningful where the row has no problem) and the rows'
    problems with the times that are not times added; the report learns the forms of time met
    (:func:`~pipeline.data.time_split.time_keys` of the time column's text)."""
    column = layout.fields.index(layout.time)
    candidates = to_host(xp.flatnonzero(row_problem == 0))
    keys = np.zeros(len(row_problem), dtype=np.int64)
    at = xp.asarray(candidates)
    found, ok, dated = time_keys(values.texts(host, to_host(field_starts[at, column]), to_host(field_ends[at, column])))
    keys[candidates] = found
    row_problem[at[xp.asarray(~ok)]] = VALUE + len(layout.checked)
    numbers = to_host(lines[at])
    for form, seen in zip(FORMS, (ok & ~dated, ok & dated)):
        if seen.any() and form not in report.time_forms:
            report.time_forms[form] = int(numbers[np.argmax(seen)])
    return keys, row_problem


def _outside_quotes(xp: ModuleType, data, quotes, cuts, starts, ends, stops, delimiter: int):
    """The delimiters ``cuts`` that are not inside a quoted value, where every quote of the block opens a value at
    its start and closes it at its end (so a line's quotes pair up: ``"a,b"``, ``""``, ``"x"``); None for any other
    quoting (a quote inside a value, an escaped ``""``, a value left open), which the Arrow path parses."""
    line = xp.searchsorted(ends, quotes)
    first = xp.searchsorted(quotes, starts)  # each line's first quote, among all of them
    opening = (xp.arange(quotes.size) - first[line]) % 2 == 0
    at_start = (quotes == starts[line]) | (data[xp.maximum(quotes - 1, 0)] == delimiter)
    at_end = (quotes + 1 == stops[line]) | (data[quotes + 1] == delimiter)  # the block ends in \n, not a quote
    paired = (xp.searchsorted(quotes, ends) - first) % 2 == 0
    if not bool(xp.where(opening, at_start, at_end).all() & paired.all()):
        return None
    inside = xp.searchsorted(quotes, cuts) % 2 == 1  # every line's quotes pair up: an odd count before is open
    return cuts[~inside]


def _values(xp: ModuleType, layout: TextLayout, data, host: np.ndarray, field_starts, field_ends):
    """Each checked column's values read from the fields: ({name: (values, present)}, then per checked column in
    order whether each row's value fits, and whether it is out of range). Columns of a kind are read together."""
    columns, fits, beyond = {}, {}, {}
    for kind in CHECKED:
        names = [name for name, k in layout.kinds if k == kind]
        if not names:
            continue
        at = [layout.fields.index(name) for name in names]
        starts, ends = field_starts[:, at].T.ravel(), field_ends[:, at].T.ravel()
        shape = (len(names), field_starts.shape[0])
        if kind == "label":
            value, ok = values.labels(xp, data, starts, ends)
            read = (value, ok, ok, xp.zeros(ok.size, bool))
        elif kind == "int":
            value, written, in_range = values.integers(xp, data, starts, ends)
            read = (value, ends > starts, written & in_range, written & ~in_range)
        elif kind == "list":  # fits unless a list written as its text (text_format.LIST_TEXT_PATTERN)
            written = _list_as_text(xp, data, starts, ends)
            read = (written, ~written, ~written, xp.zeros(written.size, bool))
        else:
            read = values.numbers(xp, data, host, starts, ends)
        value, present, ok, out = (a.reshape(shape) for a in read)
        for j, name in enumerate(names):
            columns[name], fits[name], beyond[name] = (value[j], present[j]), ok[j], out[j]
    order = [name for name, _ in layout.checked]
    return columns, [fits[n] for n in order], [beyond[n] for n in order]


def _list_as_text(xp: ModuleType, data, starts, ends):
    """Which fields ``[starts, ends)`` are a list written as its text: ``[`` first and ``]`` last."""
    last = data.size - 1
    return ((ends - starts >= 2) & (data[xp.minimum(starts, last)] == OPEN)
            & (data[xp.clip(ends - 1, 0, last)] == CLOSE))


def _lines_not_utf8(xp: ModuleType, data, ends):
    """The lines (indices, maybe repeated) that hold bytes Python's strict UTF-8 decoder refuses."""
    high = xp.flatnonzero(data >= 0x80)
    if high.size == 0:
        return high
    b = data[high].astype(xp.int32)
    after = [data[xp.minimum(high + k, data.size - 1)].astype(xp.int32) for k in (1, 2, 3)]
    need = xp.where(b >= 0xF0, 3, xp.where(b >= 0xE0, 2, xp.where(b >= 0xC0, 1, 0)))  # 0: a continuation byte
    low = xp.where(b == 0xE0, 0xA0, xp.where(b == 0xF0, 0x90, 0x80))  # no overlong forms
    top = xp.where(b == 0xED, 0x9F, xp.where(b == 0xF4, 0x8F, 0xBF))  # no surrogates, nothing past U+10FFFF
    lead_ok = ((b >= 0xC2) & (b <= 0xF4) & (after[0] >= low) & (after[0] <= top)
               & ((need < 2) | ((after[1] & 0xC0) == 0x80)) & ((need < 3) | ((after[2] & 0xC0) == 0x80)))
    claimed = xp.zeros(high.size, dtype=bool)  # a continuation byte reached by a good lead 1, 2 or 3 bytes back
    for k in (1, 2, 3):
        reaches = lead_ok & (need >= k)
        claimed[k:] |= reaches[:-k] & (high[:-k] == high[k:] - k)
    bad = xp.where(need > 0, ~lead_ok, ~claimed)
    return xp.searchsorted(ends, high[bad])


def _table(xp: ModuleType, layout: TextLayout, data, columns: dict, field_starts, field_ends, lines
           ) -> tuple[pa.Table, np.ndarray]:
    """The kept rows as the Arrow path types them, and their line numbers. Every buffer of the table (values,
    validity bitmaps, string offsets and bytes, line numbers) is made on ``xp`` and packed into one array, copied
    back at once; the table's columns are views of that host copy."""
    rows = field_starts.shape[0]
    kinds = dict(layout.kinds)
    parts, nullable = {"lines": lines}, []
    for name, kind in layout.kinds:
        if kind == "label":
            parts[name] = columns[name][0]
        elif kind in ("int", "float"):
            parts[name] = xp.ascontiguousarray(columns[name][0])
            nullable.append((name, columns[name][1]))
    texts = [name for name, kind in layout.kinds if kind == "string"]
    if texts:
        at = [layout.fields.index(name) for name in texts]
        positions, offsets = values.segments(xp, field_starts[:, at].T.ravel(), field_ends[:, at].T.ravel())
        firsts = offsets[::rows] if rows else xp.zeros(len(texts) + 1, offsets.dtype)  # each column's first byte
        cuts = offsets[:len(texts) * rows].reshape(len(texts), rows)
        relative = xp.concatenate([cuts, firsts[1:, None]], axis=1) - firsts[:-1, None]  # each column's own offsets
        parts.update({"text_firsts": firsts.astype(xp.int64), "text_offsets": relative.astype(xp.int32),
                      "text": data[positions]})
        nullable += [(name, relative[j, 1:] > relative[j, :-1]) for j, name in enumerate(texts)]
    for name, kind in layout.kinds:
        if kind == "list":
            j = layout.fields.index(name)
            counts, item_offsets, positions = values.lists(xp, data, field_starts[:, j], field_ends[:, j],
                                                           layout.separator)
            parts.update({f"{name}/lists": xp.concatenate([xp.zeros(1, xp.int32), xp.cumsum(counts, dtype=xp.int32)]),
                          f"{name}/items": item_offsets.astype(xp.int32), f"{name}/bytes": data[positions]})
            nullable.append((name, field_ends[:, j] > field_starts[:, j]))
    if nullable:
        valid = xp.stack([v for _, v in nullable])
        parts["bits"] = _bitmaps(xp, valid)
        parts["nulls"] = rows - valid.sum(axis=1, dtype=xp.int64)
    host = _packed_to_host(xp, parts)
    validity = {name: (host["bits"][j], int(host["nulls"][j])) for j, (name, _) in enumerate(nullable)}

    def column(name: str) -> pa.Array:
        kind = kinds[name]
        if kind == "label":
            return pa.Array.from_buffers(pa.int8(), rows, [None, pa.py_buffer(host[name])])
        bits, nulls = validity[name]
        mask = pa.py_buffer(bits) if nulls else None
        if kind in ("int", "float"):
            t = pa.int64() if kind == "int" else pa.float64()
            return pa.Array.from_buffers(t, rows, [mask, pa.py_buffer(host[name])], nulls)
        if kind == "string":
            j, firsts = texts.index(name), host["text_firsts"]
            text = host["text"][firsts[j] - firsts[0]:firsts[j + 1] - firsts[0]]
            return pa.Array.from_buffers(pa.string(), rows, [mask, pa.py_buffer(host["text_offsets"][j]),
                                                             pa.py_buffer(text)], nulls)
        lists = host[f"{name}/lists"]
        items = pa.Array.from_buffers(pa.string(), int(lists[-1]), [None, pa.py_buffer(host[f"{name}/items"]),
                                                                    pa.py_buffer(host[f"{name}/bytes"])])
        return pa.Array.from_buffers(pa.list_(pa.string()), rows, [mask, pa.py_buffer(lists)], nulls,
                                     children=[items])

    names = [name for name, kind in layout.kinds if kind != "time"]
    return pa.Table.from_arrays([column(n) for n in names], names=names), host["lines"]


def _bitmaps(xp: ModuleType, valid):
    """Arrow validity bitmaps of the rows of a 2-d bool array: one row of bytes each, least significant bit
    first."""
    k, n = valid.shape
    padded = xp.zeros((k, -(-n // 8) * 8), dtype=xp.uint8)
    padded[:, :n] = valid
    weights = xp.asarray([1 << b for b in range(8)], dtype=xp.uint8)
    return (padded.reshape(k, -1, 8) * weights).sum(axis=2, dtype=xp.uint8)


def _packed_to_host(xp: ModuleType, parts: dict) -> dict[str, np.ndarray]:
    """The arrays of ``parts`` on the host, packed into one array (each at a multiple of 64 bytes, as Arrow places
    its buffers) that CuPy copies back in one transfer, into pinned memory."""
    places, size = {}, 0
    for name, array in parts.items():
        places[name] = size
        size += -(-array.nbytes // 64) * 64
    packed = xp.empty(size, dtype=xp.uint8)
    for name, array in parts.items():
        if array.nbytes:
            packed[places[name]:places[name] + array.nbytes] = xp.ascontiguousarray(array).view(xp.uint8).ravel()
    host = packed
    if xp is not np:
        host = host_array(xp, size)
        packed.get(out=host)
    return {name: host[places[name]:places[name] + array.nbytes].view(array.dtype).reshape(array.shape)
            for name, array in parts.items()}


def host_array(xp: ModuleType, size: int) -> np.ndarray:
    """``size`` bytes of host memory for copies to and from ``xp``. For CuPy it is page-locked, which the GPU reads
    and writes without a copy through pageable memory, from CuPy's pool: a buffer freed is used again for a size
    of its class (sizes are rounded up to a sixteenth of their power of two), so blocks whose sizes differ a little
    do not each lock new memory. Where the system lends no more page-locked memory, it is pageable: slower copies,
    the same bytes."""
    if xp is np:
        return np.empty(size, dtype=np.uint8)
    unit = 1 << max(size.bit_length() - 4, 12)
    rounded = -(-size // unit) * unit
    try:
        pinned = xp.cuda.alloc_pinned_memory(rounded)
    except (MemoryError, xp.cuda.runtime.CUDARuntimeError):
        return np.empty(size, dtype=np.uint8)
    return np.ndarray((rounded,), dtype=np.uint8, buffer=pinned)[:size]


def release_memory(xp: ModuleType) -> None:
    """Give back what ``xp``'s pools kept of the parse's memory once reading is done: CuPy's pools keep freed GPU and
    page-locked host memory for reuse, which the stages after this one (in the same process) would go without."""
    if xp is np:
        return
    xp.get_default_memory_pool().free_all_blocks()
    xp.get_default_pinned_memory_pool().free_all_blocks()


def _report(xp: ModuleType, layout: TextLayout, block: bytes, first_line: int, report: FileReport, starts, ends,
            problem, kind) -> None:
    """Count the block's malformed lines by kind and keep the first examples, in the Arrow path's order:
    by problem (for the checked columns: by column), then by line."""
    bad = xp.flatnonzero(problem)
    if bad.size == 0:
        return
    order = bad[xp.lexsort(xp.stack([bad, problem[bad].astype(bad.dtype)]))]
    kinds = kind[order]
    counts = to_host(xp.bincount(kinds, minlength=len(KINDS)))
    firsts = {k: int(xp.argmax(kinds == k)) for k in np.flatnonzero(counts)}
    for k in sorted(firsts, key=firsts.get):  # a kind is listed where it is first met, as add_bad does
        report.bad[KINDS[k]] = report.bad.get(KINDS[k], 0) + int(counts[k])
    shown = order[: max(EXAMPLES - len(report.examples), 0)]
    for i, start, end, code in zip(*(to_host(a).tolist() for a in (shown, starts[shown], ends[shown], problem[shown]))):
        reason, excerpt = _reason(layout, code, bytes(block[start:end]))
        report.add_example(first_line + i, reason, excerpt)


def _reason(layout: TextLayout, problem: int, line: bytes) -> tuple[str, bytes]:
    """The reason the Arrow path gives for ``line``'s ``problem``, and the excerpt it shows."""
    content = line[:-1] if line.endswith(b"\r") else line
    fields = len(layout.fields)
    if problem == EMPTY:
        return field_count_reason(fields, None), b""
    if problem == LONG:
        return too_long(len(line)), line[:200]
    if problem == CARRIAGE:
        return carriage_return_reason(_LONE_CR.search(line + b"\n").start()), line
    if problem == UTF8:
        return str(utf8_reason(line)), line
    text, delimiter = content.decode("utf-8"), chr(layout.delimiter)
    values = next(csv.reader([text], delimiter=delimiter)) if layout.quoting else text.split(delimiter)
    if problem == FIELD_COUNT:
        return field_count_reason(fields, len(values)), line
    if problem == VALUE + len(layout.checked):
        return time_problem(layout.time, values[layout.fields.index(layout.time)]), line
    name, kind = layout.checked[problem - VALUE]
    value = values[layout.fields.index(name)]
    return value_problem(name, "list_text" if kind == "list" else kind, value, layout.time)[1], line
