"""The fields of a text block read as values with array operations only, on numpy or CuPy.

Each function takes the block on its array module ``xp`` and the fields as two arrays of positions, ``starts`` and
``ends`` (a field is the bytes ``[start, end)``), and judges and converts every field at once, as the Arrow path of
:mod:`pipeline.data.readers` does one by one: labels by the readers' label pattern, integers by ``-?[0-9]+`` within
the int64 range, numbers by the float pattern, pandas' missing words and a finite value, lists by their separator.

A number of at most 19 significant digits whose value is a normal double is converted on ``xp``
(:mod:`pipeline.data.nearest_double`: the nearest double, as Arrow's parser finds it). The other numbers (more digits,
subnormal or beyond the doubles) and the fields that are not written as numbers (``NA``, ``inf``, a typo) are few in
real data; they are read on the host by Arrow's own cast, so every value is the one the Arrow path gives.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.data.nearest_double import nearest_doubles
from pipeline.data.text_format import MISSING_NUMBER_PATTERN, is_infinite

NL, CR, TAB, PLUS, MINUS, DOT, ZERO = 10, 13, 9, 43, 45, 46, 48
INT64_DIGITS = 19
_EXPONENT_DIGITS = 6  # an exponent of more digits is read on the host


def segments(xp: ModuleType, starts, ends):
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


def segment_of(xp: ModuleType, offsets):
    """The segment of each byte laid out by :func:`segments`."""
    filled = xp.flatnonzero(offsets[1:] > offsets[:-1])
    first = xp.zeros(int(offsets[-1]), dtype=offsets.dtype)
    if filled.size:
        first[offsets[filled]] = 1
        xp.cumsum(first, out=first)
        first -= 1
    return filled[first]


def sums(xp: ModuleType, values, offsets):
    """The sum of ``values`` over each segment (modulo 2**64 for uint64)."""
    total = xp.concatenate([xp.zeros(1, values.dtype), xp.cumsum(values, dtype=values.dtype)])
    return total[offsets[1:]] - total[offsets[:-1]]


class _Fields:
    """The bytes of the fields ``[starts, ends)`` laid end to end, with each byte's field and place in its field."""

    def __init__(self, xp: ModuleType, data, starts, ends):
        self.xp, self.starts, self.ends = xp, starts, ends
        self.positions, self.offsets = segments(xp, starts, ends)
        self.field = segment_of(xp, self.offsets)
        self.bytes = data[self.positions]
        self.at = self.positions - starts[self.field]  # the byte's place in its field

    def count(self, flags):
        """How many of each field's bytes are flagged."""
        return sums(self.xp, flags.astype(self.xp.int32), self.offsets)

    def power(self):
        """How many bytes follow each byte in its field."""
        return self.ends[self.field] - 1 - self.positions


def labels(xp: ModuleType, data, starts, ends):
    """Each label as (int8 value, written ``[01](\\.0*)?`` or true / false in any case), as the readers' pattern
    asks."""
    f = _Fields(xp, data, starts, ends)
    b, at = f.bytes, f.at
    digits = (ends > starts) & (f.count(xp.where(at == 0, (b != ZERO) & (b != ZERO + 1),
                                                 xp.where(at == 1, b != DOT, b != ZERO))) == 0)
    lower = b | 0x20  # ASCII letters in lower case (other bytes are not letters of the words)
    words = []
    for word in (b"false", b"true"):
        spelled = xp.asarray(np.frombuffer(word, np.uint8))[xp.minimum(at, len(word) - 1)]
        words.append((ends - starts == len(word)) & (f.count(lower != spelled) == 0))
    ok = digits | words[0] | words[1]
    first = data[xp.minimum(starts, data.size - 1)]
    value = xp.where(digits, first.astype(xp.int16) - ZERO, words[1].astype(xp.int16)).astype(xp.int8)
    return value, ok


def integers(xp: ModuleType, data, starts, ends):
    """Each field as an integer: (int64 value, written ``-?[0-9]+`` or empty, within the int64 range)."""
    f = _Fields(xp, data, starts, ends)
    b = f.bytes
    digit = (b >= ZERO) & (b <= ZERO + 9)
    sign = (b == MINUS) & (f.at == 0)
    power = f.power()  # digits after this one
    empty = ends == starts
    written_ok = empty | ((f.count(~(digit | sign)) == 0) & (f.count(digit) > 0))
    huge = f.count(digit & (b != ZERO) & (power >= INT64_DIGITS)) > 0
    terms = xp.where(digit & (power < INT64_DIGITS),
                     (b - ZERO).astype(xp.uint64) * _tens(xp)[xp.minimum(power, INT64_DIGITS - 1)], xp.uint64(0))
    magnitude = sums(xp, terms, f.offsets)  # at most 19 digits: below 2**64
    negative = ~empty & (data[xp.minimum(starts, data.size - 1)] == MINUS)
    fits = ~huge & ((magnitude <= xp.uint64(2**63 - 1)) | (negative & (magnitude == xp.uint64(2**63))))
    values = xp.where(negative, xp.uint64(0) - magnitude, magnitude).view(xp.int64)
    return values, written_ok, fits


def numbers(xp: ModuleType, data, host: np.ndarray, starts, ends):
    """Each field as a number: (float64 value, present, fits, out of range). A field fits when it is empty, one of
    pandas' missing words (both not present), or a finite number written ``[+-]?([0-9]+\\.?[0-9]*|\\.[0-9]+)
    ([eE][+-]?[0-9]+)?``; it is out of range when what is written is infinite (``1e999``, ``inf``). ``host`` is
    the block's bytes on the host, where the fields off the exact path are read."""
    f = _Fields(xp, data, starts, ends)
    b, at = f.bytes, f.at
    length = ends - starts
    digit = (b >= ZERO) & (b <= ZERO + 9)
    dot, mark = b == DOT, (b | 0x20) == ord("e")
    sign = (b == MINUS) | (b == PLUS)
    marks, dots = f.count(mark), f.count(dot)
    mark_at = xp.where(marks > 0, sums(xp, xp.where(mark, at, 0), f.offsets), length)
    dot_at = xp.where(dots > 0, sums(xp, xp.where(dot, at, 0), f.offsets), mark_at)
    in_exponent = at > mark_at[f.field]
    mantissa = digit & ~in_exponent
    mantissa_digits = f.count(mantissa)
    written = ((length > 0) & (f.count(~(digit | dot | mark | sign)) == 0) & (marks <= 1) & (dots <= 1)
               & (dot_at <= mark_at) & (mantissa_digits > 0) & ((marks == 0) | (f.count(digit & in_exponent) > 0))
               & (f.count(sign & (at != 0) & (at != mark_at[f.field] + 1)) == 0))
    # the significand's digits as one integer, and the power of ten it is scaled by
    through = xp.concatenate([xp.zeros(1, xp.int32), xp.cumsum(mantissa.astype(xp.int32))])
    after = through[f.offsets[1:]][f.field] - through[1:]  # the significand's digits after this byte
    huge = f.count(mantissa & (b != ZERO) & (after >= INT64_DIGITS)) > 0
    terms = xp.where(mantissa & (after < INT64_DIGITS),
                     (b - ZERO).astype(xp.uint64) * _tens(xp)[xp.clip(after, 0, INT64_DIGITS - 1)], xp.uint64(0))
    significand = sums(xp, terms, f.offsets)
    fraction = f.count(mantissa & (at > dot_at[f.field]))
    power = f.power()
    exponent_digit = digit & in_exponent
    long_exponent = f.count(exponent_digit & (b != ZERO) & (power >= _EXPONENT_DIGITS)) > 0
    exponent = sums(xp, xp.where(exponent_digit & (power < _EXPONENT_DIGITS), (b - ZERO).astype(xp.int64)
                                 * _tens(xp)[xp.clip(power, 0, _EXPONENT_DIGITS - 1)].astype(xp.int64), 0), f.offsets)
    first = xp.minimum(starts, data.size - 1)
    exponent = xp.where(data[xp.minimum(starts + mark_at + 1, data.size - 1)] == MINUS, -exponent, exponent)
    scale = exponent - fraction
    zero = ~huge & (significand == 0)
    magnitude, normal = nearest_doubles(xp, xp.where(zero, xp.uint64(1), significand), scale.astype(xp.int64))
    exact = written & (zero | (~huge & ~long_exponent & normal))
    magnitude = xp.where(zero, 0.0, magnitude)
    values = xp.where(data[first] == MINUS, -magnitude, magnitude)
    present, fits, beyond = ~(length == 0), xp.ones(length.size, bool), xp.zeros(length.size, bool)
    off_path = xp.flatnonzero((length > 0) & ~exact)
    if off_path.size:
        _numbers_on_host(xp, host, starts, ends, off_path, written, values, present, fits, beyond)
    return values, present, fits, beyond


def _numbers_on_host(xp: ModuleType, host: np.ndarray, starts, ends, fields, written, values, present, fits,
                     beyond) -> None:
    """Read ``fields`` (indices) on the host as the Arrow path does and write what they are into the arrays."""
    text = texts(host, to_host(starts[fields]), to_host(ends[fields]))
    is_number = to_host(written[fields])
    number = pc.cast(text.filter(pa.array(is_number)), pa.float64()).to_numpy(zero_copy_only=False)
    value = np.full(len(text), np.nan)
    value[is_number] = number
    missing = ~is_number & pc.match_substring_regex(text, MISSING_NUMBER_PATTERN).to_numpy(zero_copy_only=False)
    ok = np.where(is_number, ~np.isinf(value), missing)
    out = np.isinf(value)
    for i in np.flatnonzero(~ok & ~is_number):  # a word that is not a number: is it an infinity (``inf``)?
        out[i] = is_infinite(text[int(i)].as_py())
    values[fields] = xp.asarray(value)
    present[fields] = xp.asarray(~missing)
    fits[fields] = xp.asarray(ok)
    beyond[fields] = xp.asarray(out)


def lists(xp: ModuleType, data, starts, ends, separator: int):
    """Each field split on the byte ``separator``, empty items dropped: (items per field, each item's start in the
    items' bytes laid end to end (one more than the items), where each of those bytes is in the block)."""
    f = _Fields(xp, data, starts, ends)
    kept = f.bytes != separator
    previous_kept = xp.concatenate([xp.zeros(1, bool), kept[:-1]])
    item_start = kept & ((f.at == 0) | ~previous_kept)
    place = xp.cumsum(kept.astype(f.offsets.dtype)) - 1  # each kept byte's place among the kept bytes
    item_offsets = xp.concatenate([place[item_start], kept.sum(dtype=place.dtype).reshape(1)])
    return f.count(item_start), item_offsets, f.positions[kept]


def texts(host: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> pa.Array:
    """The fields ``[starts, ends)`` of the host's bytes as an Arrow string array."""
    positions, offsets = segments(np, starts.astype(np.int64), ends.astype(np.int64))
    return pa.Array.from_buffers(pa.string(), starts.size, [None, pa.py_buffer(offsets.astype(np.int32)),
                                                             pa.py_buffer(host[positions])])


def _tens(xp: ModuleType):
    return xp.asarray([10**k for k in range(INT64_DIGITS)], dtype=xp.uint64)


def to_host(array) -> np.ndarray:
    """``array`` as a numpy array (copied back from the GPU for CuPy)."""
    return array if isinstance(array, np.ndarray) else array.get()
