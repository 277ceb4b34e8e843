"""Run a function on N local ranks (torch.distributed, one process each) and collect what each returns.

The model-parallel benchmark (``bench train_distributed``), ``tools/a2a_bandwidth.py`` and the
distributed tests start their ranks with it, torchrec ``MultiProcessTestBase`` style:
``fn(rank, world_size, *args)`` runs in every spawned process after the process group is up (gloo
on CPU, NCCL with one GPU per rank); its return value (plain data and CPU tensors) comes back in
rank order. An exception in any rank fails the call with that rank's traceback, and the other ranks
are stopped. Training itself is launched by torchrun (``pipeline.distributed.launch``).

Example::

    results = spawn(my_check, world_size=2, backend="gloo", args=(spec,))
"""

from __future__ import annotations

import io
import os
import queue
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.multiprocessing as mp


class WorkerFailed(RuntimeError):
    """A spawned rank raised; the message holds its traceback."""


def spawn(fn: Callable[..., Any], world_size: int, backend: str = "gloo", args: tuple = (),
          timeout_s: float = 300.0) -> list[Any]:
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="pipeline-dist-")
    os.close(fd)
    os.unlink(init_file)
    procs = [ctx.Process(target=_entry, args=(rank, world_size, backend, init_file, fn, args, results, timeout_s),
                         daemon=True) for rank in range(world_size)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    try:
        while len(got) < world_size:
            try:
                rank, ok, value = results.get(timeout=timeout_s)
            except queue.Empty:
                raise WorkerFailed(f"no result from ranks {sorted(set(range(world_size)) - set(got))} "
                                   f"within {timeout_s:.0f} s") from None
            if not ok:
                raise WorkerFailed(f"rank {rank} failed:\n{value}")
            got[rank] = torch.load(io.BytesIO(value), weights_only=False)
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
        if os.path.exists(init_file):
            os.unlink(init_file)
    return [got[r] for r in range(world_size)]


def _entry(rank, world_size, backend, init_file, fn, args, results, timeout_s):
    import torch.distributed as dist

    try:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        if backend == "nccl":
            torch.cuda.set_device(rank)
        else:
            # One thread per rank: ranks on one machine would otherwise oversubscribe its cores.
            torch.set_num_threads(1)
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        value = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(value, buf)
        results.put((rank, True, buf.getvalue()))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001  (reported to the parent, which raises WorkerFailed)
        results.put((rank, False, traceback.format_exc()))
