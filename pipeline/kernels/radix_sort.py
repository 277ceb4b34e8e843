"""Stable sort of (key, int32 value) pairs on the GPU by the low bits of the keys (``radix_sort.cu``).

Example::

    sorted_keys, sorted_values = sort_pairs(keys, values, key_bits=27)   # keys: int32/int64 in [0, 2**27)
"""

from __future__ import annotations

import torch

from pipeline.kernels._launch import i32, i64, launch, ptr

SOURCE = "radix_sort.cu"
THREADS = 256  # as SORT_THREADS in radix_sort.cu
MAX_DIGIT_BITS = 9  # as MAX_DIGIT_BITS there
_ITEMS = {torch.int32: 16, torch.int64: 8}  # keys a thread holds, as Tile<K>::ITEMS there
_SUFFIX = {torch.int32: "i32", torch.int64: "i64"}


def digit_bits(key_bits: int) -> list[int]:
    """The bits of each pass: as few passes of at most MAX_DIGIT_BITS bits as cover ``key_bits``, evenly."""
    if key_bits <= 0:
        return []
    passes = -(-key_bits // MAX_DIGIT_BITS)
    width, wider = divmod(key_bits, passes)
    return [width + (p < wider) for p in range(passes)]


def sort_pairs(keys: torch.Tensor, values: torch.Tensor, key_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``keys`` in ascending order, each ``values`` entry moved with its key; equal keys keep their order.

    ``keys``: 1-D int32 or int64, every one in ``[0, 2**key_bits)`` (higher bits are not looked at);
    ``values``: int32 of the same length (fewer than 2**31). Returns new tensors; the inputs are left as they are.
    """
    if keys.dtype not in _ITEMS or values.dtype != torch.int32 or keys.dim() != 1 or keys.shape != values.shape:
        raise ValueError(f"sort_pairs: expected 1-D int32/int64 keys and int32 values of one length, got "
                         f"{keys.dtype} {tuple(keys.shape)} and {values.dtype} {tuple(values.shape)}")
    if not 0 <= key_bits <= keys.element_size() * 8 - 1:
        raise ValueError(f"sort_pairs: key_bits must be within 0..{keys.element_size() * 8 - 1}, got {key_bits}")
    n = keys.numel()
    if n >= 2**31:
        raise ValueError(f"sort_pairs: sorts fewer than 2**31 pairs, got {n}")
    passes = digit_bits(key_bits)
    if n <= 1 or not passes:
        return keys.clone(), values.clone()
    keys, values = keys.contiguous(), values.contiguous()
    tiles = -(-n // (THREADS * _ITEMS[keys.dtype]))
    buffers = [(torch.empty_like(keys), torch.empty_like(values)) for _ in range(min(len(passes), 2))]
    counts = torch.empty((1 << max(passes)) * tiles, dtype=torch.int32, device=keys.device)
    suffix, shift = _SUFFIX[keys.dtype], 0
    for p, bits in enumerate(passes):
        out_keys, out_values = buffers[p % 2]
        used = counts[:(1 << bits) * tiles]
        launch(SOURCE, f"radix_histogram_{suffix}", keys.device, tiles, THREADS,
               [ptr(keys), i64(n), i32(shift), i32(bits), i32(tiles), ptr(used)])
        ends = torch.cumsum(used, 0, dtype=torch.int32)
        launch(SOURCE, f"radix_scatter_{suffix}", keys.device, tiles, THREADS,
               [ptr(keys), ptr(values), i64(n), i32(shift), i32(bits), i32(tiles), ptr(used), ptr(ends),
                ptr(out_keys), ptr(out_values)])
        keys, values, shift = out_keys, out_values, shift + bits
    return keys, values
