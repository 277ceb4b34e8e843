"""The nearest double of ``w * 10**q`` with array operations (numpy here, CuPy on a GPU) against Arrow's parse of
``"{w}e{q}"``, to the bit: random significands of 1 to 19 digits at every power of ten, integers exactly half way
between two doubles (ties go to the even one), the shortest text of random doubles, and the edges of the normal
doubles, where the function says which results are not normal doubles (subnormal, zero, infinite)."""

from __future__ import annotations

import random

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from pipeline.data.nearest_double import LARGEST_POWER, SMALLEST_POWER, nearest_doubles

XPS = [pytest.param("numpy"), pytest.param("cupy", marks=pytest.mark.gpu)]


def _cases() -> list[tuple[int, int]]:
    rng = random.Random(7)
    cases = []
    for _ in range(20_000):
        digits = rng.randrange(1, 20)
        cases.append((rng.randrange(10 ** (digits - 1), 10**digits), rng.randrange(SMALLEST_POWER - 5,
                                                                                    LARGEST_POWER + 5)))
    for _ in range(20_000):  # half way between two doubles: an odd multiple of half their spacing
        k = rng.randrange(53, 63)
        step = 2 ** (k - 52)
        middle = rng.randrange(2**k, 2 ** (k + 1)) // step * step + step // 2
        if middle < 10**19:
            cases.append((middle, 0))
        if middle < 10**18:
            cases.append((middle * 10, -1))
    for value in np.abs(np.random.default_rng(7).standard_normal(20_000)) * 10.0 ** np.random.default_rng(8).integers(
            -300, 300, 20_000):
        mantissa, _, exponent = repr(float(value)).partition("e")
        whole, _, fraction = mantissa.partition(".")
        cases.append((int(whole + fraction), int(exponent or 0) - len(fraction)))
    cases += [(17976931348623157, 292), (17976931348623159, 292), (22250738585072014, -324), (22250738585072011, -324),
              (49, -325), (1, -400), (1, 309), (9007199254740993, 0), (1, 23), (1, 22), (10**19 - 1, 0), (1, -342),
              (1, 308), (123456789012345678, -5)]
    return cases


@pytest.mark.parametrize("xp", XPS)
def test_the_nearest_double_is_arrows_to_the_bit_and_the_rest_is_said_not_normal(xp):
    array_module = pytest.importorskip(xp)
    cases = _cases()
    w = array_module.asarray(np.array([c[0] for c in cases], dtype=np.uint64))
    q = array_module.asarray(np.array([c[1] for c in cases], dtype=np.int64))
    values, normal = nearest_doubles(array_module, w, q)
    values, normal = (a if isinstance(a, np.ndarray) else a.get() for a in (values, normal))
    want = pc.cast(pa.array([f"{a}e{b}" for a, b in cases]), pa.float64()).to_numpy()
    np.testing.assert_array_equal(values[normal].view(np.uint64), want[normal].view(np.uint64))
    tiny = np.finfo(np.float64).tiny
    assert ((want[~normal] < tiny) | np.isinf(want[~normal])).all()  # what is left out is not a normal double
    assert normal.mean() > 0.95
    assert (np.isinf(want) | (want < tiny)).sum() == (~normal).sum()  # and every normal double is found
