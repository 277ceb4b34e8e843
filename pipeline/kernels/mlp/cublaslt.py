"""cuBLASLt's matrix product with the bias and ReLU epilogue that also writes the ReLU's bit mask, called through
``ctypes`` on the ``libcublasLt`` that torch's CUDA build already loaded.

torch exposes cuBLASLt's bias and ReLU epilogue (``torch._addmm_activation``, without autograd) but not the one
that writes the mask beside the output (``RELU_AUX_BIAS``): a bit a value, which the backward reads in place of the
layer's output (the kernel of ``relu_grad.cu``). The forward of a Linear + ReLU layer is then one product, where
Inductor writes the product and reads it again for the ReLU.

cuBLASLt's backward epilogues (``DRELU``, ``DRELU_BGRAD``, ``BGRADB``) are not used: on Hopper they run as a
kernel of their own after the product, slower than the pass they replace (docs/BENCHMARKS.md).

::

    linear(rows, weight, out, epilogue=RELU_AUX_BIAS, bias=b, aux=mask)   # out = relu(rows @ weight.T + b)

``rows`` ``[B, K]``, ``weight`` ``[N, K]``, ``out`` ``[B, N]``: ``RELU_AUX_BIAS`` adds ``bias`` (``[N]``), applies
the ReLU and writes its mask to ``aux`` (uint8 ``[B, mask_width(N) / 8]``, bit ``j % 8`` of byte ``j // 8`` set
where output ``j`` is positive; the bits past ``N`` are not written). The plans (descriptors and the heuristic's
algorithm) are cached per shape; :class:`NoAlgorithm` says cuBLASLt has none for a shape, and callers fall back to
plain torch.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import threading

import torch

from pipeline.kernels.mlp.reference import mask_width

RELU_AUX_BIAS = 2 | 128 | 4

_COMPUTE_32F = 68
_DATA_TYPE = {torch.bfloat16: 14, torch.float16: 2}
_OP_N, _OP_T = 0, 1
# cublasLtMatmulDescAttributes_t
_TRANSA, _TRANSB, _EPILOGUE, _BIAS_POINTER, _AUX_POINTER, _AUX_LD = 3, 4, 7, 8, 11, 12
_PREF_MAX_WORKSPACE_BYTES = 1
WORKSPACE_BYTES = 32 << 20
"""The most workspace a product may take (what cuBLAS asks for on Hopper)."""


class NoAlgorithm(RuntimeError):
    """cuBLASLt's heuristic found no algorithm for a product."""


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _library_path() -> str:
    """torch's own libcublasLt: the one mapped into this process (torch's CUDA libraries link it), else the one
    in the nvidia wheels beside torch."""
    torch.cuda.init()
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "/libcublasLt.so" in path:
                return path
    roots = [os.path.dirname(os.path.dirname(torch.__file__))]
    found = sorted(p for root in roots for p in glob.glob(os.path.join(root, "nvidia", "*", "lib", "libcublasLt.so*")))
    if not found:
        raise OSError("libcublasLt is neither loaded by torch nor in the nvidia wheels beside it")
    return found[-1]


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(_library_path())
    p, i, u64, i64, size = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
    pp = ctypes.POINTER(ctypes.c_void_p)
    for name, args in {
        "cublasLtCreate": [pp],
        "cublasLtMatmulDescCreate": [pp, i, i],
        "cublasLtMatmulDescSetAttribute": [p, i, p, size],
        "cublasLtMatrixLayoutCreate": [pp, i, u64, u64, i64],
        "cublasLtMatmulPreferenceCreate": [pp],
        "cublasLtMatmulPreferenceSetAttribute": [p, i, p, size],
        "cublasLtMatmulAlgoGetHeuristic": [p, p, p, p, p, p, p, i, ctypes.POINTER(_HeuristicResult),
                                           ctypes.POINTER(ctypes.c_int)],
        "cublasLtMatmul": [p, p, p, p, p, p, p, p, p, p, p, p, ctypes.POINTER(_Algo), p, size, p],
    }.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = args, i
    return lib


def library_problem() -> str | None:
    """``None`` where torch's cuBLASLt can be called here, else why not, in words."""
    try:
        _lib()
    except (OSError, AttributeError, RuntimeError) as error:
        return f"cuBLASLt could not be loaded ({error})"
    return None


def _call(name: str, *args) -> None:
    status = getattr(_lib(), name)(*args)
    if status != 0:
        raise RuntimeError(f"cuBLASLt: {name} returned status {status}")


def _create(name: str, *args) -> ctypes.c_void_p:
    handle = ctypes.c_void_p()
    _call(name, ctypes.byref(handle), *args)
    return handle


def _set(desc: ctypes.c_void_p, attribute: int, value: ctypes._SimpleCData) -> None:
    _call("cublasLtMatmulDescSetAttribute", desc, attribute, ctypes.addressof(value), ctypes.sizeof(value))


@functools.cache
def _handle(device_index: int) -> ctypes.c_void_p:
    with torch.cuda.device(device_index):
        return _create("cublasLtCreate")


@functools.cache
def _preference() -> ctypes.c_void_p:
    preference = _create("cublasLtMatmulPreferenceCreate")
    limit = ctypes.c_uint64(WORKSPACE_BYTES)
    _call("cublasLtMatmulPreferenceSetAttribute", preference, _PREF_MAX_WORKSPACE_BYTES, ctypes.addressof(limit),
          ctypes.sizeof(limit))
    return preference


class _Plan:
    """The descriptors of one product's shapes and epilogue, and the algorithm the heuristic picked for them.
    cuBLASLt is column-major, where a row-major ``[R, C]`` tensor is ``[C, R]``: ``out = rows @ weight.T`` is
    ``D [N, B] = op_T(A [K, N]) B [K, B]`` with A ``weight``, B ``rows`` and D ``out``."""

    def __init__(self, device_index: int, dtype: torch.dtype, rows: int, weight_shape: tuple[int, int], epilogue: int,
                 pointers: tuple[int, int]) -> None:
        data_type = _DATA_TYPE[dtype]
        width, inputs = weight_shape
        self.handle = _handle(device_index)
        self.desc = _create("cublasLtMatmulDescCreate", _COMPUTE_32F, 0)
        _set(self.desc, _TRANSA, ctypes.c_int32(_OP_T))
        _set(self.desc, _TRANSB, ctypes.c_int32(_OP_N))
        _set(self.desc, _EPILOGUE, ctypes.c_uint32(epilogue))
        if epilogue & 128:
            _set(self.desc, _AUX_LD, ctypes.c_int64(mask_width(width)))
        self.a = _create("cublasLtMatrixLayoutCreate", data_type, inputs, width, inputs)
        self.b = _create("cublasLtMatrixLayoutCreate", data_type, inputs, rows, inputs)
        self.d = _create("cublasLtMatrixLayoutCreate", data_type, width, rows, width)
        self.epilogue = epilogue
        self._point(*pointers)
        result, found = _HeuristicResult(), ctypes.c_int(0)
        _call("cublasLtMatmulAlgoGetHeuristic", self.handle, self.desc, self.a, self.b, self.d, self.d, _preference(),
              1, ctypes.byref(result), ctypes.byref(found))
        if found.value == 0:
            raise NoAlgorithm(f"cuBLASLt has no algorithm for [{rows}, {inputs}] x [{inputs}, {width}] in {dtype} "
                              f"with epilogue {epilogue}")
        self.algo, self.workspace = result.algo, result.workspace_size

    def _point(self, bias: int, aux: int) -> None:
        _set(self.desc, _BIAS_POINTER, ctypes.c_void_p(bias))
        if self.epilogue & 128:
            _set(self.desc, _AUX_POINTER, ctypes.c_void_p(aux))

    def run(self, rows: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, pointers: tuple[int, int]) -> None:
        self._point(*pointers)
        workspace = torch.empty(self.workspace, dtype=torch.uint8, device=out.device) if self.workspace else None
        stream = torch.cuda.current_stream(out.device).cuda_stream
        _call("cublasLtMatmul", self.handle, self.desc, ctypes.addressof(_ONE), weight.data_ptr(), self.a,
              rows.data_ptr(), self.b, ctypes.addressof(_ZERO), out.data_ptr(), self.d, out.data_ptr(), self.d,
              ctypes.byref(self.algo), workspace.data_ptr() if workspace is not None else None, self.workspace,
              stream)


_ONE, _ZERO = ctypes.c_float(1.0), ctypes.c_float(0.0)
_plans: dict[tuple, _Plan | NoAlgorithm] = {}
_lock = threading.Lock()


def _alignment(pointer: int) -> int:
    """The pointer's alignment up to 256 bytes: the heuristic picks algorithms for the alignment it sees."""
    return min(256, pointer & -pointer) if pointer else 256


def linear(rows: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, *, epilogue: int, bias: torch.Tensor,
           aux: torch.Tensor | None = None) -> None:
    """``out = rows @ weight.T`` with ``epilogue`` (the module's doc). All tensors contiguous on one GPU; ``rows``,
    ``weight``, ``out`` and ``bias`` in one half dtype. Raises :class:`NoAlgorithm` where cuBLASLt has none for
    the shapes."""
    pointers = (bias.data_ptr(), aux.data_ptr() if aux is not None else 0)
    key = (out.device.index, out.dtype, rows.shape[0], tuple(weight.shape), epilogue,
           tuple(_alignment(t.data_ptr()) for t in (rows, weight, out)), tuple(map(_alignment, pointers)))
    with _lock:
        plan = _plans.get(key)
        if plan is None:
            try:
                plan = _Plan(out.device.index, out.dtype, rows.shape[0], tuple(weight.shape), epilogue, pointers)
            except NoAlgorithm as missing:
                plan = missing
            _plans[key] = plan
        if isinstance(plan, NoAlgorithm):
            raise plan
        plan.run(rows, weight, out, pointers)
