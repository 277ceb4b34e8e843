"""Checking raw parquet files against the declared column roles before any work starts."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.errors import BadInputError


def check_raw_files(splits: dict[str, list[Path]], roles: dict) -> None:
    """One BadInputError listing every declared column that is missing or of the wrong type."""
    expected = {roles["label"]: "label", **{c: "continuous" for c in roles["continuous"]},
                **{c: "categorical" for c in roles["categorical"]}, **{c: "multihot" for c in roles.get("multihot", [])}}
    if not splits.get("train"):
        raise BadInputError("no raw training data: expected raw/train/part-*.parquet")
    problems = []
    for files in splits.values():
        for path in files[:1] + files[-1:] if files else []:
            schema = pq.read_schema(path)
            for name, role in expected.items():
                if name not in schema.names:
                    problems.append(f"{path}: column {name!r} ({role}) is missing (found {schema.names})")
                elif not _type_fits(role, schema.field(name).type):
                    problems.append(f"{path}: column {name!r} should be {_EXPECTED_TYPES[role]}, found {schema.field(name).type}")
    if problems:
        unique = list(dict.fromkeys(problems))
        raise BadInputError("the raw files do not match meta.json:\n  " + "\n  ".join(unique[:20]))


_EXPECTED_TYPES = {
    "label": "integer, boolean or float 0/1",
    "continuous": "integer or float",
    "categorical": "string or integer",
    "multihot": "list of strings or integers",
}


def _type_fits(role: str, kind: pa.DataType) -> bool:
    numeric = pa.types.is_integer(kind) or pa.types.is_floating(kind)
    text = pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_dictionary(kind)
    if role == "label":
        return numeric or pa.types.is_boolean(kind)
    if role == "continuous":
        return numeric or pa.types.is_null(kind)
    if role == "categorical":
        return text or pa.types.is_integer(kind) or pa.types.is_null(kind)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        inner = kind.value_type
        return pa.types.is_string(inner) or pa.types.is_large_string(inner) or pa.types.is_integer(inner)
    return False
