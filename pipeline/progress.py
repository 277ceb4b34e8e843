"""Progress of a long loop, as the ``progress`` setting asks: a bar, a plain line now and then, or nothing.

``bar`` draws a tqdm bar (on stderr). ``plain`` prints a line on stdout at most every 5 seconds and a
last one when the loop ends, readable in a log file::

    [train] step 1/5000 (0%) 0.0145 step/s, the first step in 1m09s, loss=0.6931, lr=0.0001, samples/s=1,201
    [train] step 1200/5000 (24%) 3.1k step/s, eta 1m12s, loss=0.4512, lr=0.0093, samples/s=52,310
    [train] step 5000/5000 (100%) 2.9k step/s, in 1m36s, loss=0.4470, lr=0.001, samples/s=52,980

``auto`` is ``bar`` when stderr is a terminal and ``plain`` otherwise; ``off`` shows nothing. Library
functions take the mode as a plain argument (``progress: str | bool``, True meaning ``auto`` and
False ``off``); the stages pass ``PipelineConfig.progress`` down.

Example::

    with Progress("synthetic data", total=12, unit="chunk", mode=cfg.progress) as bar:
        for chunk in chunks:
            ...
            bar.update(1)
"""

from __future__ import annotations

import sys
import time
from typing import Self

MODES = ("auto", "bar", "plain", "off")
PLAIN_EVERY_S = 5.0


def progress_mode(progress: str | bool) -> str:
    """``bar``, ``plain`` or ``off``: what ``progress`` (a mode of :data:`MODES`, True or False) means here."""
    if isinstance(progress, bool):
        progress = "auto" if progress else "off"
    if progress not in MODES:
        raise ValueError(f"progress: expected one of {', '.join(MODES)}, got {progress!r}")
    if progress == "auto":
        return "bar" if sys.stderr.isatty() else "plain"
    return progress


class Progress:
    """Counts ``unit``s done out of ``total`` (None: not known) under the name ``desc``.

    ``scaled`` shows large counts as ``1.2M``; ``fields`` (:meth:`set_fields`) follow the count in both
    forms, e.g. the training loss; ``every_s`` is the least time between two plain lines.
    """

    def __init__(self, desc: str, total: int | None = None, unit: str = "it", mode: str | bool = "auto",
                 initial: int = 0, scaled: bool = False, every_s: float = PLAIN_EVERY_S) -> None:
        self.desc, self.total, self.unit, self.n, self.scaled = desc, total, unit, initial, scaled
        self.mode = progress_mode(mode)
        self.fields: dict[str, str] = {}
        self._initial, self._every_s = initial, every_s
        self._start = self._printed = time.monotonic()
        self._first: tuple[float, int] | None = None  # when the first update came, and the count it made
        self._bar = None
        if self.mode == "bar":
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, unit_scale=scaled,
                             dynamic_ncols=True)

    def update(self, n: int = 1) -> None:
        self.n += n
        if self._first is None:
            self._first = (time.monotonic(), self.n)
        if self._bar is not None:
            self._bar.update(n)
        elif self.mode == "plain" and (self.total is None or self.n < self.total):  # close() prints the last
            now = time.monotonic()
            if now - self._printed >= self._every_s:
                self._printed = now
                print(self.line(now, last=False), flush=True)

    def set_fields(self, fields: dict[str, str]) -> None:
        self.fields.update(fields)
        if self._bar is not None:
            self._bar.set_postfix(self.fields, refresh=False)

    def close(self) -> None:
        """End the bar, or print the last plain line; once."""
        if self._bar is not None:
            self._bar.close()
        elif self.mode == "plain":
            print(self.line(time.monotonic(), last=True), flush=True)
        self.mode, self._bar = "off", None

    def line(self, now: float, last: bool) -> str:
        """The plain line: count, rate, then the time left (or, for the last, the time taken) and the fields.

        The rate and the time left of a line before the last are those since the first update: the first unit
        of a loop often holds its start-up (compiling a model, starting workers, a cold disk), which would
        make the time left many times too long. Until a second update there is no rate to go by, and the
        line says how long the first took instead."""
        elapsed = now - self._start
        shown = _scaled if self.scaled else str
        count = f"{self.unit} {shown(self.n)}"
        if self.total is not None:
            count += f"/{shown(self.total)} ({100 * self.n / self.total if self.total else 100:.0f}%)"
        rate = (self.n - self._initial) / elapsed if elapsed > 0 else 0.0
        since_first = None
        if not last and self._first is not None and self.n > self._first[1] and now > self._first[0]:
            rate = since_first = (self.n - self._first[1]) / (now - self._first[0])
        parts = [f"[{self.desc}] {count} {_scaled(rate)} {self.unit}/s"]
        if last:
            parts.append(f"in {_duration(elapsed)}")
        elif since_first is None and self._first is not None:
            first = self._first[1] - self._initial
            what = self.unit if first == 1 else f"{shown(first)} {self.unit}s"
            parts.append(f"the first {what} in {_duration(self._first[0] - self._start)}")
        elif self.total is not None and rate > 0:
            parts.append(f"eta {_duration((self.total - self.n) / rate)}")
        return ", ".join(parts + [f"{k}={v}" for k, v in self.fields.items()])

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _scaled(x: float) -> str:
    """3 significant digits with k / M / G: ``3.1k``, ``120``, ``0.25``."""
    for suffix in ("", "k", "M"):
        if abs(x) < 999.5:
            return f"{x:.3g}{suffix}"
        x /= 1000
    return f"{x:.3g}G"


def _duration(seconds: float) -> str:
    """``4.2s``, ``42s``, ``1m12s``, ``2h03m``."""
    if seconds < 10:
        return f"{seconds:.1f}s"
    s = round(seconds)
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
