"""The standard workflow for a raw dataset's column roles.

Categorical and multi-hot columns -> ``Categorify(etl.freq_threshold, etl.max_vocab_size)``, or
``HashBucket(n)`` for columns named in ``etl.hash_buckets`` (multi-hot too); continuous ->
``FillMissing(0) >> Clip(min_value=0) >> LogOp >> Normalize``; the label -> float32.

Example::

    roles = roles_of(raw)            # raw: pipeline.data.raw_folder.RawDataset
    workflow = default_workflow(roles, EtlConfig(freq_threshold=2))
"""

from __future__ import annotations

from typing import Any

from pipeline.errors import BadInputError
from pipeline.etl.config import EtlConfig
from pipeline.etl.graph import Node
from pipeline.etl.ops import Cast, Categorify, Clip, FillMissing, HashBucket, LogOp, Normalize
from pipeline.etl.workflow import Workflow


def roles_of(raw: Any) -> dict:
    """The column roles of a raw dataset (``pipeline.data.raw_folder.RawDataset``) as the ETL uses them."""
    return {"label": raw.label, "continuous": list(raw.continuous), "categorical": list(raw.categorical),
            "multihot": list(raw.multihot)}


def default_workflow(roles: dict, etl: EtlConfig, library: str = "pandas") -> Workflow:
    """The standard workflow for these column roles (see the module docstring).

    ``roles`` is ``{"label": name, "continuous": [...], "categorical": [...], "multihot": [...]}``
    as in ``raw/meta.json``. Output columns come in the order label, continuous, categorical,
    multi-hot, each in the order given.
    """
    sparse = list(roles["categorical"]) + list(roles.get("multihot", []))
    unknown = sorted(set(etl.hash_buckets) - set(sparse))
    if unknown:
        raise BadInputError(f"etl.hash_buckets names {unknown}, which are not categorical columns; those are {sparse}")
    parts: list[Node] = [[roles["label"]] >> Cast("float32")]
    if roles["continuous"]:
        parts.append(list(roles["continuous"]) >> FillMissing(0.0) >> Clip(min_value=0) >> LogOp() >> Normalize())
    for group in _runs(sparse, etl.hash_buckets):
        if group[0] in etl.hash_buckets:
            parts.append(group >> HashBucket(etl.hash_buckets[group[0]]))
        else:
            parts.append(group >> Categorify(freq_threshold=etl.freq_threshold, max_vocab_size=etl.max_vocab_size))
    output = parts[0]
    for part in parts[1:]:
        output = output + part
    return Workflow(output, library=library)


def _runs(columns: list[str], hashed: dict[str, int]) -> list[list[str]]:
    """Consecutive columns with the same treatment, so the output keeps the given order."""
    runs: list[tuple[tuple, list[str]]] = []
    for name in columns:
        key = ("hash", hashed[name]) if name in hashed else ("vocab",)
        if runs and runs[-1][0] == key:
            runs[-1][1].append(name)
        else:
            runs.append((key, [name]))
    return [cols for _, cols in runs]
