"""Custom CUDA kernels, compiled at run time with NVRTC through CuPy, registered as ``torch.library`` ops.

One sub-package per op family, FBGEMM style: :mod:`pipeline.kernels.embedding` (pooled lookups and
the fused sparse-optimizer backward), :mod:`pipeline.kernels.interaction` (DLRM's pairwise dot
interaction) and :mod:`pipeline.kernels.mlp` (Linear + ReLU layers: cuBLASLt's products with the bias, ReLU and
mask epilogue through ``ctypes``, and the ReLU's and bias's gradients from the mask). Each holds the ``.cu``
sources, the plain-torch reference beside them (the CPU path and the test oracle), the launchers, and the
``pipeline::`` custom ops with their fake implementations and autograd. :mod:`pipeline.kernels.hashtable` is the
GPU hash table of embedding ids, its kernels and reference behind one class, ``HashTable``. Importing this
package needs neither CuPy nor a GPU; the CUDA implementations fall back to the reference where
:func:`kernels_problem` names what is missing.

Example::

    import pipeline.kernels
    pipeline.kernels.kernels_problem()      # None on a GPU machine with CuPy, else the reason
    EmbeddingCollection(tables, features, backend="cuda")   # or "auto"
"""

from __future__ import annotations

import functools
import importlib.util

from pipeline.kernels._compile import KernelCompileError

__all__ = ["KernelCompileError", "compile_ahead", "kernels_problem", "kernels_usable"]


def kernels_problem() -> str | None:
    """``None`` when the CUDA kernels can run here, else what is missing, in words."""
    from pipeline.device import gpu_problem

    problem = gpu_problem()
    if problem:
        return problem
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed (the kernels compile through it: pip install cupy-cuda13x)"
    return None


@functools.cache
def kernels_usable() -> bool:
    """Whether the CUDA kernels can run here (:func:`kernels_problem` finds nothing missing), asked once."""
    return kernels_problem() is None


def compile_ahead(device) -> None:
    """On a GPU where the kernels can run, start compiling in background threads each source a training run
    launches that the disk cache lacks for it (:func:`pipeline.kernels._compile.compile_ahead`; the candidates only
    the benchmarks time compile when first launched); elsewhere nothing."""
    if device.type != "cuda" or kernels_problem():
        return
    from pipeline.kernels import _compile
    from pipeline.kernels.embedding import launcher as embedding
    from pipeline.kernels.hashtable import launcher as hashtable
    from pipeline.kernels.interaction import launcher as interaction
    from pipeline.kernels.mlp import launcher as mlp

    _compile.compile_ahead(_compile.arch_of(device), [embedding.FORWARD_SOURCE, embedding.BACKWARD_SOURCE,
                                                      embedding.RUNS_SOURCE, interaction.SOURCE, hashtable.SOURCE,
                                                      mlp.SOURCE])
