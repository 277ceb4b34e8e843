"""Triton's BYTES tensors on the wire, encoded and decoded with numpy instead of a Python call per value.

On the wire a BYTES tensor is its values one after the other, each as its length (4 bytes,
little-endian) then its bytes. tritonclient encodes, and the python backend decodes, value by value
in Python: at a batch of 1,024 raw rows with 26 string columns that is 26,624 values each way and
more time than the model's. Here:

- :func:`encode_bytes` (the client): the values read into one Arrow array, each joined to its length by Arrow
  (interleaved by numpy in a small request); all the string tensors of a request at once.
- :func:`decode_bytes` (the served models, installed over the python backend's
  ``deserialize_bytes_tensor``, which the stub calls on every BYTES input: a request's ``[B, m]``
  strings in one call): the values come back as one fixed-width ``S`` array. A small tensor (under
  :data:`_SPLIT_BELOW` bytes: a request of up to about 16 rows of 26 columns) is cut into its values
  by one Python pass and handed to numpy as a list. A larger one is built by numpy from where each
  value starts: where every value has the same length those starts are known at once; where the
  values are text (under 256 bytes, no NUL byte) numpy reads them off the zero bytes, which are then
  those of the lengths alone, and copies each value's bytes as one fixed-width item (a value of
  another length than the widest then has the bytes after its end cleared); otherwise one Python
  pass over the lengths finds them.
  A value holding a NUL byte cannot live in an ``S`` array (numpy and Arrow read such values up to
  their NUL), so a tensor with one comes back as an object array of ``bytes``, as the backend's own
  function returns it. So does a tensor whose ``S`` array would take far more memory than its values
  (:func:`fixed_width_fits`): one value of 1 MiB among 1,024 short ones would make it 1 GiB.

Example::

    c1, c2 = encode_bytes([np.array([b"68fd1e64", b""], dtype=object), np.array([[b"a"]], dtype=object)])
    decode_bytes(np.frombuffer(c1, np.uint8)).tolist()      # [b"68fd1e64", b""]
"""

from __future__ import annotations

import struct
from itertools import pairwise

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from numpy.lib.stride_tricks import sliding_window_view

_LENGTH = struct.Struct("<I")
_ZEROS_FROM = 4096
"""Tensors of at least this many bytes look for their values' lengths in their zero bytes; below it one
Python pass over the lengths costs less than the numpy calls."""
_SPLIT_BELOW = 4096
"""Tensors under this many bytes are cut into their values in Python: below it that costs less than the numpy
calls that place the values in a fixed-width array (measured on ``[B, 26]`` tensors of 8-byte values, about a
third of them empty: the same at 16 rows, 4.6 KB)."""
_JOIN_FROM = 8192
"""From this many values Arrow joins them to their lengths; below it numpy's interleaving costs less (measured on
``[B, 26]`` tensors of 8-byte values: the same near 256 rows, 6,656 values; Arrow 1.7x as fast at 1,024 rows, numpy
about 40 us faster at 32)."""
_SPARE_FACTOR = 4
_SPARE_BYTES = 1 << 20
"""A fixed-width array of values may take up to :data:`_SPARE_FACTOR` times their bytes, and this much more."""


def encode_bytes(arrays: list[np.ndarray]) -> list[bytes]:
    """The wire form of each array (any shape; ``bytes`` as they are, anything else as its UTF-8 text),
    all encoded in one pass: a request's string columns cost one call each step, not one per column."""
    flat = np.concatenate([np.asarray(a, dtype=object).reshape(-1) for a in arrays]) if arrays else np.empty(0, object)
    encoded, starts = _wire_form(flat)
    bounds = starts[np.cumsum([0] + [np.asarray(a).size for a in arrays])].tolist()
    return [encoded[start:end] for start, end in pairwise(bounds)]


def _wire_form(values: np.ndarray) -> tuple[bytes, np.ndarray]:
    """The values one after the other, each as its length (4 bytes, little-endian) then its bytes; and where each
    value's length starts in it, then where the last value ends.

    Where every value is ``bytes`` or ``str``, Arrow reads them in one pass (writing ``str`` as its UTF-8 text too)
    and joins each value to its length's 4 bytes (``binary_join_element_wise``), its data then the wire form (below
    :data:`_JOIN_FROM` values numpy interleaves them: fewer calls); else value by value."""
    try:
        array = pa.array(values, type=pa.large_binary())
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        array = None
    if array is None or array.null_count or not len(array):
        encoded = [v if isinstance(v, bytes) else str(v).encode() for v in values]
        return (b"".join(_LENGTH.pack(len(v)) + v for v in encoded),
                _starts(np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))))
    offsets = np.frombuffer(array.buffers()[1], dtype=np.int64, count=len(array) + 1)
    lengths = np.diff(offsets)
    if len(array) < _JOIN_FROM:  # interleaved by numpy
        starts = _starts(lengths)
        out = np.empty(int(starts[-1]), dtype=np.uint8)
        prefixes = starts[:-1, None] + np.arange(4)
        is_value = np.ones(out.size, dtype=bool)
        is_value[prefixes] = False
        out[prefixes] = lengths.astype("<u4").view(np.uint8).reshape(-1, 4)
        data = array.buffers()[2]
        out[is_value] = np.frombuffer(data, dtype=np.uint8, count=int(offsets[-1])) if data else []
        return out.tobytes(), starts
    prefixes = pa.FixedSizeBinaryArray.from_buffers(pa.binary(4), len(array),
                                                    [None, pa.py_buffer(lengths.astype("<u4").tobytes())])
    joined = pc.binary_join_element_wise(prefixes.cast(pa.large_binary()), array, pa.scalar(b"", pa.large_binary()))
    ends = np.frombuffer(joined.buffers()[1], dtype=np.int64, count=len(joined) + 1)
    return memoryview(joined.buffers()[2])[ends[0]:ends[-1]].tobytes(), ends - ends[0]


def decode_bytes(encoded) -> np.ndarray:
    """The values of a wire-form BYTES tensor (``bytes`` or a uint8 array), flat, in order."""
    buffer = np.frombuffer(encoded, dtype=np.uint8)
    if buffer.size == 0:
        return np.empty(0, dtype=object)
    if buffer.size < _SPLIT_BELOW:
        return _from_list(_split(buffer.tobytes()))
    first = _LENGTH.unpack_from(buffer)[0] if buffer.size >= 4 else -1
    if first >= 0 and buffer.size % (4 + first) == 0:
        records = buffer.reshape(-1, 4 + first)
        if len(records) == 1 or (records[:, :4] == records[0, :4]).all():  # one length: no pass needed
            values = records[:, 4:]
            if first == 0:
                return np.zeros(len(records), dtype="S1")
            return np.ascontiguousarray(values).view(f"S{first}").reshape(-1) if values.all() else _objects(buffer)
    lengths, text = _lengths(buffer)
    width = max(int(lengths.max()), 1)
    if not fixed_width_fits(width, lengths.size, buffer.size - 4 * lengths.size):
        return _objects(buffer, lengths)
    if text:
        return _text_values(buffer, lengths, width)
    is_value = np.ones(buffer.size, dtype=bool)
    is_value[_starts(lengths)[:-1, None] + np.arange(4)] = False
    values = buffer[is_value]
    if not values.all():
        return _objects(buffer, lengths)
    out = np.zeros((lengths.size, width), dtype=np.uint8)
    out[np.arange(width) < lengths[:, None]] = values
    return out.view(f"S{width}").reshape(-1)


def _text_values(buffer: np.ndarray, lengths: np.ndarray, width: int) -> np.ndarray:
    """The values, none holding a NUL byte, as one ``S{width}`` array: each value's ``width`` bytes read at once
    from where it starts (numpy copies them as one item), the bytes past its end (the next values') then cleared."""
    starts = _starts(lengths)[:-1] + 4
    present = np.flatnonzero(lengths)
    if (lengths[present] == width).all():  # each value of one length or empty: read whole, nothing to clear
        out = np.zeros(lengths.size, dtype=f"S{width}")
        out[present] = sliding_window_view(buffer, width).view(f"S{width}")[starts[present], 0]
        return out
    padded = np.zeros(buffer.size + width, dtype=np.uint8)
    padded[:buffer.size] = buffer
    out = sliding_window_view(padded, width).view(f"S{width}")[starts, 0]
    out.view(np.uint8).reshape(-1, width)[np.arange(width) >= lengths[:, None]] = 0
    return out


def _split(data: bytes) -> list[bytes]:
    """The values of a wire-form tensor, in one pass."""
    unpack = _LENGTH.unpack_from
    values = []
    offset = 0
    while offset + 4 <= len(data):
        (length,) = unpack(data, offset)
        offset += 4
        values.append(data[offset: offset + length])
        offset += length
    if offset != len(data):
        raise ValueError(f"a BYTES tensor of {len(data)} bytes whose value lengths add up to {offset}")
    return values


def _from_list(values: list[bytes]) -> np.ndarray:
    """The values as one ``S`` array, or as objects where one holds a NUL byte or the array would be too wide."""
    width = max(map(len, values))
    joined = b"".join(values)
    if b"\x00" in joined or not fixed_width_fits(max(width, 1), len(values), len(joined)):
        return np.array(values, dtype=object)
    return np.array(values, dtype=f"S{max(width, 1)}")


def _lengths(buffer: np.ndarray) -> tuple[np.ndarray, bool]:
    """Each value's length, and whether it was read off the zero bytes of a large tensor of text values (then no
    value holds a NUL byte); else found in one pass."""
    if buffer.size >= _ZEROS_FROM:
        lengths = _lengths_from_zeros(buffer)
        if lengths is not None:
            return lengths, True
    values = _split(buffer.tobytes())
    return np.fromiter(map(len, values), dtype=np.int64, count=len(values)), False


def _lengths_from_zeros(buffer: np.ndarray) -> np.ndarray | None:
    """The lengths where every value is under 256 bytes and holds no NUL byte (text), else None.

    Then the zero bytes are exactly those of the lengths: 3 after the first length byte of a value
    with bytes, 4 for an empty value. So every run of zeros is 3 long (the value starts at the byte
    before it) or 4 per empty value; the values found that way are kept only if each one starts
    where the one before ends, which is the decoding itself.
    """
    zero = np.concatenate(([False], buffer == 0, [False]))
    edges = np.flatnonzero(zero[1:] != zero[:-1])
    run_starts, runs = edges[0::2], edges[1::2] - edges[0::2]
    three = runs == 3
    if run_starts.size == 0 or not (three | (runs % 4 == 0)).all():
        return None
    counts = np.where(three, 1, runs // 4)
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    starts = np.repeat(np.where(three, run_starts - 1, run_starts), counts) + 4 * within
    if starts[-1] + 4 > buffer.size:
        return None
    lengths = buffer[starts].astype(np.int64)  # the 3 bytes after each are zero: runs of 3 or 4
    ends = starts + 4 + lengths
    if starts[0] != 0 or ends[-1] != buffer.size or not np.array_equal(starts[1:], ends[:-1]):
        return None
    return lengths


def _starts(lengths: np.ndarray) -> np.ndarray:
    """Where each value (its 4 length bytes, then its bytes) starts in the wire form, then where the last ends."""
    return np.concatenate([[0], np.cumsum(lengths.astype(np.int64) + 4)])


def fixed_width_fits(width: int, count: int, value_bytes: int) -> bool:
    """Whether ``count`` values of ``value_bytes`` bytes in all may live in an ``S{width}`` array: at most a few
    times their bytes (a tensor of short text, or of one length, does; one long value among short ones does not)."""
    return width * count <= _SPARE_FACTOR * value_bytes + _SPARE_BYTES


def _objects(buffer: np.ndarray, lengths: np.ndarray | None = None) -> np.ndarray:
    """The values as an object array of ``bytes``, as the python backend's own function returns them."""
    data = buffer.tobytes()
    lengths = _lengths(buffer)[0] if lengths is None else lengths
    starts = _starts(lengths)[:-1] + 4
    return np.array([data[start: start + n] for start, n in zip(starts.tolist(), lengths.tolist())], dtype=object)
