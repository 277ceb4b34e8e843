"""``Loader``: batches from the ETL's parquet files, read ahead by a background thread.

A producer thread drives a small pool of reader threads that read row groups with pyarrow (which
releases the GIL), check them and pack each into one int32 block (in pinned memory when the target
is a GPU). The producer joins blocks into windows of a few row groups on the target device,
permutes a window's rows when shuffling, and cuts batches from it. On a GPU the copies and the
cutting run on a side CUDA stream; each batch carries an event that the consumer's stream waits on,
so loading overlaps compute. With ``reader="cudf"`` (a GPU only) the reader threads read row groups
with cuDF straight into device memory and build each block there (:mod:`pipeline.loader.cudf_read`),
skipping the pinned host copy; what follows the block is the same for both readers. Batches wait
in a bounded queue; an error in a thread is put on the queue and raised in the consumer; stopping
(``break``, :meth:`Loader.close`, ``with``, garbage collection) sets a stop event that the producer
checks between batches and in its timed ``put``, and joins it (and the readers).

Order, sharding and the remainder (see :mod:`pipeline.loader.plan`): rank ``r`` of ``world_size``
gets a contiguous part of the epoch's row-group sequence, every rank the same number of rows and
batches. With ``drop_last=False`` every row is read once per epoch; the last ranks are padded with
fewer than ``world_size`` rows taken again from the start of the epoch, always the last
:attr:`Loader.padding` rows of that rank's last batch (0 on a single rank). With ``drop_last=True``
the remainder of ``N / world_size`` and each rank's short last batch are dropped.

Resuming: ``state_dict()`` says which epoch is running and how many of its batches were handed
out; after ``load_state_dict(state)`` the next iteration starts exactly at the next batch, reading
from the window (a few row groups) that holds it, not from the start of the epoch.

Example::

    loader = Loader("data/synthetic/processed/train", batch_size=4096, shuffle=True, seed=0,
                    device="cuda", rank=rank, world_size=world_size)
    for epoch in range(loader.epoch, epochs):
        for batch in loader:            # one epoch; the next ``for`` runs the next epoch
            loss = model(batch.dense, batch.sparse, batch.label)
            checkpoint["loader"] = loader.state_dict()
"""

from __future__ import annotations

import functools
import os
import queue
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator, Sequence

import torch

from pipeline.errors import UserError
from pipeline.loader import collate, cudf_read, plan
from pipeline.loader.batch import Batch
from pipeline.loader.decode import Chunk, Split, find_files, open_split, read_segment
from pipeline.loader.pinned import PinnedPool
from pipeline.schema import Schema

STATE_VERSION = 1


class LoaderStateError(UserError, ValueError):
    """A saved loader state that cannot resume this loader exactly (other settings or data)."""


class Loader:
    """Iterates batches of a processed split, one epoch per ``for`` loop.

    Args:
        data: a split folder (``processed/train``, read as ``part-*.parquet`` in natural order), a
            parquet file, or a list of files.
        batch_size: samples per batch, per rank.
        schema: the ETL's schema (a :class:`Schema` or a path); default ``<data>/../schema.json``.
        shuffle: shuffle the row-group order and rows within a buffer, seeded by ``(seed, epoch)``.
        seed: the shuffling seed.
        drop_last: drop the short last batch (and the rows that do not divide among ranks).
        rank, world_size: this process's shard for distributed training.
        device: where batches land (``"cpu"``, ``"cuda"``, ``"cuda:1"``, a ``torch.device``).
        buffer_row_groups: about how many row groups are read and shuffled together.
        prefetch: batches made ahead and waiting in the queue.
        read_threads: row groups decoded in parallel (default: the CPU cores, at most 8).
        validate: check nulls, labels and id ranges while reading (cheap; on by default).
        reader: ``"pyarrow"`` (row groups decoded on the host) or ``"cudf"`` (decoded by cuDF into GPU
            memory; needs ``device="cuda"`` and cuDF). Both give the same batches.
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
        buffer_row_groups: int = 4,
        prefetch: int = 8,
        read_threads: int | None = None,
        validate: bool = True,
        reader: str = "pyarrow",
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size: expected a positive number, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"expected 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        read_threads = read_threads or min(8, os.cpu_count() or 1)
        for name, value in (
            ("buffer_row_groups", buffer_row_groups),
            ("prefetch", prefetch),
            ("read_threads", read_threads),
        ):
            if value < 1:
                raise ValueError(f"{name}: expected a positive number, got {value}")
        if reader not in cudf_read.READERS:
            raise ValueError(f"reader: expected one of {cudf_read.READERS}, got {reader!r}")
        if reader == "cudf":
            cudf_read.check(device)
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
        group_rows = self.schema.row_group_rows or -(-self._split.rows // len(self._split.groups))
        self.window_rows = max(1, round(buffer_row_groups * group_rows / batch_size)) * batch_size
        self._placement = collate.SparsePlacement.of(self.schema.sparse, self.schema.multihot,
                                                     len(self.schema.continuous))
        first = self._shard(0)
        self.rows_per_rank, self.padding, self._batches = first.rows, first.padding, first.batches
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
            block_rows = 1 + len(self.schema.continuous) + len(self._placement.keys) - len(self.schema.multihot)
            most = max(g.rows for g in self._split.groups)
            self._pool = PinnedPool(count=_lookahead(self.read_threads) + 2, numel=block_rows * most)

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
                batch, event = item
                if event is not None:
                    stream = torch.cuda.current_stream(self.device)
                    stream.wait_event(event)
                    batch.record_stream(stream)
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

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self._stop_active()
        except Exception:
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


class _Producer:
    """One epoch's background thread: reads windows, cuts batches, fills the queue."""

    def __init__(self, loader: Loader, epoch: int, start_batch: int) -> None:
        self._split = loader._split
        self._placement = loader._placement
        self._device = loader.device
        self._stream = loader._stream
        self._pool = loader._pool
        self._validate = loader.validate
        self._reader = loader.reader
        self._read_threads = loader.read_threads
        self._shard = loader._shard(epoch)
        self._windows = plan.windows(self._shard, loader.window_rows, loader.batch_size, start_batch)
        self._order_seed = (loader.shuffle, loader.seed, epoch, loader.rank)
        self._queue: queue.Queue = queue.Queue(maxsize=loader.prefetch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pipeline-loader", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def get(self) -> tuple[Batch, Any] | None:
        """The next batch and its CUDA event (or ``None``), ``None`` at the end; re-raises the thread's error."""
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
            if self._pool is not None:
                self._pool.reset()
            if self._stream is not None:
                with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
                    self._produce(executor)
            else:
                self._produce(executor)
            self._put(_END)
        except BaseException as err:  # handed to the consumer, who re-raises it
            self._put(err)
        finally:
            executor.shutdown(wait=True, cancel_futures=True)
            if self._stream is not None:
                self._stream.synchronize()  # no copy out of the pool's buffers is left in flight

    def _produce(self, executor: ThreadPoolExecutor) -> None:
        if not self._windows:
            return
        cuda = self._stream is not None
        if self._reader == "cudf":
            read = functools.partial(cudf_read.read_segment, self._split, validate=self._validate, device=self._device)
        else:
            read = functools.partial(
                read_segment, self._split, validate=self._validate, buffers=self._pool, stop=self._stop
            )
        reader = _SegmentReader(
            plan.shard_segments_from(self._shard, self._windows[0].start),
            read,
            executor,
            _lookahead(self._read_threads),
            self._device,
            self._pool,
        )
        real_rows = self._shard.rows - self._shard.padding
        shuffle, seed, epoch, rank = self._order_seed
        orders: dict[int, Future] = {}
        for i, window in enumerate(self._windows):
            if self._stop.is_set():
                return
            for ahead in self._windows[i : i + 2]:
                if ahead.index not in orders:
                    real = max(0, min(ahead.stop, real_rows) - ahead.start)
                    orders[ahead.index] = executor.submit(
                        plan.window_order, ahead.stop - ahead.start, real, shuffle, seed, epoch, rank, ahead.index
                    )
            pieces = reader.take(window.stop - window.start)
            order = orders.pop(window.index).result()
            device_window = collate.make_window(pieces, self._placement, self._device, order)
            for begin, end in window.batch_bounds:
                batch = device_window.batch(begin, end)
                event = None
                if cuda:
                    event = torch.cuda.Event()
                    event.record(self._stream)
                if not self._put((batch, event)):
                    return


class _SegmentReader:
    """Decoded segments in order, read ahead by an executor; :meth:`take` returns the next rows."""

    def __init__(
        self,
        segments: list[plan.Segment],
        read: Callable[[plan.Segment], Chunk],
        executor: ThreadPoolExecutor,
        lookahead: int,
        device: torch.device,
        pool: PinnedPool | None,
    ) -> None:
        self._read, self._executor = read, executor
        self._device, self._pool = device, pool
        self._segments = iter(segments)
        self._pending: deque[Future] = deque()
        self._lookahead = lookahead
        self._chunk: Chunk | None = None
        self._offset = 0

    def take(self, rows: int) -> list[collate.Piece]:
        pieces = []
        while rows:
            if self._chunk is None or self._offset == self._chunk.rows:
                self._chunk, self._offset = self._next(), 0
            n = min(rows, self._chunk.rows - self._offset)
            pieces.append(collate.Piece(self._chunk, self._offset, self._offset + n))
            self._offset += n
            rows -= n
        return pieces

    def _next(self) -> Chunk:
        while len(self._pending) < self._lookahead:
            segment = next(self._segments, None)
            if segment is None:
                break
            self._pending.append(self._executor.submit(self._read, segment))
        if not self._pending:
            raise RuntimeError("the shard plan asked for more rows than its segments hold")
        chunk = self._pending.popleft().result()
        if self._device.type == "cuda":
            collate.upload(chunk, self._device, self._pool)  # frees its pinned buffer for the next read
        return chunk


def _lookahead(read_threads: int) -> int:
    """Row groups read ahead of the producer (each holds a pinned buffer until the producer takes it)."""
    return 2 * read_threads


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
