"""What a serving instance of the embedding lookup does besides looking up: built from Triton's
``initialize`` arguments, refreshed to new store versions, and reporting its cache counters.

Used by the ``embedding`` model and by the fused model (embedding and dense in one model). Every 0.2 s a
background thread switches to a newer store version (so an instance that gets no request switches
too, and lets go of the versions export prunes) and writes the counters to
``stats/instance-<pid>-<start>.json`` beside the store, with the identity of its process (boot, pid, start
time); :func:`live_stats` reads only the files whose process still runs, so a file left by an instance that
crashed or by an earlier server never counts, even where its pid now belongs to another process. A clean
stop (``finalize``) removes the instance's file, and an instance that starts removes the files of processes
that are gone (their half-written ``.tmp`` files too). Beside the cache counters the file holds the host time
the model spent in each phase of its batches (``phases_ns``: the store version's refresh, reading the inputs,
preprocess, lookup, dense, writing the outputs) and the number of batches, so a benchmark can say where a served request's time goes. The model also refreshes before each batch, so the first request after an update gets the
new version.
A ``KIND_GPU`` instance caches hot rows in its GPU's memory, and its pooled embeddings stay there.

Example (inside a ``model.py``)::

    self.instance = LookupInstance(args, params, pb_utils.Logger.log_error)
    self.instance.refresh()                               # before each batch
    pooled = self.instance.pooled(features)                 # the embedding model
    scores = self.instance.scored(features, dense_part)   # the fused model: lookup and dense part together
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from export.cache import Rows
from export.lookup import EmbeddingLookup, LookupConfig, ResidentRows
from export.preprocess import CATEGORICAL_IDS, MULTIHOT_IDS, MULTIHOT_LENGTHS
from pipeline.files import write_text

if TYPE_CHECKING:
    from export.cache_torch import CachedRows

STATS_EVERY_S = 0.2
STATS_FOLDER = "stats"


def pin_to_core(args: dict, params: dict[str, str]) -> int | None:
    """With the model parameter ``pin_cores`` (``export.pin_instances``), every thread of this instance's process runs
    on one core from now on, and returns it: of the cores the server may use, the instance's number-th counted from
    the last (Triton names an instance ``<model>_<group>_<index>``; the export writes one group per instance, so its
    number is its group's plus its index), so two instances of a model share a core only when there are more instances
    than cores. Else None, and the threads stay where they may run.

    A python model's instance computes one request at a time; with several instances taking requests in turn, each
    finds its data gone from a core's caches that others used meanwhile, unless it keeps to a core of its own."""
    if params.get("pin_cores") != "true" or not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    group, index = (str(args.get("model_instance_name", "")).rsplit("_", 2) + ["", ""])[1:3]
    number = sum(int(part) for part in (group, index) if part.isdigit())
    core = cores[-1 - number % len(cores)]
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task.name), {core})
    return core


def process_identity(pid: int) -> str | None:
    """``<boot id>:<pid>:<start time>`` of the running process ``pid``, or None where there is none: two processes
    never share it, also when the kernel gives a finished process's pid to a new one. A process that ended and is
    not reaped yet (a zombie: a killed server's stub until its new parent collects it) runs no more."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        state, start = fields[0], fields[19]
    except (OSError, IndexError):
        return None
    return None if state in ("Z", "X") else f"{boot}:{pid}:{start}"


def live_stats(model_dir: str | Path, prune: bool = False) -> list[dict]:
    """The counters in ``<model_dir>/stats`` of the instances whose process runs now; with ``prune``, the files
    of the others (a crashed instance, an earlier server, an older format) are removed."""
    live = []
    for path in sorted((Path(model_dir) / STATS_FOLDER).glob("instance-*.json")):
        try:
            stats = json.loads(path.read_text())
            alive = stats["process"] == process_identity(int(stats["pid"]))
        except FileNotFoundError:
            continue
        except (OSError, ValueError, KeyError, TypeError):
            alive = False
        if alive:
            live.append(stats)
        elif prune:
            path.unlink(missing_ok=True)
    if prune:
        for path in (Path(model_dir) / STATS_FOLDER).glob("instance-*.json.tmp"):
            if not _writer_runs(path):
                path.unlink(missing_ok=True)
    return live


def _writer_runs(tmp: Path) -> bool:
    """Whether the process named in ``instance-<pid>-<start>.json.tmp`` runs now (a killed one leaves its
    half-written file behind)."""
    try:
        pid, start = tmp.name[len("instance-"):-len(".json.tmp")].split("-")
        identity = process_identity(int(pid))
    except ValueError:
        return False
    return identity is not None and identity.split(":", 1)[1] == f"{pid}:{start}"


class LookupInstance:
    """An :class:`EmbeddingLookup` over ``<model dir>/store``, refreshed and its counters written in the background;
    ``log_error`` says why a new store version is not served."""

    def __init__(self, args: dict, params: dict[str, str], log_error: Callable[[str], None]) -> None:
        model_dir = Path(args["model_repository"])
        config = LookupConfig.load(model_dir / args["model_version"] / "layout.json")
        policy, device = params.get("cache_policy", "lru"), None
        if args.get("model_instance_kind") == "GPU" and policy != "none":
            import torch

            torch.cuda.set_device(int(args["model_instance_device_id"]))
            policy, device = f"gpu-{policy}", f"cuda:{args['model_instance_device_id']}"
        self.lookup = EmbeddingLookup(model_dir / "store", config, policy=policy,
                                      cache_fraction=float(params.get("cache_fraction", "0.25")), device=device,
                                      whole_mb=float(params.get("gpu_whole_tables_mb", "0")))
        self._identity = {"pid": os.getpid(), "process": process_identity(os.getpid())}
        start = self._identity["process"].rsplit(":", 1)[1]
        self._stats_path = model_dir / STATS_FOLDER / f"instance-{os.getpid()}-{start}.json"
        self._stats_path.parent.mkdir(exist_ok=True)
        live_stats(model_dir, prune=True)
        self._log_error = log_error
        self._lock = threading.Lock()  # one version per lookup: the background thread refreshes too
        self._file_lock = threading.Lock()  # no write after close removed the file
        self._closed = False
        self._phases_ns: dict[str, int] = {}
        self._timers: dict[str, _PhaseTimer] = {}
        self._batches = 0
        self._resident: ResidentRows | None = None
        self._resident_for: tuple | None = None
        self._stop = threading.Event()
        self._writer = threading.Thread(target=self._background_loop, daemon=True)
        self._writer.start()

    def refresh(self) -> None:
        """Switch to a newer store version; if it can't be opened, keep serving the current one and say so once."""
        with self._lock:
            try:
                self.lookup.refresh()
            except Exception as err:  # noqa: BLE001
                self._log_error(f"store version {self.lookup.version} kept, the new one in "
                                f"{self.lookup.store_root} could not be opened: {err}; it is not tried again "
                                "until another is written (export.update=true)")

    def pooled(self, inputs: dict[str, np.ndarray]) -> Rows:
        """The pooled embeddings of a batch's features: numpy, or a tensor on the instance's GPU (its rows cached
        there), which the dense part of the same process takes as it is."""
        with self._lock:
            return self.lookup(inputs.get(CATEGORICAL_IDS), inputs.get(MULTIHOT_IDS), inputs.get(MULTIHOT_LENGTHS))

    def scored(self, inputs: dict[str, np.ndarray],
               dense_part: Callable[[Rows | CachedRows], np.ndarray]) -> np.ndarray:
        """``dense_part`` of the batch's embeddings, timed as the phases ``lookup`` and ``dense``. On a GPU instance
        a batch of one-hot features reaches it as the rows where the instance's cache keeps them, the missed ones
        fetched into it first (:class:`CachedRows`, for the dense part's CUDA graph to gather: no gather and no copy
        of its own); any other batch as :meth:`pooled`'s answer (:meth:`EmbeddingLookup.rows_or_pooled`). Both
        under the lock, so no refresh rewrites the cached rows before the dense part has read them."""
        ids = inputs.get(CATEGORICAL_IDS), inputs.get(MULTIHOT_IDS), inputs.get(MULTIHOT_LENGTHS)
        with self._lock:
            with self.timed("lookup"):
                embeddings = self.lookup.rows_or_pooled(*ids)
            with self.timed("dense"):
                return dense_part(embeddings)

    def resident_scored(self, scored: Callable[[ResidentRows], np.ndarray | None]) -> np.ndarray | None:
        """``scored`` of the rows the lookup's device cache holds whole (:meth:`EmbeddingLookup.resident`, found
        again after each new store version), timed as the phase ``graph`` and under the lock, as :meth:`scored`; the
        batch's ids counted as hits. None where the cache does not hold them whole, or ``scored`` answers None: the
        batch then goes the usual way."""
        with self._lock:
            version = (self.lookup.version, self.lookup.refreshes)
            if self._resident_for != version:
                self._resident, self._resident_for = self.lookup.resident(), version
            if self._resident is None:
                return None
            with self.timed("graph"):
                answer = scored(self._resident)
            if answer is not None:
                self.lookup.count_resident(len(answer))
            return answer

    def timed(self, phase: str) -> _PhaseTimer:
        """A context that adds the host time of its block to ``phase``'s total (written with the counters:
        ``phases_ns``). Work the block queued on a GPU and did not wait for counts in the phase that waits for it.
        One object per phase, reused: a served request times six phases, and a generator-based context would build a
        generator for each of them."""
        timer = self._timers.get(phase)
        if timer is None:
            timer = self._timers[phase] = _PhaseTimer(self._phases_ns, phase)
        return timer

    def count_batch(self) -> None:
        """One more batch executed (the phases' totals are over ``batches``)."""
        self._batches += 1

    def close(self) -> None:
        """Stop the background thread and remove this instance's counters: a stopped instance serves nothing."""
        self._stop.set()
        self._writer.join(timeout=2)
        with self._file_lock:
            self._closed = True
            self._stats_path.unlink(missing_ok=True)

    def _background_loop(self) -> None:
        last = None
        while not self._stop.wait(STATS_EVERY_S):
            self.refresh()
            last = self._write(last)

    def _write(self, last: str | None) -> str:
        with self._lock:
            text = json.dumps({**self._identity, **self.lookup.stats(), "batches": self._batches,
                               "phases_ns": dict(self._phases_ns)})
        if text != last:
            with self._file_lock:
                if not self._closed:
                    write_text(self._stats_path, text)
        return text


class _PhaseTimer:
    """Adds the host time of each ``with`` block to ``totals[phase]`` (not re-entered: phases do not nest in
    themselves)."""

    __slots__ = ("_start", "phase", "totals")

    def __init__(self, totals: dict[str, int], phase: str) -> None:
        self.totals, self.phase, self._start = totals, phase, 0

    def __enter__(self) -> None:
        self._start = time.perf_counter_ns()

    def __exit__(self, *exc) -> None:
        self.totals[self.phase] = self.totals.get(self.phase, 0) + time.perf_counter_ns() - self._start
