"""The host store: every row of every embedding table, one memory-mapped ``.npy`` file per table.

The files are numbered in the order of the tables (``00000.npy`` ...), and the manifest names each
table's file, so that any table name (any length, any characters) gives a file name. A dynamic
table (raw 64-bit ids) is stored as the rows of its ids in ascending order of the ids, then one
zero row (that of every id it does not hold), beside ``<number>.keys.npy``, those ids (int64).

Versions make online updates safe (HugeCTR HPS style): each version is a folder ``v000001/`` holding
the tables and a ``manifest.json``; the file ``CURRENT`` names the version being served. A writer
fills a new folder completely, then replaces ``CURRENT`` atomically (write a temp file, rename), so
a reader sees either the old version or the new one, never a half-written table. Old folders are
pruned after ``keep`` versions; a reader that still maps one keeps valid data (an unlinked file
stays mapped on POSIX).

Example::

    write_version("repo/embedding/store", {"t_C1": np.ones((10, 4), np.float32)})   # -> 1
    store = open_current("repo/embedding/store")
    store.version, store.tables["t_C1"].shape                                       # 1, (10, 4)
    write_version(root, {"t_user": rows}, keys={"t_user": ids})                     # rows: len(ids) + 1
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.errors import UserError
from pipeline.files import full_disk_named, write_text

STORE_FORMAT = 2
CURRENT = "CURRENT"


@dataclass
class StoreVersion:
    """One version of the tables, memory-mapped read-only."""

    version: int
    path: Path
    tables: dict[str, np.ndarray]
    keys: dict[str, np.ndarray]
    """The ids of each dynamic table, ascending: row ``i`` is ``keys[i]``'s, the last row every other id's."""
    dense: str = ""
    """The fingerprint of the dense part the tables were written for (``export.repository.dense_fingerprint``)."""


def current_version(root: str | Path) -> int:
    """The version ``CURRENT`` names (0 when the store is empty); a UserError naming the file when it names none."""
    path = Path(root) / CURRENT
    try:
        text = path.read_bytes().strip()
    except FileNotFoundError:
        return 0
    if not re.fullmatch(rb"v?[0-9]{1,9}", text):
        raise UserError(f"{path} holds {text[:40]!r}, not a store version such as v000001: write a new version "
                        "(`python -m pipeline run export export.update=true`) or export again")
    return int(text.lstrip(b"v"))


def file_stamp(path: str) -> tuple[int, int, int] | None:
    """What tells the file ``path`` (a store's ``CURRENT``) as it is now apart from an earlier one (None when absent),
    without reading it: a writer replaces the file, so a new version means a new stamp (one ``stat``, cheap enough for
    every batch). A plain string: a served model checks it before every batch, where building ``Path`` objects costs
    more than the ``stat`` once the CPU's caches are cold."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_mtime_ns, stat.st_size


def write_version(root: str | Path, tables: dict[str, np.ndarray], keep: int = 2,
                  keys: dict[str, np.ndarray] | None = None, dense: str = "") -> int:
    """Write ``tables`` (name -> ``[rows, dim]`` array) as the next version, make it current, return it.
    ``keys``: the ids of the dynamic tables (name -> ascending int64, one fewer than the table's rows); ``dense``: the
    fingerprint of the dense part they are for, which a served lookup checks before it takes them."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    existing = [int(p.name[1:]) for p in root.glob("v*") if p.name[1:].isdigit()]
    try:
        served = current_version(root)
    except UserError:
        served = 0  # a CURRENT that names no version is replaced below
    version = max(existing + [served], default=0) + 1
    folder = root / f"v{version:06d}"
    staging = root / f".staging-v{version:06d}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    manifest = {"format": STORE_FORMAT, "version": version, "dense": dense, "tables": {}}
    try:  # a version half written (a full disk, an error) leaves nothing behind
        with full_disk_named(root):
            _write_tables(staging, tables, keys or {}, manifest["tables"])
            (staging / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    staging.rename(folder)
    write_text(root / CURRENT, f"v{version:06d}\n")
    for old in sorted(v for v in existing if v <= version - keep):
        shutil.rmtree(root / f"v{old:06d}", ignore_errors=True)
    return version


def _write_tables(staging: Path, tables: dict[str, np.ndarray], keys: dict[str, np.ndarray], entries: dict) -> None:
    """Each table's ``.npy`` in ``staging`` (a dynamic table's ids in ``.keys.npy`` beside it), its entry of the
    manifest in ``entries``."""
    for index, (name, array) in enumerate(tables.items()):
        array = np.ascontiguousarray(array)
        if array.ndim != 2:
            raise ValueError(f"table {name}: expected a [rows, dim] array, got shape {array.shape}")
        file = f"{index:05d}"
        np.save(staging / f"{file}.npy", array)
        entries[name] = {"file": file, "rows": int(array.shape[0]), "dim": int(array.shape[1]),
                         "dtype": str(array.dtype)}
        if name in keys:
            ids = np.ascontiguousarray(keys[name], dtype=np.int64)
            if ids.shape != (array.shape[0] - 1,) or (np.diff(ids) <= 0).any():
                raise ValueError(f"table {name}: expected {array.shape[0] - 1} ascending distinct ids, one per row "
                                 f"but the last, got shape {ids.shape}")
            np.save(staging / f"{file}.keys.npy", ids)
            entries[name]["dynamic"] = True


def open_current(root: str | Path) -> StoreVersion:
    """Memory-map the tables of the current version (checks the manifest's format and shapes)."""
    root = Path(root)
    for _ in range(5):
        try:
            return _open_version(root, current_version(root))
        except FileNotFoundError:
            continue  # pruned between reading CURRENT and opening: read CURRENT again
    return _open_version(root, current_version(root))


def _open_version(root: Path, version: int) -> StoreVersion:
    if version == 0:
        raise UserError(f"no embedding store at {root}: run `python -m pipeline run export` first")
    folder = root / f"v{version:06d}"
    manifest = json.loads((folder / "manifest.json").read_text())
    if manifest.get("format") != STORE_FORMAT:
        raise UserError(f"embedding store {folder}: format {manifest.get('format')} is not {STORE_FORMAT}; re-export")
    tables, keys = {}, {}
    for name, meta in manifest["tables"].items():
        array = np.load(folder / f"{meta['file']}.npy", mmap_mode="r")
        if array.shape != (meta["rows"], meta["dim"]):
            raise UserError(f"embedding store {folder}: table {name} has shape {array.shape}, manifest says "
                            f"{(meta['rows'], meta['dim'])}")
        tables[name] = array
        if meta.get("dynamic"):
            keys[name] = np.load(folder / f"{meta['file']}.keys.npy", mmap_mode="r")
            if keys[name].shape != (meta["rows"] - 1,):
                raise UserError(f"embedding store {folder}: table {name} has {meta['rows']} rows but "
                                f"{keys[name].shape[0]} ids; re-export")
    return StoreVersion(version, folder, tables, keys, manifest.get("dense", ""))
