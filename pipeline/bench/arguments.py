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
from pathlib import Path


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


def integers(low: int) -> Callable[[str], list[int]]:
    """A comma-separated list of integers, each at least ``low`` (``1,64,1024``)."""
    one = integer(low)

    def parse(text: str) -> list[int]:
        values = [one(part.strip()) for part in text.split(",") if part.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"expected integers >= {low}, comma-separated, got {text!r}")
        return values

    return parse


def bench_rows(given: int | None, data, default: int) -> int:
    """The synthetic rows a bench makes: ``--rows`` (``given``), else ``data.rows`` where it is set to other than its
    default, else the bench's ``default``; ``--rows`` and another ``data.rows`` both given are refused."""
    from dataclasses import fields

    from pipeline.errors import UserError

    unset = next(f.default for f in fields(data) if f.name == "rows")
    if given is not None and data.rows not in (unset, given):
        raise UserError(f"--rows {given} and data.rows={data.rows} disagree: give the bench's rows once")
    return given if given is not None else data.rows if data.rows != unset else default


def output_file(text: str) -> str:
    """A file a bench writes its figures to (atomically, when they are measured): a folder there is refused while the
    command line is read, not after the run."""
    if Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder: name a file, e.g. {Path(text) / 'bench.json'}")
    return text


def one_of(*allowed: str) -> Callable[[str], list[str]]:
    """A comma-separated list of ``allowed`` words (``fp32,bf16``)."""

    def parse(text: str) -> list[str]:
        words = [w.strip() for w in text.split(",") if w.strip()]
        if not words or any(w not in allowed for w in words):
            raise argparse.ArgumentTypeError(f"expected {' | '.join(allowed)} (or several, comma-separated), "
                                             f"got {text!r}")
        return words

    return parse


def widths_ending_in_one(text: str) -> list[int]:
    """An MLP's layer widths ending in the one output (``512,256,1``)."""
    widths = integers(1)(text)
    if widths[-1] != 1:
        raise argparse.ArgumentTypeError(f"expected widths ending in 1 (the output), e.g. 512,256,1, got {text!r}")
    return widths
