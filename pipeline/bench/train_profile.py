"""``bench train --profile N``: N more steps of each model under ``torch.profiler`` once the timed rounds are done,
to see where a step's time goes: its wall time, the time its kernels take on the device, and the operations
that take the most of each (``profile-<model>.txt``, written atomically)."""

from __future__ import annotations

import time
from pathlib import Path


def profile_steps(name: str, train_on, batches: list, device, folder: Path) -> dict:
    """Train ``batches`` (one step each) with ``train_on`` under the profiler; the figures a step, and the file
    of the operations' table (by time on the device, then by time on the host)."""
    import torch

    from pipeline.bench.stage_probe import sync
    from pipeline.files import write_text

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync(device)
    with torch.profiler.profile(activities=activities) as profiler:
        start = time.perf_counter()
        train_on(batches)
        sync(device)
        wall = time.perf_counter() - start
    events = profiler.key_averages()
    steps = len(batches)
    device_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
    figures = {"steps": steps, "wall_ms_per_step": 1e3 * wall / steps,
               "kernels_ms_per_step": device_us / 1e3 / steps, "launches_per_step": launches / steps}
    path = folder / f"profile-{name}.txt"
    head = (f"{name}: {steps} steps, {figures['wall_ms_per_step']:.2f} ms a step, its kernels "
            f"{figures['kernels_ms_per_step']:.2f} ms a step on the device, {figures['launches_per_step']:.0f} "
            "launches a step\n")
    by_device = events.table(sort_by="self_device_time_total", row_limit=40) if device.type == "cuda" else ""
    write_text(path, head + "\nby time on the device\n" + by_device + "\nby time on the host\n"
               + events.table(sort_by="self_cpu_time_total", row_limit=40) + "\n")
    figures["file"] = str(path)
    return figures


def print_profiles(profiles: dict) -> None:
    for name, p in profiles.items():
        kernels = (f", kernels {p['kernels_ms_per_step']:.2f} ms a step, {p['launches_per_step']:.0f} launches"
                   if p["launches_per_step"] else "")
        print(f"  profile of {name}: {p['steps']} steps, {p['wall_ms_per_step']:.2f} ms a step{kernels} ({p['file']})")
