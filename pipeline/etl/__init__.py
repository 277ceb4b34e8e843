"""The ETL: NVTabular-style operators composed into a Workflow, fitted and applied with Dask.

Example::

    from pipeline.etl import Workflow, Categorify, FillMissing, Clip, LogOp, Normalize, Cast

    features = (
        (["label"] >> Cast("float32"))
        + (["I1", "I2"] >> FillMissing() >> Clip(min_value=0) >> LogOp() >> Normalize())
        + (["C1", "C2"] >> Categorify(freq_threshold=2))
    )
    workflow = Workflow(features).fit("data/synthetic/raw/train")
    workflow.save("my-workflow")
    Workflow.load("my-workflow").transform(pandas_rows)   # serving: pandas in, pandas out

The stage (``python -m pipeline run etl``) is :mod:`pipeline.stages.etl`.
"""

from pipeline.etl import ops
from pipeline.etl.graph import Node  # noqa: F401  (exported: __all__ below)
from pipeline.etl.ops import *  # the operators, listed once in ops.__all__
from pipeline.etl.workflow import Workflow, WorkflowVersionError  # noqa: F401  (exported: __all__ below)

__all__ = sorted([*ops.__all__, "Node", "Workflow", "WorkflowVersionError"])  # noqa: PLE0605  (ops.__all__ listed once)
