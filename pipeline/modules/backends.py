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

import torch

from pipeline.registry import Registry

BACKENDS = Registry("embedding backend", {
    "torch": "pipeline.kernels.embedding.backends:TorchBackend",
    "cuda": "pipeline.kernels.embedding.backends:CudaBackend",
})
register_backend = BACKENDS.register
available_backends = BACKENDS.names


def backend_class(name: str) -> type:
    """The class registered as ``name``, imported now."""
    if name not in BACKENDS:
        raise ValueError(f"embedding backend {name!r} is not registered; available: {available_backends()} or auto")
    return BACKENDS.load(name)


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


def check_backend(setting: str, name: str, device: torch.device | str, dtype: torch.dtype = torch.float32) -> None:
    """Refuse, before any table is built, a backend ``name`` (given by ``setting``) that ``device`` cannot run."""
    from pipeline.errors import UserError

    try:
        resolve_backend(name, device, dtype)
    except ValueError as err:
        raise UserError(f"{setting}: {err}; use auto (or torch) here") from err
