"""Launcher of ``relu_grad.cu``: the gradient through a ReLU from the bit mask its forward product wrote, and the bias
gradient of the layer the ReLU follows, in one pass (the reference: :func:`.reference.grad_through_mask`).

A block of 256 threads takes a tile of 256 columns (32 groups of 8: one 16-byte load and one mask byte each) and a
chunk of rows; there are as many chunks as fill the GPU once with blocks (the tiles times the chunks).

Example::

    grad_z, grad_bias = grad_through_mask(grad_h, mask)    # [B, N] fp16/bf16 on CUDA, N % 8 == 0
"""

from __future__ import annotations

import torch

from pipeline.kernels._launch import i32, i64, launch, ptr, resident_blocks
from pipeline.kernels.mlp.reference import mask_shape

SOURCE = "mlp/relu_grad.cu"
BLOCK = 256
TILE_COLUMNS = 256  # as in relu_grad.cu: 32 groups of 8 columns
_DTYPE_NAMES = {torch.float16: "f16", torch.bfloat16: "bf16"}


def supported(g: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether the kernel takes ``g`` ``[B, N]`` and its mask: fp16 or bf16 on CUDA, ``N`` a multiple of 8, the mask
    uint8 ``[B, mask_width(N) / 8]`` contiguous on the same device."""
    return (g.is_cuda and g.dim() == 2 and g.dtype in _DTYPE_NAMES and g.shape[1] % 8 == 0
            and mask.dtype == torch.uint8 and mask.device == g.device and mask.is_contiguous()
            and tuple(mask.shape) == mask_shape(*g.shape))


def grad_through_mask(g: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``g`` zeroed where ``mask`` has no bit (a new tensor), and its column sums in ``g``'s dtype (fp32 sums), one
    launch (and the sums' zeroing and cast)."""
    if not supported(g, mask):
        raise ValueError(f"relu mask gradient: expected fp16 or bf16 [B, N % 8 == 0] on CUDA and its uint8 mask "
                         f"[B, mask_width(N) / 8], got {g.dtype} {tuple(g.shape)} on {g.device} and {mask.dtype} "
                         f"{tuple(mask.shape)} on {mask.device}")
    if not g.is_contiguous() or g.data_ptr() % 16:
        g = g.clone(memory_format=torch.contiguous_format)
    rows, width = g.shape
    out = torch.empty_like(g, memory_format=torch.contiguous_format)
    sums = torch.zeros(width, dtype=torch.float32, device=g.device)
    if rows and width:
        function = f"relu_mask_grad_{_DTYPE_NAMES[g.dtype]}"
        tiles = -(-width // TILE_COLUMNS)
        chunks = max(1, min(-(-rows // 8), resident_blocks(SOURCE, function, g.device, BLOCK) // tiles))
        chunk_rows = -(-rows // chunks)
        launch(SOURCE, function, g.device, tiles * -(-rows // chunk_rows), BLOCK,
               [ptr(g), ptr(mask), ptr(out), ptr(sums), i64(rows), i32(width // 8), i64(mask.stride(0)), i32(tiles),
                i64(chunk_rows)])
    return out, sums.to(g.dtype)
