"""Vectorized MurmurHash3_x86_32 over numpy arrays, and cuDF's row-hash convention.

``murmur3_strings`` hashes the UTF-8 bytes of each string and ``murmur3_int64`` the 8 little-endian
bytes of each integer, exactly as the reference MurmurHash3_x86_32 (and the ``mmh3`` package) does.
``combine_row_hashes`` folds per-column hashes the way libcudf's row hasher
(``cudf/detail/row_operator/hashing.cuh``) does: ``hash = hash_combine(hash, h)`` starting from the
seed, ``hash_combine`` taken from Boost; one column with seed 0 thus gives ``h + 0x9E3779B9``.
Newer libcudf (the JIT row-hash kernel) starts from the first column's hash instead, so the cuDF
path of HashBucket hashes column by column and folds here-defined (see ``hashing._bucket_cudf``):
the buckets are this module's on either backend and any libcudf.

Example::

    murmur3_strings(pa.array(["a", "bc"]))        # == [mmh3.hash("a", signed=False), ...]
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

_C1 = np.uint32(0xCC9E2D51)
_C2 = np.uint32(0x1B873593)
GOLDEN = np.uint32(0x9E3779B9)


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def _mix_block(h: np.ndarray, k: np.ndarray) -> np.ndarray:
    k = _rotl(k * _C1, 15) * _C2
    h = h ^ k
    return _rotl(h, 13) * np.uint32(5) + np.uint32(0xE6546B64)


def _finalize(h: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    h = h ^ lengths.astype(np.uint32)
    h ^= h >> np.uint32(16)
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> np.uint32(16)
    return h


def murmur3_int64(values: np.ndarray, seed: int = 0) -> np.ndarray:
    """Hash each int64 as its 8 little-endian bytes; returns uint32."""
    words = np.ascontiguousarray(values, dtype="<i8").view("<u4").reshape(-1, 2)
    with np.errstate(over="ignore"):
        h = np.full(len(words), seed, dtype=np.uint32)
        h = _mix_block(h, words[:, 0].astype(np.uint32))
        h = _mix_block(h, words[:, 1].astype(np.uint32))
        return _finalize(h, np.full(len(words), 8, dtype=np.uint32))


def murmur3_strings(strings: pa.Array, seed: int = 0) -> np.ndarray:
    """Hash the UTF-8 bytes of each string of a pyarrow string array; nulls hash as ""; returns uint32."""
    strings = strings.cast(pa.large_string()) if strings.type != pa.large_string() else strings
    n = len(strings)
    offsets = np.frombuffer(strings.buffers()[1], dtype=np.int64)[strings.offset : strings.offset + n + 1]
    data_buf = strings.buffers()[2]
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    data = np.concatenate([data, np.zeros(4, np.uint8)])  # lets a tail read 4 bytes past the end
    starts = offsets[:-1]
    lengths = offsets[1:] - starts
    if strings.null_count:
        lengths = np.where(strings.is_null().to_numpy(zero_copy_only=False), 0, lengths)
    h = np.full(n, seed, dtype=np.uint32)
    blocks = lengths // 4
    with np.errstate(over="ignore"):
        for b in range(int(blocks.max(initial=0))):
            rows = np.flatnonzero(blocks > b)
            h[rows] = _mix_block(h[rows], _gather_u32(data, starts[rows] + 4 * b))
        tail = lengths & 3
        rows = np.flatnonzero(tail)
        if len(rows):
            pos = starts[rows] + 4 * blocks[rows]
            word = _gather_u32(data, pos)
            keep = (np.uint64(1) << (8 * tail[rows]).astype(np.uint64)) - np.uint64(1)
            k = (word.astype(np.uint64) & keep).astype(np.uint32)
            k = _rotl(k * _C1, 15) * _C2
            h[rows] ^= k
        return _finalize(h, lengths)


def murmur3_fixed_width(values: np.ndarray, lengths: np.ndarray, seeds: tuple[int, ...] = (0,)) -> np.ndarray:
    """MurmurHash3_x86_32 of the values of a numpy ``S`` array, each its first ``lengths`` bytes (zeros after them),
    with each of ``seeds``: uint32 ``[len(seeds), n]``.

    The values' 4-byte blocks are read in place as the columns of one uint32 matrix, every value's block ``b`` in
    one step (a value without one keeps its hash), which for the few short values of a request costs fewer numpy
    calls than :func:`murmur3_strings`' gathers; the tail block needs no mask, its bytes past the end being zero.
    """
    n, width = len(values), values.dtype.itemsize
    blocks = width // 4 + 1  # one more: the tail block of a value of a multiple of 4 bytes reads as zero
    padded = np.zeros((n, 4 * blocks), dtype=np.uint8)
    padded[:, :width] = np.ascontiguousarray(values).view(np.uint8).reshape(n, width)
    words = padded.view("<u4")
    full = lengths // 4
    h = np.repeat(np.array(seeds, dtype=np.uint32)[:, None], n, axis=1)
    with np.errstate(over="ignore"):
        for b in range(int(full.max(initial=0))):
            h = np.where(full > b, _mix_block(h, words[:, b]), h)
        tail = words[np.arange(n), full]
        h ^= _rotl(tail * _C1, 15) * _C2  # zero where there is no tail
        return _finalize(h, lengths)


def _gather_u32(data: np.ndarray, pos: np.ndarray) -> np.ndarray:
    b = [data[pos + i].astype(np.uint32) for i in range(4)]
    return b[0] | (b[1] << np.uint32(8)) | (b[2] << np.uint32(16)) | (b[3] << np.uint32(24))


def hash_combine(lhs: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """Boost's ``hash_combine`` on uint32, as libcudf uses it to fold column hashes into a row hash."""
    lhs = np.asarray(lhs, dtype=np.uint32)
    with np.errstate(over="ignore"):
        return lhs ^ (np.asarray(rhs, dtype=np.uint32) + GOLDEN + (lhs << np.uint32(6)) + (lhs >> np.uint32(2)))


def combine_row_hashes(column_hashes: list[np.ndarray], seed: int = 0) -> np.ndarray:
    """Fold per-column hashes into one row hash the way libcudf's row hasher does, starting from ``seed``."""
    row = np.full(len(column_hashes[0]), seed, dtype=np.uint32)
    for h in column_hashes:
        row = hash_combine(row, h)
    return row
