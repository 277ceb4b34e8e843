"""The low-rank cross layer as ``torch.library`` custom ops (namespace ``pipeline``), with fake implementations so
``torch.compile`` traces each as one node, and autograd:

- ``cross_layer(x0, x, down, up, bias) -> (y, v, u)``: ``y = x0 * (x @ down^T @ up^T + bias) + x``, with ``v`` and
  ``u`` (:mod:`.reference`) kept for the backward;
- ``cross_layer_backward(grad, x0, x, v, u, down, up)``: the gradients of ``x0, x, down, up, bias``.

The forward is the reference everywhere (two products and an ``addcmul``). The backward on CUDA with Triton reads
``grad`` and ``x0`` once, in :func:`.triton_kernels.input_grad`, and leaves the other products to cuBLAS
(``h^T @ v``, ``grad_v^T @ x``, and ``grad + grad_v @ down`` as one ``addmm``); elsewhere it is the reference. Models
call :func:`cross_layer`, which takes the ops for fp16 and bf16 tensors on CUDA (autocast's dtypes), and the plain
expression otherwise and while ``torch.jit`` traces (an exported model holds plain torch ops only).

Example::

    x = cross_layer(x0, x, layer[0].weight, layer[1].weight, layer[1].bias)
"""

from __future__ import annotations

import importlib.util

import torch
from torch import Tensor
from torch.nn import functional
from torch.utils.flop_counter import register_flop_formula

from pipeline.kernels.cross import reference

HALF_DTYPES = (torch.float16, torch.bfloat16)
TRITON_FOUND = importlib.util.find_spec("triton") is not None


def _on_kernels(x0: Tensor) -> bool:
    return x0.dtype in HALF_DTYPES and TRITON_FOUND


@torch.library.custom_op("pipeline::cross_layer", mutates_args=())
def cross_forward(x0: Tensor, x: Tensor, down: Tensor, up: Tensor, bias: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return reference.forward(x0, x, down, up, bias)


@cross_forward.register_fake
def _forward_fake(x0, x, down, up, bias):
    reference.check_inputs(x0, x, down, up, bias)
    return torch.empty_like(x0), x.new_empty((x.shape[0], down.shape[0])), torch.empty_like(x0)


@torch.library.custom_op("pipeline::cross_layer_backward", mutates_args=())
def cross_backward(grad: Tensor, x0: Tensor, x: Tensor, v: Tensor, u: Tensor, down: Tensor,
                   up: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return reference.backward(grad, x0, x, v, u, down, up)


@cross_backward.register_kernel("cuda")
def _backward_cuda(grad, x0, x, v, u, down, up):
    if not _on_kernels(x0):
        return reference.backward(grad, x0, x, v, u, down, up)
    from pipeline.kernels.cross import triton_kernels

    grad_v, h, grad_bias, grad_x0 = triton_kernels.input_grad(grad.contiguous(), x0.contiguous(), up.contiguous(),
                                                              u.contiguous())
    return grad_x0, torch.addmm(grad, grad_v, down), grad_v.t() @ x, h.t() @ v, grad_bias


@cross_backward.register_fake
def _backward_fake(grad, x0, x, v, u, down, up):
    return (torch.empty_like(x0), torch.empty_like(x), torch.empty_like(down), torch.empty_like(up),
            up.new_empty(up.shape[0]))


def _setup_context(ctx, inputs, output) -> None:
    x0, x, down, up, _ = inputs
    _, v, u = output
    ctx.save_for_backward(x0, x, v, u, down, up)
    ctx.set_materialize_grads(False)  # only y's gradient comes back: no zeros made for v's and u's


def _backward(ctx, grad, _grad_v, _grad_u):
    if grad is None:
        return None, None, None, None, None
    return cross_backward(grad, *ctx.saved_tensors)


cross_forward.register_autograd(_backward, setup_context=_setup_context)


@register_flop_formula(torch.ops.pipeline.cross_layer)
def _forward_flops(x0_shape, x_shape, down_shape, *_, **__) -> int:
    return 2 * (2 * x0_shape[0] * x0_shape[1] * down_shape[0])  # x @ down^T, then @ up^T


@register_flop_formula(torch.ops.pipeline.cross_layer_backward)
def _backward_flops(grad_shape, x0_shape, x_shape, v_shape, *_, **__) -> int:
    return 4 * (2 * grad_shape[0] * grad_shape[1] * v_shape[1])  # the gradients of v, x, down and up


def cross_layer(x0: Tensor, x: Tensor, down: Tensor, up: Tensor, bias: Tensor) -> Tensor:
    """``x0 * (x @ down^T @ up^T + bias) + x``: the ``pipeline::cross_layer`` op for fp16 and bf16 ``x0`` and ``x``
    on CUDA (the weights cast to their dtype, as autocast does), else the plain expression (autocast applies)."""
    if x0.is_cuda and x.dtype == x0.dtype and _on_kernels(x0) and not torch.jit.is_tracing():
        dtype = x0.dtype
        return cross_forward(x0, x, down.to(dtype), up.to(dtype), bias.to(dtype))[0]
    return x0 * functional.linear(functional.linear(x, down), up, bias) + x
