"""``bench train --profile N``: N more steps of each model under ``torch.profiler`` once the timed rounds are done,
to see where a step's time goes: its wall time, the time its kernels take on the device, and the operations
that take the most of each (``profile-<model>.txt``, written atomically), on a GPU how busy each stream was and how much
of that overlapped (``streams``: kernels of a step on each stream, and the time any stream ran one), and the
timeline for chrome://tracing or Perfetto (``trace-<model>.json.gz``)."""

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
    if device.type == "cuda":
        figures["streams"] = _stream_busy(profiler.events(), steps)
        profiler.export_chrome_trace(str(folder / f"trace-{name}.json.gz"))
    return figures


def _stream_busy(events, steps: int) -> dict:
    """Per CUDA stream, the ms a step in which it ran a kernel or copy, and ``any``: the ms a step in which some
    stream did (less than their sum where streams overlapped)."""
    import torch

    spans: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA:
            spans.setdefault(f"stream {e.device_resource_id}", []).append((e.time_range.start, e.time_range.end))
    spans["any"] = [s for v in spans.values() for s in v]
    return {name: _union_us(v) / 1e3 / steps for name, v in spans.items()}


def _union_us(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(spans):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


def print_profiles(profiles: dict) -> None:
    for name, p in profiles.items():
        kernels = (f", kernels {p['kernels_ms_per_step']:.2f} ms a step, {p['launches_per_step']:.0f} launches"
                   if p["launches_per_step"] else "")
        print(f"  profile of {name}: {p['steps']} steps, {p['wall_ms_per_step']:.2f} ms a step{kernels} ({p['file']})")
        if p.get("streams"):
            print("    busy, ms a step: " + ", ".join(f"{k} {v:.2f}" for k, v in p["streams"].items()))
