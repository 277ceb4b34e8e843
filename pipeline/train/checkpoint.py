"""Checkpoints of the training loop, in two formats: one ``.pt`` file (one process) or sharded (N ranks).

:class:`PlainCheckpoints` (a world of one) writes ``checkpoints/step-NNNNNNNN.pt``::

    {"version": 1, "step": int, "epoch": int,
     "model": model.state_dict()           (embedding weights + their optimizer state + dense part),
     "dense_optimizer": optimizer.state_dict(),
     "loader": the train loader's state (plain values),
     "rng": {"torch": ByteTensor, "cuda": [ByteTensor, ...], "python": list},
     "early_stopping": LoopState.progress(), "best_model": the best epoch's model.state_dict() or None}

:class:`ShardedCheckpoints` (N ranks) writes folders ``checkpoints/step-NNNNNNNN.sharded/``: the
tables and dense state of :mod:`pipeline.distributed.checkpoint` (which any number of ranks can
read back) plus one ``rank-R.pt`` per rank with its loader position and RNG states.

Both keep the newest ``keep`` checkpoints. Every file is written atomically (a kill mid-save leaves
the previous checkpoint intact), and no code is pickled, so loading runs nothing from the file.
A resume takes the newest checkpoint that reads whole (``newest_readable``): each newer one that
does not (truncated, empty, foreign, another version, an unfinished sharded folder) is reported in
one line and passed over. The ``*.tmp`` files of a killed save go at the next start or save.

Example::

    save_checkpoint(folder, state, keep=2)
    state = load_checkpoint(latest_checkpoint(folder))
"""

from __future__ import annotations

import random
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from pipeline.distributed.checkpoint import (
    CheckpointError,
    ShardedCheckpointError,
    check_sharded_checkpoint,
    cpu_copy,
    load_sharded_checkpoint,
    load_torch_file,
    read_meta,
    save_sharded_checkpoint,
)
from pipeline.distributed.world import World
from pipeline.errors import UserError
from pipeline.files import atomic_open, remove_tmp_files
from pipeline.train.model import model_from_spec

CHECKPOINT_VERSION = 1
_NAME = re.compile(r"^step-(\d+)\.pt$")
_SHARDED = ".sharded"
_SHARDED_NAME = re.compile(r"^step-(\d+)\.sharded$")
_PLAIN_KEYS = ("step", "epoch", "model", "dense_optimizer", "loader", "rng")


@dataclass
class LoopState:
    """Where training is: steps done, the current epoch and its next batch; with early stopping, the best
    epoch so far (its valid scores, the step and epoch count at its end), the epochs since it, whether
    training stopped early."""

    step: int = 0
    epoch: int = 0
    batch: int = 0
    best_valid: dict | None = None
    best_step: int = 0
    best_epoch: int = 0
    bad_epochs: int = 0
    stopped: bool = False

    def progress(self) -> dict[str, Any]:
        """The early-stopping fields, as plain values."""
        return {"best_valid": self.best_valid, "best_step": self.best_step, "best_epoch": self.best_epoch,
                "bad_epochs": self.bad_epochs, "stopped": self.stopped}


class Trainer(Protocol):
    """What a checkpoint saves of a training run and restores into it: :class:`pipeline.train.loop.Trainer`'s."""

    model: nn.Module
    optimizer: Any
    loader: Any
    state: LoopState
    best_weights: dict[str, torch.Tensor] | None
    device: torch.device
    steps_per_epoch: int


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
    """Write ``state`` as ``folder/step-<state['step']>.pt`` atomically, then drop all but the newest ``keep``.

    The ``*.tmp`` files of earlier saves that were killed are removed first.
    """
    path = Path(folder) / f"step-{int(state['step']):08d}.pt"
    remove_tmp_files(folder)
    with atomic_open(path) as f:
        torch.save({"version": CHECKPOINT_VERSION, **state}, f)
    for old in checkpoints(folder)[: -max(1, keep)]:
        old.unlink(missing_ok=True)
    return path


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu", **load_args: Any) -> dict[str, Any]:
    """The state saved in ``path``; :class:`CheckpointError` in one line naming the file and what is wrong."""
    label = f"checkpoint {path}"
    state = load_torch_file(path, label, map_location=map_location, **load_args)
    if not isinstance(state, dict) or state.get("version") != CHECKPOINT_VERSION:
        found = state.get("version") if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"{label} is unreadable: expected version {CHECKPOINT_VERSION}, found {found}")
    return state


def sharded_checkpoints(folder: str | Path, finished: bool = True) -> list[Path]:
    """Sharded checkpoint folders in ``folder``, oldest step first: the finished ones (with ``meta.json``), or all."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if p.is_dir() and (m := _SHARDED_NAME.match(p.name))]
    return [p for _, p in sorted(found) if not finished or (p / "meta.json").is_file()]


def _newest_readable(candidates: list[Path], check: Callable[[Path], None]) -> Path | None:
    """The first of ``candidates`` (newest first) that ``check`` passes; one line for each one passed over."""
    for i, path in enumerate(candidates):
        try:
            check(path)
            return path
        except CheckpointError as err:
            then = (f"falling back to {candidates[i + 1]}" if i + 1 < len(candidates)
                    else f"no readable checkpoint left in {path.parent}: starting fresh")
            print(f"[train] {err}; {then}", flush=True)
    return None


def _check_same_weights(path: Path, saved: Any, expected: dict[str, Any]) -> None:
    """Raise :class:`CheckpointError` unless ``saved`` has the names of ``expected`` and, for its tensors, their shapes."""
    if not isinstance(saved, dict):
        raise CheckpointError(f"checkpoint {path} is unreadable: its model is a {type(saved).__name__}, not weights")
    differ = [f"{k} is not in this model" for k in saved.keys() - expected.keys()]
    differ += [f"{k} is missing" for k in expected.keys() - saved.keys()]
    differ += [f"{k} is {list(saved[k].shape)} where this model's is {list(v.shape)}" for k, v in expected.items()
               if isinstance(v, torch.Tensor) and isinstance(saved.get(k), torch.Tensor) and saved[k].shape != v.shape]
    if differ:
        raise CheckpointError(f"checkpoint {path} holds another model's weights ({len(differ)} differ: "
                              f"{'; '.join(sorted(differ)[:2])})")


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


class PlainCheckpoints:
    """One ``step-N.pt`` file per save: the whole state of a single-process :class:`Trainer`.

    Given the ``model`` they are saved from, a checkpoint whose weights are not that model's (their
    names or shapes differ: another model's file copied in) does not read whole.
    """

    def __init__(self, folder: str | Path, keep: int = 2, model: nn.Module | None = None) -> None:
        self.folder, self.keep, self.model = Path(folder), keep, model

    def candidates(self) -> list[Path]:
        """Every checkpoint a resume could start from, newest first."""
        return checkpoints(self.folder)[::-1]

    def check(self, path: Path) -> None:
        """Raise :class:`CheckpointError` unless ``path`` reads whole (its tensors are mapped, not read)."""
        state = load_checkpoint(path, mmap=True)
        missing = [key for key in _PLAIN_KEYS if key not in state]
        if missing:
            raise CheckpointError(f"checkpoint {path} is unreadable: it lacks {', '.join(missing)}")
        if self.model is not None:
            _check_same_weights(path, state["model"], self.model.state_dict())

    def newest_readable(self) -> Path | None:
        """The newest checkpoint that reads whole; each newer one is reported in a line and passed over."""
        return _newest_readable(self.candidates(), self.check)

    def remove_stale(self) -> None:
        """Remove what killed saves left (``*.tmp``); only while nothing saves."""
        remove_tmp_files(self.folder)

    def clear(self) -> None:
        for old in self.folder.glob("step-*.pt*"):
            old.unlink()

    def save(self, trainer: Trainer) -> Path:
        s = trainer.state
        return save_checkpoint(self.folder, {
            "step": s.step,
            "epoch": s.epoch,
            "model": trainer.model.state_dict(),
            "dense_optimizer": trainer.optimizer.state_dict(),
            "loader": {**trainer.loader.state_dict(), "epoch": s.epoch, "batches": s.batch},
            "rng": rng_state(),
            "early_stopping": s.progress(),
            "best_model": trainer.best_weights,
        }, keep=self.keep)

    def load(self, trainer: Trainer, path: Path) -> tuple[LoopState, dict[str, Any]]:
        """Restore ``trainer`` from ``path``; returns where the loop stands and fields for the resume record."""
        # Read into host memory and copied into the model's tensors from there: a host-cached table does not fit
        # the device.
        ckpt = load_checkpoint(path, map_location="cpu")
        trainer.model.load_state_dict(ckpt["model"])
        load_dense_optimizer(trainer.optimizer, ckpt["dense_optimizer"], path)
        trainer.loader.load_state_dict(ckpt["loader"])
        set_rng_state({k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in ckpt["rng"].items()})
        best = ckpt.get("best_model")
        trainer.best_weights = cpu_copy(best) if best is not None else None
        loader = ckpt["loader"]
        return LoopState(step=int(ckpt["step"]), epoch=int(loader["epoch"]), batch=int(loader["batches"]),
                         **ckpt.get("early_stopping", {})), {}

    def model_state(self, model: nn.Module, spec: dict, restored: bool) -> dict[str, torch.Tensor]:
        """The trained weights as one process's model holds them (``model`` is that model; ``restored``, whether
        they are an earlier epoch's than the newest checkpoint's, makes no difference here)."""
        return model.state_dict()


class ShardedCheckpoints:
    """A ``step-N.sharded/`` folder per save, written by every rank of ``world`` (a ``DistributedModelParallel``)."""

    def __init__(self, folder: str | Path, world: World, keep: int = 2) -> None:
        self.folder, self.world, self.keep = Path(folder), world, keep

    def latest(self) -> Path | None:
        found = sharded_checkpoints(self.folder)
        return found[-1] if found else None

    def candidates(self) -> list[Path]:
        """Every checkpoint folder a resume could start from (unfinished ones too, to report them), newest first."""
        return sharded_checkpoints(self.folder, finished=False)[::-1]

    def check(self, path: Path) -> None:
        """Raise :class:`ShardedCheckpointError` unless the folder ``path`` reads whole for this world."""
        meta = check_sharded_checkpoint(path)
        if meta["world_size"] != self.world.size:
            return  # the ranks' loader positions and RNG states are not used
        for rank in range(self.world.size):
            mine = load_torch_file(path / f"rank-{rank}.pt", f"sharded checkpoint {path}: rank-{rank}.pt",
                                   ShardedCheckpointError, mmap=True)
            if not isinstance(mine, dict) or not {"loader", "rng"} <= mine.keys():
                raise ShardedCheckpointError(f"sharded checkpoint {path} is unreadable: rank-{rank}.pt holds no "
                                             "loader position and RNG states")

    def newest_readable(self) -> Path | None:
        """The newest folder that reads whole, as rank 0 finds it (on every rank); newer ones are reported."""
        found = _newest_readable(self.candidates(), self.check) if self.world.is_writer else None
        found = self.world.gather_objects(str(found) if found else None)[0]
        return Path(found) if found else None

    def remove_stale(self) -> None:
        """Remove what killed saves left (``*.tmp`` files, folders without ``meta.json``); rank 0, while nothing saves."""
        remove_tmp_files(self.folder, recursive=True)
        for folder in sharded_checkpoints(self.folder, finished=False):
            if not (folder / "meta.json").is_file():
                shutil.rmtree(folder, ignore_errors=True)

    def clear(self) -> None:
        for old in self.folder.glob("step-*"):
            shutil.rmtree(old) if old.is_dir() else old.unlink()

    def save(self, trainer: Trainer) -> Path:
        s, world = trainer.state, self.world
        folder = self.folder / f"step-{s.step:08d}{_SHARDED}"
        if world.is_writer:
            self.remove_stale()
            if folder.exists():
                shutil.rmtree(folder)
        world.barrier()
        with atomic_open(folder / f"rank-{world.rank}.pt") as f:
            torch.save({"loader": {**trainer.loader.state_dict(), "epoch": s.epoch, "batches": s.batch},
                        "rng": rng_state(), "early_stopping": s.progress(), "best_model": trainer.best_weights}, f)
        save_sharded_checkpoint(folder, trainer.model.sharded_collections(),
                                dense={"model": trainer.model.dense_state_dict(),
                                       "dense_optimizer": trainer.optimizer.state_dict()},
                                step=s.step, extra={"epoch": s.epoch, "batch": s.batch})
        if world.is_writer:
            for old in sharded_checkpoints(self.folder)[: -max(1, self.keep)]:
                shutil.rmtree(old, ignore_errors=True)
        world.barrier()
        return folder

    def load(self, trainer: Trainer, path: Path) -> tuple[LoopState, dict[str, Any]]:
        """Restore ``trainer`` from a sharded checkpoint; returns the loop position and resume-record fields.

        Written by as many ranks as this run has: an exact resume (loader positions and RNG states
        too). Written by another number: the tables and all optimizer states are resharded exactly,
        the loop goes on from the saved step, and the data position within the epoch is carried
        over by samples seen (each rank's shard of the data changes with the rank count, so the
        batches that follow are not the ones an uninterrupted run would have seen).
        """
        world, model = self.world, trainer.model
        meta = read_meta(path)
        saved = load_sharded_checkpoint(path, model.sharded_collections())
        model.load_dense_state_dict({k: v.to(trainer.device) for k, v in saved["dense"]["model"].items()})
        load_dense_optimizer(trainer.optimizer, saved["dense"]["dense_optimizer"], path)
        if meta["world_size"] == world.size:
            mine = load_torch_file(path / f"rank-{world.rank}.pt", f"sharded checkpoint {path}: rank-{world.rank}.pt",
                                   ShardedCheckpointError, map_location="cpu")
            trainer.loader.load_state_dict(mine["loader"])
            epoch, batch = int(mine["loader"]["epoch"]), int(mine["loader"]["batches"])
            set_rng_state(mine["rng"])
            best = mine.get("best_model")
            trainer.best_weights = cpu_copy(best) if best is not None else None
            progress = mine.get("early_stopping", {})
        else:
            progress = {}  # this rank's part of the best epoch's weights was another part of the tables
            epoch, batch = int(saved["extra"]["epoch"]), int(saved["extra"]["batch"]) * meta["world_size"] // world.size
            if batch >= trainer.steps_per_epoch:
                epoch, batch = epoch + 1, 0
            trainer.loader.load_state_dict({**trainer.loader.state_dict(), "epoch": epoch, "batches": batch})
            if world.is_writer:
                print(f"[train] resuming {meta['world_size']}-rank checkpoint {path} on {world.size} ranks: weights "
                      f"and optimizer states resharded; data resumes at epoch {epoch}, batch {batch}; early stopping "
                      "keeps the best epoch from here", flush=True)
        return (LoopState(step=int(meta["step"]), epoch=epoch, batch=batch, **progress),
                {"saved_by_ranks": meta["world_size"], "ranks": world.size})

    def model_state(self, model: nn.Module, spec: dict, restored: bool) -> dict[str, torch.Tensor] | None:
        """The weights ``model`` holds now as one process's model of ``spec`` holds them, on the writer rank; None
        on the others. They are read from the newest checkpoint, unless ``restored`` (early stopping put an earlier
        epoch's weights back): then every rank writes its part of the tables into a folder that the writer reads
        back whole, then removes. Every rank calls it."""
        source = self.latest()
        if restored:
            source = self.folder / f"model{_SHARDED}"
            if self.world.is_writer:
                shutil.rmtree(source, ignore_errors=True)
            self.world.barrier()
            save_sharded_checkpoint(source, model.sharded_collections(), dense={"model": model.dense_state_dict()})
        if not self.world.is_writer:
            return None
        plain = model_from_spec(spec, backend="torch")
        state = load_sharded_checkpoint(source, {"embedding": plain.embedding})
        plain.load_state_dict({**plain.state_dict(), **state["dense"]["model"]})
        if restored:
            shutil.rmtree(source, ignore_errors=True)
        return plain.state_dict()


def _to_lists(value: Any) -> Any:
    return [_to_lists(v) for v in value] if isinstance(value, (tuple, list)) else value


def _to_tuples(value: Any) -> Any:
    return tuple(_to_tuples(v) for v in value) if isinstance(value, (tuple, list)) else value



def load_dense_optimizer(optimizer: torch.optim.Optimizer, state: dict, path: Path) -> None:
    """Restore the dense optimizer's ``state``, saved in ``path``; one of another optimizer (its groups' settings
    differ: Adam's betas, SGD's momentum) is refused, as torch would take it and fail at the first step."""
    saved = {key for group in state["param_groups"] for key in group} - {"params"}
    mine = {key for group in optimizer.param_groups for key in group} - {"params"}
    if saved != mine:
        raise UserError(f"train.resume=true, but the checkpoint {path} holds the state of another dense optimizer "
                        f"than {type(optimizer).__name__}: resume with the train.optimizer the run was trained with, "
                        "or rerun without train.resume")
    optimizer.load_state_dict(state)
