"""The ReLU MLP as ``torch.library`` custom ops (namespace ``pipeline``), with fake implementations so
``torch.compile`` traces each as one node, autograd, and FLOP formulas for ``torch.utils.flop_counter``.

- ``relu_mlp(x, weights, biases, last_relu) -> Tensor[]``: every layer's output, then every layer's ReLU
  mask (:mod:`.reference` says which layers have one);
- ``relu_mlp_backward(grad, x, weights, outputs, masks, last_relu) -> Tensor[]``: the gradients of ``x``,
  of each weight, then of each bias.

On CPU both run the plain-torch reference. On CUDA a layer whose widths the tensor cores take runs as one
cuBLASLt product: bias and ReLU in the forward's epilogue with the mask written beside the output. In the
backward the next layer's input-gradient product applies that mask as it writes, and each layer's
weight-gradient product sums its bias gradient as it reads the output's gradient. Other layers, and shapes
cuBLASLt has no algorithm for, run as plain torch.

Example::

    y = relu_mlp(x, [w1, w2], [b1, b2], last_relu=False)    # x [B, K], w1 [N1, K], w2 [N2, N1]: y [B, N2]
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from pipeline.kernels.mlp import cublaslt, reference


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
        (h.shape[0], reference.mask_width(width) // 8), dtype=torch.uint8, device=h.device)
    try:
        cublaslt.matmul(h, weight, out, right_t=True, epilogue=cublaslt.RELU_AUX_BIAS, bias=bias, aux=mask)
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
            masks.append(x.new_empty((x.shape[0], reference.mask_width(weight.shape[0]) // 8), dtype=torch.uint8))
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
    g = grad.masked_fill(outputs[-1] <= 0, 0) if last_relu else grad.contiguous()
    grad_weights, grad_biases = [None] * layers, [None] * layers
    for i in reversed(range(layers)):
        grad_weights[i], grad_biases[i] = _weight_grads(g, inputs[i])
        if i > 0:
            g = _input_grad_through_relu(g, weights[i].contiguous(), inputs[i], masks[i - 1])
    return [g.mm(weights[0]), *grad_weights, *grad_biases]


def _aligned(*widths: int) -> bool:
    return all(width % reference.ALIGN == 0 for width in widths)


def _weight_grads(g: Tensor, layer_input: Tensor) -> tuple[Tensor, Tensor]:
    """A layer's weight gradient ``g.T @ layer_input`` and its bias gradient (``g``'s column sums), summed by the
    product as it reads ``g`` where the tensor cores take both widths."""
    if _aligned(g.shape[1], layer_input.shape[1]):
        out = g.new_empty((g.shape[1], layer_input.shape[1]))
        grad_bias = g.new_empty((g.shape[1],))
        try:
            cublaslt.matmul(g, layer_input, out, left_t=True, epilogue=cublaslt.BGRADB, bias=grad_bias)
            return out, grad_bias
        except cublaslt.NoAlgorithm:
            pass
    return g.t().mm(layer_input), g.sum(dim=0)


def _input_grad_through_relu(g: Tensor, weight: Tensor, relu_out: Tensor, mask: Tensor) -> Tensor:
    """``(g @ weight)`` through the ReLU that gave ``relu_out``: one product that applies the mask as it writes,
    where the layer wrote its mask and the product takes ``g``'s width."""
    if mask.numel() and _aligned(g.shape[1]):
        out = g.new_empty((g.shape[0], weight.shape[1]))
        try:
            cublaslt.matmul(g, weight, out, epilogue=cublaslt.DRELU, aux=mask)
            return out
        except cublaslt.NoAlgorithm:
            pass
    return g.mm(weight).masked_fill_(relu_out <= 0, 0)


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
