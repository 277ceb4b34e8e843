"""The ReLU MLP op in plain torch: the CPU path, the fallback of the CUDA op, and the test oracle.

A stack of linear layers ``h_i = relu(h_{i-1} W_i^T + b_i)``, the last one without its ReLU unless
``last_relu``. The forward returns every layer's output (the last is the MLP's; the others are kept for the
weight gradients) and, per layer, the ReLU's bit mask where :func:`has_mask` says the CUDA op's matrix
product writes one (an empty tensor elsewhere). A mask is cuBLASLt's: one row of ``mask_width(N) / 8``
bytes a sample, bit ``j % 8`` of byte ``j // 8`` set where output ``j`` was positive.

Example::

    x, weights, biases = torch.randn(4, 16), [torch.randn(32, 16), torch.randn(1, 32)], [torch.zeros(32), torch.zeros(1)]
    outputs, masks = forward(x, weights, biases, last_relu=False)       # outputs[-1]: [4, 1]
    grad_x, grad_weights, grad_biases = backward(torch.ones(4, 1), x, weights, outputs, last_relu=False)
"""

from __future__ import annotations

import torch
from torch import Tensor

HALF_TYPES = (torch.bfloat16, torch.float16)
ALIGN = 8
"""Widths the tensor-core products take without falling back to kernels several times slower: multiples of 8
elements (16 bytes in half). The models pad an MLP's input to it (``pipeline.modules.models.PadColumns``)."""


def mask_width(width: int) -> int:
    """Bits a sample's row of a mask holds for ``width`` outputs: cuBLASLt's leading dimension, a multiple of 128."""
    return -(-width // 128) * 128


def mask_shape(rows: int, width: int) -> tuple[int, int]:
    """The uint8 mask of ``rows`` samples of ``width`` outputs: a row of ``mask_width(width) / 8`` bytes each."""
    return rows, mask_width(width) // 8


def has_mask(dtype: torch.dtype, in_width: int, width: int, relu: bool) -> bool:
    """Whether a layer's forward product writes its ReLU's bit mask: a ReLU layer in half precision whose
    widths the tensor cores take (the same answer on every device, so the op's outputs have one shape)."""
    return relu and dtype in HALF_TYPES and in_width % ALIGN == 0 and width % ALIGN == 0


def pack_mask(positive: Tensor) -> Tensor:
    """``[B, N]`` bool -> ``[B, mask_width(N) / 8]`` uint8, bit ``j % 8`` of byte ``j // 8`` for column ``j``."""
    rows, width = positive.shape
    bits = torch.nn.functional.pad(positive.to(torch.uint8), (0, mask_width(width) - width))
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=positive.device)
    return (bits.view(rows, -1, 8) * weights).sum(dim=2, dtype=torch.uint8)


def unpack_mask(mask: Tensor, width: int) -> Tensor:
    """The inverse of :func:`pack_mask`: ``[B, width]`` bool."""
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    return ((mask.unsqueeze(2) >> shifts) & 1).flatten(1)[:, :width].bool()


def grad_through_mask(g: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """The gradient ``g`` ``[B, N]`` through a ReLU whose mask is ``mask`` (zero where the output was not positive),
    and its column sums, summed in fp32 (the bias gradient of the layer the ReLU follows): what ``relu_grad.cu``
    computes."""
    out = g.masked_fill(~unpack_mask(mask, g.shape[1]), 0)
    return out, out.sum(dim=0, dtype=torch.float32).to(g.dtype)


def empty_mask(device: torch.device | str) -> Tensor:
    """The mask of a layer that writes none."""
    return torch.empty(0, dtype=torch.uint8, device=device)


def check(x: Tensor, weights: list[Tensor], biases: list[Tensor]) -> None:
    if not weights or len(weights) != len(biases):
        raise ValueError(f"relu mlp: expected as many biases as weights (at least one), got {len(weights)} weights "
                         f"and {len(biases)} biases")
    width = x.shape[-1] if x.dim() == 2 else None
    for i, (weight, bias) in enumerate(zip(weights, biases)):
        if weight.dim() != 2 or weight.shape[1] != width or bias.shape != (weight.shape[0],):
            raise ValueError(f"relu mlp: layer {i} takes {width} inputs (x {tuple(x.shape)}), got weight "
                             f"{tuple(weight.shape)} and bias {tuple(bias.shape)}")
        if weight.dtype != x.dtype or bias.dtype != x.dtype:
            raise ValueError(f"relu mlp: layer {i}'s weight and bias must be in x's dtype {x.dtype}, got "
                             f"{weight.dtype} and {bias.dtype}")
        width = weight.shape[0]


def relu_after(layer: int, layers: int, last_relu: bool) -> bool:
    return layer < layers - 1 or last_relu


def forward(x: Tensor, weights: list[Tensor], biases: list[Tensor], last_relu: bool) -> tuple[list[Tensor], list[Tensor]]:
    """Every layer's output and every layer's mask (see the module's doc)."""
    check(x, weights, biases)
    outputs, masks, h = [], [], x
    for i, (weight, bias) in enumerate(zip(weights, biases)):
        z = torch.addmm(bias, h, weight.t())
        relu = relu_after(i, len(weights), last_relu)
        masks.append(pack_mask(z > 0) if has_mask(x.dtype, h.shape[1], z.shape[1], relu) else empty_mask(x.device))
        h = torch.relu(z) if relu else z
        outputs.append(h)
    return outputs, masks


def backward(grad: Tensor, x: Tensor, weights: list[Tensor], outputs: list[Tensor],
             last_relu: bool) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """The gradients of ``x``, the weights and the biases, given the gradient of the last output. A ReLU's
    gradient passes where its output is positive."""
    inputs = [x, *outputs[:-1]]
    layers = len(weights)
    g = grad.masked_fill(outputs[-1] <= 0, 0) if last_relu else grad
    grad_weights, grad_biases = [None] * layers, [None] * layers
    for i in reversed(range(layers)):
        grad_weights[i] = g.t().mm(inputs[i])
        grad_biases[i] = g.sum(dim=0)
        g = g.mm(weights[i])
        if i > 0:
            g = g.masked_fill(inputs[i] <= 0, 0)
    return g, grad_weights, grad_biases
