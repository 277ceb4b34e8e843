"""Shared test setup: GPU tests are skipped (with the reason) where no GPU is usable."""

from __future__ import annotations

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
