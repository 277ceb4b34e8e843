"""The dot interaction as ``torch.library`` custom ops (namespace ``pipeline``), with fake implementations
so ``torch.compile`` traces them as single nodes, and autograd:

- ``dot_interaction(vectors) -> Tensor[B, V*(V-1)/2]``: ``<v_i, v_j>`` for the pairs ``j < i`` in
  ``torch.tril_indices(V, V, offset=-1)`` order, in the vectors' dtype;
- ``dot_interaction_backward(vectors, grad) -> Tensor[B, V, D]``: its gradient for the vectors
  (what the forward's autograd calls).

On CPU both run the plain-torch reference; on CUDA the kernels of ``interaction.cu`` where they take
the input (fp32, fp16, bf16; ``V <= 64``; CuPy installed), else the reference. Models call
:func:`dot_interaction`, which uses the reference while ``torch.jit`` traces, so an exported model
holds plain torch ops only.

Example::

    dots = dot_interaction(vectors)              # vectors [B, V, D], any device
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from pipeline.kernels.interaction import launcher, reference


@functools.cache
def _kernels_usable() -> bool:
    from pipeline.kernels import kernels_problem

    return kernels_problem() is None


def _runs_kernels(vectors: Tensor) -> bool:
    return launcher.supported(vectors) and _kernels_usable()


@torch.library.custom_op("pipeline::dot_interaction", mutates_args=())
def interaction_forward(vectors: Tensor) -> Tensor:
    return reference.dot_interaction(vectors)


@interaction_forward.register_kernel("cuda")
def _forward_cuda(vectors: Tensor) -> Tensor:
    return launcher.forward(vectors) if _runs_kernels(vectors) else reference.dot_interaction(vectors)


@interaction_forward.register_fake
def _forward_fake(vectors: Tensor) -> Tensor:
    reference.check_vectors(vectors)
    return vectors.new_empty((vectors.shape[0], reference.pair_count(vectors.shape[1])))


@torch.library.custom_op("pipeline::dot_interaction_backward", mutates_args=())
def interaction_backward(vectors: Tensor, grad: Tensor) -> Tensor:
    return reference.dot_interaction_backward(vectors, grad)


@interaction_backward.register_kernel("cuda")
def _backward_cuda(vectors: Tensor, grad: Tensor) -> Tensor:
    if _runs_kernels(vectors):
        return launcher.backward(vectors, grad)
    return reference.dot_interaction_backward(vectors, grad)


@interaction_backward.register_fake
def _backward_fake(vectors: Tensor, grad: Tensor) -> Tensor:
    reference.check_vectors(vectors)
    return vectors.new_empty(vectors.shape)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])


def _backward(ctx, grad: Tensor) -> Tensor:
    (vectors,) = ctx.saved_tensors
    return interaction_backward(vectors, grad)


interaction_forward.register_autograd(_backward, setup_context=_setup_context)


def dot_interaction(vectors: Tensor) -> Tensor:
    """``[B, V, D] -> [B, V*(V-1)/2]``: the ``pipeline::dot_interaction`` op, or the plain-torch reference
    while ``torch.jit`` traces (the traced model then needs no custom op to load and run)."""
    if torch.jit.is_tracing():
        return reference.dot_interaction(vectors)
    return interaction_forward(vectors)
