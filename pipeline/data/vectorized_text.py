"""Criteo TSV parsed with array operations only, on numpy (CPU) or CuPy (GPU).

:func:`parse_criteo_block` takes a block of whole lines (what ``readers._line_blocks`` cuts a plain
or compressed file into) and an array module ``xp``, and gives what the Arrow path of
:func:`pipeline.data.readers.read_criteo` gives for it: the same table (label int8, I1..I13 int64,
C1..C26 string, empty = null), the same line numbers and the same report. The block goes to ``xp``
once as bytes; line ends, tabs, UTF-8, labels and integers are then checked for every line at once,
with no Python loop over lines or fields, so the same code runs on the GPU with ``xp=cupy``.

A malformed line has the first problem the Arrow path finds, in its order: an empty line, a line
over ``MAX_LINE_BYTES``, a ``\\r`` inside the line, broken UTF-8, the wrong number of fields, a bad
label, then the first of I1..I13 that is not an integer or is outside the int64 range. The counts
by kind are array reductions; the examples (at most ``EXAMPLES`` a file, in the Arrow path's order)
are written on the host from the readers' own reason functions, from the few lines they quote.
Only the output leaves ``xp``: every buffer of the table (typed columns, validity bitmaps, string
offsets and bytes) is made there, packed into one array and copied back at once (into pinned memory
for CuPy, as the block came), and the pyarrow table is views of that copy, as the Arrow path's.

Example::

    report = FileReport("day_0.gz")
    for table, lines in read_criteo("day_0.gz", 250_000, report, xp=cupy):
        ...
"""

from __future__ import annotations

import re
from types import ModuleType

import numpy as np
import pyarrow as pa

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

FIELDS = 1 + len(CRITEO_CONTINUOUS) + len(CRITEO_CATEGORICAL)
NAMES = ["label", *CRITEO_CONTINUOUS, *CRITEO_CATEGORICAL]
KINDS = ["wrong_field_count", "line_too_long", "carriage_return", "invalid_utf8", "bad_label", "not_a_number",
         "out_of_range"]
# A malformed line's first problem, numbered in the order the Arrow path looks (0: none). The problem
# LABEL + k is column I<k>; the kind of each problem is KINDS[PROBLEM_KINDS[problem]] (an integer
# column's problem is not_a_number, or out_of_range for digits outside the int64 range).
EMPTY, LONG, CARRIAGE, UTF8, FIELD_COUNT, LABEL = 1, 2, 3, 4, 5, 6
PROBLEM_KINDS = [-1] + [KINDS.index(kind) for kind in (
    "wrong_field_count", "line_too_long", "carriage_return", "invalid_utf8", "wrong_field_count", "bad_label",
    *["not_a_number"] * len(CRITEO_CONTINUOUS))]
NL, CR, TAB, MINUS, ZERO, DOT = 10, 13, 9, 45, 48, 46
INT64_DIGITS = 19
_LONE_CR = re.compile(rb"\r(?!\n)")


def parse_criteo_block(xp: ModuleType, block: bytes | memoryview, first_line: int, report: FileReport
                       ) -> tuple[pa.Table, np.ndarray, int]:
    """The valid lines of ``block`` as a table, their line numbers, and the number of lines in the
    block; the malformed ones go to ``report``. ``block`` holds whole lines, each ending in ``\\n``."""
    data = xp.asarray(np.frombuffer(block, dtype=np.uint8))
    index = xp.int32 if len(block) < 2**31 else xp.int64  # positions in the block: half the memory traffic
    ends = xp.flatnonzero(data == NL).astype(index)
    starts = xp.concatenate([xp.zeros(1, ends.dtype), ends + 1])[:-1]
    crlf = (ends > starts) & (data[xp.maximum(ends - 1, 0)] == CR)
    stops = ends - crlf.astype(ends.dtype)  # a \r\n line's \r is not content
    problem = xp.zeros(ends.size, dtype=xp.uint8)

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
    tabs = xp.flatnonzero(data == TAB).astype(index)
    tabs_before_end = xp.searchsorted(tabs, ends)
    tab_counts = tabs_before_end - xp.concatenate([xp.zeros(1, tabs_before_end.dtype), tabs_before_end[:-1]])
    mark(tab_counts != FIELDS - 1, FIELD_COUNT)

    rows = xp.flatnonzero(problem == 0)
    at_tab = tabs[(tabs_before_end[rows] - (FIELDS - 1))[:, None] + xp.arange(FIELDS - 1)]
    field_starts = xp.concatenate([starts[rows][:, None], at_tab + 1], axis=1)
    field_ends = xp.concatenate([at_tab, stops[rows][:, None]], axis=1)
    label_ok = _labels_ok(xp, data, field_starts[:, 0], field_ends[:, 0])
    ints = len(CRITEO_CONTINUOUS)
    values, written_ok, fits = _integers(xp, data, field_starts[:, 1:1 + ints].T.ravel(),
                                         field_ends[:, 1:1 + ints].T.ravel())
    values, written_ok, fits = (a.reshape(ints, rows.size) for a in (values, written_ok, fits))
    int_bad = ~(written_ok & fits)
    first_bad = xp.argmax(int_bad, axis=0)  # each row's first bad integer column
    value_problem = xp.where(~label_ok, LABEL, xp.where(int_bad.any(axis=0), LABEL + 1 + first_bad, 0))
    problem[rows] = value_problem.astype(xp.uint8)
    kind = xp.asarray(PROBLEM_KINDS, dtype=xp.int32)[problem.astype(xp.int32)]
    beyond = (value_problem > LABEL) & (written_ok & ~fits)[first_bad, xp.arange(rows.size)]
    kind[rows[beyond]] = KINDS.index("out_of_range")
    _report(xp, block, first_line, report, starts, ends, problem, kind)

    good = xp.flatnonzero(value_problem == 0)
    table, lines = _table(xp, data, values[:, good], field_starts[good], field_ends[good],
                          rows[good].astype(xp.int64) + first_line)
    return table, lines, int(ends.size)


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


def _segments(xp: ModuleType, starts, ends):
    """The position of every byte of the segments ``[starts, ends)`` laid end to end, and where each
    segment's bytes begin there (``offsets``, one more than the segments)."""
    lengths = ends - starts
    offsets = xp.concatenate([xp.zeros(1, lengths.dtype), xp.cumsum(lengths, dtype=lengths.dtype)])
    positions = xp.ones(int(offsets[-1]), dtype=lengths.dtype)
    filled = xp.flatnonzero(lengths > 0)
    if filled.size:  # each segment's first byte jumps there from the last byte of the segment before
        before = xp.concatenate([xp.full(1, -1, lengths.dtype), ends[filled[:-1]] - 1])
        positions[offsets[filled]] = starts[filled] - before
        xp.cumsum(positions, out=positions)
        positions -= 1
    return positions, offsets


def _segment_of(xp: ModuleType, offsets):
    """The segment of each byte laid out by :func:`_segments`."""
    filled = xp.flatnonzero(offsets[1:] > offsets[:-1])
    first = xp.zeros(int(offsets[-1]), dtype=offsets.dtype)
    if filled.size:
        first[offsets[filled]] = 1
        xp.cumsum(first, out=first)
        first -= 1
    return filled[first]


def _sums(xp: ModuleType, values, offsets):
    """The sum of ``values`` over each segment (modulo 2**64 for uint64)."""
    total = xp.concatenate([xp.zeros(1, values.dtype), xp.cumsum(values, dtype=values.dtype)])
    return total[offsets[1:]] - total[offsets[:-1]]


def _labels_ok(xp: ModuleType, data, starts, ends):
    """Which labels are written ``[01](\\.0*)?``, as the readers' label pattern asks."""
    positions, offsets = _segments(xp, starts, ends)
    b = data[positions]
    at = positions - starts[_segment_of(xp, offsets)]
    wrong = xp.where(at == 0, (b != ZERO) & (b != ZERO + 1), xp.where(at == 1, b != DOT, b != ZERO))
    return (ends > starts) & (_sums(xp, wrong.astype(xp.int32), offsets) == 0)


def _integers(xp: ModuleType, data, starts, ends):
    """Each field as an integer: (int64 value, written ``-?[0-9]+`` or empty, within the int64 range)."""
    positions, offsets = _segments(xp, starts, ends)
    segment = _segment_of(xp, offsets)
    b = data[positions]
    digit = (b >= ZERO) & (b <= ZERO + 9)
    sign = (b == MINUS) & (positions == starts[segment])
    power = ends[segment] - 1 - positions  # digits after this one
    empty = ends == starts
    written_ok = empty | ((_sums(xp, (~(digit | sign)).astype(xp.int32), offsets) == 0)
                         & (_sums(xp, digit.astype(xp.int32), offsets) > 0))
    huge = _sums(xp, (digit & (b != ZERO) & (power >= INT64_DIGITS)).astype(xp.int32), offsets) > 0
    tens = xp.asarray([10**k for k in range(INT64_DIGITS)], dtype=xp.uint64)
    terms = xp.where(digit & (power < INT64_DIGITS),
                     (b - ZERO).astype(xp.uint64) * tens[xp.minimum(power, INT64_DIGITS - 1)], xp.uint64(0))
    magnitude = _sums(xp, terms, offsets)  # at most 19 digits: below 2**64
    negative = ~empty & (data[starts] == MINUS)
    fits = ~huge & ((magnitude <= xp.uint64(2**63 - 1)) | (negative & (magnitude == xp.uint64(2**63))))
    values = xp.where(negative, xp.uint64(0) - magnitude, magnitude).view(xp.int64)
    return values, written_ok, fits


def _table(xp: ModuleType, data, values, field_starts, field_ends, lines) -> tuple[pa.Table, np.ndarray]:
    """The kept rows as the Arrow path types them, and their line numbers. Every buffer of the table (values,
    validity bitmaps, string offsets and bytes, line numbers) is made on ``xp`` and packed into one array, copied
    back at once; the table's columns are views of that host copy."""
    ints, texts = len(CRITEO_CONTINUOUS), len(CRITEO_CATEGORICAL)
    rows = field_starts.shape[0]
    positions, offsets = _segments(xp, field_starts[:, 1 + ints:].T.ravel(), field_ends[:, 1 + ints:].T.ravel())
    firsts = offsets[::rows] if rows else xp.zeros(texts + 1, offsets.dtype)  # where each column's bytes begin
    cuts = offsets[:texts * rows].reshape(texts, rows)
    relative = xp.concatenate([cuts, firsts[1:, None]], axis=1) - firsts[:-1, None]  # each column's own offsets
    int_valid = (field_ends[:, 1:1 + ints] > field_starts[:, 1:1 + ints]).T
    text_valid = relative[:, 1:] > relative[:, :-1]
    parts = {
        "labels": (data[field_starts[:, 0]] - ZERO).astype(xp.int8),
        "values": xp.ascontiguousarray(values),
        "int_bits": _bitmaps(xp, int_valid),
        "text_bits": _bitmaps(xp, text_valid),
        "nulls": rows - xp.concatenate([int_valid.sum(axis=1), text_valid.sum(axis=1)]).astype(xp.int64),
        "firsts": firsts.astype(xp.int64),
        "relative": relative.astype(xp.int32),
        "lines": lines,
        "text": data[positions],
    }
    host = _packed_to_host(xp, parts)
    nulls, firsts = host["nulls"], host["firsts"]
    columns = [pa.Array.from_buffers(pa.int8(), rows, [None, pa.py_buffer(host["labels"])])]
    for j in range(ints):
        columns.append(pa.Array.from_buffers(pa.int64(), rows, [_validity(host["int_bits"][j], nulls[j]),
                                                                pa.py_buffer(host["values"][j])], int(nulls[j])))
    for j in range(texts):
        null = nulls[ints + j]
        columns.append(pa.Array.from_buffers(pa.string(), rows, [
            _validity(host["text_bits"][j], null), pa.py_buffer(host["relative"][j]),
            pa.py_buffer(host["text"][firsts[j] - firsts[0]:firsts[j + 1] - firsts[0]])], int(null)))
    return pa.Table.from_arrays(columns, names=NAMES), host["lines"]


def _bitmaps(xp: ModuleType, valid):
    """Arrow validity bitmaps of the rows of a 2-d bool array: one row of bytes each, least significant bit
    first."""
    k, n = valid.shape
    padded = xp.zeros((k, -(-n // 8) * 8), dtype=xp.uint8)
    padded[:, :n] = valid
    weights = xp.asarray([1 << b for b in range(8)], dtype=xp.uint8)
    return (padded.reshape(k, -1, 8) * weights).sum(axis=2, dtype=xp.uint8)


def _validity(bitmap: np.ndarray, nulls) -> pa.Buffer | None:
    return pa.py_buffer(bitmap) if nulls else None


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


def _report(xp: ModuleType, block: bytes, first_line: int, report: FileReport, starts, ends, problem, kind) -> None:
    """Count the block's malformed lines by kind and keep the first examples, in the Arrow path's order:
    by problem (for I1..I13: by column), then by line."""
    bad = xp.flatnonzero(problem)
    if bad.size == 0:
        return
    order = bad[xp.lexsort(xp.stack([bad, problem[bad].astype(bad.dtype)]))]
    kinds = kind[order]
    counts = _host(xp.bincount(kinds, minlength=len(KINDS)))
    firsts = {k: int(xp.argmax(kinds == k)) for k in np.flatnonzero(counts)}
    for k in sorted(firsts, key=firsts.get):  # a kind is listed where it is first met, as add_bad does
        report.bad[KINDS[k]] = report.bad.get(KINDS[k], 0) + int(counts[k])
    shown = order[: max(EXAMPLES - len(report.examples), 0)]
    for i, start, end, code in zip(*(_host(a).tolist() for a in (shown, starts[shown], ends[shown], problem[shown]))):
        reason, excerpt = _reason(code, bytes(block[start:end]))
        report.add_example(first_line + i, reason, excerpt)


def _reason(problem: int, line: bytes) -> tuple[str, bytes]:
    """The reason the Arrow path gives for ``line``'s ``problem``, and the excerpt it shows."""
    content = line[:-1] if line.endswith(b"\r") else line
    if problem == EMPTY:
        return field_count_reason(FIELDS, None), b""
    if problem == LONG:
        return too_long(len(line)), line[:200]
    if problem == CARRIAGE:
        return carriage_return_reason(_LONE_CR.search(line + b"\n").start()), line
    if problem == UTF8:
        return str(utf8_reason(line)), line
    if problem == FIELD_COUNT:
        return field_count_reason(FIELDS, content.count(b"\t") + 1), line
    column = problem - LABEL
    value = content.split(b"\t")[column].decode("utf-8")
    return value_problem(NAMES[column], "label" if column == 0 else "int", value)[1], line


def _host(array) -> np.ndarray:
    """``array`` as a numpy array (copied back from the GPU for CuPy)."""
    return array if isinstance(array, np.ndarray) else array.get()
