"""Column roles to propose for a table that was given none: read from the first rows of its first file.

Roles stay the user's to declare (a column's meaning is not in its type); this only fills the example of the
error that asks for them, from what the columns hold::

    role_hint(Path("events.csv"), ",", label="clicked", separator="|")
    # "perhaps, from events.csv: data.categorical=[user_id,item_id,category] data.continuous=[price]
    #  data.time_column=ts"

- a column of text or booleans is categorical, or multi-hot where a fifth of its cells hold ``separator``;
- an integer column is categorical where its name says it is an identifier (``user_id``, ``itemId``, ``zip``),
  else continuous, as a float column is;
- a column of dates or times (typed, or text that ``data.time_column`` reads) orders the splits
  (``data.time_column``); any other one (dates written otherwise, durations, times of day) is left out (it is no
  feature as it is);
- a list column is multi-hot;
- a column that pandas wrote its index to (named ``""`` by ``to_csv``, ``Unnamed: 0`` once read back and written
  again) is dropped (``data.ignore``).

The settings are written to paste into a shell as they are (:func:`list_setting`).

Where ``label`` is not a column of the file, the hint proposes one (:func:`label_column`) and leaves it out of the
features.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from pipeline.data.line_blocks import CODECS
from pipeline.data.text_format import DATE_OR_TIME_PATTERN
from pipeline.data.time_split import time_keys

SAMPLE_ROWS = 2000
IDENTIFIER_NAME = r"(?i:.*(^|[_\-\s.])(id|ids|key|code|zip|zipcode|hash))$|.*[a-z0-9](Id|ID|Key)$"
"""A column name that says its integers are identifiers, not quantities."""


def role_hint(path: Path, delimiter: str | None, label: str, separator: str) -> str:
    """``"perhaps, from FILE: data.categorical=[...] ..."`` for the file at ``path`` (text cut at ``delimiter``, or
    parquet where it is None), or ``""`` when it cannot be read or holds no feature column; never raises (it only
    completes another error's message)."""
    try:
        sample = _sample(path, delimiter)
    except (OSError, pa.ArrowException, ValueError):
        return ""
    found_label = label if label in sample.column_names else label_column(sample)
    roles = propose_roles(sample, found_label, separator)
    settings = [list_setting(f"data.{role}", names) for role, names in roles.items()
                if names and role not in ("time_column", "ignore")]
    if not settings:
        return ""
    if roles["time_column"]:
        settings.append(_shell_word(f"data.time_column={roles['time_column']}"))
    if roles["ignore"]:
        settings.append(list_setting("data.ignore", roles["ignore"]))
    if found_label != label:
        settings.insert(0, _shell_word(f"data.label={found_label}") if found_label else
                        f"data.label=<its 0/1 column> (it has none named {label!r})")
    return f"perhaps, from {path.name}: {' '.join(settings)}"


_PLAIN_NAME = r"[A-Za-z0-9_][A-Za-z0-9_.\-/]*"
"""A column name that a list setting holds as it is; any other is quoted (YAML reads ``a: b``, ``#x``, ``a,b``,
``x[0]`` and an empty name otherwise)."""
INDEX_NAME = r"|Unnamed: \d+"
"""The name of a column pandas wrote its index to: ``""`` (``to_csv``), ``Unnamed: 0`` (that file read back)."""


def list_setting(setting: str, names: list[str]) -> str:
    """``setting=[a,b]`` as it pastes into a shell: a name a YAML list would read otherwise in double quotes, and the
    whole quoted for the shell where it holds more than plain names."""
    items = ",".join(n if re.fullmatch(_PLAIN_NAME, n) else json.dumps(n, ensure_ascii=False) for n in names)
    return _shell_word(f"{setting}=[{items}]")


def _shell_word(text: str) -> str:
    return text if re.fullmatch(r"[A-Za-z0-9_.,=\[\]\-/]*", text) else shlex.quote(text)


LABEL_NAME = r"(?i)(label|target|y|clicks?|clicked|is_?click(ed)?|converted|conversion|purchased?|outcome)"
"""A name that says a column of 0 and 1 is the label."""


def label_column(sample: pa.Table) -> str:
    """The column of ``sample`` to propose as the label: of those holding only 0 and 1 (integers or booleans), the
    one whose name says so, else the only one; ``""`` when there is none to propose."""
    binary = []
    for name, column in zip(sample.column_names, sample.columns):
        if pa.types.is_boolean(column.type) or pa.types.is_integer(column.type):
            values = set(column.drop_null().to_pylist())
            if values and values <= {0, 1}:
                binary.append(name)
    named = [n for n in binary if re.fullmatch(LABEL_NAME, n)]
    return named[0] if named else binary[0] if len(binary) == 1 else ""


def propose_roles(sample: pa.Table, label: str, separator: str) -> dict:
    """``{"categorical": [...], "continuous": [...], "multihot": [...], "time_column": name or "", "ignore": [...]}``
    for the columns of ``sample`` other than ``label`` (the rules in the module's docstring)."""
    roles: dict = {"categorical": [], "continuous": [], "multihot": [], "time_column": "", "ignore": []}
    for name, column in zip(sample.column_names, sample.columns):
        if name == label or name.startswith("__index_level_"):
            continue
        if re.fullmatch(INDEX_NAME, name):
            roles["ignore"].append(name)
            continue
        kind = _kind(name, column, separator)
        if kind == "time_column":
            roles["time_column"] = roles["time_column"] or name
        elif kind:
            roles[kind].append(name)
    return roles


def _kind(name: str, column: pa.ChunkedArray, separator: str) -> str:
    t = column.type.value_type if pa.types.is_dictionary(column.type) else column.type
    if pa.types.is_timestamp(t) or pa.types.is_date(t):
        return "time_column"
    if pa.types.is_temporal(t):
        return ""  # durations and times of day: no feature as they are
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return "multihot"
    if pa.types.is_boolean(t):
        return "categorical"
    if pa.types.is_integer(t):
        return "categorical" if re.fullmatch(IDENTIFIER_NAME, name) else "continuous"
    if pa.types.is_floating(t) or pa.types.is_decimal(t):
        return "continuous"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        values = [v for v in column.drop_null().to_pylist()[:SAMPLE_ROWS] if v != ""]
        if values and all(re.fullmatch(DATE_OR_TIME_PATTERN, v.strip()) for v in values[:100]):
            return "time_column" if time_keys(pa.array(values[:100]))[1].all() else ""
        if values and sum(separator in v for v in values) * 5 >= len(values):
            return "multihot"
        return "categorical"
    return ""


def _sample(path: Path, delimiter: str | None) -> pa.Table:
    """The first rows of a parquet file (``delimiter`` None) or a text one (compressed as its suffix says), types as
    Arrow infers them."""
    if delimiter is None:
        batches = pq.ParquetFile(path).iter_batches(batch_size=SAMPLE_ROWS)
        return pa.Table.from_batches([next(batches)])
    codec = CODECS.get(path.suffix.lower())
    with pa.input_stream(str(path), compression=codec) as stream:
        reader = pacsv.open_csv(stream, parse_options=pacsv.ParseOptions(delimiter=delimiter),
                                read_options=pacsv.ReadOptions(block_size=1 << 20))
        return pa.Table.from_batches([reader.read_next_batch()])
