"""Training runs side by side: each training writes its own folder under the training root, and
``latest`` names the newest one that finished.

Layout (``<workdir>/<dataset>/train``)::

    20261201-171500-dlrm/     model.json, model.pt, result.json, metrics.jsonl, checkpoints/ (see driver)
    20261201-173012-dcnv2/
    latest -> 20261201-173012-dcnv2

A run is finished once its ``result.json`` is written, the driver's last write; only then does
``latest`` (a relative symlink, replaced atomically) move to it, so a run that fails or is
interrupted leaves it on the previous finished run.

A run folder is locked while a process trains it (``.lock``, an ``flock`` that ends with the
process however it ends), so a second training of the same run at once is refused.

Example::

    with choose_run("data/synthetic/train", cfg.train) as folder:   # a new run, or the one train.resume continues
        ...                                                          # train into folder
    latest_run("data/synthetic/train")                               # the newest finished run, or None
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from pipeline.errors import UserError
from pipeline.files import FileLock, tmp_path
from pipeline.train.config import LATEST, TrainConfig


def new_run_name(model: str, when: float | None = None) -> str:
    """A readable name for a new run: its start in UTC and its model, e.g. ``20261201-171500-dlrm``."""
    return f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime(when))}-{model}"


def choose_run(root: str | Path, cfg: TrainConfig) -> RunLock:
    """The folder the training of ``cfg`` writes (created), locked: the run to resume with ``cfg.resume``
    (``cfg.run``, else the run most recently started or resumed), else ``cfg.run`` when it is not in
    use, else a new run of :func:`new_run_name` (``-2``, ``-3``, ... appended when that name is taken)."""
    root = Path(root)
    link = root / LATEST
    if link.exists() and not link.is_symlink():
        raise UserError(f"{link} is not the link to the newest finished run that training writes there: move it "
                        "away, then train")
    if cfg.resume and cfg.run:
        folder = root / cfg.run
        if not folder.is_dir():
            known = ", ".join(p.name for p in runs(root)) or "none"
            raise UserError(f"train.resume=true, but there is no run train.run={cfg.run} in {root} "
                            f"(runs there: {known}); name one of them, or leave train.resume=false for a new run")
        return RunLock(folder)
    if cfg.resume:
        newest = newest_run(root)
        if newest is not None:
            return RunLock(newest)
    if cfg.run:
        folder = root / cfg.run
        folder.mkdir(parents=True, exist_ok=True)
        lock = RunLock(folder)
        if any(p.name != LOCK_FILE for p in folder.iterdir()):
            lock.release()
            raise UserError(f"train.run={cfg.run}: {folder} already holds a run; continue it with train.resume=true, "
                            "or choose another train.run")
        return lock
    root.mkdir(parents=True, exist_ok=True)
    name = new_run_name(cfg.model)
    folder, n = root / name, 1
    while True:
        try:
            folder.mkdir()
            return RunLock(folder)
        except FileExistsError:
            n += 1
            folder = root / f"{name}-{n}"


LOCK_FILE = ".lock"


class RunLock(FileLock):
    """An exclusive lock on the run ``folder`` while this process trains it (``flock`` on ``folder/.lock``); a
    context manager that gives the folder and releases the lock. Refused with :class:`UserError` when another
    process holds it."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        super().__init__(folder / LOCK_FILE, f"the run {folder} is being trained by another process now; wait for it "
                         "to end, or choose another train.run")

    def __enter__(self) -> Path:
        return self.folder


def runs(root: str | Path) -> list[Path]:
    """The runs under ``root`` (folders with a ``model.json``), the one most recently started or resumed last."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name != LATEST and not p.is_symlink() and (p / "model.json").is_file()]
    return sorted(found, key=lambda p: ((p / "model.json").stat().st_mtime_ns, p.name))


def newest_run(root: str | Path) -> Path | None:
    """The run most recently started or resumed, finished or not; None when there is none."""
    found = runs(root)
    return found[-1] if found else None


def is_finished(folder: str | Path) -> bool:
    """Whether the run in ``folder`` finished: its model, weights and ``result.json`` are written."""
    folder = Path(folder)
    return all((folder / name).is_file() for name in ("model.json", "model.pt", "result.json"))


def latest_run(root: str | Path) -> Path | None:
    """The newest finished run, which ``<root>/latest`` points at; None when there is none."""
    link = Path(root) / LATEST
    if not link.is_symlink():
        return None
    folder = Path(root) / os.readlink(link)
    return folder if is_finished(folder) else None


def mark_latest(folder: str | Path) -> None:
    """Point ``latest`` beside ``folder`` at it (a relative symlink, made aside and renamed over the old one)."""
    folder = Path(folder)
    link = folder.parent / LATEST
    aside = tmp_path(link)
    aside.unlink(missing_ok=True)
    os.symlink(folder.name, aside)
    os.replace(aside, link)
