"""Exact medians of Dask columns in bounded memory, the same on pandas and cuDF partitions.

Round one: each partition's present values become a :class:`Summary` (sorted distinct values and
their counts), merged by a tree of 8. A summary of more than :data:`SUMMARY_POINTS` values is
compressed to that many evenly spaced order statistics, each standing for its block of rows, and
adds the block size to its ``error`` (how many ranks a value read from it may be off). Without
compression the root gives the exact median. Otherwise it gives a :class:`Pivot`: an estimate and
the error bound.

Round two, only for such columns: each partition counts its values below, equal to and above the
pivot and keeps the ``width`` values nearest to it on each side (a :class:`Window`); merged, they
hold the exact middle values.

Where the cluster holds every partition at once (no more partitions than workers, :func:`in_one_graph`), both
rounds are one graph (:func:`medians`): round two's tasks wait for round one's estimates on the workers, with no
return to the client in between, take the partitions round one read, and skip the columns whose summary was exact.

The median of an even count is the mean of the two middle values (as numpy's and pandas'); a
column without values has none (NaN).

Example::

    stats = compute(summaries(ddf))               # {column: median or Pivot}
    pivots = {c: p for c, p in stats.items() if isinstance(p, Pivot)}
    exact = compute(windows(ddf[list(pivots)], pivots)) if pivots else {}
    exact = compute(medians(ddf))                 # the same in one graph, where in_one_graph(ddf)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.etl.frames import array_module, float_rows

SUMMARY_POINTS = 65_536
"""Distinct values a summary keeps exactly; beyond, it keeps this many order statistics."""
_SPLIT_EVERY = 8


@dataclass
class Summary:
    """Sorted distinct values with their counts; ``error``: how many ranks a value may be off (0: exact)."""

    values: np.ndarray
    counts: np.ndarray
    error: int = 0


@dataclass(frozen=True)
class Pivot:
    """A median estimate whose rank is within ``width - 1`` of the middle ranks."""

    value: float
    width: int


@dataclass
class Window:
    """Rows below, equal to and above ``pivot``, and the ``width`` values nearest it on each side (ascending)."""

    pivot: Pivot
    below: int
    equal: int
    above: int
    lower: np.ndarray
    upper: np.ndarray


def summaries(ddf: Any) -> dict[str, Any]:
    """Round one, lazy: ``{column: Delayed[float | Pivot]}``, each partition read once for all columns."""
    from dask import delayed

    names = list(ddf.columns)
    parts = [delayed(_summarize_partition, pure=True)(part, names) for part in ddf.to_delayed()]
    return {name: reduce_tree([part[name] for part in parts], _merge_summaries, _estimate) for name in names}


def windows(ddf: Any, pivots: dict[str, Pivot]) -> dict[str, Any]:
    """Round two, lazy: ``{column: Delayed[float]}``, the exact medians of the columns of ``pivots``."""
    from dask import delayed

    parts = [delayed(_window_partition, pure=True)(part, pivots) for part in ddf[list(pivots)].to_delayed()]
    return {name: reduce_tree([part[name] for part in parts], _merge_windows, _exact) for name in pivots}


def medians(ddf: Any) -> dict[str, Any]:
    """Both rounds in one graph, lazy: ``{column: Delayed[float]}``, each partition read once for both."""
    from dask import delayed

    names = list(ddf.columns)
    parts = ddf.to_delayed()
    summaries_ = [delayed(_summarize_partition, pure=True)(part, names) for part in parts]
    estimates = {name: reduce_tree([s[name] for s in summaries_], _merge_summaries, _estimate) for name in names}
    pivots = delayed(_pivots, pure=True)(estimates)
    found = [delayed(_windows_where_needed, pure=True)(part, names, pivots) for part in parts]
    return {name: reduce_tree([f[name] for f in found], _merge_windows, _median, estimates[name]) for name in names}


def in_one_graph(ddf: Any) -> bool:
    """Whether :func:`medians` suits ``ddf``: no more partitions than the cluster runs tasks at once (its workers'
    threads; one without a distributed client), so that holding each partition from round one to round two holds no
    more than one round does. With more, a partition read in round one would wait in memory for all the others to be
    summarized."""
    from pipeline.etl.progress import task_slots

    return ddf.npartitions <= task_slots()


def reduce_tree(items: list, merge: Callable, finish: Callable, *before: Any) -> Any:
    """Lazy: ``finish(*before, *items)`` of the Dask delayed ``items`` after merging them 8 at a time (``merge``) until 8
    are left."""
    from dask import delayed

    while len(items) > _SPLIT_EVERY:
        items = [delayed(merge, pure=True)(*items[i : i + _SPLIT_EVERY]) for i in range(0, len(items), _SPLIT_EVERY)]
    return delayed(finish, pure=True)(*before, *items)


# ----------------------------------------------------------------------------------------- round one


def _summarize_partition(df: Any, names: list[str]) -> dict[str, Summary]:
    rows = _sorted_rows(df, names)
    return {name: _summarize(rows[k]) for k, name in enumerate(names)}


def _sorted_rows(df: Any, names: list[str]) -> Any:
    """The columns ``names`` as one float64 matrix ``[column, row]`` (numpy, or CuPy for cuDF), each row sorted
    with its missing values (NaN) last.

    numpy sorts the matrix in one call. CuPy sorts a matrix's rows by a merge sort of (row, value) pairs, and one
    row alone by a radix sort, several times faster; a radix sort orders floats by their bits, so every NaN is made
    the same positive one first (last, as numpy has them) and -0.0 is made 0.0 (beside the other zeros)."""
    rows = float_rows(df, names)
    xp = array_module(rows)
    if xp is np:
        return np.sort(rows, axis=1)
    rows = xp.where(xp.isnan(rows), xp.nan, rows + 0.0)
    for row in rows:
        row.sort()
    return rows


def _present(ordered: Any) -> Any:
    """A sorted row of :func:`_sorted_rows` without its missing values (its end)."""
    return ordered[: len(ordered) - int(array_module(ordered).isnan(ordered).sum())]


def _summarize(ordered: Any) -> Summary:
    """The summary of one sorted row of :func:`_sorted_rows`, copied to the host."""
    xp = array_module(ordered)
    present = _present(ordered)
    n = len(present)
    if not n:
        return Summary(np.zeros(0, dtype=np.float64), np.zeros(0, dtype=np.int64))
    starts = xp.flatnonzero(xp.concatenate([xp.ones(1, dtype=bool), present[1:] != present[:-1]]))
    if len(starts) > SUMMARY_POINTS:  # the order statistics
        middles, sizes = _blocks(n)
        return Summary(_host(present[xp.asarray(middles)]), sizes, int(sizes.max()))
    counts = xp.diff(xp.concatenate([starts, xp.full(1, n, dtype=starts.dtype)]))
    return Summary(_host(present[starts]), _host(counts).astype(np.int64))


def _host(array: Any) -> np.ndarray:
    return array.get() if array_module(array) is not np else array


def _blocks(total: int) -> tuple[np.ndarray, np.ndarray]:
    """For ``total`` > :data:`SUMMARY_POINTS` sorted rows: the middle rank and the size of each of that many blocks."""
    bounds = np.arange(SUMMARY_POINTS + 1, dtype=np.int64) * total // SUMMARY_POINTS
    return (bounds[:-1] + bounds[1:]) // 2, np.diff(bounds)


def _compress(summary: Summary) -> Summary:
    if len(summary.values) <= SUMMARY_POINTS:
        return summary
    middles, sizes = _blocks(int(summary.counts.sum()))
    at = np.searchsorted(np.cumsum(summary.counts), middles, side="right")
    return Summary(summary.values[at], sizes, summary.error + int(sizes.max()))


def _merged(parts: tuple[Summary, ...]) -> Summary:
    values = np.concatenate([p.values for p in parts])
    distinct, inverse = np.unique(values, return_inverse=True)
    counts = np.bincount(inverse, weights=np.concatenate([p.counts for p in parts]), minlength=len(distinct))
    return Summary(distinct, counts.astype(np.int64), sum(p.error for p in parts))


def _merge_summaries(*parts: Summary) -> Summary:
    return _compress(_merged(parts))


def _estimate(*parts: Summary) -> float | Pivot:
    """The median when no summary was compressed, else the pivot for round two (the root is not compressed)."""
    summary = _merged(parts)
    rows = int(summary.counts.sum())
    if rows == 0:
        return float("nan")
    cumulative = np.cumsum(summary.counts)
    low, high = (summary.values[np.searchsorted(cumulative, rank, side="right")] for rank in _middle(rows))
    if summary.error:
        return Pivot(float(low), summary.error + 1)
    return _midpoint(float(low), float(high))


def _middle(rows: int) -> tuple[int, int]:
    return (rows - 1) // 2, rows // 2


def _midpoint(low: float, high: float) -> float:
    """The mean of two middle values, finite for any two finite floats (``1e308 + 1e308`` overflows)."""
    total = low + high
    return total / 2 if math.isfinite(total) else low / 2 + high / 2


# ----------------------------------------------------------------------------------------- round two


def _window_partition(df: Any, pivots: dict[str, Pivot]) -> dict[str, Window]:
    names = list(pivots)
    rows = _sorted_rows(df, names)
    return {name: _window(rows[k], pivots[name]) for k, name in enumerate(names)}


def _pivots(estimates: dict[str, float | Pivot]) -> dict[str, Pivot]:
    return {name: value for name, value in estimates.items() if isinstance(value, Pivot)}


def _windows_where_needed(df: Any, names: list[str], pivots: dict[str, Pivot]) -> dict[str, Window | None]:
    """:func:`_window_partition` of the columns with a pivot; None for the others (their median is known)."""
    found = _window_partition(df[list(pivots)], pivots) if pivots else {}
    return {name: found.get(name) for name in names}


def _median(estimate: float | Pivot, *windows: Window | None) -> float:
    """The median of a column of :func:`medians`: its estimate, exact unless a pivot, else from the windows."""
    return _exact(*windows) if isinstance(estimate, Pivot) else estimate


def _window(ordered: Any, pivot: Pivot) -> Window:
    """The window of one sorted row of :func:`_sorted_rows` around ``pivot``."""
    xp = array_module(ordered)
    present = _present(ordered)
    n = len(present)
    at = xp.full(1, pivot.value, dtype=present.dtype)
    below, not_above = (int(xp.searchsorted(present, at, side=side)[0]) for side in ("left", "right"))
    lower = _host(present[max(0, below - pivot.width):below]).astype(np.float64)
    upper = _host(present[not_above:not_above + pivot.width]).astype(np.float64)
    return Window(pivot, below, not_above - below, n - not_above, lower, upper)


def _largest(values: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` largest values, ascending."""
    if len(values) > k:
        values = np.partition(values, len(values) - k)[len(values) - k :]
    return np.sort(values)


def _merge_windows(*parts: Window | None) -> Window | None:
    if parts[0] is None:  # a column without a pivot (medians)
        return None
    width = parts[0].pivot.width
    return Window(parts[0].pivot, sum(p.below for p in parts), sum(p.equal for p in parts),
                  sum(p.above for p in parts), _largest(np.concatenate([p.lower for p in parts]), width),
                  -_largest(-np.concatenate([p.upper for p in parts]), width)[::-1])


def _exact(*parts: Window) -> float:
    window = _merge_windows(*parts)
    rows = window.below + window.equal + window.above

    def value(rank: int) -> float:
        if window.below <= rank < window.below + window.equal:
            return window.pivot.value
        side, at = ((window.lower, len(window.lower) - (window.below - rank)) if rank < window.below
                    else (window.upper, rank - window.below - window.equal))
        if not 0 <= at < len(side):
            raise RuntimeError(f"median: rank {rank} of {rows} is outside the window around {window.pivot}")
        return float(side[at])

    low, high = (value(rank) for rank in _middle(rows))
    return _midpoint(low, high)
