"""The embedding ops as ``torch.library`` custom ops (namespace ``pipeline``), so ``torch.compile``,
``torch.fx`` and export see them as single nodes with fake (meta) implementations.

The packing travels as four lists, ``TablePacking.op_args()`` = ``(rows, dims, slot_table, slot_mean)``:

- ``embedding_forward(weights, indices, offsets, batch_size, *packing) -> Tensor[B, total_dim]``
- ``embedding_update(weights!, momentum1!?, momentum2!?, master_weights!?, indices, offsets, batch_size,
  grad_output, *packing, optimizer, hyper, eps, beta1, beta2, weight_decay, stochastic_rounding, seed)``:
  the fused backward (sum the gradient of each touched row, apply the optimizer in place); ``hyper`` is
  a CPU float64 tensor ``[lr, step, ...]``, read on the host so no device sync happens.
- ``embedding_lookup(trigger, weights, momentum1?, momentum2?, master_weights?, step, hyper, indices,
  offsets, batch_size, *packing, optimizer, eps, beta1, beta2, weight_decay, stochastic_rounding, seed,
  out_dtype)``: the training forward, its output in ``out_dtype`` (fp32, or the dense part's autocast dtype,
  summed in fp32 and rounded once); its backward advances the step (``embedding_advance_step``) and runs
  ``embedding_update`` on the gradient as it comes (bf16 and column slices read in place on CUDA). No
  gradient flows to any input; ``trigger`` is an empty tensor that requires grad.
- ``embedding_check_ids(values, offsets, batch_size, slot_rows, slot_features, slot_tables)``: raises
  :class:`~pipeline.errors.BadInputError` for an id outside its table (``slot_rows`` an int64 tensor on
  the values' device, names newline-joined).

Each of the first three has a ``*_reference`` twin that runs the plain-torch reference on every device
(the ``torch`` backend). The plain ops run the reference on CPU and the NVRTC kernels on CUDA, falling
back to the reference where the kernels are unusable (no CuPy, or float64 weights).

Example::

    out = torch.ops.pipeline.embedding_forward(weights, indices, offsets, batch_size, *packing.op_args())
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from pipeline.errors import BadInputError
from pipeline.kernels import kernels_usable
from pipeline.kernels.embedding import reference
from pipeline.kernels.embedding.packing import packing_of

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _packing(rows, dims, slot_table, slot_mean):
    return packing_of(tuple(rows), tuple(dims), tuple(slot_table), tuple(slot_mean))


def _slot_arrays(rows, dims, slot_table, slot_mean, device):
    """The packing's arrays for the CUDA kernels on ``device``, made once a packing and device."""
    from pipeline.kernels.embedding import launcher

    packing = _packing(rows, dims, slot_table, slot_mean)
    return packing.cached(("slots", str(device)), lambda: launcher.SlotArrays.from_packing(packing, device))


def _state(momentum1, momentum2, master_weights) -> dict[str, Tensor]:
    named = {"momentum1": momentum1, "momentum2": momentum2, "master_weights": master_weights}
    return {k: v for k, v in named.items() if v is not None}


def _out_dtype(weights: Tensor, out_dtype: torch.dtype) -> torch.dtype:
    """The pooled output's dtype: ``out_dtype``, but float64 for float64 weights (the reference's checks)."""
    return torch.float64 if weights.dtype == torch.float64 else out_dtype


def _forward_reference(weights, indices, offsets, batch_size, rows, dims, slot_table, slot_mean,
                       out_dtype=torch.float32):
    pooled = reference.pooled_forward(weights, _packing(rows, dims, slot_table, slot_mean), indices, offsets,
                                      batch_size)
    return pooled.to(_out_dtype(weights, out_dtype))


def _forward_cuda(weights, indices, offsets, batch_size, rows, dims, slot_table, slot_mean, out_dtype=torch.float32):
    if not (kernels_usable() and weights.dtype in KERNEL_DTYPES and out_dtype in KERNEL_DTYPES):
        return _forward_reference(weights, indices, offsets, batch_size, rows, dims, slot_table, slot_mean, out_dtype)
    from pipeline.kernels.embedding import launcher

    slots = _slot_arrays(rows, dims, slot_table, slot_mean, weights.device)
    return launcher.pooled_forward(weights, slots, indices, offsets, batch_size, out_dtype)


def _update_reference(weights, momentum1, momentum2, master_weights, indices, offsets, batch_size, grad_output,
                      rows, dims, slot_table, slot_mean, optimizer, hyper, eps, beta1, beta2, weight_decay,
                      stochastic_rounding, seed):
    lr, step = hyper.tolist()[:2]
    reference.backward_update(weights, _state(momentum1, momentum2, master_weights),
                              _packing(rows, dims, slot_table, slot_mean), indices, offsets, batch_size, grad_output,
                              optimizer, lr, int(step), eps, beta1, beta2, weight_decay, stochastic_rounding)


def _update_cuda(weights, momentum1, momentum2, master_weights, indices, offsets, batch_size, grad_output,
                 rows, dims, slot_table, slot_mean, optimizer, hyper, eps, beta1, beta2, weight_decay,
                 stochastic_rounding, seed):
    if not (kernels_usable() and weights.dtype in KERNEL_DTYPES):
        return _update_reference(weights, momentum1, momentum2, master_weights, indices, offsets, batch_size,
                                 grad_output, rows, dims, slot_table, slot_mean, optimizer, hyper, eps, beta1, beta2,
                                 weight_decay, stochastic_rounding, seed)
    from pipeline.kernels.embedding import launcher

    lr, step = hyper.tolist()[:2]
    slots = _slot_arrays(rows, dims, slot_table, slot_mean, weights.device)
    launcher.backward_update(weights, _state(momentum1, momentum2, None), slots, indices, offsets, batch_size,
                             grad_output, optimizer, lr, int(step), eps=eps, beta1=beta1, beta2=beta2,
                             weight_decay=weight_decay, master_weights=master_weights,
                             stochastic_rounding=stochastic_rounding and weights.dtype != torch.float32, seed=seed)


def _forward_fake(weights, indices, offsets, batch_size, rows, dims, slot_table, slot_mean, out_dtype=torch.float32):
    return weights.new_empty((batch_size, sum(dims[t] for t in slot_table)), dtype=_out_dtype(weights, out_dtype))


def _define(suffix: str, forward_cuda, update_cuda):
    """The forward, update and training-lookup ops named ``embedding_*{suffix}``."""

    @torch.library.custom_op(f"pipeline::embedding_forward{suffix}", mutates_args=())
    def forward(weights: Tensor, indices: Tensor, offsets: Tensor, batch_size: int, rows: list[int],
                dims: list[int], slot_table: list[int], slot_mean: list[bool]) -> Tensor:
        return _forward_reference(weights, indices, offsets, batch_size, rows, dims, slot_table, slot_mean)

    forward.register_kernel("cuda", forward_cuda)
    forward.register_fake(_forward_fake)

    @torch.library.custom_op(f"pipeline::embedding_update{suffix}",
                             mutates_args=("weights", "momentum1", "momentum2", "master_weights"))
    def update(weights: Tensor, momentum1: Optional[Tensor], momentum2: Optional[Tensor],
               master_weights: Optional[Tensor], indices: Tensor, offsets: Tensor, batch_size: int,
               grad_output: Tensor, rows: list[int], dims: list[int], slot_table: list[int], slot_mean: list[bool],
               optimizer: str, hyper: Tensor, eps: float, beta1: float, beta2: float, weight_decay: float,
               stochastic_rounding: bool, seed: int) -> None:
        _update_reference(weights, momentum1, momentum2, master_weights, indices, offsets, batch_size, grad_output,
                          rows, dims, slot_table, slot_mean, optimizer, hyper, eps, beta1, beta2, weight_decay,
                          stochastic_rounding, seed)

    update.register_kernel("cuda", update_cuda)
    update.register_fake(lambda *args: None)

    @torch.library.custom_op(f"pipeline::embedding_lookup{suffix}", mutates_args=())
    def lookup(trigger: Tensor, weights: Tensor, momentum1: Optional[Tensor], momentum2: Optional[Tensor],
               master_weights: Optional[Tensor], step: Tensor, hyper: Tensor, indices: Tensor, offsets: Tensor,
               batch_size: int, rows: list[int], dims: list[int], slot_table: list[int], slot_mean: list[bool],
               optimizer: str, eps: float, beta1: float, beta2: float, weight_decay: float,
               stochastic_rounding: bool, seed: int, out_dtype: torch.dtype) -> Tensor:
        return _forward_reference(weights, indices, offsets, batch_size, rows, dims, slot_table, slot_mean, out_dtype)

    lookup.register_kernel("cuda", lambda trigger, weights, m1, m2, master, step, hyper, indices, offsets, batch_size,
                           rows, dims, slot_table, slot_mean, *rest: forward_cuda(
                               weights, indices, offsets, batch_size, rows, dims, slot_table, slot_mean, rest[-1]))
    lookup.register_fake(lambda trigger, weights, m1, m2, master, step, hyper, indices, offsets, batch_size, rows,
                         dims, slot_table, slot_mean, *rest: _forward_fake(
                             weights, indices, offsets, batch_size, rows, dims, slot_table, slot_mean, rest[-1]))

    def setup_context(ctx, inputs, output):
        (_, weights, m1, m2, master, step, hyper, indices, offsets, batch_size, *rest) = inputs
        ctx.save_for_backward(weights, m1, m2, master, step, hyper, indices, offsets)
        ctx.batch_size, ctx.rest = batch_size, rest

    def backward(ctx, grad_output):
        weights, m1, m2, master, step, hyper, indices, offsets = ctx.saved_tensors
        rows, dims, slot_table, slot_mean, optimizer, eps, beta1, beta2, weight_decay, stochastic, seed, _ = ctx.rest
        torch.ops.pipeline.embedding_advance_step(step, hyper)
        update(weights, m1, m2, master, indices, offsets, ctx.batch_size, grad_output, rows, dims, slot_table,
               slot_mean, optimizer, hyper, eps, beta1, beta2, weight_decay, stochastic, seed)
        return (None,) * 22

    lookup.register_autograd(backward, setup_context=setup_context)
    return forward, update, lookup


@torch.library.custom_op("pipeline::embedding_advance_step", mutates_args=("step", "hyper"))
def advance_step(step: Tensor, hyper: Tensor) -> None:
    """``step += 1`` on the device and in ``hyper[1]`` (CPU), reading the device counter only when
    ``hyper[2]`` is 0 (first use, or after a checkpoint load): no device sync per step."""
    if hyper[2] == 0:
        hyper[1] = float(step)
        hyper[2] = 1
    hyper[1] += 1
    step.add_(1)


advance_step.register_fake(lambda step, hyper: None)


@torch.library.custom_op("pipeline::embedding_check_ids", mutates_args=())
def check_ids(values: Tensor, offsets: Tensor, batch_size: int, slot_rows: Tensor, slot_features: str,
              slot_tables: str) -> None:
    """Raise :class:`BadInputError` naming the feature, the id and the table when an id is outside
    ``0 <= id < slot_rows[slot]`` (``values`` / ``offsets`` slot-major; names newline-joined per slot)."""
    if values.numel() == 0:
        return
    counts = offsets[batch_size::batch_size] - offsets[:-1:batch_size]
    limit = torch.repeat_interleave(slot_rows, counts, output_size=values.numel())
    bad = (values < 0) | (values >= limit)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        s = int(torch.searchsorted(offsets[::batch_size].contiguous(), torch.tensor(i, device=offsets.device),
                                   right=True)) - 1
        feature, table = slot_features.split("\n")[s], slot_tables.split("\n")[s]
        raise BadInputError(f"feature {feature}: id {int(values[i])} is outside table {table} "
                            f"(expected 0 <= id < {int(slot_rows[s])})")


check_ids.register_fake(lambda *args: None)

embedding_forward, embedding_update, embedding_lookup = _define("", _forward_cuda, _update_cuda)
embedding_forward_reference, embedding_update_reference, embedding_lookup_reference = _define(
    "_reference", _forward_reference, _update_reference)
