"""Rows of tables kept in host memory, read and written by the GPU itself: no host gather, no staging copy.

:func:`map_to_device` page-locks a host tensor where it lies (``cudaHostRegister``, no copy: a pinned copy
would round a table of tens of GB up to a power of two) and maps it into the GPU's address space;
:func:`copy_rows` then moves rows between it and device memory with the
``copy_rows`` kernel of the hash table (``hashtable/hashtable.cu``), on the current stream, the rows crossing
the bus once, as FBGEMM's and HugeCTR's host-memory tables do. Rows move as 4-byte words, so any dtype whose
row is a whole number of words moves (a bf16 row of an even dim, a float32 per-row state).

Example::

    if map_to_device(host_table, torch.device("cuda")):   # [rows, dim] in host memory
        copy_rows(cache, slots, host_table, rows)           # cache[slots[i]] = host_table[rows[i]], on the GPU
        copy_rows(host_table, rows, cache, slots)           # and back
"""

from __future__ import annotations

import functools
import weakref

import torch

from pipeline.kernels._launch import i32, i64, launch, ptr
from pipeline.kernels.hashtable.launcher import BLOCK, COPY_GROUP, SOURCE

_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02  # cudaHostRegisterPortable | cudaHostRegisterMapped
_CAN_USE_HOST_POINTER = 91  # cudaDevAttrCanUseHostPointerForRegisteredMem


@functools.cache
def _host_pointers_usable(index: int) -> bool:
    """The GPU reads registered host memory at its host address (true of x86-64 Linux with a current driver)."""
    from cupy.cuda import runtime

    return bool(runtime.deviceGetAttribute(_CAN_USE_HOST_POINTER, index))


def map_to_device(tensor: torch.Tensor, device: torch.device) -> bool:
    """Page-lock the (contiguous) host ``tensor``'s memory and map it for ``device``'s kernels, until this tensor
    object is freed (keep it while the GPU uses the memory); False where that cannot be done (then copy rows
    through the host instead)."""
    if tensor.is_cuda or not tensor.is_contiguous() or tensor.numel() == 0:
        return False
    from pipeline.kernels import kernels_problem

    if kernels_problem() or not _host_pointers_usable(device.index if device.index is not None else 0):
        return False
    address, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    if _MAPPED.get(address, 0) >= size:
        return True
    from cupy.cuda import runtime

    try:  # through CuPy, which clears the runtime's last error on a refusal (torch would report it later)
        runtime.hostRegister(address, size, _REGISTER_PORTABLE_MAPPED)
    except runtime.CUDARuntimeError:
        return False
    _MAPPED[address] = size
    weakref.finalize(tensor, _unmap, address)  # not its storage: a storage object is made anew at each call
    return True


HOST_COPY_BLOCK = 1024
"""Threads of a block of a copy between host and device memory: 128 rows in flight a block."""

HOST_COPY_BLOCKS_PER_SM = 1 / 16
"""Blocks such a copy launches per multiprocessor of the GPU (fewer where its rows need fewer): 8 on an H200, 8,192
threads with up to four 16-byte loads in flight each. Its rows wait on the bus, so the bytes in flight, not the
multiprocessors, set its rate; and a block resident for the whole copy keeps a GEMM's blocks off its multiprocessor
(docs/BENCHMARKS.md, "Tables larger than the device"), so the threads go in few large blocks."""

_MAPPED: dict[int, int] = {}
"""The host memory mapped so far: address -> bytes."""


def _unmap(address: int) -> None:
    if _MAPPED.pop(address, None) is not None:
        from cupy.cuda import runtime

        try:
            runtime.hostUnregister(address)
        except runtime.CUDARuntimeError:
            pass  # at interpreter exit the runtime may be gone already


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _words(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` (``[n, ...]``, contiguous) as ``[n, words]`` of float32, bit for bit: a view of the same memory."""
    if not rows.is_contiguous():
        raise ValueError("copy_rows: the rows must be contiguous")
    flat = rows.view(rows.shape[0], -1)
    if (flat.shape[1] * flat.element_size()) % 4:
        raise ValueError(f"rows of {flat.shape[1]} x {flat.dtype} are not a whole number of 4-byte words")
    return flat.view(torch.float32)


def rows_movable(rows: torch.Tensor) -> bool:
    """The rows of this ``[n, ...]`` tensor are whole 4-byte words (they can move with :func:`copy_rows`)."""
    return rows.dim() >= 1 and (rows[0].numel() * rows.element_size()) % 4 == 0


def copy_rows(dst: torch.Tensor, dst_rows: torch.Tensor, src: torch.Tensor, src_rows: torch.Tensor,
              bounds: torch.Tensor | None = None) -> None:
    """``dst[dst_rows[i]] = src[src_rows[i]]`` for every ``i`` (``dst_rows`` distinct), or with ``bounds`` (two int64
    on the rows' device) for ``bounds[0] <= i < bounds[1]`` only: a range the host need not read. ``dst`` and ``src``
    (``[n, ...]``, the same row size) in device memory or in mapped host memory (:func:`map_to_device`), the int64
    row numbers on the device; on its current stream. On the CPU, by indexing."""
    n = dst_rows.numel()
    if src_rows.numel() != n:
        raise ValueError(f"copy_rows: {n} destination rows for {src_rows.numel()} source rows")
    if not n:
        return
    dst_words, src_words = _words(dst), _words(src)
    dim = dst_words.shape[1]
    if src_words.shape[1] != dim:
        raise ValueError(f"copy_rows: rows of {src_words.shape[1]} words into rows of {dim}")
    if dst_rows.device.type == "cpu":
        lo, hi = bounds.tolist() if bounds is not None else (0, n)
        dst[dst_rows[lo:hi]] = src[src_rows[lo:hi]]
        return
    dst, src = dst_words, src_words
    aligned = dim % 4 == 0 and dst.data_ptr() % 16 == 0 and src.data_ptr() % 16 == 0
    through_host = not (dst.is_cuda and src.is_cuda)
    block = HOST_COPY_BLOCK if through_host else BLOCK
    blocks = -(-n * COPY_GROUP // block)
    if through_host:
        blocks = min(blocks, max(1, int(_multiprocessors(dst_rows.device) * HOST_COPY_BLOCKS_PER_SM)))
    launch(SOURCE, "copy_rows", dst_rows.device, blocks, block,
           [ptr(dst), ptr(dst_rows.contiguous()), ptr(src), ptr(src_rows.contiguous()), ptr(None), i64(n), i32(dim),
            i32(aligned), ptr(None if bounds is None else bounds.contiguous())])
