"""The plain-torch reference of the embedding ops: the CPU path and the oracle of the CUDA kernels.

Forward is one ``F.embedding_bag`` (sum) per dim group over a 2-D view of the group's storage
(differentiable in the weights, so ``gradcheck`` can check it); the update sums duplicate rows with
``unique`` + ``scatter_add_`` and applies the optimizer to those rows only, in fp32, rounding to the
weights' dtype to nearest. The update rules are in ``docs/EMBEDDING.md``.

Example::

    pooled = pooled_forward(weights, packing, indices, offsets, batch_size)
    backward_update(weights, {"momentum1": m}, packing, indices, offsets, batch_size, grad, "adagrad", 0.05, 1)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.kernels.embedding.packing import DimGroup, TablePacking


def pooled_forward(weights: torch.Tensor, packing: TablePacking, indices: torch.Tensor, offsets: torch.Tensor,
                   batch_size: int) -> torch.Tensor:
    """Pooled lookups of every slot, concatenated: ``[batch_size, total_dim]`` float32 (float64 for float64
    weights). Differentiable in ``weights``: one ``F.embedding_bag`` (sum) per dim group."""
    out_dtype = torch.float64 if weights.dtype == torch.float64 else torch.float32
    out = torch.empty(batch_size, packing.total_dim, dtype=out_dtype, device=weights.device)
    if batch_size == 0:
        return out
    for group in packing.groups:
        ids, bag_offsets = _group_bags(packing, group, indices, offsets, batch_size)
        table = _group_view(weights, group)
        if weights.dtype in (torch.float32, torch.float64):
            pooled = F.embedding_bag(ids, table, bag_offsets[:-1], mode="sum")
        else:
            bag_of_value = _bag_of_value(bag_offsets, ids.numel())
            pooled = torch.zeros(bag_offsets.numel() - 1, group.dim, dtype=torch.float32, device=weights.device)
            pooled.index_add_(0, bag_of_value, table.index_select(0, ids).float())
        pooled = _scale_mean(packing, group, pooled, bag_offsets, batch_size)
        _scatter_columns(out, packing, group, pooled.view(len(group.slots), batch_size, group.dim))
    return out


def backward_update(weights: torch.Tensor, state: dict[str, torch.Tensor], packing: TablePacking,
                    indices: torch.Tensor, offsets: torch.Tensor, batch_size: int, grad_output: torch.Tensor,
                    optimizer: str, lr: float, step: int, eps: float = 1e-8, beta1: float = 0.9,
                    beta2: float = 0.999, weight_decay: float = 0.0, stochastic_rounding: bool = False) -> None:
    """Sum the gradient of every touched row (``unique`` + ``scatter_add_``) and update those rows in place."""
    if stochastic_rounding and weights.dtype in (torch.float16, torch.bfloat16):
        raise ValueError("stochastic rounding of 16-bit tables is done by the cuda backend only; "
                         "on the torch backend use master_weights=True (an fp32 copy) instead")
    if batch_size == 0:
        return
    grad_output = grad_output.float()
    for group in packing.groups:
        ids, bag_offsets = _group_bags(packing, group, indices, offsets, batch_size)
        if ids.numel() == 0:
            continue
        grad_bags = _gather_columns(grad_output, packing, group, batch_size)
        grad_bags = _scale_mean(packing, group, grad_bags, bag_offsets, batch_size)
        if ids.numel() == grad_bags.shape[0] and bool((bag_offsets[1:] - bag_offsets[:-1]).eq(1).all()):
            grad_values = grad_bags
        else:
            grad_values = grad_bags.index_select(0, _bag_of_value(bag_offsets, ids.numel()))
        table = _group_view(weights, group)
        if optimizer == "sgd" and weight_decay == 0 and weights.dtype == torch.float32:
            table.scatter_add_(0, _expand_rows(ids, group.dim), grad_values * -lr)
            continue
        rows, inverse = torch.unique(ids, return_inverse=True)
        grad = torch.zeros(rows.numel(), group.dim, dtype=torch.float32, device=weights.device)
        grad.scatter_add_(0, _expand_rows(inverse, group.dim), grad_values)
        _apply_rows(table, rows, grad, group, state, optimizer, lr, step, eps, beta1, beta2, weight_decay)


def _expand_rows(rows: torch.Tensor, dim: int) -> torch.Tensor:
    # An expanded (stride-0) index takes scatter_add_'s sorted, vectorized path on CPU, which index_add_ lacks.
    return rows.unsqueeze(1).expand(-1, dim)


def _group_view(weights: torch.Tensor, group: DimGroup) -> torch.Tensor:
    return weights[group.start : group.start + group.rows * group.dim].view(group.rows, group.dim)


def _bag_of_value(bag_offsets: torch.Tensor, nnz: int) -> torch.Tensor:
    lengths = bag_offsets[1:] - bag_offsets[:-1]
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths, output_size=nnz)


def _group_bags(packing: TablePacking, group: DimGroup, indices: torch.Tensor, offsets: torch.Tensor,
                batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's bags (ids shifted to rows of the group's 2-D view) and their ``len(slots) * B + 1`` offsets."""
    b = batch_size
    tensors = packing.tensors(indices.device)
    if len(group.slots) == packing.num_slots:
        counts = offsets[b::b] - offsets[:-1:b]
        base = tensors["slot_group_row_base"]
        if not any(packing.slot_group_row_base):
            return indices, offsets
        return indices + torch.repeat_interleave(base, counts, output_size=indices.numel()), offsets
    pieces, piece_offsets, start = [], [offsets.new_zeros(1)], 0
    for s in group.slots:
        lo, hi = int(offsets[s * b]), int(offsets[(s + 1) * b])
        pieces.append(indices[lo:hi] + packing.slot_group_row_base[s])
        piece_offsets.append(offsets[s * b + 1 : (s + 1) * b + 1] - lo + start)
        start += hi - lo
    return torch.cat(pieces), torch.cat(piece_offsets)


def _scale_mean(packing: TablePacking, group: DimGroup, pooled: torch.Tensor, bag_offsets: torch.Tensor,
                batch_size: int) -> torch.Tensor:
    means = [packing.slot_mean[s] for s in group.slots]
    if not any(means):
        return pooled
    lengths = (bag_offsets[1:] - bag_offsets[:-1]).view(len(group.slots), batch_size).to(pooled.dtype)
    is_mean = torch.tensor(means, device=pooled.device).unsqueeze(1)
    scale = torch.where(is_mean, 1.0 / lengths.clamp(min=1), torch.ones_like(lengths))
    return pooled * scale.view(-1, 1)


def _contiguous_columns(packing: TablePacking, group: DimGroup) -> tuple[int, int] | None:
    slots = group.slots
    if slots == list(range(slots[0], slots[-1] + 1)):
        return packing.output_offsets[slots[0]], packing.output_offsets[slots[-1] + 1]
    return None


def _scatter_columns(out: torch.Tensor, packing: TablePacking, group: DimGroup, pooled: torch.Tensor) -> None:
    span = _contiguous_columns(packing, group)
    if span is not None:
        out[:, span[0] : span[1]].view(out.shape[0], len(group.slots), group.dim).copy_(pooled.transpose(0, 1))
        return
    for i, s in enumerate(group.slots):
        out[:, packing.output_offsets[s] : packing.output_offsets[s + 1]] = pooled[i]


def _gather_columns(grad: torch.Tensor, packing: TablePacking, group: DimGroup, batch_size: int) -> torch.Tensor:
    span = _contiguous_columns(packing, group)
    if span is not None:
        block = grad[:, span[0] : span[1]].reshape(batch_size, len(group.slots), group.dim)
        return block.transpose(0, 1).reshape(-1, group.dim)
    return torch.cat([grad[:, packing.output_offsets[s] : packing.output_offsets[s + 1]] for s in group.slots])


def _apply_rows(table: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor, group: DimGroup,
                state: dict[str, torch.Tensor], kind: str, lr: float, step: int, eps: float, beta1: float,
                beta2: float, weight_decay: float) -> None:
    master = _group_view(state["master_weights"], group) if "master_weights" in state else None
    w = (master if master is not None else table).index_select(0, rows).float()
    if weight_decay:
        grad = grad + weight_decay * w
    if kind == "sgd":
        w -= lr * grad
    elif kind == "adagrad":
        m = state["momentum1"][group.row_start : group.row_start + group.rows]
        m_rows = m.index_select(0, rows) + grad.pow(2).mean(1)
        m.index_copy_(0, rows, m_rows)
        w -= lr * grad / (m_rows.sqrt().unsqueeze(1) + eps)
    else:
        m1 = _group_view(state["momentum1"], group)
        m2 = _group_view(state["momentum2"], group)
        m1_rows = m1.index_select(0, rows).mul_(beta1).add_(grad, alpha=1 - beta1)
        m2_rows = m2.index_select(0, rows).mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        m1.index_copy_(0, rows, m1_rows)
        m2.index_copy_(0, rows, m2_rows)
        m1_hat = m1_rows / (1 - beta1**step)
        m2_hat = m2_rows / (1 - beta2**step)
        w -= lr * m1_hat / (m2_hat.sqrt() + eps)
    if master is not None:
        master.index_copy_(0, rows, w)
    table.index_copy_(0, rows, w.to(table.dtype))
