"""The cross layer's backward product that reads ``grad * x0``, with the element-wise work around it inside, in Triton.

cuBLAS runs the products alone at the device's rate, but ``h = grad * x0``, the bias's gradient ``h.sum(0)`` and
x0's gradient ``grad * u`` are each a pass of their own over ``[batch, width]`` tensors, each as long as a product
at MLPerf's width 3456 and rank 512 (cuBLASLt's prologues and epilogues scale, add a bias and an activation; none
multiplies by a third tensor). :func:`input_grad` computes ``h @ up`` with ``h`` made as its tiles are loaded, and
on the side writes ``h`` (for the weight's gradient ``h^T @ v``, a cuBLAS product), the bias's partial sums and
``grad * u``, reading ``grad`` and ``x0`` from memory once. The forward stays cuBLAS and one ``addcmul``: an epilogue
``x0 * (acc + bias) + x`` in a Triton product measured no faster than the two (the stores of a tile do not overlap
the next tile's products).

The product accumulates in fp32, the bias's sums too (fixed row blocks, added in order: no atomics, the same inputs
give the same bits); inputs and outputs are fp16 or bf16, contiguous. The tile shape is fixed, not autotuned: an
autotuner times its candidates at a shape's first call, inside whatever runs then (a CUDA graph's capture included).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

SIDE = 2
INPUT_GRAD_TILES = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3)
GROUP_M = 8


@triton.jit
def _tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Row and column tile of program ``pid``, GROUP_M row tiles side by side (their operands stay in L2)."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % in_group) % size_m, (pid % in_group) // size_m


@triton.jit
def _cross_input_grad(grad, x0, up, u, out, h_out, grad_x0, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SIDE: tl.constexpr):
    """out[M, N] = (grad * x0)[M, K] @ up[K, N]. On the side (SIDE), each tile of ``grad`` once: the programs of the
    first column tile store h = grad * x0, those of the second (the first, where there is one) ``grad * u``."""
    pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    stores_h = pid_n == 0
    stores_grad_x0 = pid_n == tl.minimum(1, tl.cdiv(N, BLOCK_N) - 1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        at = rm[:, None] * K + kk[None, :]
        inside = (rm[:, None] < M) & (kk[None, :] < K)
        g = tl.load(grad + at, mask=inside, other=0.0).to(tl.float32)
        h = g * tl.load(x0 + at, mask=inside, other=0.0)
        if SIDE >= 1 and stores_h:
            tl.store(h_out + at, h.to(h_out.dtype.element_ty), mask=inside)
        if SIDE >= 2 and stores_grad_x0:
            tl.store(grad_x0 + at, (g * tl.load(u + at, mask=inside, other=0.0)).to(grad_x0.dtype.element_ty),
                     mask=inside)
        b = tl.load(up + kk[:, None] * N + rn[None, :], mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(h.to(up.dtype.element_ty), b, acc)
    tl.store(out + rm[:, None] * N + rn[None, :], acc.to(out.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def input_grad(grad: Tensor, x0: Tensor, up: Tensor, u: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(grad_v, h, bias_grad, grad_x0)``: ``h = grad * x0``, ``grad_v = h @ up``, the bias's gradient ``h.sum(0)``
    and x0's ``grad * u``, ``grad`` and ``x0`` read once from memory."""
    (M, K), N = grad.shape, up.shape[1]
    tiles = dict(INPUT_GRAD_TILES)
    out, h, grad_x0 = grad.new_empty((M, N)), torch.empty_like(grad), torch.empty_like(grad)
    if M:
        grid = (triton.cdiv(M, tiles["BLOCK_M"]) * triton.cdiv(N, tiles["BLOCK_N"]),)
        _cross_input_grad[grid](grad, x0, up, u, out, h, grad_x0, M, N, K, GROUP_M=GROUP_M, SIDE=SIDE, **tiles)
    if SIDE < 1:
        torch.mul(grad, x0, out=h)
    if SIDE < 2:
        torch.mul(grad, u, out=grad_x0)
    return out, h, h.sum(0, dtype=torch.float32).to(grad.dtype), grad_x0
