"""Choosing the device, explicitly, and failing loudly when the choice can't be honoured.

``auto`` picks the GPU only when it is really usable (torch sees a CUDA device and a kernel runs on
it), never just because a GPU library imports. ``cuda`` without a usable GPU is an error that names
what is missing. Nothing falls back silently.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


class DeviceError(RuntimeError):
    """The requested device can't be used here."""


@dataclass(frozen=True)
class Device:
    kind: str  # "cpu" | "cuda"
    reason: str  # why this one, in words, for the log

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"


@functools.cache
def gpu_problem() -> str | None:
    """``None`` when a CUDA GPU is usable through torch, else what is missing."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.backends.cuda.is_built():
        return f"this torch ({torch.__version__}) is a CPU-only build"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device (no GPU, or no driver)"
    try:
        (torch.ones(1, device="cuda") + 1).item()
    except Exception as err:  # noqa: BLE001  (a broken driver or a busy/forbidden device)
        return f"a CUDA device is listed but a kernel failed on it: {err}"
    return None


def resolve_device(requested: str) -> Device:
    """Turn ``cpu | cuda | auto`` into a :class:`Device`, or raise :class:`DeviceError`."""
    if requested == "cpu":
        return Device("cpu", "asked for cpu")
    problem = gpu_problem()
    if requested == "cuda":
        if problem:
            raise DeviceError(f"--device cuda was asked for, but {problem}. Use --device cpu or auto.")
        return Device("cuda", "asked for cuda")
    if requested == "auto":
        if problem:
            return Device("cpu", f"auto: no usable GPU ({problem})")
        return Device("cuda", "auto: a usable CUDA GPU was found")
    raise DeviceError(f"device: expected cpu, cuda or auto, got {requested!r}")
