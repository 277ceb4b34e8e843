"""Types of the benchmarks' numeric options: a value out of range is refused while the command line is read, as
one line naming the option and what it takes (``argument --rows: expected an integer >= 1, got '0'``), before
anything is built or run.

Example::

    parser.add_argument("--rows", type=integer(1), default=2_000_000)
    parser.add_argument("--seconds", type=number(above=0), default=10.0)
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def integer(low: int) -> Callable[[str], int]:
    """An integer of at least ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
        return value

    return parse


def number(*, above: float | None = None, low: float | None = None) -> Callable[[str], float]:
    """A finite number greater than ``above``, or at least ``low``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        fits = math.isfinite(value) and (above is None or value > above) and (low is None or value >= low)
        if not fits:
            wanted = f"> {above:g}" if above is not None else f">= {low:g}"
            raise argparse.ArgumentTypeError(f"expected a number {wanted}, got {text!r}")
        return value

    return parse
