"""A training loop's batches one step ahead: on N ranks the next batch's id exchange under way (TorchRec's
``TrainPipelineSparseDist`` in its simplest shape); on one process with host-cached or dynamic tables the
next batch's lookup prepared (TorchRec's prefetch pipeline): its rows on their way into the device caches,
its ids placed in the dynamic tables.

``SparseDistPipeline(dmp, device)`` wraps an epoch's iterator of :class:`~pipeline.loader.Batch`.
Before it hands out batch ``i`` it has read batch ``i + 1`` from the loader, moved it to the device
and started its input dist (:class:`~pipeline.distributed.embedding.StartedInputDist` in place of
its ``sparse``), so that exchange runs while batch ``i``'s forward, backward and optimizer do; the
model's sharded ``embedding`` waits for it at the start of step ``i + 1``. The batches, their order
and every computation are those of a plain loop, so both train the same weights; only the loader is
one batch further (a caller that saves the loader's position counts the batches it consumed). An
epoch's last batch has nothing ahead of it.

On CUDA the copy and the launch run on a side stream that first waits for the work queued on the
compute stream (so no memory of an earlier batch is reused while that work may still read it); the
compute stream waits for the side stream's event before a batch is used. No host synchronization is
added. On CPU there are no streams and gloo runs the exchange on its own threads.

``PrefetchPipeline(model, device)`` does the same for a model whose embedding prefetches
(:attr:`~pipeline.modules.collection.EmbeddingCollection.prefetches`: a
:class:`~pipeline.modules.cached_collection.HostCachedCollection`, or a collection with dynamic tables): it hands
out batch ``i`` with its ``sparse`` already prefetched (:class:`~pipeline.modules.collection.Prefetched`: its rows
copied into the caches, or its ids placed in the dynamic tables, whose new rows its lookup starts). Dynamic tables:
the prefetch runs when the loop asks for batch ``i``, after it queued batch ``i - 1``'s step, and after batch
``i - 1``'s evaluation and checkpoint, which therefore see the tables as a loop without the pipeline does (a
placement admits ids). On a GPU the prefetch's side stream waits for an event recorded before that step (when batch
``i`` was read, so its ids are ready, and every earlier step was queued), not for the step itself: the prefetch's
host waits and copies run while batch ``i - 1`` computes. Batch ``i + 1`` is read from the loader, and its event
recorded, before ``i`` is prefetched (so that event follows the step queued last but not the compute stream's wait
for ``i``'s prefetch), and prefetched only when the loop asks for it. Host-cached tables, whose prefetch changes no
value that an evaluation or a checkpoint reads
(:attr:`~pipeline.modules.collection.EmbeddingCollection.prefetches_during_step`): batch ``i + 1`` is prefetched
too when the loop asks for batch ``i``, before step ``i`` is queued, and the loader is two batches ahead. Batch
``i + 1`` was read before step ``i - 1`` was queued, so its books (where its rows go) wait only for the event
recorded then and run on the GPU beside step ``i - 1``; its copies wait for the event recorded when ``i + 2`` was
read, after step ``i - 1`` (the rows they write back or replace may be batch ``i - 1``'s, never batch ``i``'s), and
run beside step ``i``. The lookup of batch ``i + 1`` waits for them
(:attr:`~pipeline.modules.collection.Prefetched.ready`). The prefetch is queued by the loop's thread: on a thread
of its own it would take the interpreter's lock from the thread that queues the step and the one that queues its
backward (torch's autograd thread), and the host's queueing is what paces this step. A batch that does not fit its
caches raises its error when the loop asks for it; a batch prefetched and never trained (the loop stopped) leaves
only its rows in the caches, counted in their stats.

Example::

    pipeline = SparseDistPipeline(dmp, device)
    batches = pipeline(iter(loader))
    for batch in batches:
        loss = loss_of(dmp(batch.dense, batch.sparse), batch.label)   # waits for the started exchange
        ...
    batches.close()           # waits for an exchange still in flight (all ranks stop at the same batch)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import torch
from torch import nn

from pipeline.distributed.embedding import ShardedEmbeddingCollection, StartedInputDist
from pipeline.loader import Batch
from pipeline.modules.collection import EmbeddingCollection, Prefetched
from pipeline.modules.host_cache import CacheTooSmall


class SparseDistPipeline:
    """Makes an iterator of batches run one ahead through ``model.embedding``'s input dist."""

    def __init__(self, model: nn.Module, device: torch.device | str) -> None:
        embedding = model.embedding
        if not isinstance(embedding, ShardedEmbeddingCollection):
            raise TypeError(f"expected a model whose embedding is sharded, got {type(embedding).__name__}")
        self.embedding = embedding
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def __call__(self, batches: Iterator[Batch]) -> OneAhead:
        return OneAhead(batches, self)

    def start(self, batch: Batch) -> tuple[Batch, torch.cuda.Event | None]:
        """``batch`` on the device with its input dist started; the event the compute stream waits for."""
        if self.stream is None:
            batch = batch.to(self.device)
            return Batch(batch.dense, StartedInputDist(self.embedding, batch.sparse), batch.label), None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            batch = batch.to(self.device, non_blocking=True)
            started = Batch(batch.dense, StartedInputDist(self.embedding, batch.sparse), batch.label)
            return started, self.stream.record_event()


class OneAhead:
    """The batches of ``source``, each handed out after the next one was started (see the module)."""

    def __init__(self, source: Iterator[Batch], pipeline: SparseDistPipeline) -> None:
        self.source, self.pipeline = source, pipeline
        self.ahead: tuple[Batch, torch.cuda.Event | None] | None = None
        self.exhausted = False

    def __iter__(self) -> OneAhead:
        return self

    def __next__(self) -> Batch:
        if self.ahead is None:
            self.ahead = self._read()
        current, self.ahead = self.ahead, None
        if current is None:
            raise StopIteration
        self.ahead = self._read()
        batch, ready = current
        if ready is not None:
            torch.cuda.current_stream(self.pipeline.device).wait_event(ready)
        return batch

    def _read(self) -> tuple[Batch, torch.cuda.Event | None] | None:
        if self.exhausted:
            return None
        try:
            return self.pipeline.start(next(self.source))
        except StopIteration:
            self.exhausted = True
            return None

    def close(self) -> None:
        """Wait for the input dist started ahead (every rank stops at the same batch), close the source."""
        if self.ahead is not None:
            self.ahead[0].sparse.wait()
            self.ahead = None
        self.exhausted = True
        close = getattr(self.source, "close", None)
        if callable(close):
            close()


class PrefetchPipeline:
    """Makes an iterator of batches hand out each batch prefetched by ``model.embedding`` (its rows in the device
    caches of host-cached tables, its ids placed in dynamic tables), the prefetch overlapping the step before (see
    the module)."""

    def __init__(self, model: nn.Module, device: torch.device | str) -> None:
        embedding = model.embedding
        if not (isinstance(embedding, EmbeddingCollection) and embedding.prefetches):
            kind = "a collection with neither" if isinstance(embedding, EmbeddingCollection) else type(embedding).__name__
            raise TypeError(f"expected a model whose embedding has host-cached or dynamic tables, got {kind}")
        self.embedding = embedding
        self.device = torch.device(device)

    def __call__(self, batches: Iterator[Batch]) -> PrefetchAhead:
        return PrefetchAhead(batches, self)


class PrefetchAhead:
    """The batches of ``source``, each prefetched when asked for, the next one read already (see the module); where
    the embedding allows it, the next one prefetched too before this one is handed out, and the one after it read."""

    def __init__(self, source: Iterator[Batch], pipeline: PrefetchPipeline) -> None:
        self.source, self.pipeline = source, pipeline
        self.before_step = pipeline.embedding.prefetches_during_step
        self.depth = 2 if self.before_step else 1  # batches read ahead of the one handed out
        self.ahead: deque[tuple[Batch, torch.cuda.Event | None]] = deque()  # each with its event, when read
        self.queued: torch.cuda.Event | None = None  # after the last read, and every step queued before it
        self.following: Prefetched | CacheTooSmall | None = None  # the next batch's prefetch, or its error
        self.started = self.exhausted = False

    def __iter__(self) -> PrefetchAhead:
        return self

    def __next__(self) -> Batch:
        if not self.started:
            self.started = True
            self._read()
        prefetched, self.following = self.following, None
        if isinstance(prefetched, CacheTooSmall):  # the error of this batch's prefetch, when the loop asks for it
            raise prefetched
        if not self.ahead:
            raise StopIteration
        batch, _ = self.ahead.popleft()
        after = self.queued  # this batch's ids are ready, and every step but the last one queued
        # the batches ahead read first: their event then follows the step queued last, not this prefetch's work,
        # which the compute stream waits for from here on (the next prefetch's books need not wait for its copies)
        while len(self.ahead) < self.depth and self._read():
            pass
        embedding = self.pipeline.embedding
        if prefetched is None or prefetched.generation != embedding.generation:
            prefetched = embedding.prefetch(batch.sparse, after=after)
        if self.before_step and self.ahead:
            # the next batch was read before the step queued last: its books need not wait for that step, only its
            # copies do (they may take the rows of the batch before this one)
            following, read_at = self.ahead[0]
            try:
                self.following = embedding.prefetch(following.sparse, after=self.queued, inputs=read_at)
            except CacheTooSmall as error:
                self.following = error
        return Batch(batch.dense, prefetched, batch.label)

    def _read(self) -> bool:
        """The next batch on the device, and the compute stream's event after it (and every step queued so far):
        False at the end of the source."""
        batch = None
        if not self.exhausted:
            try:
                batch = next(self.source).to(self.pipeline.device, non_blocking=True)
            except StopIteration:
                self.exhausted = True
        device = self.pipeline.device
        self.queued = torch.cuda.current_stream(device).record_event() if device.type == "cuda" else None
        if batch is not None:
            self.ahead.append((batch, self.queued))
        return batch is not None

    def close(self) -> None:
        """Drop the batches read ahead (a batch prefetched leaves its rows in the caches; the error of its prefetch is
        not the loop's, which takes no step of it), close the source."""
        self.following = None
        self.ahead.clear()
        self.exhausted = True
        close = getattr(self.source, "close", None)
        if callable(close):
            close()
