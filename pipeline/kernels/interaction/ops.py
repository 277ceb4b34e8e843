"""The dot interaction as ``torch.library`` custom ops (namespace ``pipeline``), with fake implementations
so ``torch.compile`` traces them as single nodes, and autograd. A sample's ``V`` vectors come in two parts,
its first (``head`` ``[B, D]``: DLRM's bottom MLP output) and the others (``tail`` ``[B, V - 1, D]``: the
pooled embeddings), which the kernels read where they lie: nothing concatenates them first.

- ``dot_interaction(head, tail) -> Tensor[B, V*(V-1)/2]``: ``<v_i, v_j>`` for the pairs ``j < i`` in
  ``torch.tril_indices(V, V, offset=-1)`` order, in the vectors' dtype;
- ``dot_interaction_backward(head, tail, grad) -> Tensor[B, V, D]``: its gradient for the vectors
  (what the forward's autograd calls, and splits into the two parts' gradients, views of it).

On CPU both run the plain-torch reference; on CUDA the kernels of ``interaction.cu`` where they take
the input (fp32, fp16, bf16; ``V <= 64``; CuPy installed), else the reference. Models call
:func:`dot_interaction`, which uses the reference while ``torch.jit`` traces, so an exported model
holds plain torch ops only.

Example::

    dots = dot_interaction(vectors)              # vectors [B, V, D], any device
    dots = dot_interaction(bottom, pooled)       # the same vectors as [B, D] and [B, V - 1, D]
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipeline.kernels import kernels_usable
from pipeline.kernels.interaction import launcher, reference


def _runs_kernels(head: Tensor, tail: Tensor) -> bool:
    return launcher.supported(head, tail) and kernels_usable()


def _reference_forward(head: Tensor, tail: Tensor) -> Tensor:
    return reference.dot_interaction(reference.joined(head, tail))


def _reference_backward(head: Tensor, tail: Tensor, grad: Tensor) -> Tensor:
    return reference.dot_interaction_backward(reference.joined(head, tail), grad)


@torch.library.custom_op("pipeline::dot_interaction", mutates_args=())
def interaction_forward(head: Tensor, tail: Tensor) -> Tensor:
    return _reference_forward(head, tail)


@interaction_forward.register_kernel("cuda")
def _forward_cuda(head: Tensor, tail: Tensor) -> Tensor:
    if _runs_kernels(head, tail):
        return launcher.forward(head, tail)
    return _reference_forward(head, tail)


@interaction_forward.register_fake
def _forward_fake(head: Tensor, tail: Tensor) -> Tensor:
    reference.check_parts(head, tail)
    return head.new_empty((head.shape[0], reference.pair_count(tail.shape[1] + 1)))


@torch.library.custom_op("pipeline::dot_interaction_backward", mutates_args=())
def interaction_backward(head: Tensor, tail: Tensor, grad: Tensor) -> Tensor:
    return _reference_backward(head, tail, grad)


@interaction_backward.register_kernel("cuda")
def _backward_cuda(head: Tensor, tail: Tensor, grad: Tensor) -> Tensor:
    if _runs_kernels(head, tail):
        return launcher.backward(head, tail, grad)
    return _reference_backward(head, tail, grad)


@interaction_backward.register_fake
def _backward_fake(head: Tensor, tail: Tensor, grad: Tensor) -> Tensor:
    reference.check_parts(head, tail)
    return head.new_empty((head.shape[0], tail.shape[1] + 1, head.shape[1]))


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor]:
    head, tail = ctx.saved_tensors
    vectors = interaction_backward(head, tail, grad)
    return vectors[:, 0], vectors[:, 1:]


interaction_forward.register_autograd(_backward, setup_context=_setup_context)


def dot_interaction(vectors: Tensor, tail: Tensor | None = None) -> Tensor:
    """``[B, V, D] -> [B, V*(V-1)/2]``: the ``pipeline::dot_interaction`` op, or the plain-torch reference
    while ``torch.jit`` traces (the traced model then needs no custom op to load and run). With ``tail``, the
    vectors come in two parts: ``vectors`` ``[B, D]``, each sample's first, then ``tail``'s ``[B, V - 1, D]``."""
    if tail is None:
        reference.check_vectors(vectors)
        if vectors.shape[1] == 0:
            return reference.dot_interaction(vectors)
        vectors, tail = vectors[:, 0], vectors[:, 1:]
    if torch.jit.is_tracing():
        return _reference_forward(vectors, tail)
    return interaction_forward(vectors, tail)
