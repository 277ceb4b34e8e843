"""Checkpoints: plain tensors and dicts written atomically, read back with ``weights_only=True``.

Layout under the training folder (``cfg.paths.train``)::

    checkpoints/step-00000200.pt   one per save, the newest ``keep`` kept
        {"version": 1, "step": int, "epoch": int,
         "model": model.state_dict()           (embedding weights + their optimizer state + dense part),
         "dense_optimizer": optimizer.state_dict(),
         "loader": the train loader's state (plain values),
         "rng": {"torch": ByteTensor, "cuda": [ByteTensor, ...], "python": list},
         "extra": plain values (e.g. the best valid AUC so far)}

A save writes ``step-N.pt.tmp`` and renames it, so a kill mid-save leaves the previous checkpoint
intact; no code is pickled, so loading runs nothing from the file.

Example::

    save_checkpoint(folder, state, keep=2)
    state = load_checkpoint(latest_checkpoint(folder))
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_VERSION = 1
_NAME = re.compile(r"^step-(\d+)\.pt$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not match this version."""


def checkpoints(folder: str | Path) -> list[Path]:
    """The checkpoint files in ``folder``, oldest step first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(folder: str | Path) -> Path | None:
    found = checkpoints(folder)
    return found[-1] if found else None


def save_checkpoint(folder: str | Path, state: dict[str, Any], keep: int = 2) -> Path:
    """Write ``state`` as ``folder/step-<state['step']>.pt`` atomically, then drop all but the newest ``keep``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{int(state['step']):08d}.pt"
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save({"version": CHECKPOINT_VERSION, **state}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    for old in checkpoints(folder)[: -max(1, keep)]:
        old.unlink(missing_ok=True)
    return path


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    path = Path(path)
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:
        raise CheckpointError(f"cannot read checkpoint {path}: {err}") from err
    if not isinstance(state, dict) or state.get("version") != CHECKPOINT_VERSION:
        found = state.get("version") if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"checkpoint {path}: expected version {CHECKPOINT_VERSION}, found {found}")
    return state


def rng_state() -> dict[str, Any]:
    """Every RNG the training loop draws from, as tensors and lists."""
    state = {"torch": torch.get_rng_state(), "python": _to_lists(random.getstate())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_to_tuples(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _to_lists(value: Any) -> Any:
    return [_to_lists(v) for v in value] if isinstance(value, (tuple, list)) else value


def _to_tuples(value: Any) -> Any:
    return tuple(_to_tuples(v) for v in value) if isinstance(value, (tuple, list)) else value
