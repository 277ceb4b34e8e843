"""Thin launchers of the dot-interaction kernels (``interaction.cu``): checks, shared memory, launch geometry.

A warp computes one sample at a time in its own slice of shared memory, laid out as in the kernel:
the sample's rows padded to a multiple of 16 (``padded_vectors``), ``ROW_WORDS`` 32-bit words apart
(``COLUMN_ROW_WORDS`` in the fp32 backward), then the forward's staged pairs or the backward's pair
gradient matrix. A block has as many warps (up to ``MAX_WARPS``) as fit 48 KiB, and each warp takes
about ``SAMPLES_PER_WARP`` samples. A sample's vectors come in two parts, its first (``head``, ``[B, D]``) and
the others (``tail``, ``[B, V - 1, D]``), each read where it lies. The plain-torch reference is :mod:`.reference`.

Example::

    dots = forward(head, tail)                      # [B, D] and [B, V - 1, D], fp32 / fp16 / bf16 on CUDA, V <= 64
    grad_vectors = backward(head, tail, grad_dots)  # [B, V, D]
"""

from __future__ import annotations

import torch

from pipeline.kernels._launch import i32, i64, launch, ptr
from pipeline.kernels.interaction.reference import check_parts, pair_count

SOURCE = "interaction/interaction.cu"
MAX_VECTORS = 64
ROW_WORDS = 68  # as in interaction.cu
COLUMN_ROW_WORDS = 72  # as in interaction.cu
MAX_WARPS = 4
SAMPLES_PER_WARP = 4
BLOCK_SHARED_BYTES = 48 * 1024
_DTYPE_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def supported(head: torch.Tensor, tail: torch.Tensor) -> bool:
    """Whether the kernels take the vectors ``head`` ``[B, D]`` and ``tail`` ``[B, V - 1, D]``: on CUDA, one dtype of
    fp32 / fp16 / bf16, ``V <= MAX_VECTORS``."""
    return (head.is_cuda and head.dim() == 2 and tail.dim() == 3 and head.dtype in _DTYPE_NAMES
            and tail.dtype == head.dtype and tail.device == head.device and tail.shape[1] + 1 <= MAX_VECTORS)


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


def _parts(head: torch.Tensor, tail: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int, int, bool]:
    """``head`` and ``tail`` as the kernels read them (each sample's rows contiguous; copied only where they are
    not), ``(B, V, D)`` and whether 16-byte loads can move every row."""
    check_parts(head, tail)
    if not supported(head, tail):
        raise ValueError(f"dot interaction kernels: expected fp32, fp16 or bf16 vectors [B, D] and [B, V - 1 < "
                         f"{MAX_VECTORS}, D] of one dtype on CUDA, got {head.dtype} {tuple(head.shape)} and "
                         f"{tail.dtype} {tuple(tail.shape)} on {head.device}")
    b, d = head.shape
    if d > 1 and head.stride(1) != 1:
        head = head.contiguous()
    if tail.shape[1] > 0 and d > 0 and (tail.stride(2) != 1 or tail.stride(1) != d):
        tail = tail.contiguous()
    size = head.element_size()
    aligned = (d * size % 16 == 0 and all(t.data_ptr() % 16 == 0 and t.stride(0) * size % 16 == 0
                                          for t in (head, tail)))
    return head, tail, b, tail.shape[1] + 1, d, aligned


def forward(head: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """The vectors ``head`` ``[B, D]`` then ``tail`` ``[B, V - 1, D]`` of each sample ``-> [B, V*(V-1)/2]`` in their
    dtype (fp32 accumulation), one launch."""
    head, tail, b, v, d, aligned = _parts(head, tail)
    out = head.new_empty((b, pair_count(v)))
    if out.numel() == 0 or d == 0:
        return out.zero_()
    words = forward_warp_words(v, head.dtype)
    blocks, warps = geometry(b, words)
    launch(SOURCE, f"dot_interaction_forward_{_DTYPE_NAMES[head.dtype]}_v{padded_vectors(v)}", head.device, blocks,
           32 * warps, [ptr(head), i64(head.stride(0)), ptr(tail), i64(tail.stride(0)), ptr(out), i32(b), i32(v),
                        i32(d), i32(aligned), i32(words)], shared=4 * words * warps)
    return out


def backward(head: torch.Tensor, tail: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The vectors' gradient ``[B, V, D]`` (row 0: ``head``'s) from the pairs' ``grad`` ``[B, V*(V-1)/2]`` (any row
    stride), one launch."""
    head, tail, b, v, d, aligned = _parts(head, tail)
    pairs = pair_count(v)
    if grad.shape != (b, pairs) or grad.device != head.device:
        raise ValueError(f"dot interaction backward: expected grad [{b}, {pairs}] on {head.device}, got "
                         f"{tuple(grad.shape)} on {grad.device}")
    out = head.new_empty((b, v, d))
    if out.numel() == 0 or pairs == 0:
        return out.zero_()
    grad = grad.to(head.dtype)
    if pairs > 1 and grad.stride(1) != 1:
        grad = grad.contiguous()
    words = backward_warp_words(v, head.dtype)
    blocks, warps = geometry(b, words)
    launch(SOURCE, f"dot_interaction_backward_{_DTYPE_NAMES[head.dtype]}_v{padded_vectors(v)}", head.device, blocks,
           32 * warps, [ptr(head), i64(head.stride(0)), ptr(tail), i64(tail.stride(0)), ptr(grad),
                        i64(grad.stride(0)), ptr(out), i32(b), i32(v), i32(d), i32(aligned), i32(words)],
           shared=4 * words * warps)
    return out
