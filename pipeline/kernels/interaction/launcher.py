"""Thin launchers of the dot-interaction kernels (``interaction.cu``): checks, shared memory, launch geometry.

A warp computes one sample at a time in its own slice of shared memory, laid out as in the kernel:
the sample's rows padded to a multiple of 16 (``padded_vectors``), ``ROW_WORDS`` 32-bit words apart
(``COLUMN_ROW_WORDS`` in the fp32 backward), then the forward's staged pairs or the backward's pair
gradient matrix. A block has as many warps (up to ``MAX_WARPS``) as fit 48 KiB, and each warp takes
about ``SAMPLES_PER_WARP`` samples. The plain-torch reference is :mod:`.reference`.

Example::

    dots = forward(vectors)                      # [B, V, D] fp32 / fp16 / bf16 on CUDA, V <= 64
    grad_vectors = backward(vectors, grad_dots)  # [B, V, D]
"""

from __future__ import annotations

import torch

from pipeline.kernels._launch import i32, i64, launch, ptr
from pipeline.kernels.interaction.reference import check_vectors, pair_count

SOURCE = "interaction/interaction.cu"
MAX_VECTORS = 64
ROW_WORDS = 68  # as in interaction.cu
COLUMN_ROW_WORDS = 72  # as in interaction.cu
MAX_WARPS = 4
SAMPLES_PER_WARP = 4
BLOCK_SHARED_BYTES = 48 * 1024
_DTYPE_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def supported(vectors: torch.Tensor) -> bool:
    """Whether the kernels take ``vectors``: ``[B, V, D]`` on CUDA, fp32 / fp16 / bf16, ``V <= MAX_VECTORS``."""
    return (vectors.is_cuda and vectors.dim() == 3 and vectors.dtype in _DTYPE_NAMES
            and vectors.shape[1] <= MAX_VECTORS)


def padded_vectors(v: int) -> int:
    return max(16, -(-v // 16) * 16)


def forward_warp_words(v: int, dtype: torch.dtype) -> int:
    """Shared words of one forward warp: the rows, then the staged pairs (to a 16-byte boundary)."""
    staged_bytes = pair_count(v) * torch.empty((), dtype=dtype).element_size()
    return padded_vectors(v) * ROW_WORDS + -(-staged_bytes // 16) * 4


def backward_warp_words(v: int, dtype: torch.dtype) -> int:
    """Shared words of one backward warp: the rows, then the padded ``V x V`` pair-gradient matrix."""
    size = torch.empty((), dtype=dtype).element_size()
    vp = padded_vectors(v)
    return vp * (COLUMN_ROW_WORDS if size == 4 else ROW_WORDS) + vp * (vp * size // 4 + 4)


def geometry(batch: int, warp_words: int) -> tuple[int, int]:
    """(blocks, warps per block) for ``batch`` samples and a warp's shared words."""
    warps = max(1, min(MAX_WARPS, BLOCK_SHARED_BYTES // (4 * warp_words)))
    return -(-batch // (warps * SAMPLES_PER_WARP)), warps


def _check(vectors: torch.Tensor) -> None:
    check_vectors(vectors)
    if not supported(vectors):
        raise ValueError(f"dot interaction kernels: expected fp32, fp16 or bf16 vectors [B, V <= {MAX_VECTORS}, D] "
                         f"on CUDA, got {vectors.dtype} {tuple(vectors.shape)} on {vectors.device}")


def _aligned(x: torch.Tensor) -> bool:
    """Rows that 16-byte loads and stores can move: the row size and the start on 16-byte boundaries."""
    return x.shape[2] * x.element_size() % 16 == 0 and x.data_ptr() % 16 == 0


def forward(vectors: torch.Tensor) -> torch.Tensor:
    """``[B, V, D] -> [B, V*(V-1)/2]`` in the vectors' dtype (fp32 accumulation), one launch."""
    _check(vectors)
    b, v, d = vectors.shape
    out = vectors.new_empty((b, pair_count(v)))
    if out.numel() == 0 or d == 0:
        return out.zero_()
    x = vectors.contiguous()
    words = forward_warp_words(v, x.dtype)
    blocks, warps = geometry(b, words)
    launch(SOURCE, f"dot_interaction_forward_{_DTYPE_NAMES[x.dtype]}_v{padded_vectors(v)}", x.device, blocks,
           32 * warps, [ptr(x), ptr(out), i32(b), i32(v), i32(d), i32(_aligned(x)), i32(words)],
           shared=4 * words * warps)
    return out


def backward(vectors: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The vectors' gradient ``[B, V, D]`` from the pairs' ``grad`` ``[B, V*(V-1)/2]`` (any row stride), one launch."""
    _check(vectors)
    b, v, d = vectors.shape
    pairs = pair_count(v)
    if grad.shape != (b, pairs) or grad.device != vectors.device:
        raise ValueError(f"dot interaction backward: expected grad [{b}, {pairs}] on {vectors.device}, got "
                         f"{tuple(grad.shape)} on {grad.device}")
    x = vectors.contiguous()
    out = torch.empty_like(x)
    if out.numel() == 0 or pairs == 0:
        return out.zero_()
    grad = grad.to(x.dtype)
    if pairs > 1 and grad.stride(1) != 1:
        grad = grad.contiguous()
    words = backward_warp_words(v, x.dtype)
    blocks, warps = geometry(b, words)
    launch(SOURCE, f"dot_interaction_backward_{_DTYPE_NAMES[x.dtype]}_v{padded_vectors(v)}", x.device, blocks,
           32 * warps, [ptr(x), ptr(grad), i64(grad.stride(0)), ptr(out), i32(b), i32(v), i32(d), i32(_aligned(x)),
                        i32(words)], shared=4 * words * warps)
    return out
