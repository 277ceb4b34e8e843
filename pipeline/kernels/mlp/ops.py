"""The ReLU MLP as ``torch.library`` custom ops (namespace ``pipeline``), with fake implementations so
``torch.compile`` traces each as one node, autograd, and FLOP formulas for ``torch.utils.flop_counter``.

- ``relu_mlp(x, weights, biases, last_relu) -> Tensor[]``: every layer's output, then every layer's ReLU
  mask (:mod:`.reference` says which layers have one);
- ``relu_mlp_backward(grad, x, weights, outputs, masks, last_relu) -> Tensor[]``: the gradients of ``x``,
  of each weight, then of each bias.

On CPU both run the plain-torch reference. On CUDA a ReLU layer whose widths the tensor cores take runs forward as
one cuBLASLt product: bias and ReLU in its epilogue, the ReLU's bit mask written beside the output. In the backward
one pass of ``relu_grad.cu`` takes the gradient through that ReLU from the mask (one bit a value, where the layer's
output has 16) and sums the layer's bias gradient on the way; the products are torch's. Other layers, shapes
cuBLASLt has no algorithm for, and GPUs without CuPy (the kernel compiles through it) run as plain torch.

Example::

    y = relu_mlp(x, [w1, w2], [b1, b2], last_relu=False)    # x [B, K], w1 [N1, K], w2 [N2, N1]: y [B, N2]
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from pipeline.kernels import kernels_usable
from pipeline.kernels.mlp import cublaslt, launcher, reference


def _runs_cublaslt(x: Tensor) -> bool:
    return x.dtype in reference.HALF_TYPES and x.shape[0] > 0


def _layer_cuda(h: Tensor, weight: Tensor, bias: Tensor, relu: bool) -> tuple[Tensor, Tensor]:
    """One layer's output and its mask (written by the product where the layer has one)."""
    if not reference.has_mask(h.dtype, h.shape[1], weight.shape[0], relu):
        z = torch.addmm(bias, h, weight.t())
        return (torch.relu_(z) if relu else z), reference.empty_mask(h.device)
    width = weight.shape[0]
    out = h.new_empty((h.shape[0], width))
    # cuBLASLt writes a mask row's bits up to the width; those after it are zeroed so the op's outputs are defined
    mask = (torch.empty if reference.mask_width(width) == width else torch.zeros)(
        reference.mask_shape(h.shape[0], width), dtype=torch.uint8, device=h.device)
    try:
        cublaslt.linear(h, weight, out, epilogue=cublaslt.RELU_AUX_BIAS, bias=bias, aux=mask)
    except cublaslt.NoAlgorithm:
        z = torch.addmm(bias, h, weight.t())
        mask.copy_(reference.pack_mask(z > 0))
        out = torch.relu_(z)
    return out, mask


def _reference_forward(x: Tensor, weights: list[Tensor], biases: list[Tensor], last_relu: bool) -> list[Tensor]:
    outputs, masks = reference.forward(x, weights, biases, last_relu)
    return [*outputs, *masks]


def _reference_backward(grad: Tensor, x: Tensor, weights: list[Tensor], outputs: list[Tensor],
                        last_relu: bool) -> list[Tensor]:
    grad_x, grad_weights, grad_biases = reference.backward(grad, x, weights, outputs, last_relu)
    return [grad_x, *grad_weights, *grad_biases]


@torch.library.custom_op("pipeline::relu_mlp", mutates_args=())
def mlp_forward(x: Tensor, weights: list[Tensor], biases: list[Tensor], last_relu: bool) -> list[Tensor]:
    return _reference_forward(x, weights, biases, last_relu)


@mlp_forward.register_kernel("cuda")
def _forward_cuda(x: Tensor, weights: list[Tensor], biases: list[Tensor], last_relu: bool) -> list[Tensor]:
    if not _runs_cublaslt(x):
        return _reference_forward(x, weights, biases, last_relu)
    reference.check(x, weights, biases)
    outputs, masks, h = [], [], x.contiguous()
    for i, (weight, bias) in enumerate(zip(weights, biases)):
        h, mask = _layer_cuda(h, weight.contiguous(), bias.contiguous(), reference.relu_after(i, len(weights),
                                                                                               last_relu))
        outputs.append(h)
        masks.append(mask)
    return [*outputs, *masks]


@mlp_forward.register_fake
def _forward_fake(x: Tensor, weights: list[Tensor], biases: list[Tensor], last_relu: bool) -> list[Tensor]:
    reference.check(x, weights, biases)
    outputs, masks, width = [], [], x.shape[1]
    for i, weight in enumerate(weights):
        outputs.append(x.new_empty((x.shape[0], weight.shape[0])))
        if reference.has_mask(x.dtype, width, weight.shape[0], reference.relu_after(i, len(weights), last_relu)):
            masks.append(x.new_empty(reference.mask_shape(x.shape[0], weight.shape[0]), dtype=torch.uint8))
        else:
            masks.append(x.new_empty((0,), dtype=torch.uint8))
        width = weight.shape[0]
    return [*outputs, *masks]


@torch.library.custom_op("pipeline::relu_mlp_backward", mutates_args=())
def mlp_backward(grad: Tensor, x: Tensor, weights: list[Tensor], outputs: list[Tensor], masks: list[Tensor],
                 last_relu: bool) -> list[Tensor]:
    return _reference_backward(grad, x, weights, outputs, last_relu)


@mlp_backward.register_kernel("cuda")
def _backward_cuda(grad: Tensor, x: Tensor, weights: list[Tensor], outputs: list[Tensor], masks: list[Tensor],
                   last_relu: bool) -> list[Tensor]:
    if not _runs_cublaslt(x):
        return _reference_backward(grad, x, weights, outputs, last_relu)
    layers = len(weights)
    inputs = [x, *outputs[:-1]]
    g = grad.contiguous()
    grad_weights, grad_biases = [None] * layers, [None] * layers
    for i in reversed(range(layers)):
        if reference.relu_after(i, layers, last_relu):
            g, grad_biases[i] = _through_relu(g, outputs[i], masks[i])
        else:
            grad_biases[i] = g.sum(dim=0)
        grad_weights[i] = g.t().mm(inputs[i])
        g = g.mm(weights[i])
    return [g, *grad_weights, *grad_biases]


def _through_relu(g: Tensor, relu_out: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """The gradient ``g`` through the ReLU that gave ``relu_out``, and its column sums (the bias gradient of the
    layer before the ReLU): one pass of ``relu_grad.cu`` over ``g`` and the layer's mask where it wrote one."""
    if mask.numel() and launcher.supported(g, mask) and kernels_usable():
        return launcher.grad_through_mask(g, mask)
    g = g.masked_fill(relu_out <= 0, 0)
    return g, g.sum(dim=0)


@mlp_backward.register_fake
def _backward_fake(grad: Tensor, x: Tensor, weights: list[Tensor], outputs: list[Tensor], masks: list[Tensor],
                   last_relu: bool) -> list[Tensor]:
    return [x.new_empty(x.shape), *(w.new_empty(w.shape) for w in weights), *(w.new_empty(w.shape[:1])
                                                                              for w in weights)]


def _setup_context(ctx, inputs, output) -> None:
    x, weights, _, last_relu = inputs
    ctx.layers, ctx.last_relu = len(weights), last_relu
    ctx.save_for_backward(x, *weights, *output)


def _backward(ctx, grads: list[Tensor]):
    layers = ctx.layers
    x, *rest = ctx.saved_tensors
    weights, outputs, masks = rest[:layers], rest[layers:2 * layers], rest[2 * layers:]
    grad = grads[layers - 1]
    if grad is None:
        grad = torch.zeros_like(outputs[-1])
    result = mlp_backward(grad, x, weights, outputs, masks, ctx.last_relu)
    return result[0], result[1:layers + 1], result[layers + 1:], None


mlp_forward.register_autograd(_backward, setup_context=_setup_context)


def _products_flops(x_shape, weight_shapes) -> int:
    return sum(2 * x_shape[0] * in_width * width for width, in_width in weight_shapes)


@register_flop_formula(torch.ops.pipeline.relu_mlp)
def _forward_flops(x_shape, weight_shapes, bias_shapes, last_relu, out_shape=None, **kwargs) -> int:
    return _products_flops(x_shape, weight_shapes)


@register_flop_formula(torch.ops.pipeline.relu_mlp_backward)
def _backward_flops(grad_shape, x_shape, weight_shapes, *args, out_shape=None, **kwargs) -> int:
    return 2 * _products_flops(x_shape, weight_shapes)


def relu_mlp(x: Tensor, weights: list[Tensor], biases: list[Tensor], last_relu: bool) -> Tensor:
    """``x`` through the layers: ``relu(x W_1^T + b_1)``, ... , the last without ReLU unless ``last_relu``. Weights,
    biases and ``x`` in one dtype."""
    return mlp_forward(x, weights, biases, last_relu)[len(weights) - 1]
