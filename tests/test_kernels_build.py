"""CPU checks of the CUDA kernels: every ``.cu`` compiles (nvcc, and NVRTC where CuPy is installed),
compiler errors name the file and line, the package imports without CuPy or a GPU, the launch
geometry and per-slot arrays derived from a table packing are right, every candidate update kernel is
launched with the arguments its signature declares, and none of the per-segment ones spills."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from pipeline.kernels._compile import KERNEL_DIR, KernelCompileError
from pipeline.kernels.embedding import TablePacking
from pipeline.kernels.embedding.launcher import SlotArrays, _log_lanes, _vector_width
from pipeline.modules.configs import TableConfig

SOURCES = sorted(str(p.relative_to(KERNEL_DIR)) for p in KERNEL_DIR.rglob("*.cu"))


def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except Exception as err:  # noqa: BLE001  (CuPy missing, or its NVRTC library not found)
        pytest.skip(f"NVRTC through CuPy is not usable here: {err}")
    return nvrtc


def test_there_are_kernel_sources():
    assert {"embedding/embedding_forward.cu", "embedding/embedding_backward.cu", "interaction/interaction.cu"} <= set(SOURCES)


@pytest.mark.parametrize("source", SOURCES)
def test_source_compiles_with_nvcc_for_sm90(source, nvcc_build):
    nvcc_build.start(SOURCES)  # all of them side by side, while this test waits for its own
    result, out = nvcc_build(source)
    assert result.returncode == 0, f"nvcc failed on {source}:\n{result.stderr}"
    assert (out / "k.cubin").read_bytes()[:4] == b"\x7fELF"


@pytest.mark.parametrize("source", SOURCES)
def test_source_compiles_with_nvrtc(source):
    _nvrtc()
    from pipeline.kernels._compile import compile_cubin

    assert compile_cubin(source, "sm_90")[:4] == b"\x7fELF"


def test_a_source_brings_the_headers_its_headers_include():
    """NVRTC has no include path: every header, the shared ones under the kernel folder too, is handed to it
    by the name it is included by."""
    from pipeline.kernels._compile import _program

    # the 16-bit families' sources that include headers (row_traffic.cu moves bytes and includes none)
    with_headers = [s for s in SOURCES if s.split("/")[0] in ("embedding", "interaction")
                    and "#include" in (KERNEL_DIR / s).read_text()]
    assert len(with_headers) >= 6
    for source in with_headers:
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
    assert slots.column_multiple == 4
    odd = SlotArrays.from_packing(TablePacking.build([TableConfig("t", 3, 7, ["a"]), TableConfig("u", 3, 4, ["b"])]),
                                 "cpu")
    assert odd.column_multiple == 1


def test_the_update_reads_fp32_and_bf16_gradients_where_they_lie_and_copies_the_rest():
    from pipeline.kernels.embedding.launcher import _gradient_rows

    tables = [TableConfig("a", 10, 8, ["a"]), TableConfig("b", 10, 16, ["b"])]
    slots = SlotArrays.from_packing(TablePacking.build(tables), "cpu")
    wide = torch.zeros(4, 40, dtype=torch.bfloat16)
    for column, aligned in ((8, True), (4, False), (3, False)):  # bf16 weights: vectors of 8 elements
        grad, vectors = _gradient_rows(wide[:, column : column + 24], slots, width=8)
        assert grad.data_ptr() == wide.data_ptr() + 2 * column and grad.stride(0) == 40 and vectors == aligned
    grad, vectors = _gradient_rows(wide[:, 4:28], slots, width=4)  # fp32 weights: vectors of 4
    assert grad.data_ptr() == wide.data_ptr() + 8 and vectors
    contiguous = torch.zeros(4, 24)
    assert _gradient_rows(contiguous, slots, width=4) == (contiguous, True)
    for other in (torch.zeros(4, 24, dtype=torch.float16), torch.zeros(24, 4).t(), torch.zeros(24).expand(4, 24)):
        grad, vectors = _gradient_rows(other, slots, width=4)
        assert grad.dtype == torch.float32 and grad.is_contiguous() and vectors


_CTYPE_TO_PTX = {"c_void_p": "u64", "c_int": "u32", "c_long": "u64", "c_ulong": "u64", "c_float": "f32"}


def _ptx_entries(ptx: str) -> dict[str, list[str]]:
    """Entry name -> the PTX types of its parameters."""
    return {name: re.findall(r"\.param\s+\.(\w+)", params)
            for name, params in re.findall(r"\.entry\s+(\w+)\s*\(([^)]*)\)", ptx)}


def _built_ptx_params(source: str, nvcc_build) -> dict[str, list[str]]:
    """Entry name -> the PTX types of its parameters, from the PTX nvcc made of ``source`` (the ``nvcc_build``
    fixture)."""
    result, out = nvcc_build(source)
    assert result.returncode == 0, result.stderr
    return _ptx_entries((out / (Path(source).stem + ".ptx")).read_text())


def _ptxas_report(source: str, nvcc_build) -> dict[str, tuple[int, int]]:
    """Entry name -> (registers, bytes spilled: stores + loads), from ptxas's report on ``source``."""
    result, _ = nvcc_build(source)
    assert result.returncode == 0, result.stderr
    report, name, spilled = {}, None, 0
    for line in result.stderr.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            name = m.group(1)
        elif m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line):
            spilled = int(m.group(1)) + int(m.group(2))
        elif m := re.search(r"Used (\d+) registers", line):
            report[name] = (int(m.group(1)), spilled)
    return report


UPDATE_SOURCES = ("embedding/embedding_forward.cu", "embedding/embedding_backward.cu",
                  "embedding/embedding_update_position.cu", "embedding/embedding_update_runs.cu",
                  "embedding/embedding_update_runs_uncapped.cu")


@pytest.mark.parametrize("update_kernel", ["position", "segments", "segments_looped", "segments_looped_capped",
                                           "segments_looped_capped_2vec", "singles_apart"])
@pytest.mark.parametrize("dims", [(8, 300), (8, 100)])
def test_launch_arguments_match_kernel_signatures(update_kernel, dims, nvcc_build, monkeypatch):
    from pipeline.kernels.embedding import launcher

    by_source = {source: _built_ptx_params(source, nvcc_build) for source in UPDATE_SOURCES}
    entries = {name: params for built in by_source.values() for name, params in built.items()}
    launches, asked = [], []
    monkeypatch.setattr(launcher, "launch", lambda source, function, device, grid, block, args: (
        launches.append((function, grid, args)), asked.append((source, function))))
    monkeypatch.setattr(launcher, "_check", lambda *a: None)
    # how many blocks stay resident is the GPU's to say; here a number below the one-group-per-segment grid
    monkeypatch.setattr(launcher, "resident_blocks",
                        lambda source, function, device, block: (asked.append((source, function)), 3)[1])
    monkeypatch.setattr(launcher, "UPDATE_KERNEL", update_kernel)
    kernel = launcher.UPDATE_KERNELS[update_kernel]
    tables = [TableConfig("a", 50, dims[0], ["a"]), TableConfig("b", 20, dims[1], ["b"], pooling="mean")]
    packing = TablePacking.build(tables)
    slots = SlotArrays.from_packing(packing, "cpu")
    indices = torch.arange(200, dtype=torch.int64) % 20  # more ids than one update segment: both update kernels
    offsets = torch.tensor([0, 60, 100, 170, 200], dtype=torch.int64)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        weights = torch.zeros(packing.total_elements, dtype=dtype)
        for out_dtype in (torch.float32, torch.float16, torch.bfloat16):
            launcher.pooled_forward(weights, slots, indices, offsets, 2, out_dtype)
        for opt in ("sgd", "adagrad", "adam"):
            state = {"adagrad": {"momentum1": torch.zeros(packing.total_rows)},
                     "adam": {"momentum1": torch.zeros(weights.numel()), "momentum2": torch.zeros(weights.numel())},
                     }.get(opt, {})
            for grad in (torch.zeros(2, packing.total_dim), torch.zeros(2, packing.total_dim + 8,
                                                                        dtype=torch.bfloat16)[:, 8:]):
                launcher.backward_update(weights, state, slots, indices, offsets, 2, grad, opt, 0.1, 1)
    functions = {f for f, _, _ in launches}
    wide = dims[1] > 256  # bf16 rows that one pass of 32 lanes does not cover: two vectors a lane
    chunks = "c2" if wide or kernel.vectors_per_lane == 2 else "c1"
    assert {"pooled_forward_f32_f32", "pooled_forward_f16_bf16", f"sparse_update_adam_bf16_i32_{'c2' if wide else 'c1'}_long",
            "row_keys_i32"} <= functions
    if kernel.singles_apart and not wide:
        assert {"count_segments_apart_i32", "compact_segments_apart_i32", "sparse_update_singles_adam_bf16_i32",
                "sparse_update_runs_apart_adam_bf16_i32"} <= functions
        assert not any(f.startswith(("sparse_update_runs_capped", "count_segments_i")) for f in functions)
        assert {grid for f, grid, _ in launches if f.startswith(("sparse_update_singles", "sparse_update_runs_apart"))
                } == {3}  # looped: the resident blocks
    elif kernel.per_segment:
        assert {"count_segments_i32", "compact_segments_i32"} <= functions
        prefix = "sparse_update_runs_capped" if kernel.capped else "sparse_update_runs"
        assert f"{prefix}_adam_bf16_i32_{chunks}" in functions and "sparse_update_adam_bf16_i32_c2" not in functions
        # the looped kernels get the resident blocks; the others a group for each of the 200 positions
        grids = {grid for f, grid, _ in launches if f.startswith(prefix)}
        assert grids == {3} if kernel.looped else (not wide or grids == {200 // (256 // 32)})
    else:
        assert f"sparse_update_adam_bf16_i32_{chunks}" in functions and not any("segments" in f for f in functions)
    for function, _, args in launches:
        assert function in entries, f"{function} is not a kernel of the .cu sources"
        passed = [_CTYPE_TO_PTX[type(a).__name__] for a in args]
        assert passed == [t.replace("s", "u") for t in entries[function]], function
    for source, function in asked:  # each kernel is looked up in the source that defines it
        assert function in by_source[source], f"{function} is not in {source}"


def test_the_row_traffic_launch_matches_its_kernels(nvcc_build, monkeypatch):
    from pipeline.kernels.embedding import launcher

    entries = _built_ptx_params(launcher.ROW_TRAFFIC_SOURCE, nvcc_build)
    assert set(entries) == {f"rows_read_write_{r}" for r in (1, 2, 4, 8)}
    launches = []
    monkeypatch.setattr(launcher, "launch", lambda source, function, device, grid, block, args: launches.append(
        (source, function, grid, args)))
    vec = torch.arange(100, dtype=torch.int64)
    for rows_per_warp in (1, 2, 4, 8):
        launcher.rows_read_write(torch.zeros(64), torch.zeros(64), vec, vec, 32, 32, rows_per_warp)
    for (source, function, grid, args), rows_per_warp in zip(launches, (1, 2, 4, 8)):
        assert source == launcher.ROW_TRAFFIC_SOURCE and function == f"rows_read_write_{rows_per_warp}"
        assert grid == -(-100 // (8 * rows_per_warp))  # 8 warps a block, every row once
        assert [_CTYPE_TO_PTX[type(a).__name__] for a in args] == [t.replace("s", "u") for t in entries[function]]


def test_an_unknown_update_kernel_is_refused_before_any_work(monkeypatch):
    from pipeline.kernels.embedding import launcher

    monkeypatch.setattr(launcher, "_check", lambda *a: None)
    monkeypatch.setattr(launcher, "launch", lambda *a: pytest.fail("launched a kernel"))
    monkeypatch.setattr(launcher, "UPDATE_KERNEL", "by_row")
    packing = TablePacking.build([TableConfig("a", 10, 8, ["a"])])
    with pytest.raises(ValueError, match=r"update kernel: expected one of \('position', 'segments', .*got 'by_row'"):
        launcher.backward_update(torch.zeros(packing.total_elements), {}, SlotArrays.from_packing(packing, "cpu"),
                                 torch.tensor([1, 2]), torch.tensor([0, 1, 2]), 2, torch.zeros(2, 8), "sgd", 0.1, 1)


def test_two_vectors_a_lane_halve_the_lanes_of_rows_one_pass_covers():
    from pipeline.kernels.embedding.launcher import UPDATE_KERNELS, segment_lanes

    two, one = UPDATE_KERNELS["segments_looped_capped_2vec"], UPDATE_KERNELS["segments_looped_capped"]
    fp32, bf16 = _vector_width(torch.float32), _vector_width(torch.bfloat16)
    assert segment_lanes(two, _log_lanes(128, fp32), 1) == (4, 2)  # dim 128 fp32: 16 lanes of 2 x 4 floats
    assert segment_lanes(two, _log_lanes(128, bf16), 1) == (3, 2)  # dim 128 bf16: 8 lanes of 2 x 8
    assert segment_lanes(two, _log_lanes(16, fp32), 1) == (1, 2)
    assert segment_lanes(two, _log_lanes(4, fp32), 1) == (0, 1)  # one lane already: nothing to halve
    assert segment_lanes(two, 5, 4) == (5, 4)  # wide rows keep their 32 lanes of 4 vectors
    assert segment_lanes(one, 5, 1) == (5, 1)
    for log_lanes, chunks in [(5, 1), (4, 1), (2, 1)]:  # the partial sums keep their width
        half_lanes, half_chunks = segment_lanes(two, log_lanes, chunks)
        assert half_chunks << half_lanes == chunks << log_lanes


def test_no_per_segment_update_kernel_spills_and_the_capped_ones_fit_more_blocks(nvcc_build):
    """The capped kernels are bounded to as many resident blocks as their registers allow without spilling:
    a spill (a compiler that allocates otherwise, a change of the kernel) must lower their bound."""
    runs = _ptxas_report("embedding/embedding_update_runs.cu", nvcc_build)
    report = {**runs, **_ptxas_report("embedding/embedding_update_runs_uncapped.cu", nvcc_build)}
    capped = {name: regs for name, (regs, _) in report.items() if name.startswith("sparse_update_runs_capped_")}
    apart = {name for name in runs if name.startswith(("sparse_update_singles_", "sparse_update_runs_apart_"))}
    # 3 optimizers x 7 row shapes x 2 key types, twice; the apart kernels: 3 optimizers x 3 dtypes x 2 keys, twice
    assert len(capped) == 42 and len(apart) == 36 and len(report) == 2 * 42 + 36 + 8
    assert set(runs) == {*capped, *apart, *(f"{kernel}_{key}" for kernel in (
        "count_segments", "compact_segments", "count_segments_apart", "compact_segments_apart")
        for key in ("i32", "i64"))}  # what training runs, and nothing else to compile
    assert {name: spilled for name, (_, spilled) in report.items() if spilled} == {}

    def blocks(regs):  # resident blocks of 256 threads: 64K registers a multiprocessor, 8 a thread at a time
        return 65536 // (-(-regs // 8) * 8 * 256)

    more = {name for name, regs in capped.items()
            if blocks(regs) > blocks(report[name.replace("_capped", "")][0])}
    assert {"sparse_update_runs_capped_adagrad_f32_i32_c1", "sparse_update_runs_capped_sgd_f32_i32_c1",
            "sparse_update_runs_capped_adagrad_f32_i32_c2"} <= more
    assert all(blocks(regs) >= blocks(report[name.replace("_capped", "")][0]) for name, regs in capped.items())


def test_the_singles_kernels_keep_more_blocks_resident_than_the_capped_loop(nvcc_build):
    """The lean kernel of the rows of one occurrence exists to hold more groups resident: for fp32 SGD and Adagrad
    rows, more blocks than the capped loop (none spills: the test above)."""
    runs = _ptxas_report("embedding/embedding_update_runs.cu", nvcc_build)

    def blocks(regs):
        return 65536 // (-(-regs // 8) * 8 * 256)

    for opt in ("sgd", "adagrad"):
        lean, loop = runs[f"sparse_update_singles_{opt}_f32_i32"][0], runs[f"sparse_update_runs_capped_{opt}_f32_i32_c1"][0]
        assert blocks(lean) > blocks(loop)


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
