"""Shared test setup: GPU tests are skipped (with the reason) where no GPU is usable; the kernel sources are
compiled with nvcc once for every test that reads what nvcc made of them."""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tests run tiny tensor ops, where several spinning torch threads on a small, busy machine cost far
    more than they give (seen: 100x per step on 2 loaded cores). Benchmarks set their own thread count."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_collection_modifyitems(config, items):
    if not any(item.get_closest_marker("gpu") or item.get_closest_marker("multigpu") for item in items):
        return
    from pipeline.device import gpu_problem

    problem = gpu_problem()
    count = 0
    if problem is None:
        import torch

        count = torch.cuda.device_count()
    for item in items:
        if item.get_closest_marker("gpu") and problem:
            item.add_marker(pytest.mark.skip(reason=f"needs a CUDA GPU: {problem}"))
        elif item.get_closest_marker("multigpu") and count < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2+ CUDA GPUs, found {count}"))


def _nvcc() -> str:
    found = shutil.which("nvcc") or next(
        (str(p) for p in (Path("/usr/local/cuda/bin/nvcc"),) if p.is_file()), None)
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("nvcc is not on PATH nor in /usr/local/cuda/bin, and CI is set: the kernels can't be checked")
        pytest.skip("nvcc is not on PATH nor in /usr/local/cuda/bin")
    return found


class NvccBuilds:
    """nvcc's runs on the kernel sources for sm_90 (cubin, warnings as errors, ptxas's register and spill report on
    stderr), each source compiled once, in a folder of its own that keeps the PTX (``<stem>.ptx``) beside the cubin
    (``k.cubin``). Sources started together compile side by side, as many at once as there are cores."""

    def __init__(self, nvcc: str, kernel_dir: Path, folder) -> None:
        self.nvcc, self.kernel_dir, self.folder = nvcc, kernel_dir, folder
        self.pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 2)
        self.builds = {}

    def start(self, sources) -> None:
        """Start compiling each of ``sources`` (paths relative to the kernel folder) not started yet."""
        for source in sources:
            if source not in self.builds:
                out = self.folder()
                self.builds[source] = (self.pool.submit(self._compile, source, out), out)

    def __call__(self, source: str) -> tuple[subprocess.CompletedProcess, Path]:
        """nvcc's run on ``source`` and the folder of what it made, once it is done."""
        self.start([source])
        future, out = self.builds[source]
        return future.result(), out

    def _compile(self, source: str, out: Path) -> subprocess.CompletedProcess:
        return subprocess.run(
            # -split-compile=0: a source's kernels optimised on every core (the update kernels' source is the longest)
            [self.nvcc, "-arch=sm_90", "-std=c++17", "-I", str(self.kernel_dir), "-cubin", "-Werror", "all-warnings",
             "--resource-usage", "-split-compile=0", "--keep", "--keep-dir", str(out), "-o", str(out / "k.cubin"),
             str(self.kernel_dir / source)], capture_output=True, text=True, timeout=900, check=False)


@pytest.fixture(scope="session")
def nvcc_build(tmp_path_factory):
    """The session's :class:`NvccBuilds`: every test that reads what nvcc made of a kernel source shares its one
    run."""
    from pipeline.kernels._compile import KERNEL_DIR

    builds = NvccBuilds(_nvcc(), KERNEL_DIR, lambda: tmp_path_factory.mktemp("nvcc"))
    yield builds
    builds.pool.shutdown(cancel_futures=True)
