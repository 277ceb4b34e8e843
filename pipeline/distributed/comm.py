"""Collectives of the sharded embeddings, and starting the process group from torchrun's variables.

All exchanges go through ``torch.distributed`` on the collection's own process group: NCCL on GPUs,
gloo on CPU, the same code; ``all_to_all_single`` with uneven split sizes runs on both, so ids, bag
lengths and pooled vectors each travel in one call. The forward exchanges are launched with
``async_op=True`` and returned as an :class:`~pipeline.distributed.types.Awaitable` whose ``wait()``
waits for the work handle (on a GPU: the current stream waits for NCCL's, the host does not block);
those of the backward pass, whose results are needed at once, run to completion where they start.

The pooled-vector exchange is an autograd function: its backward is the mirrored all-to-all that
carries the gradients back to the ranks owning the rows. A zero-size ``trigger`` tensor that requires
grad makes every rank enter that backward, even a rank that holds no table of the exchange (otherwise
its peers would wait for it forever).

Example::

    rank, world, local_rank = init_from_env("cuda")   # under torchrun; (0, 1, 0) when not launched
    received = all_to_all(out, send, recv_splits, send_splits, group)   # launched
    ...                                                                 # compute meanwhile
    out = received.wait()
    timer = CommTimer.get(); timer.enabled = True      # time spent in collectives (bench only)
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from pipeline.distributed.types import Awaitable, NoWait


class CommTimer:
    """Seconds spent in the sharded embeddings' collectives, when ``enabled``.

    While enabled, each collective runs to completion where it is launched, with the device
    synchronized before and after, so that its time is its own.
    """

    _instance: CommTimer | None = None

    def __init__(self) -> None:
        self.enabled = False
        self.seconds = 0.0
        self.calls = 0

    @classmethod
    def get(cls) -> CommTimer:
        if cls._instance is None:
            cls._instance = CommTimer()
        return cls._instance

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0

    def run(self, fn, device: torch.device):
        if not self.enabled:
            return fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return out


def world_of(group) -> tuple[int, int]:
    """(rank, world size) in ``group``; (0, 1) when torch.distributed is not initialized."""
    if group is None and not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class CollectiveWork(Awaitable[torch.Tensor]):
    """A collective launched with ``async_op=True``: ``wait()`` waits for its work handle, returns ``result``."""

    def __init__(self, work, result: torch.Tensor) -> None:
        self.work, self.result = work, result

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.result


def _launch(start, result: torch.Tensor, device: torch.device, async_op: bool) -> Awaitable[torch.Tensor]:
    """``start(async_op)`` runs a collective; the awaitable of ``result``, complete unless ``async_op``."""
    timer = CommTimer.get()
    if async_op and not timer.enabled:
        return CollectiveWork(start(True), result)
    timer.run(lambda: start(False), device)
    return NoWait(result)


def all_to_all(output: torch.Tensor, input: torch.Tensor, output_splits: list[int], input_splits: list[int],
               group, async_op: bool = True) -> Awaitable[torch.Tensor]:
    """``all_to_all_single`` with uneven splits into ``output`` (a plain copy in a world of one).

    ``async_op=False`` for an exchange waited on at once: it runs to completion here (with NCCL, on
    the current stream), as a blocking call does.
    """
    if group is None:
        output.copy_(input)
        return NoWait(output)
    return _launch(lambda a: dist.all_to_all_single(output, input, output_splits, input_splits, group=group,
                                                    async_op=a), output, input.device, async_op)


def all_reduce(tensor: torch.Tensor, group, async_op: bool = True) -> Awaitable[torch.Tensor]:
    """The sum of ``tensor`` over the ranks of ``group``, in place."""
    if group is None:
        return NoWait(tensor)
    return _launch(lambda a: dist.all_reduce(tensor, group=group, async_op=a), tensor, tensor.device, async_op)


def exchange_counts(send: torch.Tensor, group) -> Awaitable[torch.Tensor]:
    """``send[d]`` (a row of counts per destination rank) in, ``recv[s]`` (the row each source sent) out."""
    w, k = send.shape
    recv = torch.empty(w * k, dtype=send.dtype, device=send.device)
    return all_to_all(recv, send.reshape(-1).contiguous(), [k] * w, [k] * w, group).then(lambda r: r.view(w, k))


class AllToAllRows(torch.autograd.Function):
    """Forward: launches the all-to-all of a flat tensor with the given splits and appends its
    awaitable to ``pending``; the output is read only after that ``wait()``. Backward: the same
    exchange, reversed (run to completion: the gradient is needed at once)."""

    @staticmethod
    def forward(ctx, trigger, x, send_splits, recv_splits, group, pending):
        ctx.group, ctx.send_splits, ctx.recv_splits = group, send_splits, recv_splits
        out = x.new_empty(sum(recv_splits))
        pending.append(all_to_all(out, x.contiguous(), recv_splits, send_splits, group))
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty(sum(ctx.send_splits))
        all_to_all(out, grad.contiguous(), ctx.send_splits, ctx.recv_splits, ctx.group, async_op=False)
        return None, out, None, None, None, None


class ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``scale`` backward."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def trigger(device: torch.device) -> torch.Tensor:
    return torch.empty(0, device=device, requires_grad=True)


def backend_for(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_from_env(device_kind: str = "cpu", timeout_s: float = 600.0) -> tuple[int, int, int]:
    """Join the process group torchrun describes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_*``).

    Returns ``(rank, world_size, local_rank)``; ``(0, 1, 0)`` without starting anything when the
    variables say a world of one. On ``cuda`` the process takes GPU ``LOCAL_RANK`` and NCCL; else gloo.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world <= 1:
        return 0, 1, 0
    if not dist.is_initialized():
        if device_kind == "cuda":
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (shared machines)
            torch.cuda.set_device(local_rank)
        else:
            # Ranks of one machine share its cores; torch's default (all cores each) oversubscribes them.
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
        dist.init_process_group(backend_for(device_kind), timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size(), local_rank
