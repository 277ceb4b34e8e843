"""Compiling the kernel sources ahead, in threads (``pipeline.kernels._compile.compile_ahead``): every source that the
disk cache lacks compiles once, side by side with the others, and a launch that needs one still compiling waits for
that compile, or gets its error. NVRTC itself is replaced by a stand-in (it needs CuPy); the threads, the cache and the
waiting are the real ones."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from pipeline.kernels import _compile
from pipeline.kernels._compile import KERNEL_DIR, KernelCompileError, cached_cubin, compile_ahead

SECONDS = 0.3


def sources() -> list[str]:
    return sorted(str(p.relative_to(KERNEL_DIR)) for p in KERNEL_DIR.rglob("*.cu"))


@pytest.fixture
def nvrtc(monkeypatch, tmp_path):
    """A stand-in for NVRTC: each compile takes SECONDS, is counted by source, and fails for the names in ``failing``."""
    monkeypatch.setenv("PIPELINE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(_compile, "_nvrtc_version", lambda: (13, 0))
    stand_in = type("NVRTC", (), {"compiled": Counter(), "failing": set(), "started": threading.Event()})()

    def compile_cubin(name, arch):
        stand_in.started.set()
        time.sleep(SECONDS)
        stand_in.compiled[name] += 1
        if name in stand_in.failing:
            raise KernelCompileError(f"NVRTC could not compile {name} for {arch}:\nbroken.cu(3): error")
        return b"\x7fELF" + name.encode()

    monkeypatch.setattr(_compile, "compile_cubin", compile_cubin)
    return stand_in


def test_every_source_compiles_once_side_by_side(nvrtc):
    names = sources()
    assert len(names) >= 3 and "embedding/embedding_update_runs.cu" in names
    start = time.monotonic()
    for thread in compile_ahead("sm_90", sources()):
        thread.join()
    took = time.monotonic() - start
    assert nvrtc.compiled == Counter(names)
    assert took < SECONDS * len(names) / 2, took  # one after another would take them all in turn
    assert all(cached_cubin(name, "sm_90").read_bytes() == b"\x7fELF" + name.encode() for name in names)
    assert nvrtc.compiled == Counter(names)  # served from the disk cache since


def test_a_launch_waits_for_the_compile_under_way_instead_of_compiling_again(nvrtc):
    threads = compile_ahead("sm_90", sources())
    assert nvrtc.started.wait(5)
    path = cached_cubin("embedding/embedding_update_runs.cu", "sm_90")  # while its compile runs in a thread
    assert path.read_bytes().endswith(b"embedding_update_runs.cu")
    for thread in threads:
        thread.join()
    assert nvrtc.compiled["embedding/embedding_update_runs.cu"] == 1


def test_a_compile_that_fails_ahead_fails_the_launch_that_waits_and_the_next_with_its_log(nvrtc):
    nvrtc.failing.add("interaction/interaction.cu")
    threads = compile_ahead("sm_90", sources())  # no traceback from the thread: the launch says it
    assert nvrtc.started.wait(5)
    with pytest.raises(KernelCompileError, match=r"interaction\.cu for sm_90:\nbroken\.cu\(3\)"):
        cached_cubin("interaction/interaction.cu", "sm_90")
    for thread in threads:
        thread.join()
    with pytest.raises(KernelCompileError, match=r"broken\.cu\(3\)"):
        cached_cubin("interaction/interaction.cu", "sm_90")
    assert nvrtc.compiled["interaction/interaction.cu"] == 2 and not _compile._compiles


def test_a_training_run_compiles_ahead_the_sources_it_launches_and_no_candidate(monkeypatch):
    """What the training stage hands to the threads on a GPU: every source of the default path, each of them a
    kernel source, and not the uncapped update candidates, which only the benchmarks launch."""
    import torch

    import pipeline.kernels
    from pipeline.kernels.embedding import launcher

    asked = []
    monkeypatch.setattr(pipeline.kernels, "kernels_problem", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    monkeypatch.setattr(_compile, "compile_ahead", lambda arch, names: asked.append((arch, names)))
    pipeline.kernels.compile_ahead(torch.device("cuda", 0))
    [(arch, names)] = asked
    assert arch == "sm_90" and set(names) <= set(sources()) and launcher.UNCAPPED_SOURCE not in names
    assert {launcher.FORWARD_SOURCE, launcher.BACKWARD_SOURCE, launcher.RUNS_SOURCE, "interaction/interaction.cu"} <= set(names)
    pipeline.kernels.compile_ahead(torch.device("cpu"))
    assert len(asked) == 1  # nothing on the CPU
