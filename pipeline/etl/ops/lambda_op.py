"""LambdaOp: any function of one partition, for exploring in a notebook; it cannot be saved."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pipeline.errors import UserError
from pipeline.etl.frames import frame_like
from pipeline.etl.ops.base import Operator


class LambdaOp(Operator):
    """Apply ``fn(series) -> values`` to each column (same name out), in this process only.

    A saved workflow must be loadable without running code from the file, so a workflow holding a
    LambdaOp refuses to save: replace it by a named operator first.

    Example: ``["price"] >> LambdaOp(lambda s: s * 100)``.
    """

    def __init__(self, fn: Callable[[Any], Any], name: str = ""):
        if not callable(fn):
            raise TypeError(f"LambdaOp: expected a function, got {type(fn).__name__}")
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "lambda")

    def transform(self, df: Any) -> Any:
        return frame_like(df, {name: self.fn(df[name]) for name in df.columns})

    def get_params(self) -> dict:
        raise UserError(
            f"LambdaOp({self.name}) runs only in this process and cannot be saved; "
            "replace it with a named operator (FillMissing, Clip, LogOp, ...) to save the workflow"
        )

    def __repr__(self) -> str:
        return f"LambdaOp({self.name})"
