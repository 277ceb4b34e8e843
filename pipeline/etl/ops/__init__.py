"""The ETL operators; compose them with ``columns >> Op()`` and ``+``."""

from pipeline.etl.ops.base import Operator
from pipeline.etl.ops.categorify import Categorify
from pipeline.etl.ops.continuous import Bucketize, Cast, Clip, FillMissing, LogOp, MissingIndicator, Normalize
from pipeline.etl.ops.hashing import HashBucket, HashedCross, HashIds
from pipeline.etl.ops.lambda_op import LambdaOp

__all__ = [
    "Bucketize",
    "Cast",
    "Categorify",
    "Clip",
    "FillMissing",
    "HashBucket",
    "HashIds",
    "HashedCross",
    "LambdaOp",
    "LogOp",
    "MissingIndicator",
    "Normalize",
    "Operator",
]
