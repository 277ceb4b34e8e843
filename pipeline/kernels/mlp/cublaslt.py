"""cuBLASLt's matrix product with the epilogues of a Linear + ReLU layer's training step, called through
``ctypes`` on the ``libcublasLt`` that torch's CUDA build already loaded.

torch exposes cuBLASLt's bias and ReLU epilogue (``torch._addmm_activation``) but not the epilogues a
training step needs: the ReLU's bit mask written beside the forward's output (``RELU_AUX_BIAS``), the
input-gradient product that applies that mask as it writes (``DRELU``), and the weight-gradient product that
sums the bias gradient as it reads the output's gradient (``BGRADB``). With them, a Linear + ReLU layer reads
and writes its activations once each way, where Inductor's ReLU, ReLU gradient and bias sum are passes of
their own over each activation.

One call computes, for row-major tensors, ``out = op(left) @ op(right)`` with ``op(t) = t.T`` where
``left_t`` / ``right_t``::

    matmul(rows, weight, out, right_t=True, epilogue=RELU_AUX_BIAS, bias=b, aux=mask)  # forward [B, N]
    matmul(g, weight, out, epilogue=DRELU, aux=mask)                                # input gradient [B, K]
    matmul(g, rows, out, left_t=True, epilogue=BGRADB, bias=grad_b)                 # weight gradient [N, K]

``BIAS`` adds ``bias`` (one value per column of ``out``); ``RELU_AUX_BIAS`` adds it, applies the ReLU and
writes its mask to ``aux``; ``DRELU`` zeroes ``out`` where ``aux`` has no bit; ``BGRADB`` writes the row sums
of ``op(left)`` to ``bias``, one per row of ``out`` (with ``left`` a layer's output gradient, that layer's bias
gradient). The plans (descriptors and the heuristic's algorithm) are cached per shape; :class:`NoAlgorithm`
says cuBLASLt has none for a shape, and callers fall back to plain torch.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import threading

import torch

from pipeline.kernels.mlp.reference import mask_width

DEFAULT = 1
BIAS = 4
RELU_AUX_BIAS = 2 | 128 | 4
DRELU = 8 | 128
DRELU_BGRAD = DRELU | 16
BGRADB = 512

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


def _layout(data_type: int, tensor_shape: tuple[int, int]) -> ctypes.c_void_p:
    """A row-major ``[R, C]`` tensor as cuBLASLt's column-major ``[C, R]``."""
    rows, cols = tensor_shape
    return _create("cublasLtMatrixLayoutCreate", data_type, cols, rows, cols)


class _Plan:
    """The descriptors of one product's shapes and epilogue, and the algorithm the heuristic picked for them.
    Row-major ``out = op(left) @ op(right)`` is column-major ``out^T = op(right)^T op(left)^T``: cuBLASLt's A is
    ``right`` and its B is ``left``, each stored as the transpose of the row-major tensor."""

    def __init__(self, device_index: int, dtype: torch.dtype, shapes: tuple[tuple[int, int], ...], left_t: bool,
                 right_t: bool, epilogue: int, pointers: tuple[int, int]) -> None:
        data_type = _DATA_TYPE[dtype]
        left, right, out = shapes
        self.handle = _handle(device_index)
        self.desc = _create("cublasLtMatmulDescCreate", _COMPUTE_32F, 0)
        _set(self.desc, _TRANSA, ctypes.c_int32(_OP_T if right_t else _OP_N))
        _set(self.desc, _TRANSB, ctypes.c_int32(_OP_T if left_t else _OP_N))
        _set(self.desc, _EPILOGUE, ctypes.c_uint32(epilogue))
        if epilogue & 128:
            _set(self.desc, _AUX_LD, ctypes.c_int64(mask_width(out[1])))
        self.a, self.b, self.d = _layout(data_type, right), _layout(data_type, left), _layout(data_type, out)
        self.epilogue = epilogue
        self._point(*pointers)
        result, found = _HeuristicResult(), ctypes.c_int(0)
        _call("cublasLtMatmulAlgoGetHeuristic", self.handle, self.desc, self.a, self.b, self.d, self.d, _preference(),
              1, ctypes.byref(result), ctypes.byref(found))
        if found.value == 0:
            raise NoAlgorithm(f"cuBLASLt has no algorithm for {'T' if left_t else ''}{list(left)} x "
                              f"{'T' if right_t else ''}{list(right)} in {dtype} with epilogue {epilogue}")
        self.algo, self.workspace = result.algo, result.workspace_size

    def _point(self, bias: int, aux: int) -> None:
        if self.epilogue != DEFAULT:
            _set(self.desc, _BIAS_POINTER, ctypes.c_void_p(bias))
        if self.epilogue & 128:
            _set(self.desc, _AUX_POINTER, ctypes.c_void_p(aux))

    def run(self, left: torch.Tensor, right: torch.Tensor, out: torch.Tensor, pointers: tuple[int, int]) -> None:
        self._point(*pointers)
        workspace = torch.empty(self.workspace, dtype=torch.uint8, device=out.device) if self.workspace else None
        stream = torch.cuda.current_stream(out.device).cuda_stream
        _call("cublasLtMatmul", self.handle, self.desc, ctypes.addressof(_ONE), right.data_ptr(), self.a,
              left.data_ptr(), self.b, ctypes.addressof(_ZERO), out.data_ptr(), self.d, out.data_ptr(), self.d,
              ctypes.byref(self.algo), workspace.data_ptr() if workspace is not None else None, self.workspace,
              stream)


_ONE, _ZERO = ctypes.c_float(1.0), ctypes.c_float(0.0)
_plans: dict[tuple, _Plan | NoAlgorithm] = {}
_lock = threading.Lock()


def _alignment(pointer: int) -> int:
    """The pointer's alignment up to 256 bytes: the heuristic picks algorithms for the alignment it sees."""
    return min(256, pointer & -pointer) if pointer else 256


def matmul(left: torch.Tensor, right: torch.Tensor, out: torch.Tensor, *, left_t: bool = False,
           right_t: bool = False, epilogue: int = DEFAULT, bias: torch.Tensor | None = None,
           aux: torch.Tensor | None = None) -> None:
    """``out = op(left) @ op(right)`` with ``epilogue`` (the module's doc). All tensors contiguous on one GPU;
    ``left``, ``right``, ``out`` and ``bias`` in one half dtype; ``aux`` uint8 ``[rows of out,
    mask_width(columns of out) / 8]``. Raises :class:`NoAlgorithm` where cuBLASLt has none for the shapes."""
    pointers = tuple(t.data_ptr() if t is not None else 0 for t in (bias, aux))
    shapes = tuple(tuple(t.shape) for t in (left, right, out))
    key = (out.device.index, out.dtype, shapes, left_t, right_t, epilogue,
           tuple(_alignment(t.data_ptr()) for t in (left, right, out)), tuple(map(_alignment, pointers)))
    with _lock:
        plan = _plans.get(key)
        if plan is None:
            try:
                plan = _Plan(out.device.index, out.dtype, shapes, left_t, right_t, epilogue, pointers)
            except NoAlgorithm as missing:
                plan = missing
            _plans[key] = plan
        if isinstance(plan, NoAlgorithm):
            raise plan
        plan.run(left, right, out, pointers)
