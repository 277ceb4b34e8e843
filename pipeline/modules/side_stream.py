"""``SideStream``: the work of a batch's lookup that can run before its step, on a GPU stream of its own.

A collection's host-cached tables move a batch's rows into their caches, and its dynamic tables place a batch's
ids, before the batch's lookup; both need a few numbers read back to the host (how many rows are missing, how many
ids are new). Read on the compute stream, such a number waits for every step queued before it. On a GPU that work
runs here instead, on a side stream of high priority, and the host waits only for an event of the side stream:

- a block (:meth:`SideStream.run`) first makes the side stream wait for ``after``, an event of the compute stream
  after which its inputs are ready (or, without one, for all the compute stream's work queued so far), and for the
  compute stream's work up to the last :meth:`SideStream.follow` (work that changed what the blocks change); given
  ``inputs`` too, an earlier event after which the inputs are ready, the side stream waits for that one instead and
  only the work queued beside it (below) for ``after``: the books of a batch then need not wait for the steps that
  its copies must follow;
- at the end of the block the compute stream waits for the side stream, so whatever the compute stream runs later
  sees what the block did, and whatever it ran before was not waited for; or, for a block run without ``join``
  (the next batch's prefetch, queued before the step before it), the block hands out its streams' events, and only
  the work that uses its results waits for them (:meth:`SideStream.ready`);
- work of a block that later blocks need not wait for (the rows a batch copies, which the next batch's books do not
  read) goes on a third stream (:meth:`SideStream.beside`), which the compute stream waits for too at the end of the
  block;
- the host reads a block's numbers through pinned memory (:meth:`SideStream.read`): a copy on the side stream,
  then a wait for that stream's event, never a synchronization of the device or of the compute stream;
- a tensor made in a block and used later on the compute stream is handed over (:meth:`SideStream.hand_over`:
  ``record_stream``), so the caching allocator does not give its memory to a later block while the compute stream
  may still read it. A tensor made on the compute stream and used in a block goes back to the compute stream
  when freed, whose later work waits for the block; those a block replaces, freed while its work may still read
  them, are also marked as the side stream's when it is made (``replaced``).

On the CPU there is no stream: the blocks run in order on the host, and a read is the tensor itself.

Example::

    side = SideStream()
    with side.run(device, after=event):
        counts = side.read(torch.stack([a.sum(), b.sum()]), "counts").tolist()   # waits for the side stream only
        slots = place(...)
    slots, = side.hand_over(slots)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch


class SideStream:
    """A side stream per device, made at its first use, and the host buffers that its reads go through.
    ``replaced``: the tensors made on the compute stream that the blocks replace, marked as used by the side stream
    when it is made (their memory then waits for the side stream's work when they are freed)."""

    def __init__(self, replaced: Callable[[], Iterable[torch.Tensor]] = tuple) -> None:
        self._replaced = replaced
        self._stream: torch.cuda.Stream | None = None
        self._followed: torch.cuda.Event | None = None
        self._copies: torch.cuda.Stream | None = None
        self._buffers: dict[tuple[str, bool], torch.Tensor] = {}

    def stream(self, device: torch.device) -> torch.cuda.Stream | None:
        """The side stream of ``device`` (None on the CPU); made again for a new device."""
        if device.type != "cuda":
            return None
        if self._stream is None or self._stream.device != device:
            # high priority: a batch's books, copies and counts run beside the compute stream's large kernels
            # rather than after them, so its numbers reach the host while the step before computes
            self._stream = torch.cuda.Stream(device, priority=-1)
            self._followed = None
            for tensor in self._replaced():
                tensor.record_stream(self._stream)
        return self._stream

    @contextlib.contextmanager
    def run(self, device: torch.device, after: torch.cuda.Event | None = None, join: bool = True,
            inputs: torch.cuda.Event | None = None) -> Iterator[list[torch.cuda.Event]]:
        """Run the block on the side stream of ``device`` (see the module), after ``after`` or all the compute stream's
        work so far (only the work queued :meth:`beside` it after ``after``, the rest after ``inputs``, where given);
        the compute stream waits for it after. Without ``join`` it does not: the list the block gets holds, once the
        block is done, the events the work that uses its results must wait for first (:meth:`ready`), so the compute
        stream may run the work queued after the block beside it."""
        done: list[torch.cuda.Event] = []
        side = self.stream(device)
        if side is None:
            yield done
            return
        compute = torch.cuda.current_stream(device)
        if after is None:
            side.wait_stream(compute)
        else:
            side.wait_event(after if inputs is None else inputs)
            if self._followed is not None:
                side.wait_event(self._followed)
            if inputs is not None:  # the work queued beside the side stream, in order, after ``after``
                self._copies_on(device).wait_event(after)
        try:
            with torch.cuda.stream(side):
                yield done
        finally:
            for stream in (side, self._copies):
                if stream is None:
                    continue
                if join:
                    compute.wait_stream(stream)
                else:
                    done.append(stream.record_event())

    @staticmethod
    def ready(device: torch.device, events: Iterable[torch.cuda.Event]) -> None:
        """The current stream of ``device`` waits for ``events`` (those of a block run without ``join``) before its
        later work."""
        for event in events:
            torch.cuda.current_stream(device).wait_event(event)

    @contextlib.contextmanager
    def beside(self, device: torch.device) -> Iterator[None]:
        """Inside :meth:`run`: run the block on a third stream of ``device`` (made at its first use), after the side
        stream's work so far (and the ``after`` of a run given ``inputs``), in order with what earlier such blocks
        queued, and beside the side stream's later work, which does not wait for it (unless :meth:`join` says so); the
        compute stream waits for it at the end of the block of :meth:`run`. A tensor made on the side stream and used
        here must be marked with :meth:`lend`. On the CPU, the block runs in order on the host."""
        side = self.stream(device)
        if side is None:
            yield
            return
        copies = self._copies_on(device)
        copies.wait_stream(side)
        with torch.cuda.stream(copies):
            yield

    def _copies_on(self, device: torch.device) -> torch.cuda.Stream:
        """The stream of the work queued :meth:`beside` the side stream, made at its first use."""
        if self._copies is None or self._copies.device != device:
            self._copies = torch.cuda.Stream(device, priority=-1)
        return self._copies

    def lend(self, *tensors: torch.Tensor) -> None:
        """``tensors``, made on the side stream, are used by the work queued :meth:`beside` it: their memory waits for
        that work before the side stream gets it again."""
        if self._copies is not None:
            for tensor in tensors:
                if tensor.is_cuda:
                    tensor.record_stream(self._copies)

    def uses(self, *tensors: torch.Tensor) -> None:
        """``tensors``, made outside the blocks, are read by a block run without ``join``: their memory waits for the
        side stream's work before it is given out again (the compute stream, not waiting for the block, may free
        them first)."""
        if self._stream is not None:
            for tensor in tensors:
                if tensor.is_cuda:
                    tensor.record_stream(self._stream)

    def join(self, device: torch.device) -> None:
        """The current stream's later work waits for all the work queued :meth:`beside` the side stream."""
        if self._copies is not None and device.type == "cuda":
            torch.cuda.current_stream(device).wait_stream(self._copies)

    def follow(self, device: torch.device) -> None:
        """The compute stream's work queued so far changed what the blocks change (a lookup without a block of its
        own, a state dict loaded): every later block waits for it, also one given an earlier ``after``."""
        if device.type == "cuda":
            self._followed = torch.cuda.current_stream(device).record_event()

    @staticmethod
    def hand_over(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``tensors``, made in a block, marked as used by the current (compute) stream, so that their memory is not
        given to the side stream again before the compute stream is done with them."""
        for tensor in tensors:
            if tensor.is_cuda:
                tensor.record_stream(torch.cuda.current_stream(tensor.device))
        return tensors

    @staticmethod
    def event(device: torch.device) -> torch.cuda.Event | None:
        """An event of the current stream of ``device`` (None on the CPU)."""
        return torch.cuda.current_stream(device).record_event() if device.type == "cuda" else None

    @staticmethod
    def wait(event: torch.cuda.Event | None) -> None:
        """A host wait for the work before ``event`` (the other streams run on)."""
        if event is not None:
            event.synchronize()

    def read(self, values: torch.Tensor, name: str, wait: bool = True) -> torch.Tensor:
        """``values`` in host memory (pinned, reused per ``name``), copied on the current stream; ``wait``: the host
        waits for them, else the copy is under way (a later wait for the stream covers it)."""
        out = values
        if values.is_cuda:
            out = self.host_buffer(name, values.numel(), values.dtype, pinned=True).view(values.shape)
            out.copy_(values, non_blocking=True)
        if wait:
            self.wait(self.event(values.device))
        return out

    def host_buffer(self, name: str, size: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        """``size`` elements of host memory kept per ``name`` (page-locked where ``pinned``), grown as needed."""
        buffer = self._buffers.get((name, pinned))
        if buffer is None or buffer.numel() < size or buffer.dtype != dtype:
            grown = 2 * buffer.numel() if buffer is not None and buffer.dtype == dtype else 0
            buffer = torch.empty(max(size, grown), dtype=dtype, pin_memory=pinned)
            self._buffers[name, pinned] = buffer
        return buffer[:size]
