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
import glob
import io
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from pipeline.data import raw_folder, vectorized_text
from pipeline.data.column_checks import check_and_convert, is_text
from pipeline.data.config import DataConfig
from pipeline.data.role_hint import role_hint
from pipeline.data.text_format import (
    CRITEO_CATEGORICAL,
    CRITEO_CONTINUOUS,
    MAX_LINE_BYTES,
    FileReport,
    carriage_return_reason,
    date_or_time_advice,
    field_count_reason,
    too_long,
    utf8_reason,
)
from pipeline.data.time_split import TIME_KEY
from pipeline.errors import BadInputError, UserError

READER_VERSION = 2

_TEXT_SUFFIXES = {".csv": ",", ".tsv": "\t", ".tab": "\t", ".txt": "\t"}
_PARQUET_SUFFIXES = {".parquet", ".pq"}
_CODECS = {".gz": "gzip", ".bz2": "bzip2", ".zst": "zstd", ".lz4": "lz4"}
_COMPRESSION_SUFFIXES = set(_CODECS)
_BYTES_PER_ROW_GUESS = 200
_BOM = b"\xef\xbb\xbf"
_NL = re.compile(b"\n")
_CR = re.compile(b"\r")


@dataclass
class Roles:
    """Which column is the label and which are features of each kind."""

    label: str
    continuous: list[str]
    categorical: list[str]
    multihot: list[str] = field(default_factory=list)
    ignore: list[str] = field(default_factory=list)
    time: str = ""
    """The column that orders the rows in time (a feature too only if listed in a role); empty: none."""

    @property
    def columns(self) -> list[str]:
        """The columns written: the label and the features."""
        return [self.label, *self.continuous, *self.categorical, *self.multihot]

    def check_against(self, found: list[str], where: str) -> None:
        """Raise a :class:`BadInputError` if declared columns are absent or named more than once, or the
        file has undeclared ones."""
        declared = self.columns + ([self.time] if self.time and self.time not in self.columns else [])
        repeated = sorted({c for c in declared if found.count(c) > 1})
        if repeated:
            raise BadInputError(f"{where}: the column name(s) {repeated} appear more than once (columns {found}), so "
                                "which one holds the data is unclear: give each column its own name")
        missing = [c for c in declared if c not in found]
        if missing:
            other = next((d for d in (";", ",", "\t", "|") if len(found) == 1 and d in found[0]), None)
            hint = (f": its header looks cut by {other!r}, but a .csv file's lines are cut at ',' and a .tsv, .tab or "
                    ".txt file's at tabs: save it with one of those, under its suffix") if other else ""
            raise BadInputError(f"{where}: declared column(s) {missing} not found; the file has columns {found}{hint}")
        unknown = [c for c in found if c not in declared and c not in self.ignore]
        if unknown:
            raise BadInputError(
                f"{where}: column(s) {unknown} have no role; expected only {self.columns}. Declare them in "
                "data.continuous / data.categorical / data.multihot, or drop them with data.ignore"
            )


def criteo_roles() -> Roles:
    """Criteo's columns: label, I1..I13, C1..C26."""
    return Roles("label", list(CRITEO_CONTINUOUS), list(CRITEO_CATEGORICAL))


def table_roles(d: DataConfig) -> Roles:
    """The roles declared in the settings; a clear error when they are unusable."""
    roles = Roles(d.label, list(d.continuous), list(d.categorical), list(d.multihot), list(d.ignore), d.time_column)
    if not (roles.continuous or roles.categorical or roles.multihot):
        raise BadInputError("data.source=table needs column roles: set data.continuous, data.categorical "
                            "and/or data.multihot (and data.label); "
                            + (table_role_hint(d) or "e.g. data.categorical=[user,item] data.continuous=[price]"))
    if roles.label != raw_folder.LABEL and raw_folder.LABEL in roles.columns:
        raise BadInputError(f"the raw layout names the label column {raw_folder.LABEL!r}; a feature of that name "
                            f"clashes with data.label={roles.label!r}: rename it in the input")
    settings = {"data.label": [roles.label], "data.continuous": roles.continuous,
                "data.categorical": roles.categorical, "data.multihot": roles.multihot, "data.ignore": roles.ignore}
    names = roles.columns + roles.ignore
    repeated = sorted({c for c in names if names.count(c) > 1})
    if repeated:
        where = ", ".join(f"{c!r} in {' and '.join(k for k, v in settings.items() if c in v)}" for c in repeated)
        raise BadInputError(f"column(s) {repeated} are given more than one role ({where}): name each in one setting")
    if roles.time and roles.time in (roles.label, *roles.ignore):
        what = "the label" if roles.time == roles.label else "a column data.ignore drops"
        raise BadInputError(f"data.time_column={roles.time!r} names {what}: name the column that holds the rows' times")
    return roles


def table_role_hint(d: DataConfig) -> str:
    """Roles to propose from the first input file (:func:`pipeline.data.role_hint.role_hint`), or ``""``."""
    try:
        path = input_files(d)[0][0]
        fmt = table_format(path)
    except (BadInputError, IndexError):
        return ""
    return role_hint(path, None if fmt == "parquet" else _TEXT_SUFFIXES[fmt], d.label, d.list_separator)


# ----------------------------------------------------------------------------------------- readers


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
        yield from _read_parquet(path, roles, kinds, chunk_rows, report, stop_on_bad, list_separator)
    else:
        yield from _read_text(path, None, kinds, _TEXT_SUFFIXES[fmt], True, True, chunk_rows, report, stop_on_bad,
                              list_separator, roles, xp)


# ----------------------------------------------------------------------------------------- text


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
    with contextlib.closing(_line_blocks(path, max(1 << 20, chunk_rows * _BYTES_PER_ROW_GUESS), allocate)) as blocks:
        while True:
            try:
                block = next(blocks, None)
            except (OSError, pa.ArrowInvalid) as err:
                raise DamagedFileError(_damage_message(path, line - 1, err)) from err
            if block is None:
                break
            if isinstance(block, _LongLine):
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


@dataclass
class _LongLine:
    """A line longer than :data:`MAX_LINE_BYTES`, skipped while reading: its start and length."""

    excerpt: bytes
    length: int


class DamagedFileError(BadInputError):
    """A compressed input that does not decompress to the end."""


def _line_blocks(path: Path, block_bytes: int, allocate: Callable[[int], np.ndarray] | None = None
                 ) -> Iterator[bytes | memoryview | _LongLine]:
    """Blocks of whole lines ending in a newline, decompressing by suffix. A thread reads (and decompresses) the
    next block while the one given out is parsed, into two buffers used in turn for every block: a block costs
    the file's read and, as ``bytes``, one copy. Lines are not counted here: whoever reads a block counts its
    lines. With ``allocate`` (``size -> uint8 array``: pinned memory for the GPU) the buffers are its, and blocks
    are memoryviews of them, each valid until the next block is asked for.

    A byte-order mark at the start of the file is dropped. A file whose first line end is a lone
    ``\r`` (no ``\n`` in the first read) has ``\r`` line ends: they become ``\n``. A line that
    grows past :data:`MAX_LINE_BYTES` is not kept: a :class:`_LongLine` stands for it. A compressed file that stops
    decompressing raises its error (``OSError`` or ``pyarrow.ArrowInvalid``) after the blocks before the damage.
    """
    size = block_bytes + MAX_LINE_BYTES + 2  # a block, a line carried over (+ 1 for a \r) and a last newline
    buffers = [(allocate or _bytes)(size) for _ in range(2)]
    rooms = [memoryview(b) for b in buffers]
    have = 0  # bytes of a line not ended yet, carried to the start of the next buffer
    skipping = 0  # bytes of an over-long line seen so far
    newline: bytes | None = None
    first = True
    with _open_text(path) as (stream, step), ThreadPoolExecutor(1) as reader:
        now, start_of_read = 0, 0
        reading = reader.submit(_fill, stream, step, rooms[0], 0, block_bytes)
        while True:
            room = rooms[now]
            got, error = reading.result()
            ended = error is not None or got < start_of_read + block_bytes
            if first and got >= 3 and bytes(room[:3]) == _BOM:
                room[: got - 3] = room[3:got]
                got -= 3
            first = False
            if newline is None:
                newline = b"\n" if _NL.search(room, have, got) else b"\r" if _CR.search(room, have, got) else None
            if newline == b"\r":
                text = bytes(room[have:got]).replace(b"\r\n", b"\n").replace(b"\r", b"\n")
                room[have : have + len(text)] = text
                got = have + len(text)
            start = 0
            if skipping:
                found = _NL.search(room, 0, got)
                skipping, start = (skipping + got, got) if found is None else (0, found.end())
            cut = _last_newline(buffers[now], start, got)
            have, long = got - cut, None
            if have > MAX_LINE_BYTES + 1:  # + 1: room for a \r before the \n
                long = _LongLine(bytes(room[cut : cut + 200]), have)
                have, skipping = 0, have
            rooms[1 - now][:have] = room[got - have : got]
            if not ended:
                start_of_read = have
                reading = reader.submit(_fill, stream, step, rooms[1 - now], have, have + block_bytes)
            if cut > start:
                yield room[start:cut] if allocate else bytes(room[start:cut])
            if long is not None:
                yield long
            if error is not None:
                raise error
            now = 1 - now
            if ended:
                break
    if have:
        rooms[now][have] = ord("\n")
        yield rooms[now][: have + 1] if allocate else bytes(rooms[now][: have + 1])


def _bytes(size: int) -> np.ndarray:
    return np.empty(size, dtype=np.uint8)


@contextlib.contextmanager
def _open_text(path: Path) -> Iterator[tuple[object, int]]:
    """The file's stream and the bytes to read at a time: plain files straight from the file in large reads; a
    compressed one through Arrow's decompression in small ones, so that what comes before a damaged part is kept."""
    if path.suffix.lower() in _COMPRESSION_SUFFIXES:
        with pa.input_stream(str(path), compression="detect") as stream:
            yield stream, 1 << 20
    else:
        with open(path, "rb", buffering=0) as stream:
            yield stream, 8 << 20


def _fill(stream, step: int, room: memoryview, start: int, end: int) -> tuple[int, Exception | None]:
    """Read into ``room[start:end]`` until it is full or the stream ends: where the bytes read end, and the error
    that stopped the reading early (the bytes before it are kept)."""
    while start < end:
        try:
            got = stream.readinto(room[start : min(end, start + step)])
        except (OSError, pa.ArrowInvalid) as err:
            return start, err
        if not got:
            break
        start += got
    return start, None


def _last_newline(buf: np.ndarray, start: int, end: int) -> int:
    """Where the bytes ``buf[start:end]`` end after their last newline (``start`` when none has one)."""
    step = 1 << 16
    while end > start:
        low = max(start, end - step)
        found = np.flatnonzero(buf[low:end] == 10)
        if found.size:
            return low + int(found[-1]) + 1
        end, step = low, step * 2
    return start


def _damage_message(path: Path, lines: int, err: Exception) -> str:
    codec = _CODECS.get(path.suffix.lower(), "compressed")
    detail = " ".join(str(err).split())
    if "truncated" in detail.lower():
        what = f"ends early (truncated {codec} data)"
    elif lines == 0:
        what = f"is not valid {codec} data"
    else:
        what = f"is damaged ({codec} data that does not decompress)"
    where = f" after line {lines}" if lines else ""
    return (f"{path} {what}{where}: {detail}. Download or compress the file again, or take it out of data.path; "
            "nothing was written")


def _header(line: bytes, delimiter: str, path: Path) -> list[str]:
    try:
        text = line.decode("utf-8-sig").rstrip("\r")  # -sig: a byte-order mark is not part of the first name
    except UnicodeDecodeError as err:
        raise BadInputError(f"{path}: the header line is not valid UTF-8 ({err.reason} at byte {err.start})") from err
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
    if clean.startswith(_BOM):  # Arrow drops one byte-order mark at the start of what it parses: not the line's own
        clean = _BOM + clean
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


# ----------------------------------------------------------------------------------------- parquet


def _pandas_index_columns(schema: pa.Schema) -> set[str]:
    """The columns that pandas wrote its index to (``__index_level_0__`` for a filtered frame's), which are not
    data: a file written by ``DataFrame.to_parquet`` names them in its pandas metadata."""
    try:
        return {c for c in (schema.pandas_metadata or {}).get("index_columns", []) if isinstance(c, str)}
    except (ValueError, TypeError, AttributeError):  # metadata that is not pandas' JSON
        return set()


def _read_parquet(path: Path, roles: Roles, kinds: dict[str, str], chunk_rows: int, report: FileReport,
                  stop_on_bad: bool, separator: str) -> Iterator[tuple[pa.Table, np.ndarray]]:
    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as err:
        raise BadInputError(f"{path}: expected a parquet file, could not read it ({err})") from err
    index = _pandas_index_columns(file.schema_arrow)
    roles.check_against([n for n in file.schema_arrow.names if n not in index or n in roles.columns], str(path))
    for name, kind in kinds.items():
        _check_parquet_type(path, name, kind, file.schema_arrow.field(name).type)
    first = 1
    for batch in file.iter_batches(batch_size=chunk_rows, columns=list(kinds)):
        table = pa.Table.from_batches([batch])
        lines = np.arange(first, first + table.num_rows, dtype=np.int64)
        first += table.num_rows
        report.rows_read += table.num_rows

        def quote(i: int, table=table) -> str:
            return "row " + ", ".join(f"{n}={table.column(n)[i].as_py()!r}" for n in kinds)

        table, lines = check_and_convert(table, lines, kinds, separator, report, quote, roles.time)
        if stop_on_bad and report.bad_rows:
            report.stopped_at_line = int(first - 1)
            return
        report.rows_kept += table.num_rows
        if table.num_rows:
            yield table, lines


def _check_parquet_type(path: Path, name: str, kind: str, t: pa.DataType) -> None:
    if pa.types.is_dictionary(t):
        t = t.value_type
    numeric = pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)
    if kind == "float" and pa.types.is_decimal(t):  # what databases and Spark export prices as
        return
    if kind in ("label", "float"):
        ok, expected = numeric or is_text(t), "a numeric column"
    elif kind == "string":
        ok, expected = is_text(t) or numeric, "a string, number or boolean column"
    elif kind == "time":
        ok = numeric or is_text(t) or pa.types.is_timestamp(t) or pa.types.is_date(t)
        expected = "integers, ISO 8601 text, timestamps or dates"
    else:
        ok = is_text(t) or ((pa.types.is_list(t) or pa.types.is_large_list(t)) and (
            is_text(t.value_type) or pa.types.is_integer(t.value_type)))
        expected = "a list of strings or integers (or text to split on data.list_separator)"
    if not ok and not (pa.types.is_null(t) and kind not in ("label", "time")):  # a column of no value (pandas')
        dated = pa.types.is_temporal(t) and kind in ("label", "float")
        raise BadInputError(f"{path}: column {name!r} ({_ROLE_SETTINGS[kind]}) should be {expected}, found {t}"
                            + (f" ({date_or_time_advice(name)})" if dated else ""))


_ROLE_SETTINGS = {"label": "data.label", "float": "data.continuous", "string": "data.categorical",
                  "list": "data.multihot", "time": "data.time_column"}
"""The setting that gave a column each kind of the readers."""


# ----------------------------------------------------------------------------------------- inputs

def input_files(d: DataConfig) -> list[tuple[Path, str | None]]:
    """Every input file with the split it is pinned to (``None``: split by the fractions). A file that
    ``data.valid_path`` or ``data.test_path`` names is not read for ``data.path`` too, where its folder or glob holds
    it (its rows would train the model they test)."""
    pinned = [(p, split) for setting, split in (("valid_path", "valid"), ("test_path", "test"))
              for p in (_expand(getattr(d, setting), f"data.{setting}") if getattr(d, setting) else [])]
    taken = {p.resolve() for p, _ in pinned}
    files = [(p, None) for p in _expand(d.path, "data.path") if p.resolve() not in taken] if d.path else []
    if d.path and not files:
        raise BadInputError(f"data.path={d.path} names only files that data.valid_path / data.test_path pin to their "
                            "split: give data.path the training rows")
    return files + pinned



def _expand(pattern: str, setting: str) -> list[Path]:
    path = Path(pattern).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith((".", "_")))
        if not files:
            inside = sorted(p.name for p in path.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))
            hint = (f"; its subfolders ({', '.join(inside[:3])}{', ...' if len(inside) > 3 else ''}) are not read: "
                    f"name their files with a glob, e.g. {setting}='{path}/*/*.parquet'" if inside else "")
            raise BadInputError(f"{setting}: folder {path} has no files{hint}")
        return files
    if any(ch in pattern for ch in "*?["):
        files = sorted(Path(p) for p in glob.glob(str(path)) if Path(p).is_file())
        if not files:
            raise BadInputError(f"{setting}: no file matches {pattern}")
        return files
    if not path.exists():
        raise BadInputError(f"{setting}: {path} does not exist (expected a file, a folder or a glob)")
    return [path]


def table_format(path: Path) -> str:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in _COMPRESSION_SUFFIXES:
        suffixes = suffixes[:-1]
    last = suffixes[-1] if suffixes else ""
    if last in _PARQUET_SUFFIXES:
        return "parquet"
    if last in _TEXT_SUFFIXES:
        return last
    raise BadInputError(f"{path}: expected a .csv, .tsv, .tab, .txt or .parquet file (optionally .gz), "
                        f"found suffix {''.join(path.suffixes) or '(none)'}")
