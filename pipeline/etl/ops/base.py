"""The operator interface: ``fit`` (lazy Dask statistics) -> ``fit_finalize`` -> ``transform``.

An operator works on the columns its node hands it. Stateless operators only implement
``transform``; stateful ones return lazy Dask objects from ``fit`` (computed by the workflow together
with every other operator of the same phase), turn the computed values into plain Python / numpy
state in ``fit_finalize``, and save that state as JSON (``get_state``) plus optional parquet files
(``save_artifacts``). Nothing is pickled.

Example, a stateless operator::

    class Negate(Operator):
        def transform(self, df):
            return -df
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from pipeline.etl.graph import ColumnsLike, Node

REGISTRY: dict[str, type[Operator]] = {}


class Operator:
    """Base class of every ETL operator."""

    stateful: ClassVar[bool] = False
    """True when ``fit`` must run before ``transform``."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        REGISTRY[cls.__name__] = cls

    def __rrshift__(self, columns: ColumnsLike) -> Node:
        return Node([Node.of(columns)], op=self)

    def output_columns(self, columns: list[str]) -> list[str]:
        """Names of the columns this operator produces from ``columns`` (by default the same)."""
        return list(columns)

    def fit(self, ddf: Any) -> Any:
        """Lazy statistics over a Dask DataFrame holding exactly the input columns."""
        return None

    def fit_finalize(self, stats: Any) -> None:
        """Keep the computed statistics as plain values."""

    @property
    def fitted(self) -> bool:
        return not self.stateful or getattr(self, "_fitted", False)

    def transform(self, df: Any) -> Any:
        """Transform one partition (a pandas or cuDF DataFrame with exactly the input columns)."""
        raise NotImplementedError

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
