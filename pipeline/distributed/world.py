"""The processes that train together: rank, size, device, and the few collectives the driver needs.

A world of one (``World()``, or ``World(device=torch.device("cuda"))``) is plain single-process
training: it starts nothing and its collectives return at once. :meth:`World.from_env` joins the
world torchrun describes (one process when the program was not launched by torchrun); only the
runner calls it, everything below takes the world it is given.

Example::

    world = World.from_env("cuda")                 # under torchrun: rank, size, local rank, cuda:LOCAL_RANK
    if world.is_writer:
        write_json(out / "result.json", result)
    labels, probs = world.gather_arrays(labels, probs)   # every rank's rows, in rank order
    world.barrier()
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pipeline.distributed.comm import init_from_env


@dataclass(frozen=True)
class World:
    """``size`` processes of which this one is ``rank`` (``local_rank`` on its node), computing on ``device``."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"expected 0 <= rank < size, got rank={self.rank}, size={self.size}")

    @classmethod
    def from_env(cls, device_kind: str = "cpu", timeout_s: float = 600.0) -> World:
        """The world torchrun started this process in (its process group joined), or a world of one.

        On ``cuda`` each rank computes on GPU ``LOCAL_RANK`` (NCCL); on ``cpu`` the ranks use gloo.
        """
        rank, size, local_rank = init_from_env(device_kind, timeout_s)
        if size == 1:
            return cls(device=torch.device(device_kind))
        device = torch.device(f"cuda:{local_rank}" if device_kind == "cuda" else "cpu")
        return cls(rank, size, local_rank, device)

    @property
    def is_writer(self) -> bool:
        """Whether this process writes the shared files (rank 0)."""
        return self.rank == 0

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()

    def close(self, wait: bool = True) -> None:
        """Leave the process group, once every rank is done (``wait``), or at once (a rank failing: the others
        may never come): a gloo group left to the interpreter's exit can abort the process there (``terminate called
        without an active exception``)."""
        if self.size > 1 and dist.is_initialized():
            if wait:
                dist.barrier()
            dist.destroy_process_group()

    def gather_objects(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (picklable), in rank order, on every rank."""
        if self.size == 1:
            return [value]
        gathered: list[Any] = [None] * self.size
        dist.all_gather_object(gathered, value)
        return gathered

    def gather_arrays(self, *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
        """Each array concatenated over the ranks in rank order, on every rank."""
        if self.size == 1:
            return arrays
        gathered = self.gather_objects(arrays)
        return tuple(np.concatenate([g[i] for g in gathered]) for i in range(len(arrays)))
