"""Picking column ranges out of 2-D blocks into one tensor, with a backward that is a copy too.

``x[:, index]`` (and ``index_select``) is a gather forward but a scatter backward: ``index_put_``
with accumulation sorts the indices (a large share of a DLRM training step at MLPerf batch sizes)
and ``index_add_`` uses atomics. When the columns come in
contiguous runs, both directions are one ``torch.cat`` of column slices: :func:`assemble_columns`
does that, and in backward hands each block the gradient of its columns (zeros where a column was
not picked), again with one ``cat`` per block. Deterministic, no atomics, memory-bound.

Example (the lower triangle of a 3x3 matrix, row-major, as DLRM's interaction picks it)::

    z = torch.randn(8, 9, requires_grad=True)           # [B, 3*3]
    runs = [ColumnRun(0, 3, 4), ColumnRun(0, 6, 8)]     # (1,0), then (2,0) (2,1)
    out = assemble_columns([z], runs)                   # [8, 3] == z[:, [3, 6, 7]]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


class ColumnRun(NamedTuple):
    """Columns ``[lo, hi)`` of block ``block``, the next ``hi - lo`` columns of the output."""

    block: int
    lo: int
    hi: int


def merge_runs(runs: Sequence[ColumnRun]) -> list[ColumnRun]:
    """The same selection in the fewest runs (neighbours in one block that touch become one run)."""
    merged: list[ColumnRun] = []
    for r in runs:
        if r.hi == r.lo:
            continue
        if merged and merged[-1].block == r.block and merged[-1].hi == r.lo:
            merged[-1] = ColumnRun(r.block, merged[-1].lo, r.hi)
        else:
            merged.append(ColumnRun(*r))
    return merged


def assemble_columns(blocks: Sequence[torch.Tensor], runs: Sequence[ColumnRun],
                     dtype: torch.dtype | None = None) -> torch.Tensor:
    """``cat([blocks[r.block][:, r.lo:r.hi] for r in runs], 1)``; the runs of one block must not overlap.

    ``dtype``: of the output (default: the blocks'); the conversion happens in the copy, both ways
    (each block's gradient comes back in the block's dtype).
    """
    dtype = dtype or blocks[0].dtype
    if len(runs) == 1 and runs[0].lo == 0 and runs[0].hi == blocks[runs[0].block].shape[1]:
        return blocks[runs[0].block].to(dtype)
    if torch.compiler.is_compiling():
        # The compiler derives a fused backward from plain slices itself, and it does not trace the
        # autograd function below faithfully in every torch version (wrong gradients with torch 2.11,
        # tests/test_modules_columns.py).
        return torch.cat([blocks[r.block][:, r.lo : r.hi] for r in runs], 1).to(dtype)
    if torch.is_grad_enabled() and any(b.requires_grad for b in blocks):
        return _AssembleColumns.apply(tuple(runs), dtype, *blocks)
    return _cat([blocks[r.block][:, r.lo : r.hi] for r in runs], blocks[0], dtype)


def _cat(pieces: list[torch.Tensor], like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``pieces`` side by side in a new ``dtype`` tensor (the conversion in the same copy)."""
    out = torch.empty(like.shape[0], sum(p.shape[1] for p in pieces), dtype=dtype, device=like.device)
    if pieces:
        torch.cat(pieces, dim=1, out=out)
    return out


class _AssembleColumns(torch.autograd.Function):
    @staticmethod
    def forward(ctx, runs, dtype, *blocks):
        ctx.runs = runs
        ctx.widths = [b.shape[1] for b in blocks]
        ctx.dtypes = [b.dtype for b in blocks]
        return _cat([blocks[r.block][:, r.lo : r.hi] for r in runs], blocks[0], dtype)

    @staticmethod
    def backward(ctx, grad):
        rows = grad.shape[0]
        starts, at = [], 0
        for r in ctx.runs:
            starts.append(at)
            at += r.hi - r.lo
        gap = max(ctx.widths, default=0)
        zeros = None
        grads = []
        for k, width in enumerate(ctx.widths):
            mine = sorted((r.lo, r.hi, s) for r, s in zip(ctx.runs, starts) if r.block == k)
            pieces, pos = [], 0
            for lo, hi, s in mine:
                if lo > pos:
                    zeros = grad.new_zeros(rows, gap) if zeros is None else zeros
                    pieces.append(zeros[:, : lo - pos])
                pieces.append(grad[:, s : s + hi - lo])
                pos = hi
            if pos < width:
                zeros = grad.new_zeros(rows, gap) if zeros is None else zeros
                pieces.append(zeros[:, : width - pos])
            grads.append(_cat(pieces, grad, ctx.dtypes[k]))
        return (None, None, *grads)
