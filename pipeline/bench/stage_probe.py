"""The training stage seen from inside, for ``bench e2e``: a :class:`~pipeline.train.loop.Callback` that
times a window of its steps with the loop's own timers, counts the host syncs of the steps after it
(on a GPU), profiles a few more, and then stops the run.

Example::

    probe = StageProbe(warmup=20, steps=200, sync_steps=20, profile_steps=0, batch=65536, rows=rows,
                       device=torch.device("cuda"), out=Path("bench-out"))
    try:
        train(settings, data, out / "train", schema=schema, world=World(device=device), callbacks=[probe])
    except StopRun:
        pass
    finally:
        probe.close()
    probe.window    # {"seconds", "samples", "steps", "regions": {"batch wait": ..., "step": ..., ...}}
"""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path

import torch

from pipeline.files import tmp_path, write_text
from pipeline.train.loop import Callback


class StopRun(Exception):
    """Ends the stage's run once the bench has what it needs."""


class StageProbe(Callback):
    """Times the stage's steps ``warmup + 1 .. warmup + steps`` with the loop's own timers, then counts the
    host syncs of ``sync_steps`` more (on a GPU), profiles ``profile_steps`` more, and stops the run."""

    def __init__(self, warmup: int, steps: int, sync_steps: int, profile_steps: int, batch: int, rows: int,
                 device: torch.device, out: Path) -> None:
        self.begin, self.end_window = warmup, warmup + steps
        self.end_syncs = self.end_window + sync_steps
        self.end = self.end_syncs + profile_steps
        self.batch, self.last_batch = batch, rows - (math.ceil(rows / batch) - 1) * batch
        self.device, self.out = device, out
        self.trainer = None
        self.last_step = 0
        self.samples = 0
        self.window: dict | None = None
        self.syncs: dict | None = None
        self.profile: str | None = None
        self.profile_also: dict[str, float] = {}
        """Seconds of the loop's work beside the steps that fell in the profiled ones (an evaluation, a checkpoint)."""
        self._start: tuple[float, dict] | None = None
        self._profiled_from: dict[str, float] = {}
        self._catcher = self._records = self._profiler = None

    def on_fit_start(self, trainer) -> None:
        self.trainer = trainer

    def on_step(self, trainer) -> None:
        step = self.last_step = trainer.state.step
        timings = trainer.timings
        if self.begin < step <= self.end_window:
            self.samples += self.batch if trainer.state.batch else self.last_batch
        if step == self.begin:
            sync(self.device)
            timings.mark("callbacks")
            self._start = (timings.last, dict(timings.seconds))
        if step == self.end_window:
            timings.mark("callbacks")
            sync(self.device)
            timings.mark("end sync")
            start, before = self._start
            regions = {k: v - before.get(k, 0.0) for k, v in timings.seconds.items()}
            self.window = {"seconds": timings.last - start, "samples": self.samples, "steps": step - self.begin,
                           "regions": {k: v for k, v in regions.items() if v > 0}}
            if self.end_syncs > step:
                self._count_syncs()
        if step == self.end_syncs and self._records is not None:
            self._stop_counting(step - self.end_window)
        if step == self.end_syncs and self.end > step:
            self._start_profile()
        if step == self.end:
            self._stop_profile()
            raise StopRun

    def close(self) -> None:
        """Undo what a run stopped halfway left switched on."""
        if self._records is not None:
            self._stop_counting(0)
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None

    def _count_syncs(self) -> None:
        self._catcher = warnings.catch_warnings(record=True)
        self._records = self._catcher.__enter__()
        warnings.filterwarnings("always", message=".*synchronizing CUDA operation")
        torch.cuda.set_sync_debug_mode("warn")

    def _stop_counting(self, steps: int) -> None:
        torch.cuda.set_sync_debug_mode(0)
        records, self._records = self._records, None
        self._catcher.__exit__(None, None, None)
        sites: dict[str, int] = {}
        for r in records:
            if "synchronizing CUDA operation" in str(r.message):
                site = f"{_short(r.filename)}:{r.lineno}"
                sites[site] = sites.get(site, 0) + 1
        count = sum(sites.values())
        self.syncs = {"steps": steps, "count": count, "per_step": count / steps if steps else None,
                      "sites": dict(sorted(sites.items(), key=lambda kv: -kv[1]))}

    def _start_profile(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities)
        self._profiled_from = dict(self.trainer.timings.seconds)
        self._profiler.start()

    def _stop_profile(self) -> None:
        if self._profiler is None:
            return
        sync(self.device)
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        seconds = self.trainer.timings.seconds
        self.profile_also = {region: seconds.get(region, 0.0) - self._profiled_from.get(region, 0.0)
                             for region in ("evaluation", "checkpoint")
                             if seconds.get(region, 0.0) > self._profiled_from.get(region, 0.0)}
        self.out.mkdir(parents=True, exist_ok=True)
        trace = self.out / "trace.json"
        partial = tmp_path(trace)
        profiler.export_chrome_trace(str(partial))
        os.replace(partial, trace)
        sort = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        write_text(self.out / "profile.txt", profiler.key_averages().table(sort_by=sort, row_limit=40) + "\n")
        self.profile = str(trace)


def sync(device: torch.device) -> None:
    """Wait for the work queued on a GPU (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _short(filename: str) -> str:
    """A source path from its package on: ``pipeline/train/loop.py``, ``torch/optim/adam.py``."""
    parts = filename.replace("\\", "/").split("/")
    for anchor in ("pipeline", "export", "torch"):
        if anchor in parts:
            return "/".join(parts[len(parts) - 1 - parts[::-1].index(anchor):])
    return filename
