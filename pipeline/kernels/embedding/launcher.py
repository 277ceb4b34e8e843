"""Thin launchers of the embedding kernels: argument checks, launch geometry, the sort between kernels.

The tensors follow the contract of ``docs/EMBEDDING.md`` (flat FBGEMM-style weights, slot-major
``indices`` / ``offsets``); :class:`SlotArrays` is the per-slot part of a :class:`TablePacking` as
the kernels read it. The plain-torch reference of both ops is :mod:`pipeline.kernels.embedding.reference`.

Example::

    slots = SlotArrays.from_packing(packing, weights.device)
    pooled = pooled_forward(weights, slots, indices, offsets, batch_size)        # [B, total_dim] fp32 (or out_dtype)
    backward_update(weights, state, slots, indices, offsets, batch_size, grad, "adagrad", lr=0.05, step=1)

The fused update has candidate kernels (:data:`UPDATE_KERNELS`, ``docs/EMBEDDING.md``); :data:`UPDATE_KERNEL`
names the one ``backward_update`` runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.kernels._launch import f32, i32, i64, launch, ptr, resident_blocks, u64

FORWARD_SOURCE = "embedding/embedding_forward.cu"
BACKWARD_SOURCE = "embedding/embedding_backward.cu"  # the row keys and the long runs' update
POSITION_SOURCE = "embedding/embedding_update_position.cu"  # the update a group per sorted position
RUNS_SOURCE = "embedding/embedding_update_runs.cu"  # the per-segment kernels that training runs
UNCAPPED_SOURCE = "embedding/embedding_update_runs_uncapped.cu"  # the uncapped candidates
ROW_TRAFFIC_SOURCE = "embedding/row_traffic.cu"  # bench embedding's rows read and written back at random
BLOCK = 256
BAGS_PER_GROUP = 8  # consecutive bags one thread group pools: more row loads in flight for one-hot bags
SMALL_BATCH_BAGS = 1 << 16  # below this many bags, one bag per group keeps every multiprocessor busy
MAX_UPDATE_DIM = 512
SEGMENT = 64  # sorted positions per thread group in the update; as SEGMENT in embedding_update.cuh
_DTYPE_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_OPTIMIZERS = ("sgd", "adagrad", "adam")


@dataclass(frozen=True)
class UpdateKernel:
    """How the fused update is scheduled on the GPU. Every way sums a row's gradient rows in the same
    order and owns each row once (with two vectors a lane, a row-wise Adagrad sum of squares adds its
    terms in another order).

    ``per_segment``: list the segments first (``embedding_update_runs.cuh``) and give thread groups
    segments, not sorted positions; ``looped``: launch only as many groups as stay resident, each looping
    over segments with the next one's record loaded ahead (else one group per segment the batch may
    hold); ``capped``: kernels whose registers are capped to keep more blocks resident without
    spilling; ``vectors_per_lane``: 2 gives a row that one pass of lanes covers half the lanes, two
    16-byte vectors each, so a warp updates two rows at once; ``singles_apart``: the rows of one occurrence
    in the batch listed apart from the other segments and updated by a lean kernel, the others by the capped
    loop from a list of their own (rows that one pass of lanes covers; wider ones as ``capped``).
    """

    per_segment: bool = False
    looped: bool = False
    capped: bool = False
    vectors_per_lane: int = 1
    singles_apart: bool = False


# Each candidate adds one change to the one before it, so a side-by-side timing (bench embedding
# --sweep-update-kernels) shows what each is worth; why each should be faster: embedding_update_runs.cuh.
UPDATE_KERNELS = {
    "position": UpdateKernel(),
    "segments": UpdateKernel(per_segment=True),
    "segments_looped": UpdateKernel(per_segment=True, looped=True),
    "segments_looped_capped": UpdateKernel(per_segment=True, looped=True, capped=True),
    "segments_looped_capped_2vec": UpdateKernel(per_segment=True, looped=True, capped=True, vectors_per_lane=2),
    "singles_apart": UpdateKernel(per_segment=True, looped=True, capped=True, singles_apart=True),
}
UPDATE_KERNEL = "singles_apart"  # the one backward_update runs: the fastest measured (docs/BENCHMARKS.md)


@dataclass(frozen=True)
class SlotArrays:
    """Per-slot arrays on the device: where each slot's table starts (elements and rows), its columns."""

    weight_offsets: torch.Tensor  # int64 [S]: element offset of the slot's table in the flat weights
    row_offsets: torch.Tensor  # int64 [S]: global row of the slot's table's row 0 (row-wise state index)
    output_offsets: torch.Tensor  # int64 [S + 1]: column offsets in the pooled output
    mean: torch.Tensor  # bool [S]: mean pooling
    table_row_starts: torch.Tensor  # int64 [T + 1]: first global row of each table, ascending, then total rows
    table_weight_offsets: torch.Tensor  # int64 [T]: element offset of those tables, same order
    table_dims: torch.Tensor  # int64 [T]: their dims, same order
    num_slots: int
    max_dim: int
    total_dim: int
    total_rows: int
    column_multiple: int  # the largest of 8, 4, 2, 1 that divides every slot's first column

    @classmethod
    def from_packing(cls, packing, device: torch.device | str) -> SlotArrays:
        device = torch.device(device)
        tables = packing.slot_table
        by_row = sorted(range(len(packing.rows)), key=lambda t: packing.row_offsets[t])
        return cls(
            weight_offsets=torch.tensor([packing.weights_offsets[t] for t in tables], dtype=torch.int64, device=device),
            row_offsets=torch.tensor([packing.row_offsets[t] for t in tables], dtype=torch.int64, device=device),
            output_offsets=torch.tensor(packing.output_offsets, dtype=torch.int64, device=device),
            mean=torch.tensor(packing.slot_mean, dtype=torch.bool, device=device),
            table_row_starts=torch.tensor([packing.row_offsets[t] for t in by_row] + [sum(packing.rows)],
                                          dtype=torch.int64, device=device),
            table_weight_offsets=torch.tensor([packing.weights_offsets[t] for t in by_row], dtype=torch.int64,
                                              device=device),
            table_dims=torch.tensor([packing.dims[t] for t in by_row], dtype=torch.int64, device=device),
            num_slots=len(tables),
            max_dim=max(packing.slot_dims, default=0),
            total_dim=packing.output_offsets[-1],
            total_rows=sum(packing.rows),
            column_multiple=next(m for m in (8, 4, 2, 1) if all(o % m == 0 for o in packing.output_offsets)),
        )


def _vector_width(dtype: torch.dtype) -> int:
    return 16 // torch.empty((), dtype=dtype).element_size()


def _log_lanes(max_dim: int, width: int) -> int:
    """log2 of the threads per bag/row: enough lanes for one vector each across the widest row, <= 32."""
    lanes = 1
    while lanes < 32 and lanes * width < max_dim:
        lanes *= 2
    return lanes.bit_length() - 1


def _check(weights: torch.Tensor, slots: SlotArrays, indices: torch.Tensor, offsets: torch.Tensor,
           batch_size: int) -> None:
    if weights.device.type != "cuda" or weights.dim() != 1 or not weights.is_contiguous():
        raise ValueError(f"expected flat contiguous CUDA weights, got {tuple(weights.shape)} on {weights.device}")
    if weights.dtype not in _DTYPE_NAMES:
        raise ValueError(f"expected fp32, fp16 or bf16 weights, got {weights.dtype}")
    if indices.dtype != torch.int64 or offsets.dtype != torch.int64:
        raise ValueError(f"expected int64 indices and offsets, got {indices.dtype} and {offsets.dtype}")
    if indices.device != weights.device or offsets.device != weights.device:
        raise ValueError(f"expected indices and offsets on {weights.device}, got {indices.device}, {offsets.device}")
    if offsets.numel() != slots.num_slots * batch_size + 1:
        raise ValueError(f"expected {slots.num_slots} slots x {batch_size} bags + 1 = "
                         f"{slots.num_slots * batch_size + 1} offsets, got {offsets.numel()}")


def pooled_forward(weights: torch.Tensor, slots: SlotArrays, indices: torch.Tensor, offsets: torch.Tensor,
                   batch_size: int, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Pooled lookups of every slot, concatenated: ``[batch_size, total_dim]``, one launch. Summed in fp32 and
    written as ``out_dtype`` (fp32, fp16 or bf16: rounded once)."""
    _check(weights, slots, indices, offsets, batch_size)
    if out_dtype not in _DTYPE_NAMES:
        raise ValueError(f"expected an fp32, fp16 or bf16 output, got {out_dtype}")
    out = torch.empty(batch_size, slots.total_dim, dtype=out_dtype, device=weights.device)
    bags = slots.num_slots * batch_size
    if bags == 0 or slots.total_dim == 0:
        return out
    indices, offsets = indices.contiguous(), offsets.contiguous()
    log_lanes = _log_lanes(slots.max_dim, _vector_width(weights.dtype))
    bags_per_group = BAGS_PER_GROUP if bags >= SMALL_BATCH_BAGS else 1
    groups = slots.num_slots * ((batch_size + bags_per_group - 1) // bags_per_group)
    groups_per_block = BLOCK >> log_lanes
    launch(FORWARD_SOURCE, f"pooled_forward_{_DTYPE_NAMES[weights.dtype]}_{_DTYPE_NAMES[out_dtype]}", weights.device,
           (groups + groups_per_block - 1) // groups_per_block, BLOCK,
           [ptr(weights), ptr(slots.weight_offsets), ptr(slots.output_offsets), ptr(slots.mean), ptr(indices),
            ptr(offsets), i32(slots.num_slots), i32(batch_size), i32(bags_per_group), i32(log_lanes),
            i32(weights.data_ptr() % 16 == 0), i32(out.data_ptr() % 16 == 0), ptr(out)])
    return out


def sort_by_row(slots: SlotArrays, indices: torch.Tensor, offsets: torch.Tensor,
                batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row keys sorted, the bag of each sorted key): the grouping step of the backward.

    A key is the global row (table row offset + id), int32 when every row fits, so the radix sort
    runs over half the bits.
    """
    nnz = indices.numel()
    wide = slots.total_rows >= 2**31 - 1
    keys = torch.empty(nnz, dtype=torch.int64 if wide else torch.int32, device=indices.device)
    bag_of = torch.empty(nnz, dtype=torch.int32, device=indices.device)
    bags = slots.num_slots * batch_size
    log_lanes = min(5, max(nnz // max(bags, 1) - 1, 0).bit_length())  # lanes >= the mean ids a bag, <= 32
    threads = bags << log_lanes
    launch(BACKWARD_SOURCE, f"row_keys_{'i64' if wide else 'i32'}", indices.device, (threads + BLOCK - 1) // BLOCK,
           BLOCK, [ptr(indices), ptr(offsets), ptr(slots.row_offsets), i32(slots.num_slots), i32(batch_size),
                   i32(log_lanes), ptr(keys), ptr(bag_of)])
    sorted_keys, order = torch.sort(keys)
    return sorted_keys, bag_of.index_select(0, order)


def backward_update(weights: torch.Tensor, state: dict[str, torch.Tensor], slots: SlotArrays,
                    indices: torch.Tensor, offsets: torch.Tensor, batch_size: int, grad_output: torch.Tensor,
                    optimizer: str, lr: float, step: int, eps: float = 1e-8, beta1: float = 0.9,
                    beta2: float = 0.999, weight_decay: float = 0.0, master_weights: torch.Tensor | None = None,
                    stochastic_rounding: bool = False, seed: int = 0) -> None:
    """Sum the gradient of every touched row and apply ``optimizer`` to those rows, in place.

    ``state``: ``momentum1`` (adagrad: [total rows]; adam: like weights) and ``momentum2`` (adam),
    flat fp32. ``master_weights``: an fp32 copy of 16-bit weights that is updated and then rounded
    into ``weights``. ``stochastic_rounding``: round 16-bit results up or down at random (unbiased),
    drawn from ``seed`` and ``step``, instead of to nearest.
    """
    _check(weights, slots, indices, offsets, batch_size)
    if optimizer not in _OPTIMIZERS:
        raise ValueError(f"embedding optimizer: expected one of {_OPTIMIZERS}, got {optimizer!r}")
    if slots.max_dim > MAX_UPDATE_DIM:
        raise ValueError(f"the cuda backend updates rows of dim <= {MAX_UPDATE_DIM}, got dim {slots.max_dim}")
    if tuple(grad_output.shape) != (batch_size, slots.total_dim):
        raise ValueError(f"expected grad_output of shape {(batch_size, slots.total_dim)}, "
                         f"got {tuple(grad_output.shape)}")
    if master_weights is not None and (master_weights.dtype != torch.float32
                                       or master_weights.shape != weights.shape or master_weights.device != weights.device):
        raise ValueError(f"expected fp32 master weights shaped {tuple(weights.shape)} on {weights.device}, "
                         f"got {master_weights.dtype} {tuple(master_weights.shape)} on {master_weights.device}")
    state1, state2 = _state_for(optimizer, state, weights, slots)
    nnz = indices.numel()
    kernel = update_kernel() if nnz < 2**31 else UPDATE_KERNELS["position"]  # per-segment positions are int32
    if batch_size == 0 or nnz == 0:
        return
    indices, offsets = indices.contiguous(), offsets.contiguous()
    width = _vector_width(weights.dtype)
    grad, grad_aligned = _gradient_rows(grad_output, slots, width)
    sorted_keys, sorted_bags = sort_by_row(slots, indices, offsets, batch_size)

    log_lanes = _log_lanes(slots.max_dim, width)
    chunks = 1 if slots.max_dim <= (width << log_lanes) else MAX_UPDATE_DIM // (32 * width)
    key = "i64" if sorted_keys.dtype == torch.int64 else "i32"
    kinds = f"{optimizer}_{_DTYPE_NAMES[weights.dtype]}_{key}"
    step = max(int(step), 1)
    weights_aligned = weights.data_ptr() % 16 == 0 and all(
        t is None or t.data_ptr() % 16 == 0 for t in (master_weights, state1 if optimizer == "adam" else None, state2))
    # Two partial-sum slots per segment of SEGMENT sorted positions, each as wide as a row's lanes.
    segments = (nnz + SEGMENT - 1) // SEGMENT
    partials = torch.empty(2 * segments * chunks * (width << log_lanes), dtype=torch.float32, device=weights.device)
    update = [f32(lr), f32(eps), f32(beta1), f32(beta2), f32(1.0 - beta1**step), f32(1.0 - beta2**step),
              f32(weight_decay), i32(stochastic_rounding), u64(_mix(seed, step))]
    rows = [ptr(weights), ptr(master_weights), ptr(state1), ptr(state2)]
    tables = [ptr(slots.table_row_starts), ptr(slots.table_weight_offsets), ptr(slots.table_dims),
              i32(slots.table_dims.numel())]
    seg_log_lanes, seg_chunks = segment_lanes(kernel, log_lanes, chunks)
    slot_args = [ptr(offsets), ptr(slots.weight_offsets), ptr(slots.row_offsets), ptr(slots.output_offsets),
                 ptr(slots.mean), ptr(grad), i64(grad.stride(0))]
    lane_args = [i32(batch_size), i32(seg_log_lanes), i32(weights_aligned), i32(grad_aligned),
                 i32(grad.dtype == torch.bfloat16)]
    groups_per_block = BLOCK >> seg_log_lanes
    one_group_each = (nnz + groups_per_block - 1) // groups_per_block
    if kernel.singles_apart and seg_chunks == 1:
        singles, others = list_segments_apart(sorted_keys, sorted_bags)
        name = f"sparse_update_singles_{kinds}"
        launch(RUNS_SOURCE, name, weights.device,
               min(one_group_each, resident_blocks(RUNS_SOURCE, name, weights.device, BLOCK)), BLOCK,
               [*rows, *map(ptr, singles), i64(nnz), *slot_args, *lane_args, *update])
        name = f"sparse_update_runs_apart_{kinds}"
        launch(RUNS_SOURCE, name, weights.device,
               min(one_group_each, resident_blocks(RUNS_SOURCE, name, weights.device, BLOCK)), BLOCK,
               [*rows, *map(ptr, others), i64(nnz), ptr(sorted_bags), *slot_args, ptr(partials), *lane_args, *update])
    elif kernel.per_segment:
        segments_list = list_segments(sorted_keys, sorted_bags)
        name = f"sparse_update_runs{'_capped' if kernel.capped else ''}_{kinds}_c{seg_chunks}"
        source = RUNS_SOURCE if kernel.capped else UNCAPPED_SOURCE
        grid = one_group_each
        if kernel.looped:
            grid = min(grid, resident_blocks(source, name, weights.device, BLOCK))
        launch(source, name, weights.device, grid, BLOCK,
               [*rows, *map(ptr, segments_list), i64(nnz), ptr(sorted_bags), *slot_args, ptr(partials), *lane_args,
                *update])
    else:
        rows_per_block = BLOCK >> log_lanes
        launch(POSITION_SOURCE, f"sparse_update_{kinds}_c{chunks}", weights.device,
               (nnz + rows_per_block - 1) // rows_per_block, BLOCK,
               [*rows, ptr(sorted_keys), ptr(sorted_bags), ptr(offsets), *tables, ptr(slots.output_offsets),
                ptr(slots.mean), ptr(grad), i64(grad.stride(0)), ptr(partials), i64(nnz), i32(batch_size),
                i32(log_lanes), i32(weights_aligned), i32(grad_aligned),
                i32(grad.dtype == torch.bfloat16), *update])
    if segments > 1:
        launch(BACKWARD_SOURCE, f"sparse_update_{kinds}_c{chunks}_long", weights.device,
               (segments + (BLOCK >> log_lanes) - 1) // (BLOCK >> log_lanes), BLOCK,
               [*rows, ptr(sorted_keys), *tables, ptr(partials), i64(nnz), i32(log_lanes), i32(weights_aligned),
                *update])


def _gradient_rows(grad_output: torch.Tensor, slots: SlotArrays, width: int) -> tuple[torch.Tensor, bool]:
    """The pooled output's gradient as the update kernels read it, and whether its rows take vector loads: fp32
    or bf16 rows whose elements are contiguous, read in place (a column slice of a wider gradient, as the dense
    part's backward leaves it, is not copied); any other dtype or layout becomes contiguous fp32 first.
    ``width``: elements of a 16-byte vector of the weights."""
    grad = grad_output
    if grad.dtype not in (torch.float32, torch.bfloat16) or grad.stride(-1) != 1 or grad.stride(0) < slots.total_dim:
        grad = grad.to(torch.float32).contiguous()
    q = 4 if grad.dtype == torch.float32 else width  # elements a vector load reads (16 or, for 4 bf16, 8 bytes)
    aligned = (grad.data_ptr() % (q * grad.element_size()) == 0 and grad.stride(0) % q == 0
               and slots.column_multiple % q == 0)
    return grad, aligned


def rows_read_write(weights: torch.Tensor, grad: torch.Tensor, row_vec: torch.Tensor, grad_vec: torch.Tensor,
                    row_vectors: int, grad_vectors: int, rows_per_warp: int) -> None:
    """Read each row of ``weights`` that ``row_vec`` points at and its gradient row (``grad_vec``), and write the row
    back with the lowest bit of each 32-bit word changed by the lowest bit of the gradient word beside it: the update's
    memory traffic alone (``row_traffic.cu``), for ``bench embedding``. Offsets and lengths are in 16-byte vectors;
    ``rows_per_warp`` is 1, 2, 4 or 8."""
    n = row_vec.numel()
    rows_per_block = (BLOCK // 32) * rows_per_warp
    launch(ROW_TRAFFIC_SOURCE, f"rows_read_write_{rows_per_warp}", weights.device, (n + rows_per_block - 1) // rows_per_block,
           BLOCK, [ptr(weights), ptr(grad), ptr(row_vec), ptr(grad_vec), i64(n), i32(row_vectors), i32(grad_vectors)])


def update_kernel() -> UpdateKernel:
    """The candidate :data:`UPDATE_KERNEL` names."""
    if UPDATE_KERNEL not in UPDATE_KERNELS:
        raise ValueError(f"update kernel: expected one of {tuple(UPDATE_KERNELS)}, got {UPDATE_KERNEL!r}")
    return UPDATE_KERNELS[UPDATE_KERNEL]


def segment_lanes(kernel: UpdateKernel, log_lanes: int, chunks: int) -> tuple[int, int]:
    """(log2 lanes, chunks) of a row in ``kernel``: half the lanes and two chunks where one pass of
    ``1 << log_lanes`` lanes covers the row and ``kernel`` asks for two vectors a lane; else as given."""
    if kernel.vectors_per_lane == 2 and chunks == 1 and log_lanes > 0:
        return log_lanes - 1, 2
    return log_lanes, chunks


def _segment_blocks(sorted_keys: torch.Tensor) -> tuple[torch.device, int, str, int]:
    """What both segment listings launch over: the device, ``nnz``, the key type's kernel suffix and the blocks of
    sorted positions."""
    device, nnz = sorted_keys.device, sorted_keys.numel()
    if nnz >= 2**31:
        raise ValueError(f"the per-segment update kernels take fewer than 2**31 ids a batch, got {nnz}")
    return device, nnz, "i64" if sorted_keys.dtype == torch.int64 else "i32", (nnz + BLOCK - 1) // BLOCK


def list_segments(sorted_keys: torch.Tensor, sorted_bags: torch.Tensor) -> list[torch.Tensor]:
    """The segments of the sorted positions, listed on the device with no host sync:
    ``[seg_begin, seg_key, seg_bag, seg_split, count]``, as the per-segment kernels read them
    (``embedding_update_runs.cuh``). Sized for ``nnz`` segments; ``count`` (one int32) says how many there are."""
    device, nnz, key, blocks = _segment_blocks(sorted_keys)
    block_ends = torch.empty(blocks, dtype=torch.int32, device=device)
    launch(RUNS_SOURCE, f"count_segments_{key}", device, blocks, BLOCK, [ptr(sorted_keys), i64(nnz), ptr(block_ends)])
    block_ends.cumsum_(0)
    seg_begin = torch.empty(nnz + 1, dtype=torch.int32, device=device)
    seg_key = torch.empty(nnz, dtype=sorted_keys.dtype, device=device)
    seg_bag = torch.empty(nnz, dtype=torch.int32, device=device)
    seg_split = torch.empty(nnz, dtype=torch.uint8, device=device)
    launch(RUNS_SOURCE, f"compact_segments_{key}", device, blocks, BLOCK,
           [ptr(sorted_keys), ptr(sorted_bags), i64(nnz), ptr(block_ends), ptr(seg_begin), ptr(seg_key),
            ptr(seg_bag), ptr(seg_split)])
    return [seg_begin, seg_key, seg_bag, seg_split, block_ends[blocks - 1:]]


def list_segments_apart(sorted_keys: torch.Tensor, sorted_bags: torch.Tensor) -> tuple[list[torch.Tensor],
                                                                                     list[torch.Tensor]]:
    """The segments of the sorted positions in two lists, on the device with no host sync: the single occurrences
    ``[single_key, single_bag, count]`` and the others ``[seg_begin, seg_end, seg_key, seg_bag, seg_split, count]``
    (``embedding_update_runs.cuh``). Each sized for ``nnz``; ``count`` (one int32) says how many it holds."""
    device, nnz, key, blocks = _segment_blocks(sorted_keys)
    block_ends = torch.empty(2, blocks, dtype=torch.int32, device=device)
    launch(RUNS_SOURCE, f"count_segments_apart_{key}", device, blocks, BLOCK,
           [ptr(sorted_keys), i64(nnz), ptr(block_ends)])
    block_ends.cumsum_(1)

    def empty(dtype):
        return torch.empty(nnz, dtype=dtype, device=device)

    singles = [empty(sorted_keys.dtype), empty(torch.int32)]  # key, bag
    others = [empty(torch.int32), empty(torch.int32), empty(sorted_keys.dtype), empty(torch.int32),
              empty(torch.uint8)]  # begin, end, key, bag, split
    launch(RUNS_SOURCE, f"compact_segments_apart_{key}", device, blocks, BLOCK,
           [ptr(sorted_keys), ptr(sorted_bags), i64(nnz), ptr(block_ends), *map(ptr, singles), *map(ptr, others)])
    return [*singles, block_ends[0, blocks - 1:]], [*others, block_ends[1, blocks - 1:]]


def _state_for(optimizer: str, state: dict[str, torch.Tensor], weights: torch.Tensor,
               slots: SlotArrays) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    need = {"sgd": {}, "adagrad": {"momentum1": slots.total_rows},
            "adam": {"momentum1": weights.numel(), "momentum2": weights.numel()}}[optimizer]
    for name, size in need.items():
        t = state.get(name)
        if t is None or t.dtype != torch.float32 or t.numel() != size or t.device != weights.device \
                or not t.is_contiguous():
            found = "nothing" if t is None else f"{t.dtype} [{t.numel()}] on {t.device}"
            raise ValueError(f"{optimizer}: expected state {name!r} as contiguous fp32 [{size}] on "
                             f"{weights.device}, got {found}")
    return state.get("momentum1") if need else None, state.get("momentum2") if optimizer == "adam" else None


def _mix(seed: int, step: int) -> int:
    return (int(seed) * 0x9E3779B97F4A7C15 + int(step) * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & (2**64 - 1)
