"""A text file read as blocks of whole lines: plain or compressed (by suffix), a thread reading the next block
while the one given out is parsed, lines over :data:`~pipeline.data.text_format.MAX_LINE_BYTES` stood for by a
:class:`LongLine`, a damaged compressed file an error after the blocks before the damage.

What is in a line is not looked at here: :mod:`pipeline.data.readers` and :mod:`pipeline.data.vectorized_text`
parse the blocks.

Example::

    for block in line_blocks(Path("day_0.gz"), block_bytes=8 << 20):
        ...  # bytes ending in b"\n", or a LongLine
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from pipeline.data.text_format import MAX_LINE_BYTES
from pipeline.errors import BadInputError

CODECS = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd", ".lz4": "lz4"}
"""The compressed suffixes read, and the names of their codecs in Arrow's decompression."""
BOM = b"\xef\xbb\xbf"
_NL = re.compile(b"\n")
_CR = re.compile(b"\r")


@dataclass
class LongLine:
    """A line longer than :data:`MAX_LINE_BYTES`, skipped while reading: its start and length."""

    excerpt: bytes
    length: int


class DamagedFileError(BadInputError):
    """A compressed input that does not decompress to the end."""


def line_blocks(path: Path, block_bytes: int, allocate: Callable[[int], np.ndarray] | None = None
                 ) -> Iterator[bytes | memoryview | LongLine]:
    """Blocks of whole lines ending in a newline, decompressing by suffix. A thread reads (and decompresses) the
    next block while the one given out is parsed, into two buffers used in turn for every block: a block costs
    the file's read and, as ``bytes``, one copy. Lines are not counted here: whoever reads a block counts its
    lines. With ``allocate`` (``size -> uint8 array``: pinned memory for the GPU) the buffers are its, and blocks
    are memoryviews of them, each valid until the next block is asked for.

    A byte-order mark at the start of the file is dropped. A file whose first line end is a lone
    ``\r`` (no ``\n`` in the first read) has ``\r`` line ends: they become ``\n``. A line that
    grows past :data:`MAX_LINE_BYTES` is not kept: a :class:`LongLine` stands for it. A compressed file that stops
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
            if first and got >= 3 and bytes(room[:3]) == BOM:
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
                long = LongLine(bytes(room[cut : cut + 200]), have)
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
    if path.suffix.lower() in CODECS:
        with pa.input_stream(str(path), compression=CODECS[path.suffix.lower()]) as stream:
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


def damage_message(path: Path, lines: int, err: Exception) -> str:
    codec = CODECS.get(path.suffix.lower(), "compressed")
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
