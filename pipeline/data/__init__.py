"""The data stage: the synthetic Criteo-like generator and the Criteo / table readers.

Everything after this stage reads the raw layout (:mod:`pipeline.data.raw_folder`); the data stage's
runner (:func:`pipeline.stages.data.ensure_raw`) makes the data once and reuses it while the
settings stay the same. Names are imported on first use, so ``pipeline.stages.config`` (which
imports ``pipeline.data.config``) stays light.

Example::

    raw = RawDataset.load("data/synthetic/raw")
    raw.splits["train"], raw.continuous, raw.categorical, raw.oracle["test"]["auc"]
"""

import importlib

_EXPORTS = {
    "RawDataset": "pipeline.data.raw_folder",
    "ClickModel": "pipeline.data.synthetic",
    "generate_block": "pipeline.data.synthetic",
    "iter_split": "pipeline.data.synthetic",
    "ClickMetrics": "pipeline.data.metrics",
    "roc_auc": "pipeline.data.metrics",
    "log_loss": "pipeline.data.metrics",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pipeline.data' has no attribute {name!r}")
