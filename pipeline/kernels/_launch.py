"""Launching a compiled kernel on torch's current stream, with tensors passed as raw device pointers.

The kernel parameters are packed with ``ctypes`` exactly as the ``.cu`` signature declares them
(``ptr``, ``i32``, ``i64``, ``u64``, ``f32`` below), so no tensor is copied or converted, and the
launch goes through the driver on ``torch.cuda.current_stream().cuda_stream``: it orders with the
surrounding torch work like any torch op.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from pipeline.kernels._compile import kernel_handle


def ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(0 if t is None else t.data_ptr())


def i32(v: int) -> ctypes.c_int32:
    return ctypes.c_int32(int(v))


def i64(v: int) -> ctypes.c_int64:
    return ctypes.c_int64(int(v))


def u64(v: int) -> ctypes.c_uint64:
    return ctypes.c_uint64(int(v) & 0xFFFFFFFFFFFFFFFF)


def f32(v: float) -> ctypes.c_float:
    return ctypes.c_float(float(v))


def launch(source: str, function: str, device: torch.device, grid: int, block: int, args: list,
           shared: int = 0) -> None:
    """Run ``function`` of ``source`` with ``grid`` x ``block`` threads and ``shared`` bytes of dynamic shared
    memory per block (at most 48 KiB) on the current stream of ``device``."""
    from cupy.cuda import driver, runtime

    if grid <= 0:
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
    stream = torch.cuda.current_stream(index).cuda_stream
    with torch.cuda.device(index):
        if not driver.ctxGetCurrent():
            # A thread that made no CUDA runtime call yet (autograd's backward thread, a user's thread) has no
            # current context, and torch does not set the device it already reports: the driver needs one.
            runtime.setDevice(index)
        handle = kernel_handle(source, function, index)
        driver.launchKernel(handle, grid, 1, 1, block, 1, 1, shared, stream, ctypes.addressof(params), 0)


def resident_blocks(source: str, function: str, device: torch.device, block: int) -> int:
    """How many blocks of ``block`` threads of ``function`` the GPU ``device`` keeps resident at once: its
    multiprocessors times the blocks one holds (registers, shared memory and threads allowing)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _resident_blocks(source, function, index, block)


@functools.cache
def _resident_blocks(source: str, function: str, device_index: int, block: int) -> int:
    import cupy
    from cupy.cuda import driver

    handle = kernel_handle(source, function, device_index)
    with cupy.cuda.Device(device_index):
        per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(handle, block, 0)
    return max(per_sm, 1) * torch.cuda.get_device_properties(device_index).multi_processor_count
