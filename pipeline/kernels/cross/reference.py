"""A low-rank cross layer of DCN-V2 in plain torch: the CPU path, the fallback and the test oracle of the fused
kernels.

``y = x0 * (x @ down^T @ up^T + bias) + x`` with ``down`` ``[rank, width]`` and ``up`` ``[width, rank]`` (the two
``nn.Linear`` weights of the layer), every tensor in one dtype. The forward also returns what the backward reads
again: ``v = x @ down^T`` and ``u = v @ up^T + bias``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_inputs(x0: Tensor, x: Tensor, down: Tensor, up: Tensor, bias: Tensor) -> None:
    rank, width = down.shape
    if x0.dim() != 2 or x0.shape != x.shape or x0.shape[1] != width:
        raise ValueError(f"cross layer: x0 and x must both be [batch, {width}], got {tuple(x0.shape)} and {tuple(x.shape)}")
    if tuple(up.shape) != (width, rank) or tuple(bias.shape) != (width,):
        raise ValueError(f"cross layer: up must be [{width}, {rank}] and bias [{width}], got {tuple(up.shape)} and "
                         f"{tuple(bias.shape)}")


def forward(x0: Tensor, x: Tensor, down: Tensor, up: Tensor, bias: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, v, u)``."""
    check_inputs(x0, x, down, up, bias)
    v = x @ down.t()
    u = torch.addmm(bias, v, up.t())
    return torch.addcmul(x, x0, u), v, u


def backward(grad: Tensor, x0: Tensor, x: Tensor, v: Tensor, u: Tensor, down: Tensor,
             up: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients of ``x0, x, down, up, bias`` given ``grad``, the gradient of ``y``."""
    h = grad * x0
    grad_v = h @ up
    return grad * u, grad + grad_v @ down, grad_v.t() @ x, h.t() @ v, h.sum(0)
