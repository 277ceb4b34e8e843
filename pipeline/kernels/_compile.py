"""Run-time compilation of the ``.cu`` sources with NVRTC (through CuPy), cached on disk and in memory.

A source is compiled once per (source text, compute capability, NVRTC version) into a cubin under
``$PIPELINE_KERNEL_CACHE`` (default ``~/.cache/pipeline/kernels``), then loaded once per process and
device. The source is prefixed with ``#line 1 "<file>.cu"`` so compiler errors point at the real file
and line; a failed compilation raises :class:`KernelCompileError` carrying NVRTC's log.

CuPy is imported here, lazily: nothing in this module runs at import time.

Example::

    module = load_module("embedding/embedding_forward.cu", device_index=0)
    kernel = module.get_function("pooled_forward_f32")
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import os
import re
import tempfile
import threading
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent
NVRTC_OPTIONS = ("-std=c++17",)


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel source; the message holds the compiler's log."""


def _cache_dir() -> Path:
    root = os.environ.get("PIPELINE_KERNEL_CACHE") or Path.home() / ".cache" / "pipeline" / "kernels"
    return Path(root)


def _headers_of(source: str) -> list[str]:
    return sorted(set(re.findall(r'^\s*#include\s+"([^"]+)"', source, flags=re.MULTILINE)))


def _header_path(name: str, including: Path) -> Path:
    """A quoted include: beside the file that includes it, else at the top of this folder (shared headers)."""
    for folder in (including.parent, KERNEL_DIR):
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"{including}: included header {name!r} is neither beside it nor in {KERNEL_DIR}")


def _program(name: str | Path) -> tuple[str, list[str], list[str]]:
    """(source with #line, header names, header texts) of a ``.cu`` file (a path under this folder, or any
    path), with the headers its headers include: NVRTC gets every one by the name it is included by."""
    path = KERNEL_DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"kernel source {path} does not exist")
    source = f'#line 1 "{path.name}"\n' + path.read_text()
    headers: dict[str, str] = {}
    pending = [(h, path) for h in _headers_of(source)]
    while pending:
        header, including = pending.pop()
        if header not in headers:
            text = _header_path(header, including).read_text()
            headers[header] = f'#line 1 "{header}"\n' + text
            pending += [(h, _header_path(header, including)) for h in _headers_of(text)]
    names = sorted(headers)
    return source, names, [headers[h] for h in names]


def compile_cubin(name: str | Path, arch: str) -> bytes:
    """Compile ``name`` (a ``.cu`` path under this folder, or any path) for ``arch`` (e.g. ``"sm_90"``) with NVRTC."""
    from cupy_backends.cuda.libs import nvrtc

    source, header_names, header_texts = _program(name)
    name = Path(name).name
    program = nvrtc.createProgram(source, name, [t.encode() for t in header_texts], [h.encode() for h in header_names])
    try:
        try:
            nvrtc.compileProgram(program, [f"-arch={arch}", *NVRTC_OPTIONS])
        except nvrtc.NVRTCError as err:
            log = nvrtc.getProgramLog(program)
            raise KernelCompileError(f"NVRTC could not compile {name} for {arch} ({err}):\n{log}") from None
        return nvrtc.getCUBIN(program)
    finally:
        nvrtc.destroyProgram(program)


def cached_cubin(name: str, arch: str) -> Path:
    """The cubin of ``name`` for ``arch``, compiled now only if the disk cache lacks it; where another thread
    of this process is compiling it already (:func:`compile_ahead`), that compile's result (or error)."""
    source, _, header_texts = _program(name)
    major, minor = _nvrtc_version()
    digest = hashlib.sha256("\0".join([source, *header_texts, *NVRTC_OPTIONS]).encode()).hexdigest()[:16]
    path = _cache_dir() / f"{Path(name).stem}-{arch}-nvrtc{major}.{minor}-{digest}.cubin"
    if path.is_file():
        return path
    with _compiles_lock:
        pending = _compiles.get(path)
        mine = pending is None
        if mine:
            pending = _compiles[path] = concurrent.futures.Future()
    if not mine:
        return pending.result()
    try:
        cubin = compile_cubin(name, arch)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(cubin)
        os.replace(tmp, path)
    except BaseException as err:
        pending.set_exception(err)
        raise
    else:
        pending.set_result(path)
    finally:
        with _compiles_lock:
            del _compiles[path]
    return path


def _nvrtc_version() -> tuple[int, int]:
    from cupy_backends.cuda.libs import nvrtc

    return nvrtc.getVersion()


_compiles: dict[Path, concurrent.futures.Future] = {}  # cubins being compiled by a thread of this process
_compiles_lock = threading.Lock()


def compile_ahead(arch: str, names: list[str]) -> list[threading.Thread]:
    """Start compiling, for ``arch``, each source of ``names`` that the disk cache lacks, in a thread of its own, and
    return the threads. A source otherwise compiles at its first launch, one after the other: on a fresh machine the first
    training step waited for them in turn (the embedding update's sources alone take tens of seconds). NVRTC
    compiles without holding the GIL, so they compile side by side, and beside the run's own start (a model's
    ``torch.compile``). A launch that needs a cubin still being compiled waits for that compile; a compile that
    fails here fails again, with its log, at the launch that needs it."""
    threads = [threading.Thread(target=_compile_quietly, args=(name, arch), name=f"compile {name}", daemon=True)
               for name in names]
    for thread in threads:
        thread.start()
    return threads


def _compile_quietly(name: str, arch: str) -> None:
    with contextlib.suppress(Exception):  # a failure is said again, with its log, by the launch that needs the cubin
        cached_cubin(name, arch)


@functools.cache
def load_module(name: str, device_index: int):
    """``cupy.RawModule`` of ``name`` loaded on CUDA device ``device_index`` (once per process)."""
    import cupy

    return cupy.RawModule(path=str(cached_cubin(name, arch_of(device_index))))


def arch_of(device) -> str:
    """The NVRTC architecture of CUDA device ``device`` (an index or a ``torch.device``): ``sm_90`` on a Hopper."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


@functools.cache
def kernel_handle(name: str, function: str, device_index: int) -> int:
    """The ``CUfunction`` handle of ``function`` in ``name``, loaded on device ``device_index``."""
    import cupy

    with cupy.cuda.Device(device_index):
        return load_module(name, device_index).get_function(function).kernel.ptr
