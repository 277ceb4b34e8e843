"""``Loader``: batches from the ETL's parquet files, read ahead by a background thread.

The shard is read in windows of about ``window_rows`` rows (a multiple of the batch size). A
producer thread keeps ``read_threads`` windows being read by a small pool of reader threads: a
thread reads a window's row groups with pyarrow (one call per file, decoded on pyarrow's threads,
without the GIL), checks them and packs them into the window's one int32 block, in a pinned buffer
when the target is a GPU; the first window of an epoch is cut between row groups into parts that all
the threads read side by side, so the first batches wait for a part, not for a whole window. Per
window the producer then makes the window on the target device: on a GPU, one asynchronous copy
of the block on a side CUDA stream, the rows permuted there by an order computed there, the
columns laid out so that every batch is a view; it records one event that the consumer's stream
waits on before the window's first batch, so loading overlaps compute, and
queues the window's batches (views of it) as one item: the host's work per batch is nothing but
the training thread taking the next one from a list. With ``reader="cudf"`` (a GPU only; what
``reader="auto"`` picks on a GPU where cuDF imports) the reader threads read a window's row groups
with cuDF straight into device memory and build the block there (:mod:`pipeline.loader.cudf_read`),
skipping the host's decoding and the pinned copy; what follows the block is the same for both
readers. Windows wait in a bounded queue; an error in a thread is put on the queue
and raised in the consumer; stopping (``break``, :meth:`Loader.close`, ``with``, garbage
collection) sets a stop event that the producer checks between windows and in its timed ``put``,
and joins it (and the readers).

Order, sharding and the remainder (see :mod:`pipeline.loader.plan`): rank ``r`` of ``world_size``
gets a contiguous part of the epoch's row-group sequence, every rank the same number of rows and
batches. With ``drop_last=False`` every row is read once per epoch; the last ranks are padded with
fewer than ``world_size`` rows taken again from the start of the epoch, always the last
:attr:`Loader.padding` rows of that rank's last batch (0 on a single rank). With ``drop_last=True``
the remainder of ``N / world_size`` and each rank's short last batch are dropped.

Resuming: ``state_dict()`` says which epoch is running and how many of its batches were handed
out; after ``load_state_dict(state)`` the next iteration starts exactly at the next batch, reading
from the window that holds it, not from the start of the epoch. The batches do not depend on the
device, the reader or ``read_threads``.

Example::

    loader = Loader("data/synthetic/processed/train", batch_size=4096, shuffle=True, seed=0,
                    device="cuda", rank=rank, world_size=world_size)
    for epoch in range(loader.epoch, epochs):
        for batch in loader:            # one epoch; the next ``for`` runs the next epoch
            loss = model(batch.dense, batch.sparse, batch.label)
            checkpoint["loader"] = loader.state_dict()
"""

from __future__ import annotations

import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.errors import UserError
from pipeline.loader import collate, cudf_read, plan
from pipeline.loader.batch import Batch
from pipeline.loader.decode import Chunk, Split, find_files, join_bags, new_block, open_split, read_into
from pipeline.loader.pinned import PinnedPool
from pipeline.schema import Schema

STATE_VERSION = 2
WINDOW_ROWS = 1 << 21
"""Rows of a window by default: enough for the cudf reader's one call per window to pay (docs/BENCHMARKS.md, "The
cudf reader a window at a time"), and the same for every reader and device, since the window is what the shuffle
mixes (the batches depend on it)."""


class LoaderStateError(UserError, ValueError):
    """A saved loader state that cannot resume this loader exactly (other settings or data)."""


class Loader:
    """Iterates batches of a processed split, one epoch per ``for`` loop.

    Args:
        data: a split folder (``processed/train``, read as ``part-*.parquet`` in natural order), a
            parquet file, or a list of files.
        batch_size: samples per batch, per rank.
        schema: the ETL's schema (a :class:`Schema` or a path); default ``<data>/../schema.json``.
        shuffle: shuffle the row-group order and the rows within a window, seeded by ``(seed, epoch)``.
        seed: the shuffling seed.
        drop_last: drop the short last batch (and the rows that do not divide among ranks).
        rank, world_size: this process's shard for distributed training.
        device: where batches land (``"cpu"``, ``"cuda"``, ``"cuda:1"``, a ``torch.device``).
        window_rows: about how many rows are read, copied to the device and shuffled together: at
            least 4 of the largest row group (a row group that two windows share is read by both), at
            most the rows of a rank, rounded up to a multiple of ``batch_size``. On a GPU, the pyarrow
            reader holds ``read_threads + 1`` pinned host buffers of a window each.
        prefetch: windows made ahead (their batches ready) and waiting in the queue.
        read_threads: windows read at once (pyarrow: each decoded on pyarrow's threads, an epoch's first window
            read by all of them in parts; default 4, at most the CPU cores; cudf: default 2).
        validate: check nulls, labels and id ranges while reading (cheap; on by default).
        reader: ``"pyarrow"`` (row groups decoded on the host), ``"cudf"`` (decoded by cuDF into GPU
            memory; needs ``device="cuda"`` and cuDF) or ``"auto"``: cudf on a GPU where cuDF imports, else
            pyarrow. Every reader gives the same batches.
    """

    def __init__(
        self,
        data: str | Path | Sequence[str | Path],
        batch_size: int,
        *,
        schema: Schema | str | Path | None = None,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
        device: str | torch.device = "cpu",
        window_rows: int = WINDOW_ROWS,
        prefetch: int = 1,
        read_threads: int | None = None,
        validate: bool = True,
        reader: str = "auto",
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size: expected a positive number, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"expected 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if reader not in cudf_read.READERS:
            raise ValueError(f"reader: expected one of {cudf_read.READERS}, got {reader!r}")
        reader = cudf_read.choose(reader, device)
        read_threads = read_threads or (2 if reader == "cudf" else min(4, os.cpu_count() or 1))
        for name, value in (
            ("window_rows", window_rows),
            ("prefetch", prefetch),
            ("read_threads", read_threads),
        ):
            if value < 1:
                raise ValueError(f"{name}: expected a positive number, got {value}")
        files = find_files(data)
        if schema is None:
            if not isinstance(data, (str, Path)):
                raise ValueError("schema: give the schema (or its path) when data is a list of files")
            schema = files[0].parent.parent / "schema.json"
        self.schema = schema if isinstance(schema, Schema) else Schema.load(schema)
        self._split: Split = open_split(files, self.schema)
        self.batch_size = batch_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.rank, self.world_size = rank, world_size
        self.device = _target(device)
        self.prefetch, self.read_threads, self.validate = prefetch, read_threads, validate
        self.reader = reader
        self._placement = collate.SparsePlacement.of(self.schema.sparse, self.schema.multihot,
                                                     len(self.schema.continuous), self.schema.dynamic)
        first = self._shard(0)
        self.rows_per_rank, self.padding, self._batches = first.rows, first.padding, first.batches
        largest = max(g.rows for g in self._split.groups)
        self.window_rows = _round_up(min(max(window_rows, 4 * largest), max(1, self.rows_per_rank)), batch_size)
        if self._batches == 0:
            raise UserError(
                f"{self.total_rows} rows over {world_size} rank(s) give {self.rows_per_rank} rows per rank, "
                f"fewer than batch_size={batch_size}: no batch with drop_last=True"
            )
        self.epoch = 0
        self._consumed = 0
        self._resume_at = 0
        self._active: _Producer | None = None
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._pool = None
        if self._stream is not None and reader == "pyarrow":
            # The windows being read, and one whose copy to the device may be in flight.
            self._pool = PinnedPool(count=self.read_threads + 1, numel=self._split.block_rows * self.window_rows)

    @property
    def total_rows(self) -> int:
        """Rows in the split (all ranks together)."""
        return self._split.rows

    @property
    def files(self) -> list[Path]:
        return list(self._split.files)

    def __len__(self) -> int:
        """Batches per epoch on this rank (the same on every rank)."""
        return self._batches

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration run ``epoch`` from its first batch."""
        self.epoch, self._consumed, self._resume_at = epoch, 0, 0

    def state_dict(self) -> dict[str, Any]:
        """Where training stands: the running epoch and the batches of it already handed out."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "batches": self._consumed,
            **self._fingerprint(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration runs ``state["epoch"]`` from batch ``state["batches"]`` on."""
        if state.get("version") != STATE_VERSION:
            raise LoaderStateError(f"loader state version {state.get('version')}, expected {STATE_VERSION}")
        differ = [
            f"{k}: saved {state.get(k)!r}, now {v!r}" for k, v in self._fingerprint().items() if state.get(k) != v
        ]
        if differ:
            raise LoaderStateError(
                "the loader state was saved with other settings, so it cannot resume exactly: " + "; ".join(differ)
            )
        if not 0 <= state["batches"] <= self._batches:
            raise LoaderStateError(f"loader state: batches={state['batches']}, expected 0..{self._batches}")
        self._stop_active()
        self.epoch, self._consumed, self._resume_at = int(state["epoch"]), int(state["batches"]), int(state["batches"])

    def __iter__(self) -> Iterator[Batch]:
        self._stop_active()
        if self._batches and self._consumed >= self._batches and not self._resume_at:
            # the last iteration handed out its epoch's last batch and was left there (``islice(loader, len(loader))``)
            self.epoch, self._consumed = self.epoch + 1, 0
        epoch, start = self.epoch, self._resume_at
        self._resume_at = 0
        producer = _Producer(self, epoch, start)
        self._active = producer
        self._consumed = start
        try:
            producer.start()
            while True:
                item = producer.get()
                if item is None:
                    break
                batches, arrival = item
                if arrival is not None:  # a window made on the loader's stream
                    stream = torch.cuda.current_stream(self.device)
                    stream.wait_event(arrival.ready)
                    arrival.window.record_stream(stream)
                for batch in batches:
                    self._consumed += 1
                    yield batch
            self.epoch, self._consumed = epoch + 1, 0
        finally:
            producer.stop()
            if self._active is producer:
                self._active = None

    def close(self) -> None:
        """Stop the background thread of a running iteration (iterating again later is allowed)."""
        self._stop_active()

    def __enter__(self) -> Loader:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self._stop_active()
        except Exception:  # noqa: BLE001, S110  (a finalizer must not raise)
            pass

    def __repr__(self) -> str:
        return (
            f"Loader({len(self._split.files)} files, {self.total_rows} rows, batch_size={self.batch_size}, "
            f"batches={self._batches}, rank={self.rank}/{self.world_size}, shuffle={self.shuffle}, "
            f"device={self.device}, reader={self.reader})"
        )

    def _fingerprint(self) -> dict[str, Any]:
        return {
            "rows": self.total_rows,
            "batch_size": self.batch_size,
            "world_size": self.world_size,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "drop_last": self.drop_last,
            "window_rows": self.window_rows,
        }

    def _shard(self, epoch: int) -> plan.Shard:
        groups = plan.group_order(self._split.groups, self.shuffle, self.seed, epoch)
        return plan.plan_shard(groups, self.rank, self.world_size, self.batch_size, self.drop_last)

    def _stop_active(self) -> None:
        active, self._active = self._active, None
        if active is not None:
            active.stop()


_END = None


@dataclass(frozen=True)
class _Arrival:
    """A window made on the loader's CUDA stream: ``ready`` once its kernels are done."""

    ready: torch.cuda.Event
    window: collate.Window


class _Producer:
    """One epoch's background thread: has windows read, makes them on the device, queues their batches."""

    def __init__(self, loader: Loader, epoch: int, start_batch: int) -> None:
        self._split = loader._split
        self._placement = loader._placement
        self._device = loader.device
        self._stream = loader._stream
        self._pool = loader._pool
        self._validate = loader.validate
        self._reader = loader.reader
        self._read_threads = loader.read_threads
        self._batch_size = loader.batch_size
        self._shard = loader._shard(epoch)
        self._windows = plan.windows(self._shard, loader.window_rows, loader.batch_size, start_batch)
        self._order_seed = (loader.shuffle, loader.seed, epoch, loader.rank)
        # The order is made where the rows are permuted: on the device, but on the host for the
        # CPU and for multi-hot bags (permuted on the host).
        self._host_order = self._device.type == "cpu" or bool(self._split.schema.multihot)
        self._queue: queue.Queue = queue.Queue(maxsize=loader.prefetch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pipeline-loader", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def get(self) -> tuple[list[Batch], _Arrival | None] | None:
        """The next window's batches and, on a GPU, its arrival; ``None`` at the end. Re-raises the thread's error."""
        while True:
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                if self._stop.is_set():
                    raise RuntimeError("this iteration was stopped (close(), or a new iteration of the same loader)")
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the loader thread ended without a result")
                continue
            if isinstance(item, BaseException):
                raise item
            return item

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        executor = ThreadPoolExecutor(self._read_threads, thread_name_prefix="pipeline-loader-read")
        try:
            if self._stream is not None:
                with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
                    self._produce(executor)
            else:
                self._produce(executor)
            self._put(_END)
        except BaseException as err:  # noqa: BLE001  (handed to the consumer, who re-raises it)
            self._put(err)
        finally:
            executor.shutdown(wait=True, cancel_futures=True)
            if self._stream is not None:
                self._stream.synchronize()  # no copy out of the pool's buffers is left in flight
            if self._pool is not None:
                self._pool.clear()

    def _produce(self, executor: ThreadPoolExecutor) -> None:
        upcoming = iter(self._windows)
        reads: deque[Callable[[], tuple[Chunk, np.ndarray | None]]] = deque()

        def read_next() -> None:
            window = next(upcoming, None)
            if window is not None:
                reads.append(self._read(executor, window))

        for _ in range(self._read_threads):
            read_next()
        for window in self._windows:
            if self._stop.is_set():
                return
            chunk, order = reads.popleft()()
            read_next()
            if order is None and not self._host_order:
                order = self._order(window, self._device)
            made = collate.make_window(chunk, self._placement, self._device, self._batch_size, order, self._pool)
            arrival = None
            if self._stream is not None:
                arrival = _Arrival(torch.cuda.Event(), made)
                arrival.ready.record(self._stream)
            if not self._put(([made.batch(begin, end) for begin, end in window.batch_bounds], arrival)):
                return

    def _read(self, executor: ThreadPoolExecutor,
              window: plan.Window) -> Callable[[], tuple[Chunk, np.ndarray | None]]:
        """Have ``window`` read; returns what waits for it: its chunk, and its order when made on the host.

        With the pyarrow reader, the first window of an iteration (what the consumer waits for before its first
        batch: all of a small split, the valid one at each evaluation) is cut between row groups into up to
        ``read_threads`` parts that the reader threads read and pack side by side into its block, so it is ready in
        about the time of one part; every later window is read whole by one thread while others are read ahead
        (as fast: reading every window in parts read fewer rows a second)."""
        segments = plan.window_segments(self._shard, window.start, window.stop)
        order = executor.submit(self._order, window, "cpu") if self._host_order else None
        if self._reader == "cudf":
            whole = executor.submit(cudf_read.read_window, self._split, segments, self._validate, self._device)
            return lambda: (whole.result(), order.result() if order else None)
        parts = plan.window_parts(segments, self._read_threads if window is self._windows[0] else 1)
        block, buffer = new_block(self._split, window.stop - window.start, self._pool, self._stop)
        ends = np.cumsum([0] + [sum(s.rows for s in part) for part in parts])
        reading = [executor.submit(read_into, self._split, part, block[:, lo:hi], self._validate)
                   for part, lo, hi in zip(parts, ends, ends[1:])]

        def result() -> tuple[Chunk, np.ndarray | None]:
            try:
                bags = join_bags([part.result() for part in reading])  # the first bad part in row order raises
            except BaseException:
                futures.wait(reading)  # no part writes into the buffer once it is given back
                if buffer is not None:
                    self._pool.release(buffer)
                raise
            return Chunk(block, bags, buffer), order.result() if order else None

        return result

    def _order(self, window: plan.Window, device: torch.device | str) -> np.ndarray | torch.Tensor | None:
        shuffle, seed, epoch, rank = self._order_seed
        real = max(0, min(window.stop, self._shard.rows - self._shard.padding) - window.start)
        return plan.window_order(window.stop - window.start, real, shuffle, seed, epoch, rank, window.index, device)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _target(device: str | torch.device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda":
        from pipeline.device import DeviceError, gpu_problem

        problem = gpu_problem()
        if problem:
            raise DeviceError(f"the loader was asked for device {device}, but {problem}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise ValueError(f"device: expected cpu or cuda, got {device}")
    return device
