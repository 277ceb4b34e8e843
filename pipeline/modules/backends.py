"""The registry of embedding compute backends: a name -> ``"module:attr"`` entry, imported on first use.

A backend is a class with ``name``, ``usable(device, dtype)`` (optionally ``problem(device, dtype)``:
why not, in words), ``forward``, ``backward_update`` and the ``forward_op`` / ``update_op`` /
``lookup_op`` custom ops (see :class:`pipeline.kernels.embedding.TorchBackend`). ``auto`` picks
``cuda`` where it is usable for the device and weights dtype, else ``torch``.

Example::

    register_backend("mine", "my_package.embedding:MyBackend")
    resolve_backend("auto", "cuda", torch.bfloat16).name     # "cuda" on a GPU machine with CuPy
"""

from __future__ import annotations

import importlib

import torch

BACKENDS: dict[str, str] = {
    "torch": "pipeline.kernels.embedding.backends:TorchBackend",
    "cuda": "pipeline.kernels.embedding.backends:CudaBackend",
}


def register_backend(name: str, target: str) -> None:
    """Make the backend class at ``target`` (``"module:attr"``) available as ``name``; imported on first use."""
    if ":" not in target:
        raise ValueError(f"backend {name!r}: expected a 'module:attr' target, got {target!r}")
    BACKENDS[name] = target


def available_backends() -> list[str]:
    return sorted(BACKENDS)


def backend_class(name: str) -> type:
    """The class registered as ``name``, imported now."""
    if name not in BACKENDS:
        raise ValueError(f"embedding backend {name!r} is not registered; available: {available_backends()} or auto")
    module, attr = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), attr)


def resolve_backend(name: str, device: torch.device | str, dtype: torch.dtype = torch.float32):
    """An instance of backend ``name`` (``torch`` | ``cuda`` | registered | ``auto``) for ``device`` and ``dtype``."""
    device = torch.device(device)
    if name == "auto":
        name = "cuda" if backend_class("cuda").usable(device, dtype) else "torch"
    cls = backend_class(name)
    if not cls.usable(device, dtype):
        problem = getattr(cls, "problem", lambda device, dtype: None)(device, dtype)
        raise ValueError(f"embedding backend {name!r} cannot run on {device} with {dtype} weights"
                         + (f": {problem}" if problem else ""))
    return cls()
