"""Checking raw parquet files against the declared column roles before any work starts."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.errors import BadInputError


def check_raw_files(splits: dict[str, list[Path]], roles: dict) -> None:
    """One BadInputError naming each file whose declared columns are missing or of the wrong type.

    Every file's footer is read (a few KB each), so a column missing from any one file, or a file
    that is not parquet, is found before any work starts.
    """
    expected = {roles["label"]: "label", **{c: "continuous" for c in roles["continuous"]},
                **{c: "categorical" for c in roles["categorical"]}, **{c: "multihot" for c in roles.get("multihot", [])}}
    if not splits.get("train"):
        raise BadInputError("the raw data has no training rows (raw/train is empty): give data.path more rows, or "
                            "leave more of them to training with a smaller data.valid_fraction / data.test_fraction")
    problems = []
    for files in splits.values():
        for path in files:
            try:
                schema = pq.read_schema(path)
            except (OSError, pa.ArrowException) as err:
                problems.append(f"{path} is not a readable parquet file ({(str(err).splitlines() or [''])[0]})")
                continue
            for name, role in expected.items():
                if name not in schema.names:
                    problems.append(f"{path}: column {name!r} ({role}) is missing (found {_short(schema.names)})")
                elif not _type_fits(role, schema.field(name).type):
                    problems.append(f"{path}: column {name!r} should be {_EXPECTED_TYPES[role]}, "
                                    f"found {schema.field(name).type}")
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        root = splits["train"][0].parent.parent
        raise BadInputError(f"the raw files do not match meta.json: {shown}. Fix the files, or remove "
                            f"{root / 'meta.json'} and run `python -m pipeline data` to make them again")


def check_labels(splits: dict[str, list[Path]], label: str) -> None:
    """A BadInputError when a split's rows hold one label only. Training rows: a click model learns nothing
    from them. Validation or test rows: their AUC is undefined, and the validation AUC is what picks the epoch
    kept (early stopping). Reads only the label column."""
    for split in ("train", "valid", "test"):
        rows, seen = _labels(splits.get(split, []), label)
        if len(seen) != 1:
            continue
        value = seen.pop()
        if split == "train":
            raise BadInputError(f"every one of the {rows:,} training rows has the label {value!r}: a click model "
                                "needs rows of both labels (0 and 1); check that data.label names the click column, "
                                "or give data with clicks and non-clicks")
        name = "validation" if split == "valid" else "test"
        use = "the epoch kept is chosen" if split == "valid" else "the model is scored"
        raise BadInputError(f"every one of the {rows:,} {name} rows has the label {value!r}, so their AUC, by which "
                            f"{use}, is undefined: give the {name} split rows of both labels (a larger "
                            f"data.{split}_fraction, or more rows in data.{split}_path)")


def _labels(files: list[Path], label: str) -> tuple[int, set]:
    """The rows of ``files`` and the labels among them, read until two are seen."""
    seen: set = set()
    rows = 0
    for path in files:
        column = pq.read_table(path, columns=[label]).column(label)
        rows += len(column)
        seen.update(pc.unique(column).to_pylist())
        if len(seen) > 1:
            break
    return rows, seen


def _short(names: list[str]) -> str:
    return str(names) if len(names) <= 8 else f"{len(names)} columns: {names[:4]} ... {names[-2:]}"


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
