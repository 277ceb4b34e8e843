"""Custom CUDA kernels, compiled at run time with NVRTC through CuPy.

Each op is a small set of files, FBGEMM style: the ``.cu`` kernels (forward and backward apart, a
shared ``.cuh``), a thin launcher (``embedding_ops``), the glue to the embedding collection's seam
(``backend``), and the plain-torch reference, which is the collection's ``TorchBackend``
(``pipeline.modules.embedding``). Importing this package needs neither CuPy nor a GPU: the
``"cuda"`` embedding backend is registered only where both are usable, and :func:`kernels_problem`
says why not elsewhere.

Example::

    import pipeline.kernels
    pipeline.kernels.kernels_problem()      # None on a GPU machine with CuPy, else the reason
    EmbeddingCollection(tables, features, backend="cuda")   # or "auto"
"""

from __future__ import annotations

import importlib.util

from pipeline.kernels._compile import KernelCompileError

__all__ = ["KernelCompileError", "kernels_problem", "CudaEmbeddingBackend"]


def kernels_problem() -> str | None:
    """``None`` when the CUDA kernels can run here, else what is missing, in words."""
    from pipeline.device import gpu_problem

    problem = gpu_problem()
    if problem:
        return problem
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed (the kernels compile through it: pip install cupy-cuda13x)"
    return None


def __getattr__(name: str):
    if name == "CudaEmbeddingBackend":
        from pipeline.kernels.backend import CudaEmbeddingBackend

        return CudaEmbeddingBackend
    raise AttributeError(name)


def _usable(device, dtype) -> bool:
    import torch

    return device.type == "cuda" and dtype in (torch.float32, torch.float16, torch.bfloat16)


def _register() -> None:
    if kernels_problem() is not None:
        return
    from pipeline.kernels.backend import CudaEmbeddingBackend
    from pipeline.modules.embedding import register_backend

    register_backend("cuda", CudaEmbeddingBackend, _usable)


_register()
