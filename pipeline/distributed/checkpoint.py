"""Sharded checkpoints: every rank writes the rows it holds; any number of ranks reads them back.

Layout of a checkpoint folder (shared by all ranks; on several nodes, a shared filesystem)::

    meta.json                     version, world size, step, and per collection path: its plan,
                                  tables, feature order and the embedding optimizer's step
    embedding/<path>/<table>/rows-<lo>-<hi>.pt
                                  {"weight": [hi-lo, dim], "momentum1": ..., ...} of global rows lo..hi
    dense.pt                      rank 0: the dense state (identical on every rank) and ``extra``

Loading reads, for each table part the new plan puts on this rank (any world size, or the plain
unsharded collection), the saved pieces whose rows overlap it (memory-mapped) and copies the
overlap: resharding on load. Files are written as ``.tmp`` and renamed; ``meta.json`` is written
last by rank 0, after every rank finished, so a folder without it is an unfinished save.

Example::

    save_sharded_checkpoint(folder, dmp.sharded_collections(), dense={"model": dmp.dense_state_dict()}, step=200)
    load_sharded_checkpoint(folder, dmp.sharded_collections())          # into 1, 2, 3 ... ranks
    load_sharded_checkpoint(folder, {"embedding": plain_model.embedding})   # or unsharded
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeline.distributed.embedding import ShardedEmbeddingCollection, table_tensors
from pipeline.distributed.types import ShardingPlan
from pipeline.files import atomic_open, write_json
from pipeline.modules.collection import EmbeddingCollection

CHECKPOINT_VERSION = 1


class ShardedCheckpointError(ValueError):
    """A sharded checkpoint that is unfinished, of another version, or does not match the model."""


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
            _save({k: v.detach().cpu().contiguous() for k, v in views.items()}, _piece_path(folder, path, name, lo, hi))
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
    folder = Path(folder)
    meta_path = folder / "meta.json"
    if not meta_path.is_file():
        raise ShardedCheckpointError(f"{folder} holds no finished sharded checkpoint (no meta.json)")
    meta = json.loads(meta_path.read_text())
    if meta.get("version") != CHECKPOINT_VERSION:
        raise ShardedCheckpointError(f"{folder}: checkpoint version {meta.get('version')}, "
                                     f"expected {CHECKPOINT_VERSION}")
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
        else:
            parts = [(name, 0, target.packing.rows[t], table_tensors(target, name))
                     for t, name in enumerate(target.packing.table_names)]
        for name, lo, hi, views in parts:
            if name not in saved_rows:
                raise ShardedCheckpointError(f"{folder}: no table {name} in collection {path!r}")
            if (views["weight"].shape[1], ) != (saved_rows[name][1], ) or hi > saved_rows[name][0]:
                raise ShardedCheckpointError(f"{folder}: table {name} is {saved_rows[name][0]} x {saved_rows[name][1]} "
                                             f"there, the model wants rows {lo}..{hi} of dim {views['weight'].shape[1]}")
            _fill(folder, path, name, lo, hi, views, sorted(set(saved_plan[name].row_ranges)))
        if isinstance(target, ShardedEmbeddingCollection):
            target.set_step(saved["embedding_step"])
        else:
            target.step.fill_(saved["embedding_step"])
    return torch.load(folder / "dense.pt", map_location="cpu", weights_only=True)


def _fill(folder: Path, path: str, name: str, lo: int, hi: int, views: dict[str, torch.Tensor],
          ranges: list[tuple[int, int]]) -> None:
    covered = 0
    for plo, phi in ranges:
        a, b = max(lo, plo), min(hi, phi)
        if a >= b:
            continue
        piece = torch.load(_piece_path(folder, path, name, plo, phi), map_location="cpu", weights_only=True, mmap=True)
        for key, view in views.items():
            if key not in piece:
                raise ShardedCheckpointError(f"{folder}: table {name} was saved without {key!r} (another optimizer?)")
            with torch.no_grad():
                view[a - lo : b - lo].copy_(piece[key][a - plo : b - plo])
        covered += b - a
    if covered != hi - lo:
        raise ShardedCheckpointError(f"{folder}: saved pieces of {name} cover {covered} of rows {lo}..{hi}")
