"""Sharded checkpoints: every rank writes the rows it holds; any number of ranks reads them back.

Layout of a checkpoint folder (shared by all ranks; on several nodes, a shared filesystem)::

    meta.json                     version, world size, step, and per collection path: its plan,
                                  tables, feature order and the embedding optimizer's step
    embedding/<path>/<table>/rows-<lo>-<hi>.pt
                                  {"weight": [hi-lo, dim], "momentum1": ..., ...} of global rows lo..hi;
                                  a dynamic table's part: its rows by slot, and "dynamic": its ids, their
                                  slots and scores (the part's extra state)
    dense.pt                      rank 0: the dense state (identical on every rank) and ``extra``

Loading reads, for each table part the new plan puts on this rank (any world size, or the plain
unsharded collection), the saved pieces whose rows overlap it (memory-mapped) and copies the
overlap: resharding on load. A dynamic table's part is read back whole into the same part (the same
plan), else rebuilt from the ids of every saved part that the new part owns, each with its rows and
state, placed anew in its slots (most recent first; ``DynamicTable.load_content``). Files are
written as ``.tmp`` and renamed; ``meta.json`` is written
last by rank 0, after every rank finished, so a folder without it is an unfinished save.
:func:`check_sharded_checkpoint` says, without loading the weights, whether a folder is a whole,
readable checkpoint (what a resume tries before it changes any state).

Example::

    save_sharded_checkpoint(folder, dmp.sharded_collections(), dense={"model": dmp.dense_state_dict()}, step=200)
    load_sharded_checkpoint(folder, dmp.sharded_collections())          # into 1, 2, 3 ... ranks
    load_sharded_checkpoint(folder, {"embedding": plain_model.embedding})   # or unsharded
"""

from __future__ import annotations

import json
import re
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeline.distributed.embedding import ShardedEmbeddingCollection
from pipeline.distributed.types import PlanError, ShardingPlan
from pipeline.errors import BadInputError
from pipeline.files import atomic_open, write_json
from pipeline.modules.collection import EmbeddingCollection
from pipeline.modules.dynamic import DynamicTable, content_of

CHECKPOINT_VERSION = 1
_ZIP_HEADER = b"PK\x03\x04"


class CheckpointError(BadInputError):
    """A checkpoint that cannot be read (missing, truncated, not a torch file, another version)."""


class ShardedCheckpointError(CheckpointError):
    """A sharded checkpoint that is unfinished, damaged, of another version, or does not match the model."""


def load_torch_file(path: str | Path, label: str, error: type[CheckpointError] = CheckpointError,
                    **load_args: Any) -> Any:
    """``torch.load(path, weights_only=True, **load_args)``, or ``error`` in one line: "<label> is unreadable: why".

    The file is first checked to be a whole ``torch.save`` file (a zip archive with its end), so a
    truncated, empty or foreign file is named as such rather than by the unpickler's message.
    """
    path = Path(path)
    problem = torch_file_problem(path)
    if problem is None:
        try:
            return torch.load(path, weights_only=True, **load_args)
        except Exception as err:  # noqa: BLE001 - whatever the unpickler raises, the file is unreadable
            problem = f"torch.load cannot read it: {_load_error(err)}"
    raise error(f"{label} is unreadable: {problem}")


def torch_file_problem(path: Path) -> str | None:
    """Why ``path`` is not a whole file written by ``torch.save`` (checked from its size and zip structure), or None."""
    if not path.is_file():
        return "the file is missing"
    size = path.stat().st_size
    if size == 0:
        return "empty file (0 bytes)"
    with open(path, "rb") as f:
        head = f.read(len(_ZIP_HEADER))
    if head != _ZIP_HEADER:
        return f"not a torch checkpoint file ({size:,} bytes that do not start as torch.save writes)"
    if not zipfile.is_zipfile(path):
        return f"truncated ({size:,} bytes; the end of the file is missing)"
    return None


def _load_error(err: Exception) -> str:
    text = str(err)
    unsafe = re.search(r"Unsupported global: GLOBAL (\S+)", text)
    if unsafe:
        return f"it holds a pickled object ({unsafe.group(1)}), and checkpoints are loaded without running code"
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return f"{type(err).__name__}: {first[:300]}" if first else type(err).__name__


def cpu_copy(state: dict[str, Any]) -> dict[str, Any]:
    """A copy of a ``state_dict()`` in host memory, the extra states of modules (dicts of tensors and plain
    values, such as a dynamic table's ids) included."""
    return {k: cpu_copy(v) if isinstance(v, dict) else v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor)
            else v for k, v in state.items()}


def _save(obj: Any, path: Path) -> None:
    with atomic_open(path) as f:
        torch.save(obj, f)


def _piece_path(folder: Path, path: str, table: str, lo: int, hi: int) -> Path:
    return folder / "embedding" / path / table / f"rows-{lo:012d}-{hi:012d}.pt"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def save_sharded_checkpoint(folder: str | Path, collections: dict[str, ShardedEmbeddingCollection],
                            dense: dict[str, Any] | None = None, step: int = 0,
                            extra: dict[str, Any] | None = None) -> Path:
    """Every rank calls this; each writes its own pieces (data-parallel tables: rank 0 only)."""
    folder = Path(folder)
    rank = _rank()
    meta = {"version": CHECKPOINT_VERSION, "step": int(step), "collections": {}}
    for path, sharded in collections.items():
        for name, lo, hi, views in sharded.local_shards():
            p = sharded.plan[name]
            if p.sharding_type.value == "data_parallel" and rank != 0:
                continue
            piece = {k: v.detach().cpu().contiguous() for k, v in views.items()}
            part = sharded.dynamic_part(name)
            if part is not None:
                piece["dynamic"] = cpu_copy(part[0].get_extra_state())
            _save(piece, _piece_path(folder, path, name, lo, hi))
        meta["world_size"] = sharded.world_size
        meta["collections"][path] = {
            "plan": sharded.plan.to_dict(),
            "tables": [{"name": t.name, "rows": t.rows, "dim": t.dim, "features": t.features, "pooling": t.pooling}
                       for t in sharded.tables],
            "feature_names": sharded.feature_names,
            "optimizer": sharded.optimizer.kind,
            "embedding_step": sharded.step,
        }
    if rank == 0:
        _save({"dense": dense or {}, "extra": extra or {}}, folder / "dense.pt")
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        write_json(folder / "meta.json", meta)
    if dist.is_initialized():
        dist.barrier()
    return folder


def read_meta(folder: str | Path) -> dict[str, Any]:
    """The folder's ``meta.json``; :class:`ShardedCheckpointError` for an unfinished save or another version."""
    folder = Path(folder)
    meta_path = folder / "meta.json"
    unreadable = f"sharded checkpoint {folder} is unreadable"
    if not meta_path.is_file():
        raise ShardedCheckpointError(f"{unreadable}: no meta.json (an unfinished save)")
    try:
        meta = json.loads(meta_path.read_text())
    except (UnicodeDecodeError, ValueError) as err:
        raise ShardedCheckpointError(f"{unreadable}: meta.json is not JSON ({err})") from err
    found = meta.get("version") if isinstance(meta, dict) else type(meta).__name__
    if found != CHECKPOINT_VERSION:
        raise ShardedCheckpointError(f"{unreadable}: expected version {CHECKPOINT_VERSION}, found {found}")
    return meta


def check_sharded_checkpoint(folder: str | Path) -> dict[str, Any]:
    """The ``meta.json`` of ``folder`` once every file it lists reads as a whole; else :class:`ShardedCheckpointError`.

    Reads ``dense.pt`` and maps each embedding piece (checking its rows and dim against the meta),
    so the cost is the dense state plus one small read per piece, not the tables.
    """
    folder = Path(folder)
    meta = read_meta(folder)
    unreadable = f"sharded checkpoint {folder} is unreadable"
    try:
        pieces = []
        for path, saved in meta["collections"].items():
            plan = ShardingPlan.from_dict(saved["plan"])
            for table in saved["tables"]:
                for lo, hi in sorted(set(plan[table["name"]].row_ranges)):
                    pieces.append((_piece_path(folder, path, table["name"], lo, hi), (hi - lo, table["dim"])))
        for key in ("step", "world_size"):
            int(meta[key])
    except (KeyError, TypeError, ValueError, PlanError) as err:
        raise ShardedCheckpointError(f"{unreadable}: meta.json is malformed ({type(err).__name__}: {err})") from err
    dense = load_torch_file(folder / "dense.pt", f"sharded checkpoint {folder}: dense.pt", ShardedCheckpointError)
    if not isinstance(dense, dict) or not {"dense", "extra"} <= dense.keys():
        raise ShardedCheckpointError(f"{unreadable}: dense.pt holds no dense state")
    for piece, shape in pieces:
        name = piece.relative_to(folder)
        values = load_torch_file(piece, f"sharded checkpoint {folder}: {name}", ShardedCheckpointError, mmap=True)
        weight = values.get("weight") if isinstance(values, dict) else None
        if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != shape:
            found = tuple(weight.shape) if isinstance(weight, torch.Tensor) else "none"
            raise ShardedCheckpointError(f"{unreadable}: {name} holds weights of shape {found}, expected {shape}")
    return meta


def load_sharded_checkpoint(folder: str | Path,
                            collections: dict[str, ShardedEmbeddingCollection | EmbeddingCollection]) -> dict[str, Any]:
    """Fill each collection (sharded by any plan, or plain) from the checkpoint; returns ``dense.pt``'s dict."""
    folder = Path(folder)
    meta = read_meta(folder)
    for path, target in collections.items():
        if path not in meta["collections"]:
            raise ShardedCheckpointError(f"{folder} has no embedding collection {path!r}; "
                                         f"it has {sorted(meta['collections'])}")
        saved = meta["collections"][path]
        saved_plan = ShardingPlan.from_dict(saved["plan"])
        saved_rows = {t["name"]: (t["rows"], t["dim"]) for t in saved["tables"]}
        if isinstance(target, ShardedEmbeddingCollection):
            parts = list(target.local_shards())
            dynamic_part = target.dynamic_part
        else:
            dynamic_part = _whole_dynamic_table(target)
            parts = [(name, 0, target.packing.rows[t], target.table_views(name))
                     for t, name in enumerate(target.packing.table_names)]
        for name, lo, hi, views in parts:
            if name not in saved_rows:
                raise ShardedCheckpointError(f"{folder}: no table {name} in collection {path!r}")
            if (views["weight"].shape[1], ) != (saved_rows[name][1], ) or hi > saved_rows[name][0]:
                raise ShardedCheckpointError(f"{folder}: table {name} is {saved_rows[name][0]} x {saved_rows[name][1]} "
                                             f"there, the model wants rows {lo}..{hi} of dim {views['weight'].shape[1]}")
            ranges = sorted(set(saved_plan[name].row_ranges))
            part = dynamic_part(name)
            if part is None:
                _fill(folder, path, name, lo, hi, views, ranges)
            else:
                _fill_dynamic(folder, path, name, lo, hi, views, ranges, *part)
        if isinstance(target, ShardedEmbeddingCollection):
            target.set_step(saved["embedding_step"])
        else:
            target.step.fill_(saved["embedding_step"])
    return load_torch_file(folder / "dense.pt", f"sharded checkpoint {folder}: dense.pt", ShardedCheckpointError,
                           map_location="cpu")


def _whole_dynamic_table(ec: EmbeddingCollection) -> Callable[[str], tuple[DynamicTable, None] | None]:
    """``dynamic_part`` of a plain collection: its dynamic table ``name``, which owns every id."""
    return lambda name: (ec.dynamic[name], None) if ec.dynamic is not None and name in ec.dynamic.tables else None


def _fill_dynamic(folder: Path, path: str, name: str, lo: int, hi: int, views: dict[str, torch.Tensor],
                  ranges: list[tuple[int, int]], table: DynamicTable,
                  owned: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
    """A dynamic table's part: the saved part of the same rows whole, else the ids it owns of every saved part."""

    def piece(lo: int, hi: int) -> dict:
        file = _piece_path(folder, path, name, lo, hi)
        saved = load_torch_file(file, f"sharded checkpoint {folder}: {file.relative_to(folder)}",
                                ShardedCheckpointError, map_location="cpu")
        missing = [key for key in (*views, "dynamic") if key not in saved]
        if missing:
            raise ShardedCheckpointError(f"{folder}: dynamic table {name} was saved without {missing} (another "
                                         "optimizer, or a static table of that name?)")
        return saved

    with torch.no_grad():
        if (lo, hi) in ranges:
            same = piece(lo, hi)
            for key, view in views.items():
                view.copy_(same[key])
            table.set_extra_state(same["dynamic"])
            return
        parts = [piece(plo, phi) for plo, phi in ranges]
        table.load_content(views, [content_of(p["dynamic"], {key: p[key] for key in views}) for p in parts], owned)


def _fill(folder: Path, path: str, name: str, lo: int, hi: int, views: dict[str, torch.Tensor],
          ranges: list[tuple[int, int]]) -> None:
    covered = 0
    for plo, phi in ranges:
        a, b = max(lo, plo), min(hi, phi)
        if a >= b:
            continue
        file = _piece_path(folder, path, name, plo, phi)
        piece = load_torch_file(file, f"sharded checkpoint {folder}: {file.relative_to(folder)}", ShardedCheckpointError,
                                map_location="cpu", mmap=True)
        for key, view in views.items():
            if key not in piece:
                raise ShardedCheckpointError(f"{folder}: table {name} was saved without {key!r} (another optimizer?)")
            with torch.no_grad():
                view[a - lo : b - lo].copy_(piece[key][a - plo : b - plo])
        covered += b - a
    if covered != hi - lo:
        raise ShardedCheckpointError(f"{folder}: saved pieces of {name} cover {covered} of rows {lo}..{hi}")
