"""Operators on numeric columns: FillMissing, MissingIndicator, Clip, LogOp, Normalize, Bucketize, Cast.

Each takes numbers of any numeric dtype (nullable, arrow-backed or plain) and returns float64
(FillMissing, Clip, LogOp), float32 (MissingIndicator, Normalize) or int32 (Bucketize). The usual
chain, with the indicators beside it, is::

    conts = ["I1", "I2"]
    (conts >> FillMissing(strategy="median") >> Clip(min_value=0) >> LogOp() >> Normalize())
    + (conts >> MissingIndicator())

The operators of that chain also compute all their columns at once (``transform_many``: the serving
path, and every cuDF partition): the columns stacked into one float64 matrix ``[column, row]`` (numpy,
or CuPy on the GPU, where one kernel over the matrix replaces several cuDF calls per column), each
column's parameter broadcast down its row, the same arithmetic on every value as ``transform_column``'s.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from pipeline.errors import BadInputError
from pipeline.etl.blocks import ColumnRows
from pipeline.etl.column_schema import CATEGORICAL, CONTINUOUS
from pipeline.etl.frames import array_module, as_float64, cudf_float_rows, float_rows, is_cudf
from pipeline.etl.ops.base import Operator
from pipeline.etl.ops.median import Pivot, in_one_graph, medians, reduce_tree, summaries, windows


def _moments(df: Any, names: list[str], chain: Sequence[Operator] = ()) -> np.ndarray:
    """``[4, column]`` float64 on the host: of the values present that stay present through ``chain`` (the
    element-wise operators between a fill and Normalize, none when they are the input), the count, mean and sum of
    squared deviations from the mean after ``chain``; then the count of missing values (those a fill before
    ``chain`` takes).

    The deviations are summed about the partition's first value and then its mean (two passes over memory): a
    sum of squares less the squared sum cancels, and gave a column of one value a std of 1e-8, by which a
    different value served later was divided. Here such a column's deviations are all exactly 0."""
    rows = float_rows(df, names)
    xp = array_module(rows)
    missing = xp.isnan(rows)
    for op in chain:
        rows = op.transform_rows(names, rows)
    present = ~xp.isnan(rows) & ~missing
    count = present.sum(axis=1).astype(xp.float64)
    if not rows.shape[1]:
        return np.zeros((4, len(names)))
    first = xp.where(count > 0, xp.take_along_axis(rows, _first_true(present)[:, None], axis=1)[:, 0], 0.0)
    shifted = xp.where(present, rows - first[:, None], 0.0)
    offset = shifted.sum(axis=1) / xp.maximum(count, 1.0)
    deviations = xp.where(present, shifted - offset[:, None], 0.0)
    moments = xp.stack([count, first + offset, (deviations * deviations).sum(axis=1),
                        missing.sum(axis=1).astype(xp.float64)])
    return moments.get() if xp is not np else moments


def _first_true(mask: Any) -> Any:
    """The column of each row's first True of a boolean matrix (0 where none), looked for in the first 1,024 columns
    before all of them: an argmax over a whole matrix of booleans takes a GPU about as long as the moments' sums."""
    head = mask[:, :1024]
    if head.shape[1] == mask.shape[1] or bool(head.any(axis=1).all()):
        return head.argmax(axis=1)
    return mask.argmax(axis=1)


def _merge(*parts: np.ndarray) -> np.ndarray:
    """The moments of the union of ``parts``' values (Chan, Golub and LeVeque's pairwise update)."""
    count, mean, squares, missing = parts[0]
    for n, m, q, x in parts[1:]:
        total = count + n
        share = np.divide(n, total, out=np.zeros_like(n), where=total > 0)
        delta = m - mean
        count, mean, squares, missing = total, mean + delta * share, squares + q + delta * delta * count * share, \
            missing + x
    return np.stack([count, mean, squares, missing])


def _moments_by_name(names: list[str], *parts: np.ndarray) -> dict[str, tuple[float, ...]]:
    total = _merge(*parts)
    return {name: tuple(float(v) for v in total[:, k]) for k, name in enumerate(names)}


class _Matrix(Operator):
    """A column-by-column numeric operator that also computes many columns as one matrix (numpy, or CuPy
    for cuDF columns)."""

    takes_rows = True

    def transform_many(self, columns: Mapping[str, Any]) -> Mapping[str, Any]:
        """All the columns as one matrix, the rows of a :class:`~pipeline.etl.blocks.ColumnRows` in and out (whose
        matrix is taken as it is: no copy per column)."""
        if not columns:
            return {}
        names = list(columns)
        if isinstance(columns, ColumnRows):
            rows = columns.matrix
            rows = rows if rows.dtype == np.float64 else rows.astype(np.float64)
        elif is_cudf(first := next(iter(columns.values()))) or array_module(first) is not np:  # cuDF, or CuPy rows
            rows = cudf_float_rows(list(columns.values()))
        else:
            rows = np.array([as_float64(values, name) for name, values in columns.items()])  # np.stack, in one call
        return ColumnRows(self.output_columns(names), self.transform_rows(names, rows))

    def transform_rows(self, names: list[str], rows: Any) -> Any:
        """The columns ``names``, one float64 row each of a numpy or CuPy matrix (NaN: missing), transformed
        together: one row out per row in, of the same array library."""
        raise NotImplementedError

    def _per_row(self, parameter: Callable[[str], float], names: list[str], rows: Any) -> Any:
        """``parameter`` of each column, shaped to broadcast down the rows of the ``[column, row]`` matrix ``rows``
        (and of its array library); kept per columns and parameter until the fitted state changes (a request's
        columns come in one order)."""
        kept = self.__dict__.setdefault("_parameters", {})
        key = (parameter.__name__, tuple(names))
        values = kept.get(key)
        if values is None:
            values = kept[key] = np.array([parameter(name) for name in names], dtype=np.float64).reshape(-1, 1)
        return values if isinstance(rows, np.ndarray) else array_module(rows).asarray(values)

    def _fitted_state_changed(self) -> None:
        self.__dict__.pop("_parameters", None)


class FillMissing(_Matrix):
    """Replace missing values by a constant (``fill_value``, default 0) or by each column's median.

    ``strategy="median"`` fills with the exact median of the fitted rows (the mean of the two middle
    values for an even count; ``fill_value`` for a column without values), computed in bounded
    memory (:mod:`pipeline.etl.ops.median`: one pass, a second over the columns with more distinct
    values than a summary keeps). Output is float64.

    Example: ``["I1"] >> FillMissing()`` or ``["I1"] >> FillMissing(strategy="median")``.
    """

    output_tags = frozenset({CONTINUOUS})
    output_dtype = "float64"

    def __init__(self, fill_value: float = 0.0, strategy: str = "constant"):
        if strategy not in ("constant", "median"):
            raise ValueError(f"FillMissing: strategy must be constant or median, got {strategy!r}")
        self.fill_value = float(fill_value)
        self.strategy = strategy
        self.fill_values: dict[str, float] = {}
        self._pivots: dict[str, Pivot] = {}

    @property
    def stateful(self) -> bool:  # type: ignore[override]
        return self.strategy == "median"

    def start_fit(self) -> None:
        super().start_fit()
        self.fill_values, self._pivots = {}, {}
        self._fitted_state_changed()

    def fit(self, ddf: Any) -> Any:
        if self._pivots:
            return windows(ddf, self._pivots)
        return medians(ddf) if in_one_graph(ddf) else summaries(ddf)

    def fit_finalize(self, stats: Any) -> None:
        self._pivots = {name: v for name, v in stats.items() if isinstance(v, Pivot)}
        for name, median in stats.items():
            if not isinstance(median, Pivot):
                self.fill_values[name] = float(median) if np.isfinite(median) else self.fill_value
        self._fitted_state_changed()
        self._fitted = not self._pivots

    def transform_column(self, name: str, values: Any) -> Any:
        if self.strategy == "median":
            self._require_fitted()
        return _fillna(as_float64(values, name), self.fill_values.get(name, self.fill_value))

    def transform_rows(self, names: list[str], rows: Any) -> Any:
        if self.strategy == "median":
            self._require_fitted()
        return _fillna(rows, self._per_row(self.fill_of, names, rows))

    def fill_of(self, name: str) -> float:
        """What fills the missing values of ``name``."""
        return self.fill_values.get(name, self.fill_value)

    def get_params(self) -> dict:
        return {"fill_value": self.fill_value, "strategy": self.strategy}

    def get_state(self) -> dict:
        return {"fill_values": self.fill_values}

    def set_state(self, state: dict, directory) -> None:
        self.fill_values = dict(state["fill_values"])
        self._fitted_state_changed()
        self._fitted = True


class MissingIndicator(_Matrix):
    """``<name>_missing``: 1.0 where a value is missing (null or NaN), else 0.0, as a float32 continuous feature.

    Beside :class:`FillMissing`, it keeps what filling hides: that the value was not there.

    Example: ``(["I1"] >> FillMissing(strategy="median")) + (["I1"] >> MissingIndicator())``
    gives ``I1`` and ``I1_missing``.
    """

    output_tags = frozenset({CONTINUOUS})
    output_dtype = "float32"
    suffix = "_missing"

    def output_columns(self, columns: list[str]) -> list[str]:
        return [name + self.suffix for name in columns]

    def transform_column(self, name: str, values: Any) -> Any:
        v = as_float64(values, name)
        return v.isna().astype("float32") if is_cudf(v) else np.isnan(v).astype(np.float32)

    def transform_rows(self, names: list[str], rows: Any) -> Any:
        return array_module(rows).isnan(rows).astype(np.float32)


class Clip(_Matrix):
    """Limit values to ``[min_value, max_value]`` (either may be None); missing values stay missing."""

    elementwise = True
    output_tags = frozenset({CONTINUOUS})
    output_dtype = "float64"

    def __init__(self, min_value: float | None = None, max_value: float | None = None):
        if min_value is None and max_value is None:
            raise ValueError("Clip: give min_value, max_value or both")
        self.min_value = None if min_value is None else _plain_number(min_value, "Clip: min_value")
        self.max_value = None if max_value is None else _plain_number(max_value, "Clip: max_value")
        if self.min_value is not None and self.max_value is not None and self.min_value > self.max_value:
            raise ValueError(f"Clip: min_value {self.min_value} is above max_value {self.max_value}")

    def transform_column(self, name: str, values: Any) -> Any:
        return as_float64(values, name).clip(self.min_value, self.max_value)

    def transform_rows(self, names: list[str], rows: Any) -> Any:
        return array_module(rows).clip(rows, self.min_value, self.max_value)

    def get_params(self) -> dict:
        return {"min_value": self.min_value, "max_value": self.max_value}


class LogOp(_Matrix):
    """``log1p(x)``: tames heavy-tailed counts (below -1 it is NaN: Clip to ``min_value=0`` first). ``signed``:
    ``sign(x) * log1p(|x|)``, the same for values from 0 on, and for negative ones their mirror, so a column of
    both signs (a balance, a temperature, a change) keeps its order and its sign."""

    elementwise = True
    output_tags = frozenset({CONTINUOUS})
    output_dtype = "float64"

    def __init__(self, signed: bool = False) -> None:
        self.signed = signed

    def of(self, xp: Any, values: Any) -> Any:
        """The log of ``values`` through the array module ``xp`` (numpy, CuPy, torch: the same three functions)."""
        return xp.sign(values) * xp.log1p(xp.abs(values)) if self.signed else xp.log1p(values)

    def transform_column(self, name: str, values: Any) -> Any:
        v = as_float64(values, name)
        return _log1p_cudf(v, self) if is_cudf(v) else self.of(np, v)

    def transform_rows(self, names: list[str], rows: Any) -> Any:
        return self.of(array_module(rows), rows)

    def get_params(self) -> dict:
        return {"signed": self.signed}


class Normalize(_Matrix):
    """``(x - mean) / std`` with mean and (sample, ddof=1) std from fit; output float32.

    A column constant in training (std 0 or undefined) becomes 0 whatever its value: the model learned nothing
    from it, and a value served later, unscaled, would reach it as far outside everything it trained on (a column
    missing in every training row, filled with one value, then served at 1e6). Missing values stay NaN, so put
    FillMissing first when the output must have none.
    """

    stateful = True
    output_tags = frozenset({CONTINUOUS})
    output_dtype = "float32"

    def __init__(self) -> None:
        self.means: dict[str, float] = {}
        self.stds: dict[str, float] = {}

    def fit(self, ddf: Any) -> Any:
        # Count, mean and squared deviations in float64, all columns of a partition as one matrix in one task
        # (three Dask reductions would pass over it three times), merged by a tree.
        from dask import delayed

        names = list(ddf.columns)
        parts = [delayed(_moments, pure=True)(part, names) for part in ddf.to_delayed()]
        return reduce_tree(parts, _merge, functools.partial(_moments_by_name, names))

    def fit_before_fill(self, ddf: Any, chain: list[Operator]) -> Any:
        """Lazy statistics of ``ddf``'s columns as a fill and then ``chain`` would turn them into this operator's
        input, before the fill's values are known: :meth:`fit_finalize_after_fill` adds them."""
        from dask import delayed

        names = list(ddf.columns)
        parts = [delayed(_moments, pure=True)(part, names, chain) for part in ddf.to_delayed()]
        return reduce_tree(parts, _merge, functools.partial(_moments_by_name, names))

    def fit_finalize_after_fill(self, stats: dict[str, tuple[float, ...]], filled: dict[str, float]) -> None:
        """Finish :meth:`fit_before_fill`'s ``stats`` with ``filled``, what each column's missing values became:
        each missing value adds it, as it is counted when the values are filled first (unless it is NaN)."""
        moments = {}
        for name, (n, mean, squares, missing) in stats.items():
            value = filled[name]
            moments[name] = (n, mean, squares) if np.isnan(value) or not missing else tuple(
                _merge(np.array([n, mean, squares, 0.0]), np.array([missing, value, 0.0, 0.0]))[:3])
        self.fit_finalize(moments)

    def fit_finalize(self, stats: Any) -> None:
        self.means, self.stds = {}, {}
        for name, (n, mean, squares, *_) in stats.items():  # the count of missing values, where given, is not needed
            if n and not (np.isfinite(mean) and np.isfinite(squares)):
                raise BadInputError(f"column {name!r}: Normalize found infinite values (or values too large for a "
                                    "float64 variance), which leave no mean or spread: Clip the column first (LogOp "
                                    "of -1 is -inf: Clip(min_value=0) or LogOp(signed=True) before it)")
            self.means[name] = float(mean) if n else float("nan")
            var = squares / (n - 1) if n > 1 else float("nan")
            self.stds[name] = float(np.sqrt(max(var, 0.0))) if np.isfinite(var) else float("nan")
        self._fitted_state_changed()
        self._fitted = True

    def transform_column(self, name: str, values: Any) -> Any:
        self._require_fitted()
        return ((as_float64(values, name) - self.center(name)) / self.divisor(name)).astype("float32")

    def transform_rows(self, names: list[str], rows: Any) -> Any:
        self._require_fitted()
        means = self._per_row(self.center, names, rows)
        return ((rows - means) / self._per_row(self.divisor, names, rows)).astype(np.float32)

    def center(self, name: str) -> float:
        """What is taken from ``name``'s values: its mean, or 0 for a column with no value in training (its
        divisor is infinite: every value becomes 0)."""
        mean = self.means[name]
        return mean if np.isfinite(mean) else 0.0

    def divisor(self, name: str) -> float:
        """The divisor of ``name``: its std, or infinity for a column constant in training (any finite value
        becomes 0)."""
        std = self.stds[name]
        return std if np.isfinite(std) and std > 0 else float("inf")

    def get_state(self) -> dict:
        return {"means": self.means, "stds": self.stds}

    def set_state(self, state: dict, directory) -> None:
        self.means = dict(state["means"])
        self.stds = dict(state["stds"])
        self._fitted_state_changed()
        self._fitted = True


class Bucketize(Operator):
    """Bucket index of each value for sorted ``boundaries``: ``i`` such that ``b[i-1] <= x < b[i]``.

    Output int32 in ``0..len(boundaries)`` (numpy's ``digitize``). Missing values land in the last
    bucket; put FillMissing first to choose otherwise.

    Example: ``["age"] >> Bucketize([18, 30, 50])`` maps 17 -> 0, 18 -> 1, 64 -> 3.
    """

    output_tags = frozenset({CATEGORICAL})
    output_dtype = "int32"

    def __init__(self, boundaries: list[float]):
        self.boundaries = [float(b) for b in boundaries]
        if not self.boundaries or sorted(self.boundaries) != self.boundaries:
            raise ValueError(f"Bucketize: boundaries must be a non-empty increasing list, got {boundaries}")

    def column_properties(self, name: str) -> dict:
        return {"cardinality": len(self.boundaries) + 1}

    def transform_column(self, name: str, values: Any) -> Any:
        v = as_float64(values, name)
        buckets = _digitize_cudf(v, self.boundaries) if is_cudf(v) else np.digitize(v, self.boundaries)
        return buckets.astype("int32")

    def get_params(self) -> dict:
        return {"boundaries": self.boundaries}


class Cast(Operator):
    """Convert to a numeric dtype (e.g. the label to float32); missing values become NaN. To an integer dtype, a
    column must hold no missing value (FillMissing first) and no value outside the dtype's range, and fractions are
    cut toward 0."""

    def __init__(self, dtype: Any):
        kind = np.dtype(dtype)
        if kind.kind not in "biuf":
            raise ValueError(f"Cast: expected a numeric dtype (bool, int*, uint*, float*), got {kind}")
        self.dtype = kind.name

    @property
    def output_dtype(self) -> str:  # type: ignore[override]
        return self.dtype

    def transform_column(self, name: str, values: Any) -> Any:
        values = as_float64(values, name)
        kind = np.dtype(self.dtype)
        if kind.kind in "iu":
            _check_integral_range(name, values, kind)
        return values.astype(self.dtype)

    def get_params(self) -> dict:
        return {"dtype": self.dtype}


def _fillna(values: Any, fill: Any) -> Any:
    if is_cudf(values):
        return values.fillna(fill)
    xp = array_module(values)
    return xp.where(xp.isnan(values), fill, values)


def _log1p_cudf(values: Any, op: LogOp) -> Any:
    """``op``'s log of a float cuDF Series through CuPy, nulls kept (cuDF has no log1p method of its own)."""
    import cudf
    import cupy

    out = cudf.Series(op.of(cupy, values.fillna(0).values), index=values.index, name=values.name)
    return out.where(values.notna())


def _digitize_cudf(values: Any, boundaries: list[float]) -> Any:
    """``np.digitize`` on the GPU; a missing value lands in the last bucket, as NaN does on pandas."""
    import cudf
    import cupy

    filled = values.fillna(np.inf).values
    return cudf.Series(cupy.digitize(filled, cupy.asarray(boundaries)), index=values.index, name=values.name)


def _plain_number(value: Any, what: str) -> float:
    """``value`` (a Python or numpy number) as a float; NaN is refused."""
    number = float(value)
    if np.isnan(number):
        raise ValueError(f"{what} is NaN; expected a number")
    return number


def _check_integral_range(name: str, values: Any, kind: np.dtype) -> None:
    """Refuse float ``values`` (numpy or cuDF) that an integer ``kind`` cannot hold: missing ones, and those outside its
    range (a cast would give the dtype's minimum, or wrap)."""
    info = np.iinfo(kind)
    finite = values.notna() & ~values.isin([np.inf, -np.inf]) if is_cudf(values) else np.isfinite(values)
    missing = int(len(values) - int(finite.sum()))
    low, high = (float(values.min()), float(values.max())) if missing < len(values) else (0.0, 0.0)
    if missing or low < info.min or high >= float(info.max) + 1:
        what = f"{missing:,} missing or infinite value(s) (FillMissing first)" if missing else (
            f"values from {low:g} to {high:g}")
        raise BadInputError(f"column {name!r}: Cast to {kind.name} found {what}; {kind.name} holds integers from "
                            f"{info.min} to {info.max}")
