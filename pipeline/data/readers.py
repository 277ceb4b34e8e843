"""Readers: real Criteo logs and any CSV / TSV / parquet table, into the raw layout.

* ``criteo``: TSV without a header, ``label, I1..I13, C1..C26``; an empty field is missing; ``.gz``
  (and other compressions Arrow detects from the suffix) too.
* ``table``: CSV (``,``), TSV (``.tsv``, ``.tab``, ``.txt``: tab) with a header line, or parquet, with
  the column roles of the settings (``data.label``, ``data.continuous``, ``data.categorical``,
  ``data.multihot``; columns to drop in ``data.ignore``). A multi-hot cell of a text file is split on
  ``data.list_separator``; in parquet it is a list column. A number is missing where its field is empty or holds
  a word pandas reads as missing (``NA``, ``NULL``, ``None``, ``NaN``...:
  :data:`~pipeline.data.text_format.MISSING_NUMBER_PATTERN`); in a categorical column such a word is text.

Text is read in blocks of whole lines (about ``data.chunk_rows`` rows, so a quoted value may not
hold a newline). Empty lines and lines that are not UTF-8 are taken out first; ``pyarrow.csv``
then parses the block with its final types on all threads and rejects rows with the wrong number
of fields. A block with such rows is parsed again on one thread (to learn their line numbers), and
a block with a value that does not convert is parsed again as text and checked column by column,
so one bad row never takes its block down and every bad row is counted with its line number. Given an array
module (``xp``: ``data.reader``), a block is parsed with array operations instead
(:mod:`pipeline.data.vectorized_text`, on the GPU with CuPy), with the same rows and report.
Malformed rows: the wrong number of fields (empty lines included), broken UTF-8, a non-number in a
numeric column (an integer is ``-?[0-9]+``: not ``0x1f``, not `` 7``), an integer outside the int64
range, an infinite number, a label other than 0/1 (``0``, ``1``, ``1.0``; not ``01``), a quoted
value left open at the end of its line, a ``\r`` inside a line (line ends are ``\n`` or ``\r\n``; a
file whose first read has ``\r`` but no ``\n`` has ``\r`` line ends), a line longer than
:data:`MAX_LINE_BYTES`. A byte-order mark is dropped at the start of a file and is part of its line
anywhere else. Each value is judged on its own, whatever else its block holds. A compressed file
that is truncated or not of its format stops the ingest with one error naming it, whatever
``data.on_bad_lines`` says. ``data.on_bad_lines=error`` (the default) stops at the first block that
has any and raises a :class:`~pipeline.errors.BadInputError` naming them; ``skip`` drops them.
Either way they are counted, with examples, in ``ingest_report.json``.
The ingest of a dataset's input files into the raw layout's splits is :mod:`pipeline.data.ingest`.

Example::

    roles = criteo_roles()
    for table, lines in read_criteo("day_0.gz", chunk_rows=100_000, report=FileReport("day_0.gz")):
        ...  # table: label int8, I1..I13 int64, C1..C26 string; lines: their line numbers
"""

from __future__ import annotations

import contextlib
import csv
import functools
import io
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from pipeline.data import vectorized_text
from pipeline.data.column_checks import check_and_convert
from pipeline.data.input_files import TEXT_SUFFIXES, table_format
from pipeline.data.line_blocks import BOM, DamagedFileError, LongLine, damage_message, line_blocks
from pipeline.data.parquet_table import read_parquet_table
from pipeline.data.roles import Roles, criteo_roles
from pipeline.data.text_format import (
    MAX_LINE_BYTES,
    FileReport,
    carriage_return_reason,
    field_count_reason,
    too_long,
    utf8_reason,
)
from pipeline.data.time_split import TIME_KEY
from pipeline.errors import BadInputError, UserError

READER_VERSION = 2

_BYTES_PER_ROW_GUESS = 200
_NL = re.compile(b"\n")


def read_criteo(path: str | Path, chunk_rows: int, report: FileReport, stop_on_bad: bool = False,
                xp: ModuleType | None = None) -> Iterator[tuple[pa.Table, np.ndarray]]:
    """Valid rows of a Criteo TSV (plain or compressed) as typed tables, with their line numbers.

    Malformed rows go to ``report``; with ``stop_on_bad`` reading ends after the first block that
    has any (``report.stopped_at_line`` says where). With an array module ``xp`` (numpy, or cupy
    for the GPU) each block is parsed by :mod:`pipeline.data.vectorized_text` instead of
    ``pyarrow.csv``: the same tables, line numbers and report.
    """
    roles = criteo_roles()
    yield from _read_text(Path(path), roles.columns, _kinds(roles, integer_continuous=True), "\t", False, False,
                          chunk_rows, report, stop_on_bad, "|", xp=xp)


def read_table(path: str | Path, roles: Roles, chunk_rows: int, report: FileReport, stop_on_bad: bool = False,
               list_separator: str = "|", xp: ModuleType | None = None) -> Iterator[tuple[pa.Table, np.ndarray]]:
    """Valid rows of a CSV / TSV / parquet table as typed tables, with their line (or row) numbers.

    Text: the first line names the columns; continuous columns become float64. Parquet: integer
    columns stay int64, floating ones float64; integer categorical columns become strings.
    With a time column in ``roles``, each table also has the rows' time keys (int64) as column
    :data:`~pipeline.data.time_split.TIME_KEY`, and a row without a usable time is malformed.
    With an array module ``xp``, text is parsed as :func:`read_criteo` parses it (but a block that quotes otherwise
    than whole values, which goes to ``pyarrow.csv``).
    """
    yield from _read_table(Path(path), roles, _kinds(roles, integer_continuous=False), chunk_rows, report,
                           stop_on_bad, list_separator, xp)


def read_times(path: str | Path, roles: Roles, chunk_rows: int, list_separator: str = "|",
               xp: ModuleType | None = None) -> tuple[np.ndarray, FileReport]:
    """The first pass of a split by time: the time keys of a table's rows (only the time column is
    converted; a row malformed in another column is still counted), and the report (its ``time_forms``)."""
    report = FileReport(str(path))
    keys = []
    try:
        for table, _ in _read_table(Path(path), roles, {roles.time: "time"}, chunk_rows, report, False,
                                    list_separator, xp):
            keys.append(table.column(TIME_KEY).to_numpy())
    except DamagedFileError:
        pass  # the ingest pass reports it
    return (np.concatenate(keys) if keys else np.zeros(0, np.int64)), report


def _read_table(path: Path, roles: Roles, kinds: dict[str, str], chunk_rows: int, report: FileReport,
                stop_on_bad: bool, list_separator: str, xp: ModuleType | None = None
                ) -> Iterator[tuple[pa.Table, np.ndarray]]:
    fmt = table_format(path)
    if fmt == "parquet":
        yield from read_parquet_table(path, roles, kinds, chunk_rows, report, stop_on_bad, list_separator)
    else:
        yield from _read_text(path, None, kinds, TEXT_SUFFIXES[fmt], True, True, chunk_rows, report, stop_on_bad,
                              list_separator, roles, xp)


def _read_text(path: Path, names: list[str] | None, kinds: dict[str, str], delimiter: str, quoting: bool,
               header: bool, chunk_rows: int, report: FileReport, stop_on_bad: bool, separator: str,
               roles: Roles | None = None, xp: ModuleType | None = None) -> Iterator[tuple[pa.Table, np.ndarray]]:
    """With an array module ``xp`` a block is parsed by :func:`~pipeline.data.vectorized_text.parse_block` where
    it can be (the rest by ``pyarrow.csv`` and the checks), read into ``xp``'s host buffers (pinned for CuPy)."""
    layout = None
    allocate = functools.partial(vectorized_text.host_array, xp) if xp is not None else None
    line = 1  # the number of the next block's first line
    # Closed here, in this thread, however the reading ends: a generator left to the garbage collector shut its
    # reading thread down wherever the collection ran, once inside the start of another thread, which then hung.
    with contextlib.closing(line_blocks(path, max(1 << 20, chunk_rows * _BYTES_PER_ROW_GUESS), allocate)) as blocks:
        while True:
            try:
                block = next(blocks, None)
            except (OSError, pa.ArrowInvalid) as err:
                raise DamagedFileError(damage_message(path, line - 1, err)) from err
            if block is None:
                break
            if isinstance(block, LongLine):
                if names is None and header:
                    raise BadInputError(f"{path}: the header line is longer than {MAX_LINE_BYTES} bytes; expected a "
                                        "line naming the columns")
                report.rows_read += 1
                report.add_bad(line, "line_too_long", too_long(block.length), block.excerpt)
                if stop_on_bad:
                    report.stopped_at_line = line
                    return
                line += 1
                continue
            if names is None:
                end = _NL.search(block).start()  # type: ignore[union-attr]  # a block ends in a newline
                header_line, block = bytes(block[:end]), block[end + 1:]
                if len(header_line.rstrip(b"\r")) > MAX_LINE_BYTES:
                    raise BadInputError(f"{path}: the header line is longer than {MAX_LINE_BYTES} bytes; expected a "
                                        "line naming the columns")
                names = _header(header_line, delimiter, path)
                roles.check_against(names, str(path))  # type: ignore[union-attr]
                line += 1
                if not len(block):
                    continue
            if xp is not None and layout is None:
                layout = vectorized_text.text_layout(names, kinds, delimiter, quoting, separator,
                                                     roles.time if roles else "") or False
            try:
                parsed = vectorized_text.parse_block(xp, layout, block, line, report) if layout else None
            except MemoryError as err:  # CuPy's OutOfMemoryError is one
                raise UserError(f"{path}: out of memory parsing {len(block):,} bytes of text with {xp.__name__} near line "
                                f"{line} ({' '.join(str(err).split())[:120]}); lower data.chunk_rows, or set "
                                "data.reader=arrow") from err
            if parsed is None:
                block = bytes(block)
                table, lines, excerpt = _parse_block(block, line, names, kinds, delimiter, quoting, report)
                count = len(excerpt.starts)
                quote = functools.partial(_quote_line, excerpt, lines, line)
                table, lines = check_and_convert(table, lines, kinds, separator, report, quote,
                                                  roles.time if roles else "")
            else:
                table, lines, count = parsed
            report.rows_read += count
            line += count
            if stop_on_bad and report.bad_rows:
                report.stopped_at_line = line - 1
                return
            report.rows_kept += table.num_rows
            if table.num_rows:
                yield table, lines


def _quote_line(excerpt: _Excerpts, lines: np.ndarray, first_line: int, row: int) -> bytes:
    return excerpt(int(lines[row]) - first_line)



def _header(line: bytes, delimiter: str, path: Path) -> list[str]:
    try:
        text = line.decode("utf-8-sig").rstrip("\r")  # -sig: a byte-order mark is not part of the first name
    except UnicodeDecodeError as err:
        utf16 = line.startswith((b"\xff\xfe", b"\xfe\xff"))
        advice = "; it is UTF-16 text (Excel's \"Unicode Text\"): save it as UTF-8" if utf16 else (
            "; save the file as UTF-8")
        raise BadInputError(f"{path}: the header line is not valid UTF-8 ({err.reason} at byte {err.start}){advice}") \
            from err
    names = next(csv.reader([text], delimiter=delimiter))
    if not any(names):
        raise BadInputError(f"{path}: expected a header line naming the columns, found an empty line")
    return names


@dataclass
class _Excerpts:
    """Where each line of a block starts and ends, to quote bad rows."""

    block: bytes
    starts: np.ndarray
    ends: np.ndarray

    def __call__(self, index: int) -> bytes:
        return self.block[self.starts[index] : self.ends[index]]


def _parse_block(block: bytes, first_line: int, names: list[str], kinds: dict[str, str], delimiter: str,
                 quoting: bool, report: FileReport) -> tuple[pa.Table, np.ndarray, _Excerpts]:
    """Split a block into fields (all as text); returns the table, its rows' line numbers and the excerpts.

    Empty lines and lines that are not UTF-8 are taken out before parsing; lines with the wrong
    number of fields are rejected by the parser. All three are recorded in ``report``.
    """
    data = np.frombuffer(block, dtype=np.uint8)
    ends = np.flatnonzero(data == 10)
    starts = np.r_[0, ends[:-1] + 1]
    excerpt = _Excerpts(block, starts, ends)
    lengths = ends - starts
    keep = ~((lengths == 0) | ((lengths == 1) & (data[starts] == 13)))
    expected = len(names)
    for i in np.flatnonzero(~keep):
        report.add_bad(first_line + int(i), "wrong_field_count", field_count_reason(expected, None), b"")
    long = np.flatnonzero(keep & (lengths > MAX_LINE_BYTES))
    long = long[lengths[long] - (data[ends[long] - 1] == 13) > MAX_LINE_BYTES]
    for i in long:
        keep[i] = False
        report.add_bad(first_line + int(i), "line_too_long", too_long(int(lengths[i])), excerpt(i)[:200])
    if b"\r" in block:
        carriage = np.flatnonzero(data == 13)
        carriage = carriage[data[carriage + 1] != 10]  # \r\n is a line end; the block ends in \n
        for i in np.unique(np.searchsorted(ends, carriage)):
            if keep[i]:
                keep[i] = False
                at = int(carriage[np.searchsorted(carriage, starts[i])] - starts[i])
                report.add_bad(first_line + int(i), "carriage_return", carriage_return_reason(at), excerpt(i))
    high = np.flatnonzero(data >= 0x80)
    if high.size:
        for i in np.unique(np.searchsorted(ends, high)):
            reason = utf8_reason(excerpt(i)) if keep[i] else None
            if reason:
                keep[i] = False
                report.add_bad(first_line + int(i), "invalid_utf8", reason, excerpt(i))
    table, rejected, kept = _parse_kept(data, keep, lengths, names, kinds, delimiter, quoting)
    if table is not None and quoting and (table.num_rows + len(rejected) != kept.size
                                          or _open_quotes(excerpt, kept[-1:], delimiter)):
        # A quote left open merges lines into one row (or takes the line end at the end of the block):
        # such lines are malformed, the rest are parsed again.
        for i in _open_quotes(excerpt, kept, delimiter):
            keep[i] = False
            report.add_bad(first_line + i, "open_quote", "a quoted value does not end on its line", excerpt(i))
        table, rejected, kept = _parse_kept(data, keep, lengths, names, kinds, delimiter, quoting)
        if table is not None and table.num_rows + len(rejected) != kept.size:
            raise BadInputError(f"{report.file}: lines {first_line}..{first_line + len(starts) - 1} do not split "
                                "into one row per line; check the quoting there")
    if table is None:
        empty = pa.table({n: pa.array([], pa.string()) for n in kinds})
        return empty, np.zeros(0, dtype=np.int64), excerpt
    for number, expected_columns, actual_columns in rejected:
        index = int(kept[number - 1])
        report.add_bad(first_line + index, "wrong_field_count", field_count_reason(expected_columns, actual_columns),
                       excerpt(index))
    rejected = [number - 1 for number, _, _ in rejected]
    rows = np.delete(kept, rejected) if rejected else kept
    return table, first_line + rows.astype(np.int64), excerpt


def _parse_kept(data: np.ndarray, keep: np.ndarray, lengths: np.ndarray, names: list[str], kinds: dict[str, str],
                delimiter: str, quoting: bool) -> tuple[pa.Table | None, list[tuple[int, int, int]], np.ndarray]:
    """Parse the kept lines of a block: (table or None when no line is kept, rejected rows, kept indices)."""
    kept = np.flatnonzero(keep)
    if kept.size == 0:
        return None, [], kept
    clean = data[np.repeat(keep, lengths + 1)].tobytes() if kept.size < keep.size else data.tobytes()
    if clean.startswith(BOM):  # Arrow drops one byte-order mark at the start of what it parses: not the line's own
        clean = BOM + clean
    table, rejected = _parse_typed_or_text(clean, names, kinds, delimiter, quoting)
    return table, rejected, kept


def _open_quotes(excerpt: _Excerpts, rows: np.ndarray, delimiter: str) -> list[int]:
    """The rows whose line leaves a quoted value open (a field that would run on to the next line)."""
    found = []
    for i in rows:
        line = excerpt(int(i))
        if b'"' in line:
            fields = next(csv.reader([line.decode("utf-8", errors="replace").rstrip("\r") + "\n"],
                                     delimiter=delimiter))
            if any("\n" in f for f in fields):
                found.append(int(i))
    return found


_PARSE_TYPES = {"label": pa.string(), "int": pa.int64(), "float": pa.float64(), "string": pa.string(),
                "list": pa.string(), "time": pa.string()}


def _parse_typed_or_text(data: bytes, names: list[str], kinds: dict[str, str], delimiter: str, quoting: bool
                         ) -> tuple[pa.Table, list[tuple[int, int, int]]]:
    """Parse with the final types (the fast path); a block where a value does not convert is parsed
    again as text, so that the checks can name each bad row. Rows with the wrong field count come
    back as (line number within ``data``, expected fields, found fields).

    Arrow's numbers also take what the checks refuse (hex integers, spaces around a number), so a
    block holding such bytes goes to the text path at once, and so does a block where Arrow read a NaN (it reads
    ``nan`` in any case; the missing words are a list): a value is kept or refused on its own,
    whatever else its block holds. Labels are always checked as text (Arrow reads ``00`` as 0)."""
    text = {n: pa.string() for n in kinds}
    typed = text if _may_hold_numbers_only_arrow_takes(data, kinds, delimiter) else {
        n: _PARSE_TYPES[k] for n, k in kinds.items()}
    for types in (typed, text):
        text = all(t == pa.string() for t in types.values())
        try:
            table, rejected = _parse_csv(data, names, types, delimiter, quoting, threads=True, text=text)
            if not text and any(pc.any(pc.is_nan(table.column(n))).as_py() for n, k in kinds.items() if k == "float"):
                continue
            if rejected:
                # Threaded parsing does not know line numbers: a block with bad rows is parsed again to get them.
                table, rejected = _parse_csv(data, names, types, delimiter, quoting, threads=False, text=text)
            return table, rejected  # type: ignore[return-value]
        except pa.ArrowInvalid:
            if text:
                raise
    raise AssertionError("unreachable")


def _may_hold_numbers_only_arrow_takes(data: bytes, kinds: dict[str, str], delimiter: str) -> bool:
    """Whether ``data`` has bytes of a number Arrow's parse takes and the checks refuse: spaces (or
    tabs, in a CSV) around a number, or a hex integer (``0x1f``)."""
    numeric = set(kinds.values()) & {"int", "float"}
    marks = ([b" "] + ([b"\t"] if delimiter != "\t" else [])) if numeric else []
    marks += [b"x", b"X"] if "int" in numeric else []
    return any(mark in data for mark in marks)


def _parse_csv(data: bytes, names: list[str], types: dict[str, pa.DataType], delimiter: str, quoting: bool,
               threads: bool, text: bool) -> tuple[pa.Table, list[tuple[int | None, int, int]]]:
    """The ``types`` columns; with ``text`` every value is kept as written (empty stays ""), otherwise
    empty is null. Rows with the wrong field count are skipped and returned as (line number within
    ``data`` or None when threaded, expected fields, found fields)."""
    rejected: list[tuple[int | None, int, int]] = []

    def on_invalid_row(row) -> str:
        rejected.append((row.number, row.expected_columns, row.actual_columns))
        return "skip"

    table = pacsv.read_csv(
        io.BytesIO(data),
        read_options=pacsv.ReadOptions(column_names=names, use_threads=threads,
                                       block_size=(1 << 22) if threads else len(data) + 1),
        parse_options=pacsv.ParseOptions(delimiter=delimiter, quote_char='"' if quoting else False,
                                          invalid_row_handler=on_invalid_row),
        # UTF-8 was checked line by line before parsing
        convert_options=pacsv.ConvertOptions(column_types=types, include_columns=list(types), null_values=[""],
                                             strings_can_be_null=not text, quoted_strings_can_be_null=not text,
                                             check_utf8=False),
    )
    return table, rejected


def _kinds(roles: Roles, integer_continuous: bool) -> dict[str, str]:
    kinds = {roles.label: "label"}
    kinds.update({c: "int" if integer_continuous else "float" for c in roles.continuous})
    kinds.update({c: "string" for c in roles.categorical})
    kinds.update({c: "list" for c in roles.multihot})
    if roles.time and roles.time not in kinds:
        kinds[roles.time] = "time"  # read for the split, not written
    return kinds



