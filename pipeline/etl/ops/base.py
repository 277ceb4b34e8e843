"""The operator interface: ``fit`` (lazy Dask statistics) -> ``fit_finalize`` -> ``transform``.

An operator works on the columns its node hands it. Most operators map each column on its own:
they implement ``transform_column`` (one column in: a pandas Series or array, or a cuDF Series;
its values out), which both the Dask path (each partition, through ``transform``) and the
in-memory serving path (``Workflow.transform`` of a pandas frame, column by column) run. The
serving path, and ``transform`` of a cuDF partition, hand such an operator all its columns at once
(``transform_many``: by default each through ``transform_column``); an operator may compute them
together there (one matrix of all its numeric columns, numpy or CuPy, one pass over all its
vocabularies), giving exactly what ``transform_column`` gives each. An operator that needs several
columns at once overrides ``transform`` instead.

Stateful operators return lazy Dask objects from ``fit`` (computed by the workflow together with
every other operator of the same phase), turn the computed values into plain Python / numpy state
in ``fit_finalize``, and save that state as JSON (``get_state``) plus optional parquet files
(``save_artifacts``). Nothing is pickled.

Each operator also says what it outputs: ``output_tags`` (the role it gives a column),
``output_dtype``, and per-column properties from its fitted state (``column_properties``: a
vocabulary's cardinality, the longest list), from which the workflow computes the output schema.

Example, a stateless operator::

    class Negate(Operator):
        output_dtype = "float64"

        def transform_column(self, name, values):
            return -as_float64(values, name)
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

from pipeline.etl.column_schema import ColumnSchema
from pipeline.etl.frames import frame_like, is_cudf
from pipeline.etl.graph import ColumnsLike, Node

REGISTRY: dict[str, type[Operator]] = {}


class Operator:
    """Base class of every ETL operator."""

    stateful: ClassVar[bool] = False
    """True when ``fit`` must run before ``transform``."""
    output_tags: ClassVar[frozenset[str]] = frozenset()
    """Tags this operator gives each output column (see :mod:`pipeline.etl.column_schema`)."""
    output_dtype: ClassVar[str | None] = None
    """dtype of the output columns; ``None``: the input's."""
    elementwise: ClassVar[bool] = False
    """True for a stateless operator whose every output value is a function of the same row's value of the same
    column alone, computed by ``transform_rows`` (Clip, LogOp): a statistic after it can be fitted before a
    FillMissing below it (``Workflow.fit``)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        REGISTRY[cls.__name__] = cls

    def __rrshift__(self, columns: ColumnsLike) -> Node:
        return Node([Node.of(columns)], op=self)

    def output_columns(self, columns: list[str]) -> list[str]:
        """Names of the columns this operator produces from ``columns`` (by default the same; a
        column-by-column operator gives one name per input, in order)."""
        return list(columns)

    def compute_output_schema(self, inputs: list[ColumnSchema]) -> list[ColumnSchema]:
        """The schema of each output column from the input columns' (by default one output per input,
        named by :meth:`output_columns`)."""
        names = self.output_columns([column.name for column in inputs])
        return [
            replace(column, name=name, tags=column.with_tags(self.output_tags),
                    dtype=self.output_dtype or column.dtype, **self.column_properties(column.name))
            for column, name in zip(inputs, names)
        ]

    def column_properties(self, name: str) -> dict:
        """``ColumnSchema`` fields this operator sets on output ``name`` (e.g. ``cardinality``)."""
        return {}

    def start_fit(self) -> None:
        """Forget an earlier fit: ``Workflow.fit`` calls it before the first :meth:`fit`."""
        self._fitted = False

    def fit(self, ddf: Any) -> Any:
        """Lazy statistics over a Dask DataFrame holding exactly the input columns."""
        return None

    def fit_finalize(self, stats: Any) -> None:
        """Keep the computed statistics as plain values; an operator that needs another pass over the
        data leaves itself unfitted, and ``Workflow.fit`` calls :meth:`fit` again in the next phase."""

    @property
    def fitted(self) -> bool:
        return not self.stateful or getattr(self, "_fitted", False)

    def transform(self, df: Any) -> Any:
        """Transform one partition (a pandas or cuDF DataFrame with exactly the input columns).

        By default each column of a pandas partition goes through :meth:`transform_column`, named by
        :meth:`output_columns`; a cuDF partition's columns go through :meth:`transform_many` together,
        which an operator may compute as one array on the GPU (on pandas, stacking a partition's columns
        costs a copy that column by column does not).
        """
        if is_cudf(df):
            return frame_like(df, self.transform_many({name: df[name] for name in df.columns}))
        names = self.output_columns(list(df.columns))
        return frame_like(df, {out: self.transform_column(name, df[name]) for name, out in zip(df.columns, names)})

    def transform_column(self, name: str, values: Any) -> Any:
        """Transform one column: a pandas Series or array, or a cuDF Series; returns its new values."""
        raise NotImplementedError(f"{type(self).__name__} implements neither transform nor transform_column")

    def transform_many(self, columns: dict[str, Any]) -> dict[str, Any]:
        """Transform several columns of the same rows (name -> values): output name -> new values, what
        :meth:`transform_column` gives each, named by :meth:`output_columns`."""
        names = self.output_columns(list(columns))
        return {out: self.transform_column(name, values) for (name, values), out in zip(columns.items(), names)}

    takes_rows = False
    """Whether :meth:`transform_many` takes the rows of a CuPy matrix (a :class:`~pipeline.etl.blocks.ColumnRows` on
    the GPU) as well as cuDF Series; a cuDF partition's blocks become Series before any other operator."""

    @property
    def columnwise(self) -> bool:
        """True when ``transform`` is the column-by-column default, so callers may run ``transform_column``
        (or ``transform_many``)."""
        return type(self).transform is Operator.transform

    def get_params(self) -> dict:
        """Constructor arguments, as JSON values."""
        return {}

    def get_state(self) -> dict:
        """Fitted statistics, as JSON values (large ones go to ``save_artifacts``)."""
        return {}

    def set_state(self, state: dict, directory: Path) -> None:
        """Restore what ``get_state`` / ``save_artifacts`` wrote."""
        self._fitted = True

    def save_artifacts(self, directory: Path) -> None:
        """Write large fitted state (e.g. vocabularies) as files under ``directory``."""

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.get_params().items())
        return f"{type(self).__name__}({params})"

    def _require_fitted(self) -> None:
        if not self.fitted:
            raise RuntimeError(f"{self!r} is not fitted: call Workflow.fit first")
