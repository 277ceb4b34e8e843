"""``compute``: ``dask.compute`` with progress (:mod:`pipeline.progress`), on threads (per task) or on a
distributed client (per result).

Example::

    counts, = compute(ddf["C1"].value_counts(), desc="fit", progress="plain")
"""

from __future__ import annotations

import time
from typing import Any

from pipeline.progress import Progress, progress_mode


def compute(*collections: Any, desc: str = "dask", progress: str | bool = "auto") -> tuple:
    """Compute Dask collections together, showing the finished tasks as ``progress`` asks."""
    import dask

    client = current_client()
    if client is not None:
        leaves: list = []
        shape = _flatten(collections, leaves)
        futures = client.compute(leaves)
        with Progress(desc, total=len(futures), unit="result", mode=progress) as bar:
            _wait_all(client, futures, bar.update, desc)
        return _rebuild(shape, iter(client.gather(futures)))
    if progress_mode(progress) == "off":
        return dask.compute(*collections)
    with _ProgressCallback(desc, progress):
        return dask.compute(*collections)


WORKERS_CHECK_S = 10.0
"""How often a computation on a cluster that finishes nothing checks that the cluster has workers."""


def _wait_all(client: Any, futures: list, finished: Any, desc: str) -> None:
    """Wait for ``futures``, calling ``finished(n)`` as they finish; every :data:`WORKERS_CHECK_S` seconds in which
    none finishes, say so if the cluster has no worker left to run them (it would wait for one without a word).

    The futures report to a queue as they finish: ``distributed.wait`` with a timeout raises, and its exception keeps
    the futures in a reference cycle, so that a computation longer than the timeout left its tasks held on the
    scheduler until Python's next garbage collection (a second fit of the same data then took the first one's
    results)."""
    import queue

    ended: queue.SimpleQueue = queue.SimpleQueue()
    for future in futures:
        future.add_done_callback(ended.put)
    left, idle_since = len(futures), time.monotonic()
    while left:
        try:
            ended.get(timeout=WORKERS_CHECK_S)
        except queue.Empty:
            _say_why_nothing_runs(client, desc, time.monotonic() - idle_since)
            continue
        count = 1
        while not ended.empty():
            ended.get()
            count += 1
        left -= count
        finished(count)
        idle_since = time.monotonic()


def _say_why_nothing_runs(client: Any, desc: str, waited: float) -> None:
    """Say so where the cluster has no worker to run anything, or only paused ones (Dask pauses a worker whose
    memory passed ``distributed.worker.memory.pause`` of its limit, until it falls back): it would wait without a
    word."""
    workers = client.scheduler_info().get("workers") or {}
    address = client.scheduler.address
    if not workers:
        print(f"[etl] {desc}: the Dask cluster at {address} has no workers, waiting {waited:.0f} s for one; start "
              f"workers (`dask worker {address}`) or stop with Ctrl-C", flush=True)
    elif all(worker.get("status") == "paused" for worker in workers.values()):
        print(f"[etl] {desc}: every worker of the Dask cluster at {address} is paused, its memory past its share "
              f"that Dask pauses at (distributed.worker.memory.pause); waiting {waited:.0f} s for memory to free; "
              "give the workers more memory (fewer etl.workers) or stop with Ctrl-C", flush=True)


def _flatten(value: Any, leaves: list) -> Any:
    """The nesting of dicts / lists / tuples around Dask collections, with the collections moved to ``leaves``."""
    import dask

    if isinstance(value, dict):
        return {k: _flatten(v, leaves) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_flatten(v, leaves) for v in value)
    if dask.is_dask_collection(value):
        leaves.append(value)
        return _Leaf()
    return value


class _Leaf:
    """Where a computed collection goes back in :func:`_rebuild`."""


def _rebuild(shape: Any, results: Any) -> Any:
    if isinstance(shape, dict):
        return {k: _rebuild(v, results) for k, v in shape.items()}
    if isinstance(shape, (list, tuple)):
        return type(shape)(_rebuild(v, results) for v in shape)
    return next(results) if isinstance(shape, _Leaf) else shape


def current_client() -> Any:
    """The distributed Client this process works with, or None (no cluster, or distributed missing)."""
    try:
        from distributed import get_client
    except ImportError:
        return None
    try:
        return get_client()
    except ValueError:
        return None


def task_slots() -> int:
    """The tasks :func:`current_client`'s cluster runs at once, its workers' threads, at least 1 (1 without a client:
    this process)."""
    client = current_client()
    return max(1, sum(client.nthreads().values())) if client is not None else 1


class _ProgressCallback:
    """A dask local-scheduler callback that counts finished tasks."""

    def __init__(self, desc: str, progress: str | bool):
        from dask.callbacks import Callback

        bar_holder: dict[str, Any] = {}

        class _Callback(Callback):
            def _start_state(self, dsk, state):
                tasks = sum(len(state[k]) for k in ("ready", "waiting", "running", "finished"))  # not the data keys
                bar_holder["bar"] = Progress(desc, total=tasks, unit="task", mode=progress)

            def _posttask(self, key, result, dsk, state, worker_id):
                bar_holder["bar"].update(1)

            def _finish(self, dsk, state, errored):
                bar_holder.pop("bar").close()

        self._callback = _Callback()

    def __enter__(self) -> None:
        self._callback.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._callback.__exit__(*exc)
