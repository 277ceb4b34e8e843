"""A dataset's input files: what ``data.path``, ``data.valid_path`` and ``data.test_path`` name (a file, a folder or
a glob), and each file's format by its suffix.

Example::

    for path, split in input_files(data_config):
        fmt = table_format(path)  # "parquet", ".csv", ".tsv", ...
"""

from __future__ import annotations

import glob
from pathlib import Path

from pipeline.data.config import DataConfig
from pipeline.data.line_blocks import CODECS
from pipeline.errors import BadInputError

TEXT_SUFFIXES = {".csv": ",", ".tsv": "\t", ".tab": "\t", ".txt": "\t"}
"""The text suffixes read, and the delimiter of each."""
PARQUET_SUFFIXES = {".parquet", ".pq"}


def input_files(d: DataConfig) -> list[tuple[Path, str | None]]:
    """Every input file with the split it is pinned to (``None``: split by the fractions). A file that
    ``data.valid_path`` or ``data.test_path`` names is not read for ``data.path`` too, where its folder or glob holds
    it (its rows would train the model they test)."""
    pinned = [(p, split) for setting, split in (("valid_path", "valid"), ("test_path", "test"))
              for p in (_expand(getattr(d, setting), f"data.{setting}") if getattr(d, setting) else [])]
    both = sorted({str(p) for p, split in pinned if split == "valid"} & {str(p) for p, split in pinned if split == "test"})
    if both:
        raise BadInputError(f"data.valid_path and data.test_path both name {both}: the rows that choose the model "
                            "would be the rows that test it; give each split files of its own")
    taken = {p.resolve() for p, _ in pinned}
    files = [(p, None) for p in _expand(d.path, "data.path") if p.resolve() not in taken] if d.path else []
    if d.path and not files:
        raise BadInputError(f"data.path={d.path} names only files that data.valid_path / data.test_path pin to their "
                            "split: give data.path the training rows")
    return files + pinned


def _expand(pattern: str, setting: str) -> list[Path]:
    path = Path(pattern).expanduser()
    if path.is_dir():
        for log, what in (("_delta_log", "a Delta Lake table"), ("metadata", "an Iceberg table")):
            if (path / log).is_dir() and (log == "_delta_log" or any((path / log).glob("*.metadata.json"))):
                raise BadInputError(f"{setting}: folder {path} is {what} ({log}/): its parquet files include ones that "
                                    "later versions replaced; write one version of it out as parquet and name that")
        files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith((".", "_")))
        if not files:
            inside = sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))
            suffix = next((f.suffix for f in sorted(inside[0].iterdir()) if f.is_file() and f.suffix), ".parquet") \
                if inside else ""
            names = ", ".join(p.name for p in inside[:3]) + (", ..." if len(inside) > 3 else "")
            hint = (f"; its subfolders ({names}) are not read: name their files with a glob, e.g. "
                    f"{setting}='{path}/*/*{suffix}'" if inside else "")
            raise BadInputError(f"{setting}: folder {path} has no files{hint}")
        return files
    if not path.exists() and any(ch in pattern for ch in "*?["):
        files = sorted(Path(p) for p in glob.glob(str(path)) if Path(p).is_file())
        if not files:
            raise BadInputError(f"{setting}: no file matches {pattern}")
        return files
    if not path.exists():
        raise BadInputError(f"{setting}: {path} does not exist (expected a file, a folder or a glob)")
    return [path]


def table_format(path: Path) -> str:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in CODECS:
        suffixes = suffixes[:-1]
    last = suffixes[-1] if suffixes else ""
    if last in PARQUET_SUFFIXES:
        return "parquet"
    if last in TEXT_SUFFIXES:
        return last
    raise BadInputError(f"{path}: expected a .csv, .tsv, .tab, .txt or .parquet file (optionally .gz), "
                        f"found suffix {''.join(path.suffixes) or '(none)'}; where it lies among the data files, name "
                        f"only those with a glob, e.g. data.path='{path.parent}/*.csv'")
