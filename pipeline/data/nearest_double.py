"""The double nearest to ``w * 10**q`` for arrays of 64-bit ``w`` and integer ``q``, with array operations only (numpy
or CuPy), by the Eisel-Lemire algorithm: what Arrow's parser (fast_float) computes for a number of at most 19
significant digits, so a number read here has the bits Arrow gives it.

``w`` is normalised to 64 bits and multiplied by a 128-bit approximation of ``5**q`` (a table made at import with
Python's integers, as fast_float's own generator makes it); the top bits of that product, the power of two of
``10**q`` and the round-half-to-even rule then give the double. The truncated product always suffices (Mushtak and
Lemire, "Fast number parsing without fallback", 2023). A 64 x 64 -> 128-bit product is four 32 x 32 -> 64-bit ones.

Where the result would be subnormal, zero or infinite (``q`` far out, or ``w * 10**q`` beyond the range of normal
doubles), :func:`nearest_doubles` says so (``normal`` false): the caller reads those another way.

Reference: Daniel Lemire, "Number Parsing at a Gigabyte per Second", Software: Practice and Experience 51 (2021);
https://github.com/fastfloat/fast_float (``decimal_to_binary.h``).
"""

from __future__ import annotations

from types import ModuleType

import numpy as np

SMALLEST_POWER, LARGEST_POWER = -342, 308
_MANTISSA_BITS = 52
_MINIMUM_EXPONENT = -1023
_INFINITE_POWER = 0x7FF
_ROUND_TO_EVEN = (-4, 23)  # the powers of ten where a product can fall exactly half way
_LOW32 = (1 << 32) - 1


def _powers_of_five() -> np.ndarray:
    """``[q - SMALLEST_POWER] -> (high, low)``: 5**q as a 128-bit number with its top bit set (truncated; for ``q < 0``
    one more than the truncated quotient), as fast_float's table_generation.py makes it."""
    table = []
    for q in range(SMALLEST_POWER, LARGEST_POWER + 1):
        if q < 0:
            power5 = 5**-q
            z = power5.bit_length() - (1 if power5 & (power5 - 1) == 0 else 0)  # the least z with 2**z >= 5**-q
            c = 2 ** (z + 127) // power5 + 1 if q >= -27 else 2 ** (2 * z + 128) // power5 + 1
            while c >= 1 << 128:
                c //= 2
        else:
            c = 5**q
            while c < 1 << 127:
                c *= 2
            while c >= 1 << 128:
                c //= 2
        table.append((c >> 64, c & ((1 << 64) - 1)))
    return np.array(table, dtype=np.uint64)


_TABLE = _powers_of_five()


def nearest_doubles(xp: ModuleType, w, q):
    """The double nearest to ``w * 10**q`` (``w``: uint64 above 0; ``q``: int64), and whether it is a normal double
    found here (where not, the value is meaningless)."""
    inside = (q >= SMALLEST_POWER) & (q <= LARGEST_POWER)
    q = xp.clip(q, SMALLEST_POWER, LARGEST_POWER)
    table = xp.asarray(_TABLE)
    high5, low5 = table[q - SMALLEST_POWER, 0], table[q - SMALLEST_POWER, 1]
    zeros = _leading_zeros(xp, w)
    w = w << zeros.astype(xp.uint64)
    high, low = _product(xp, w, high5)
    mask = xp.uint64((1 << 64) - 1 >> (_MANTISSA_BITS + 3))
    refine = (high & mask) == mask  # the first product leaves the rounding open: add the second
    second_high, _ = _product(xp, w, low5)
    added = low + second_high
    high = xp.where(refine & (added < low), high + xp.uint64(1), high)
    low = xp.where(refine, added, low)
    upper = (high >> xp.uint64(63)).astype(xp.int64)
    shift = (upper + 64 - _MANTISSA_BITS - 3).astype(xp.uint64)
    mantissa = high >> shift
    power2 = (((152170 + 65536) * q) >> 16) + 63 + upper - zeros - _MINIMUM_EXPONENT
    halfway = ((low <= xp.uint64(1)) & (q >= _ROUND_TO_EVEN[0]) & (q <= _ROUND_TO_EVEN[1])
               & ((mantissa & xp.uint64(3)) == xp.uint64(1)) & ((mantissa << shift) == high))
    mantissa = xp.where(halfway, mantissa & ~xp.uint64(1), mantissa)
    mantissa = (mantissa + (mantissa & xp.uint64(1))) >> xp.uint64(1)
    carried = mantissa >= xp.uint64(2 << _MANTISSA_BITS)
    mantissa = xp.where(carried, xp.uint64(1 << _MANTISSA_BITS), mantissa)
    power2 = power2 + carried
    # a product whose low bits are all ones might need more of 5**q than the table holds, outside powers where it is
    # exact (fast_float tested for this before the proof that it cannot happen; the few such numbers go elsewhere)
    doubtful = (low == xp.uint64((1 << 64) - 1)) & ((q < -27) | (q > 55))
    normal = inside & ~doubtful & (power2 > 0) & (power2 < _INFINITE_POWER)
    bits = (mantissa & xp.uint64((1 << _MANTISSA_BITS) - 1)) | (xp.clip(power2, 0, _INFINITE_POWER).astype(xp.uint64)
                                                                << xp.uint64(_MANTISSA_BITS))
    return bits.view(xp.float64), normal


def _product(xp: ModuleType, a, b):
    """The 128-bit products of uint64 arrays ``a`` and ``b``: (high 64 bits, low 64 bits)."""
    low32, s = xp.uint64(_LOW32), xp.uint64(32)
    a_high, a_low, b_high, b_low = a >> s, a & low32, b >> s, b & low32
    low_low, high_low, low_high = a_low * b_low, a_high * b_low, a_low * b_high
    cross = (low_low >> s) + (high_low & low32) + low_high  # below 2**64
    return a_high * b_high + (high_low >> s) + (cross >> s), (cross << s) | (low_low & low32)


def _leading_zeros(xp: ModuleType, w):
    """The leading zero bits of each uint64 (above 0), as int64."""
    zeros = xp.zeros(w.shape, dtype=xp.int64)
    for bits in (32, 16, 8, 4, 2, 1):
        empty = (w >> xp.uint64(64 - bits)) == xp.uint64(0)
        w = xp.where(empty, w << xp.uint64(bits), w)
        zeros += empty * bits
    return zeros
