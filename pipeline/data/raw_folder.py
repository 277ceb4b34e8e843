"""The raw layout: what the data stage writes and the ETL reads.

::

    <raw>/train/part-00000.parquet ...   label int8 (named "label" whatever the input called it);
    <raw>/valid/part-00000.parquet ...   continuous int64 or float64 (nulls); categorical string
                                         (nulls); multi-hot list<string>
    <raw>/test/part-00000.parquet ...
    <raw>/meta.json                      {"version": 1, "source", "params", "label", "continuous",
                                          "categorical", "multihot", "rows": {"train", "valid", "test"}};
                                          split by time also "time_column" and "time_cuts": {"valid",
                                          "test"} (the first time of each, null when it has none;
                                          "time_cuts" null when both splits have their own files)
    <raw>/oracle.json                    synthetic only: AUC / logloss of the true probabilities per split
    <raw>/ingest_report.json             criteo / table only: rows read, kept, malformed (with examples)

``meta.json`` is written last, so a folder without it is unfinished. Cardinalities are not part of
it: the ETL computes them.

Example::

    raw = RawDataset.load("data/synthetic/raw")
    raw.splits["train"]     # [Path(".../train/part-00000.parquet"), ...]
    raw.oracle["test"]      # {"rows": ..., "positive_rate": ..., "auc": ..., "logloss": ...}
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.errors import BadInputError
from pipeline.files import FileLock, read_json

RAW_VERSION = 1
LABEL = "label"
SPLITS = ("train", "valid", "test")
META = "meta.json"
ORACLE = "oracle.json"
INGEST_REPORT = "ingest_report.json"


def raw_lock(root: str | Path) -> FileLock:
    """The lock on a raw folder (``.<name>.lock`` beside it), taken shared: a stage holds it while it reads the
    folder, and the data stage makes it exclusive while it makes the data (``FileLock.change``). So two processes
    that would make the same data take turns, and no process clears it under a reader; each waits, saying so."""
    root = Path(root)
    return FileLock(root.with_name(f".{root.name}.lock"), busy=f"a second process making {root} at the same time",
                    shared=True, wait=f"[data] {root} is being made by another process: waiting for it to end")


@dataclass
class RawDataset:
    """A finished raw folder: column roles, the parquet parts of each split, and the oracle if any."""

    root: Path
    label: str
    continuous: list[str]
    categorical: list[str]
    multihot: list[str]
    splits: dict[str, list[Path]]
    rows: dict[str, int]
    source: str
    params: dict = field(default_factory=dict)
    oracle: dict | None = None

    @property
    def columns(self) -> list[str]:
        return [self.label, *self.continuous, *self.categorical, *self.multihot]

    @classmethod
    def load(cls, root: str | Path) -> RawDataset:
        root = Path(root)
        meta = read_meta(root)
        if meta is None:
            raise BadInputError(
                f"no finished raw data in {root}: expected {root / META}; run `python -m pipeline data`"
            )
        oracle_path = root / ORACLE
        return cls(
            root=root,
            label=meta["label"],
            continuous=list(meta["continuous"]),
            categorical=list(meta["categorical"]),
            multihot=list(meta["multihot"]),
            splits={s: sorted((root / s).glob("part-*.parquet")) for s in SPLITS},
            rows={s: int(meta["rows"].get(s, 0)) for s in SPLITS},
            source=meta["source"],
            params=meta["params"],
            oracle=read_json(oracle_path, f"remove {root} and make the data again (`python -m pipeline data`)")
            if oracle_path.is_file() else None,
        )


def read_meta(root: Path) -> dict | None:
    """``meta.json`` of a raw folder, or ``None`` when absent or of another format version."""
    path = Path(root) / META
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    return meta if meta.get("version") == RAW_VERSION else None


def damage(root: Path, meta: dict) -> str | None:
    """Why the parts of a finished raw folder do not hold the rows and columns ``meta.json`` records (a
    part removed, added, truncated, not parquet or without a column), or None when every split is whole.
    Reads only the parts' footers."""
    root = Path(root)
    columns = [meta["label"], *meta["continuous"], *meta["categorical"], *meta["multihot"]]
    for split in SPLITS:
        parts = sorted((root / split).glob("part-*.parquet"))
        found = 0
        for part in parts:
            try:
                footer = pq.read_metadata(part)
            except (OSError, pa.ArrowException) as err:
                return f"{part} is not a readable parquet file ({(str(err).splitlines() or [''])[0]})"
            names = footer.schema.to_arrow_schema().names  # top-level columns (a list column's leaf is 'element')
            missing = [c for c in columns if c not in names]
            if missing:
                return f"{part} has no column(s) {missing}"
            found += footer.num_rows
        expected = int(meta["rows"].get(split, 0))
        if found != expected:
            return f"{root / split} holds {found:,} rows in {len(parts)} part(s) where {root / META} says {expected:,}"
    return None


def clear(root: Path) -> None:
    """Remove what an earlier run left in a raw folder (meta first, so it reads as unfinished)."""
    root.mkdir(parents=True, exist_ok=True)
    for name in (META, ORACLE, INGEST_REPORT):
        (root / name).unlink(missing_ok=True)
    clear_splits(root)


def clear_splits(root: Path) -> None:
    """Remove the splits' parts of a raw folder whose making failed: no stage reads an unfinished dataset, and its
    parts would hold the disk they may have filled. What says why it failed (``ingest_report.json``) stays."""
    for split in SPLITS:
        shutil.rmtree(root / split, ignore_errors=True)


class PartWriter:
    """Writes one split's tables as parquet parts of about ``part_rows`` rows each.

    Parts are named ``<prefix>-00000.parquet`` ...; :func:`number_parts` renames them to the final
    ``part-00000.parquet`` ... once every writer of the split is done.
    """

    def __init__(self, folder: Path, part_rows: int, prefix: str = "part") -> None:
        self.folder = folder
        self.part_rows = part_rows
        self.prefix = prefix
        self.rows = 0
        self._parts = 0
        self._writer: pq.ParquetWriter | None = None
        self._rows_in_part = 0
        folder.mkdir(parents=True, exist_ok=True)

    def write(self, table: pa.Table) -> None:
        if table.num_rows == 0:
            return
        if self._writer is None:
            path = self.folder / f"{self.prefix}-{self._parts:05d}.parquet"
            self._writer = pq.ParquetWriter(path, table.schema, write_statistics=False)  # nothing reads min / max
            self._parts += 1
        self._writer.write_table(table, row_group_size=self.part_rows)
        self.rows += table.num_rows
        self._rows_in_part += table.num_rows
        if self._rows_in_part >= self.part_rows:
            self._close_part()

    def close(self) -> None:
        self._close_part()

    def _close_part(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._writer = None
        self._rows_in_part = 0


def number_parts(folder: Path) -> list[Path]:
    """Rename every ``*.parquet`` in ``folder`` (sorted) to ``part-00000.parquet`` ... in that order."""
    current = sorted(folder.glob("*.parquet"))
    staged = [p.rename(p.with_name(f".staged-{i:05d}.parquet")) for i, p in enumerate(current)]
    return [p.rename(p.with_name(f"part-{i:05d}.parquet")) for i, p in enumerate(staged)]
