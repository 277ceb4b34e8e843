"""The standard workflow for a raw dataset's column roles.

Categorical and multi-hot columns -> ``Categorify(etl.freq_threshold, etl.max_vocab_size)``, or
``HashBucket(n)`` for columns named in ``etl.hash_buckets``, or ``HashIds(capacity)`` (raw 64-bit ids
for dynamic tables) for those named in ``etl.hash_ids`` (multi-hot too); continuous ->
``FillMissing(strategy="median") >> LogOp(signed=True) >> Normalize``, and with
``etl.missing_indicator`` a ``<name>_missing`` column beside each (``MissingIndicator``); the
label -> float32.

A missing value is filled with the column's median, not 0: a column whose values sit far from 0
(timestamps, prices, ages) would otherwise turn every missing value into an extreme input after
Normalize, and a model's prediction for such a row saturates. The indicator keeps what the median
hides, that the value was missing, which in click logs is often a signal of its own; it is a 0/1
continuous feature (the dense layers see it next to the filled value, so a model can learn a
missing value's own effect), not a categorical one (an embedding table per column for two values).

The log is signed (``sign(x) * log1p(|x|)``): it tames heavy tails as NVTabular's Criteo workflow
(``Clip(min_value=0) >> LogOp``) does for counts, and keeps what that clip flattens, a column's negative
values (a balance, a temperature, a change), which it made one value, 0.

Example::

    roles = roles_of(raw)            # raw: pipeline.data.raw_folder.RawDataset
    workflow = default_workflow(roles, EtlConfig(freq_threshold=2))
"""

from __future__ import annotations

from typing import Any

from pipeline.errors import BadInputError
from pipeline.etl.config import EtlConfig
from pipeline.etl.graph import Node
from pipeline.etl.ops import (
    Cast,
    Categorify,
    FillMissing,
    HashBucket,
    HashIds,
    LogOp,
    MissingIndicator,
    Normalize,
)
from pipeline.etl.workflow import Workflow


def roles_of(raw: Any) -> dict:
    """The column roles of a raw dataset (``pipeline.data.raw_folder.RawDataset``) as the ETL uses them."""
    return {"label": raw.label, "continuous": list(raw.continuous), "categorical": list(raw.categorical),
            "multihot": list(raw.multihot)}


def default_workflow(roles: dict, etl: EtlConfig, library: str = "pandas") -> Workflow:
    """The standard workflow for these column roles (see the module docstring).

    ``roles`` is ``{"label": name, "continuous": [...], "categorical": [...], "multihot": [...]}``
    as in ``raw/meta.json``. Output columns come in the order label, continuous, categorical,
    multi-hot, each in the order given; the missing indicators follow the continuous columns.
    """
    sparse = list(roles["categorical"]) + list(roles.get("multihot", []))
    for setting, named in (("etl.hash_buckets", etl.hash_buckets), ("etl.hash_ids", etl.hash_ids)):
        unknown = sorted(set(named) - set(sparse))
        if unknown:
            raise BadInputError(f"{setting} names {unknown}, which are not categorical columns; those are {sparse}")
    parts: list[Node] = [[roles["label"]] >> Cast("float32")]
    continuous = list(roles["continuous"])
    if continuous:
        parts.append(continuous >> FillMissing(strategy="median") >> LogOp(signed=True) >> Normalize())
    if continuous and etl.missing_indicator:
        indicators = MissingIndicator().output_columns(continuous)
        taken = sorted(set(indicators) & {roles["label"], *continuous, *sparse})
        if taken:
            raise BadInputError(f"etl.missing_indicator adds the column(s) {taken}, which the data already has: "
                                "rename them in the input, or set etl.missing_indicator=false")
        parts.append(continuous >> MissingIndicator())
    for group in _runs(sparse, etl.hash_buckets, etl.hash_ids):
        if group[0] in etl.hash_buckets:
            parts.append(group >> HashBucket(etl.hash_buckets[group[0]]))
        elif group[0] in etl.hash_ids:
            parts.append(group >> HashIds(etl.hash_ids[group[0]]))
        else:
            parts.append(group >> Categorify(freq_threshold=etl.freq_threshold, max_vocab_size=etl.max_vocab_size))
    output = parts[0]
    for part in parts[1:]:
        output = output + part
    return Workflow(output, library=library)


def _runs(columns: list[str], hashed: dict[str, int], ids: dict[str, int]) -> list[list[str]]:
    """Consecutive columns with the same treatment, so the output keeps the given order."""
    runs: list[tuple[tuple, list[str]]] = []
    for name in columns:
        key = ("hash", hashed[name]) if name in hashed else ("ids", ids[name]) if name in ids else ("vocab",)
        if runs and runs[-1][0] == key:
            runs[-1][1].append(name)
        else:
            runs.append((key, [name]))
    return [cols for _, cols in runs]
