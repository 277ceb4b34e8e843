"""CPU checks of the CUDA kernels: every ``.cu`` compiles (nvcc, and NVRTC where CuPy is installed),
compiler errors name the file and line, the package imports without CuPy or a GPU, and the launch
geometry and per-slot arrays derived from a table packing are right."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from pipeline.kernels._compile import KERNEL_DIR, KernelCompileError
from pipeline.kernels.embedding.launcher import SlotArrays, _log_lanes, _vector_width
from pipeline.kernels.embedding import TablePacking
from pipeline.modules.configs import TableConfig

SOURCES = sorted(str(p.relative_to(KERNEL_DIR)) for p in KERNEL_DIR.rglob("*.cu"))


def _nvcc() -> str:
    found = shutil.which("nvcc") or next(
        (str(p) for p in (Path("/usr/local/cuda/bin/nvcc"),) if p.is_file()), None)
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("nvcc is not on PATH nor in /usr/local/cuda/bin, and CI is set: the kernels can't be checked")
        pytest.skip("nvcc is not on PATH nor in /usr/local/cuda/bin")
    return found


def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except Exception as err:  # CuPy missing, or its NVRTC library not found
        pytest.skip(f"NVRTC through CuPy is not usable here: {err}")
    return nvrtc


def test_there_are_kernel_sources():
    assert {"embedding/embedding_forward.cu", "embedding/embedding_backward.cu", "interaction/interaction.cu"} <= set(SOURCES)


@pytest.mark.parametrize("source", SOURCES)
def test_source_compiles_with_nvcc_for_sm90(source, tmp_path):
    nvcc = _nvcc()
    result = subprocess.run(
        [nvcc, "-arch=sm_90", "-std=c++17", "-I", str(KERNEL_DIR), "-cubin", "-Werror", "all-warnings", "-o", str(tmp_path / "k.cubin"),
         str(KERNEL_DIR / source)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"nvcc failed on {source}:\n{result.stderr}"
    assert (tmp_path / "k.cubin").read_bytes()[:4] == b"\x7fELF"


@pytest.mark.parametrize("source", SOURCES)
def test_source_compiles_with_nvrtc(source):
    _nvrtc()
    from pipeline.kernels._compile import compile_cubin

    assert compile_cubin(source, "sm_90")[:4] == b"\x7fELF"


def test_a_source_brings_the_headers_its_headers_include():
    """NVRTC has no include path: every header, the shared ones under the kernel folder too, is handed to it
    by the name it is included by."""
    from pipeline.kernels._compile import _program

    for source in (s for s in SOURCES if s.split("/")[0] in ("embedding", "interaction")):  # the 16-bit families
        _, names, texts = _program(source)
        assert "floats.cuh" in names, source
        assert texts[names.index("floats.cuh")].endswith((KERNEL_DIR / "floats.cuh").read_text())
    _, names, _ = _program("embedding/embedding_forward.cu")
    assert names == ["embedding_common.cuh", "floats.cuh"]


def test_a_missing_header_names_the_file_that_includes_it(tmp_path):
    from pipeline.kernels._compile import _program

    (tmp_path / "k.cu").write_text('#include "nowhere.cuh"\n')
    with pytest.raises(FileNotFoundError, match=r"k\.cu: included header 'nowhere\.cuh'"):
        _program(tmp_path / "k.cu")


def test_compile_error_names_file_line_and_log(tmp_path):
    _nvrtc()
    from pipeline.kernels._compile import compile_cubin

    (tmp_path / "broken.cu").write_text('#include "embedding_common.cuh"\n\nextern "C" __global__ void k() { nope; }\n')
    shutil.copy(KERNEL_DIR / "embedding" / "embedding_common.cuh", tmp_path)
    with pytest.raises(KernelCompileError, match=r'(?s)broken\.cu for sm_90.*broken\.cu\(3\).*"nope" is undefined'):
        compile_cubin(tmp_path / "broken.cu", "sm_90")


def test_disk_cache_is_keyed_by_arch_and_nvrtc_version(tmp_path, monkeypatch):
    nvrtc = _nvrtc()
    from pipeline.kernels._compile import cached_cubin

    monkeypatch.setenv("PIPELINE_KERNEL_CACHE", str(tmp_path))
    path = cached_cubin("embedding/embedding_forward.cu", "sm_90")
    major, minor = nvrtc.getVersion()
    assert path.parent == tmp_path and f"-sm_90-nvrtc{major}.{minor}-" in path.name
    stamp = path.stat().st_mtime_ns
    assert cached_cubin("embedding/embedding_forward.cu", "sm_90") == path and path.stat().st_mtime_ns == stamp
    assert cached_cubin("embedding/embedding_forward.cu", "sm_80") != path


def test_without_gpu_the_cuda_backend_is_refused_and_auto_picks_torch():
    import pipeline.kernels
    from pipeline.modules.backends import resolve_backend

    problem = pipeline.kernels.kernels_problem()
    if problem is None:
        pytest.skip("a GPU and CuPy are usable here: the cuda backend runs")
    with pytest.raises(ValueError, match="'cuda' cannot run on cpu"):
        resolve_backend("cuda", "cpu")
    with pytest.raises(ValueError, match="'cuda' cannot run on cuda"):
        resolve_backend("cuda", "cuda")
    assert resolve_backend("auto", "cpu").name == "torch"
    assert resolve_backend("auto", "cuda").name == "torch"


def test_lanes_cover_the_widest_row_with_one_vector_each():
    assert _vector_width(torch.float32) == 4 and _vector_width(torch.bfloat16) == 8
    assert [1 << _log_lanes(d, 4) for d in (1, 4, 5, 16, 127, 128, 129, 4096)] == [1, 1, 2, 4, 32, 32, 32, 32]
    assert [1 << _log_lanes(d, 8) for d in (8, 9, 128, 256, 257)] == [1, 2, 16, 32, 32]


def test_slot_arrays_follow_the_packing():
    tables = [TableConfig("wide", 5, 8, ["a"]), TableConfig("shared", 7, 4, ["b", "c"], pooling="mean"),
              TableConfig("narrow", 3, 4, ["d"])]
    packing = TablePacking.build(tables)
    slots = SlotArrays.from_packing(packing, "cpu")
    # storage is grouped by dim: shared (7x4) and narrow (3x4) first, then wide (5x8)
    assert slots.weight_offsets.tolist() == [40, 0, 0, 28]
    assert slots.row_offsets.tolist() == [10, 0, 0, 7]
    assert slots.output_offsets.tolist() == [0, 8, 12, 16, 20]
    assert slots.mean.tolist() == [False, True, True, False]
    assert (slots.num_slots, slots.max_dim, slots.total_dim, slots.total_rows) == (4, 8, 20, 15)
    # tables in row order (the update kernel finds a row's table by binary search over these)
    assert slots.table_row_starts.tolist() == [0, 7, 10, 15]
    assert slots.table_weight_offsets.tolist() == [0, 28, 40]
    assert slots.table_dims.tolist() == [4, 4, 8]
    assert slots.columns_aligned
    odd = SlotArrays.from_packing(TablePacking.build([TableConfig("t", 3, 7, ["a"]), TableConfig("u", 3, 4, ["b"])]),
                                 "cpu")
    assert not odd.columns_aligned


_CTYPE_TO_PTX = {"c_void_p": "u64", "c_int": "u32", "c_long": "u64", "c_ulong": "u64", "c_float": "f32"}


def _ptx_params(source: str, tmp_path) -> dict[str, list[str]]:
    """Entry name -> the PTX types of its parameters, from nvcc's PTX of ``source``."""
    import re

    out = tmp_path / (Path(source).name + ".ptx")
    subprocess.run([_nvcc(), "-arch=sm_90", "-std=c++17", "-I", str(KERNEL_DIR), "-ptx", "-o", str(out), str(KERNEL_DIR / source)],
                   check=True, capture_output=True, timeout=600)
    entries = {}
    for name, params in re.findall(r"\.entry\s+(\w+)\s*\(([^)]*)\)", out.read_text()):
        entries[name] = re.findall(r"\.param\s+\.(\w+)", params)
    return entries


def test_launch_arguments_match_kernel_signatures(tmp_path, monkeypatch):
    from pipeline.kernels.embedding import launcher

    entries = {**_ptx_params("embedding/embedding_forward.cu", tmp_path),
               **_ptx_params("embedding/embedding_backward.cu", tmp_path)}
    launches = []
    monkeypatch.setattr(launcher, "launch",
                        lambda source, function, device, grid, block, args: launches.append((function, args)))
    monkeypatch.setattr(launcher, "_check", lambda *a: None)
    tables = [TableConfig("a", 50, 8, ["a"]), TableConfig("b", 20, 300, ["b"], pooling="mean")]
    packing = TablePacking.build(tables)
    slots = SlotArrays.from_packing(packing, "cpu")
    indices = torch.arange(200, dtype=torch.int64) % 20  # more ids than one update segment: both update kernels
    offsets = torch.tensor([0, 60, 100, 170, 200], dtype=torch.int64)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        weights = torch.zeros(packing.total_elements, dtype=dtype)
        launcher.pooled_forward(weights, slots, indices, offsets, 2)
        for opt in ("sgd", "adagrad", "adam"):
            state = {"adagrad": {"momentum1": torch.zeros(packing.total_rows)},
                     "adam": {"momentum1": torch.zeros(weights.numel()), "momentum2": torch.zeros(weights.numel())},
                     }.get(opt, {})
            launcher.backward_update(weights, state, slots, indices, offsets, 2,
                                     torch.zeros(2, packing.total_dim), opt, 0.1, 1)
    assert {f for f, _ in launches} >= {"pooled_forward_f32", "sparse_update_adam_bf16_i32_c2",
                                        "sparse_update_adam_bf16_i32_c2_long", "row_keys_i32"}
    for function, args in launches:
        assert function in entries, f"{function} is not a kernel of the .cu sources"
        passed = [_CTYPE_TO_PTX[type(a).__name__] for a in args]
        assert passed == [t.replace("s", "u") for t in entries[function]], function


def test_the_update_segment_is_the_same_in_the_launcher_and_the_kernel():
    from pipeline.kernels.embedding import launcher

    source = (KERNEL_DIR / "embedding/embedding_update.cuh").read_text()
    assert re.search(r"#define SEGMENT (\d+)", source).group(1) == str(launcher.SEGMENT)


def test_every_kernel_source_is_packaged():
    """A wheel (a non-editable install) carries every ``.cu`` and ``.cuh``: the package-data patterns of
    pyproject.toml match them all, those in the kernel packages' subfolders too."""
    import fnmatch
    import tomllib

    root = KERNEL_DIR.parent.parent
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["pipeline"]
    sources = [p.relative_to(root / "pipeline").as_posix() for p in KERNEL_DIR.rglob("*.cu*")]
    assert sources
    unpackaged = [s for s in sources if not any(fnmatch.fnmatchcase(s, pat) and s.count("/") == pat.count("/")
                                                for pat in patterns)]
    assert not unpackaged
