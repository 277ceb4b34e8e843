"""The dot interaction in plain torch: the CPU path, the fallback of the CUDA ops, and the test oracle.

Both functions take any float dtype and device and compute in it (``torch.bmm``). The forward picks
the pairs as one slice of columns per row, so a traced model holds plain slices and no index tensor.

Example::

    vectors = torch.randn(4, 27, 128)                    # [B, V, D]
    dots = dot_interaction(vectors)                      # [4, 351]: <v_i, v_j> for j < i
    grad = dot_interaction_backward(vectors, torch.ones_like(dots))   # [4, 27, 128]
"""

from __future__ import annotations

import functools

import torch


def pair_count(vectors: int) -> int:
    """The pairs ``(i, j)``, ``j < i``, of ``vectors`` vectors."""
    return vectors * (vectors - 1) // 2


def check_vectors(vectors: torch.Tensor) -> None:
    if vectors.dim() != 3:
        raise ValueError(f"dot interaction: expected vectors [B, V, D], got shape {tuple(vectors.shape)}")


def check_parts(head: torch.Tensor, tail: torch.Tensor) -> None:
    """A sample's vectors in two parts: its first, ``head`` ``[B, D]``, then ``tail`` ``[B, V - 1, D]``."""
    if head.dim() != 2 or tail.dim() != 3 or tail.shape[0] != head.shape[0] or tail.shape[2] != head.shape[1]:
        raise ValueError(f"dot interaction: expected vectors in two parts [B, D] and [B, V - 1, D], got shapes "
                         f"{tuple(head.shape)} and {tuple(tail.shape)}")


def joined(head: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """The two parts as one ``[B, V, D]`` tensor (a copy)."""
    check_parts(head, tail)
    return torch.cat([head.unsqueeze(1), tail.to(head.dtype)], dim=1)


def dot_interaction(vectors: torch.Tensor) -> torch.Tensor:
    """``[B, V, D] -> [B, V*(V-1)/2]``: ``<v_i, v_j>`` of each sample for the pairs ``j < i``, row by row
    (``torch.tril_indices(V, V, offset=-1)``'s order: pair ``i*(i-1)/2 + j``), in the vectors' dtype."""
    check_vectors(vectors)
    b, v, _ = vectors.shape
    if v < 2:
        return vectors.new_zeros((b, 0))
    products = torch.bmm(vectors, vectors.transpose(1, 2)).flatten(1)
    return torch.cat([products[:, i * v : i * v + i] for i in range(1, v)], dim=1)


def dot_interaction_backward(vectors: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient of :func:`dot_interaction` for the vectors: ``grad_v[b, i] = sum over j != i of
    grad[b, pair(i, j)] * v[b, j]``, one ``bmm`` with the pair gradients as a symmetric matrix."""
    check_vectors(vectors)
    b, v, _ = vectors.shape
    if grad.shape != (b, pair_count(v)):
        raise ValueError(f"dot interaction backward: expected grad [{b}, {pair_count(v)}] for vectors "
                         f"{tuple(vectors.shape)}, got {tuple(grad.shape)}")
    padded = torch.cat([grad.new_zeros((b, 1)), grad], dim=1).to(vectors.dtype)
    matrix = padded[:, _symmetric_index(v, vectors.device)].view(b, v, v)
    return torch.bmm(matrix, vectors)


@functools.lru_cache(maxsize=64)
def _symmetric_index(v: int, device: torch.device) -> torch.Tensor:
    """Entry ``(i, j)`` of the flat ``v x v`` pair matrix: 0 on the diagonal (a zero column), else
    ``1 + pair(max(i, j), min(i, j))``."""
    i = torch.arange(v, device=device).view(-1, 1)
    j = torch.arange(v, device=device).view(1, -1)
    high, low = torch.maximum(i, j), torch.minimum(i, j)
    return torch.where(i == j, 0, 1 + high * (high - 1) // 2 + low).flatten()
