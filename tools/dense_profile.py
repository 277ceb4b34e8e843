"""A model's dense part alone: forward, backward and the dense optimizer's step, timed and split by kernel kind.

Builds ``--model`` at the ``--preset`` widths for Criteo's 13 continuous and 26 categorical columns and times what
the training step does for its dense part: ``pipeline.train.loop.dense_loss`` (compiled as ``train.compile``
would, ``--compile``), its backward and torch's Adam (fused on a GPU) on the dense weights, on one batch of random
dense features and pooled embeddings (a leaf tensor whose gradient is written each step, as the tables' backward
takes it), bf16 autocast on a GPU. It prints ms a step (the mean of ``--steps`` after ``--warmup``, the compile
among the warm-up steps), the matrix products' FLOPs a sample and the rate the step does them at, and with
``--profile N`` the device time of N more steps by kind of kernel: matrix products (cuBLAS, CUTLASS, Inductor's
templates), Inductor's fused element-wise kernels, and the rest, each with its largest kernels.

    python tools/dense_profile.py --model dcnv2 --device cuda --batch 65536 --profile 5
    python tools/dense_profile.py --model dlrm --device cuda --batch 65536 --compile max-autotune --json dlrm.json
    python tools/dense_profile.py --model dlrm --device cuda --batch 65536 --mlp-backend cublaslt --profile 5
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

_GEMM = re.compile(r"gemm|cutlass|nvjet|cublas|wgmma|sm90_xmma|triton_tem|aten::(mm|addmm|bmm|matmul|linear)$",
                   re.IGNORECASE)
_FUSED = re.compile(r"^triton_|^cpp_fused|elementwise|vectorized|reduce_kernel", re.IGNORECASE)


def main(argv: list[str] | None = None) -> dict:
    from pipeline.loader.synthetic import criteo_schema
    from pipeline.modules.configs import EmbeddingOptimizerConfig
    from pipeline.modules.models import MLP_BACKENDS, MODEL_CLASSES, PRESETS, ModelSizes, build_model, use_mlp_backend
    from pipeline.train.config import COMPILE_MODES
    from pipeline.train.loop import compiled_dense_loss, dense_loss

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(set(MODEL_CLASSES) - {"logistic"}), default="dcnv2")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="mlperf")
    parser.add_argument("--batch", type=int, default=65536)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compile", choices=COMPILE_MODES, default="auto",
                        help="as train.compile (auto: compiled on a GPU)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=5, help="steps before the timed ones (the compile among them)")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="profile N more steps by kind of kernel")
    parser.add_argument("--pooled-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the dtype of the pooled embeddings and their gradient, as the tables hand them over")
    parser.add_argument("--mlp-backend", choices=MLP_BACKENDS, default="torch", help="as train.mlp_backend")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    torch.manual_seed(0)
    model = build_model(args.model, criteo_schema(size=0.001), ModelSizes.preset(args.preset),
                        EmbeddingOptimizerConfig("adagrad"), backend="torch").to(device)
    use_mlp_backend(model, args.mlp_backend)
    amp = device.type == "cuda"
    rows = args.batch
    dense = torch.randn(rows, model.num_dense, device=device)
    pooled = torch.randn(rows, model.embedding.output_dim, device=device, dtype=getattr(torch, args.pooled_dtype),
                         requires_grad=True)
    label = torch.randint(0, 2, (rows,), device=device).float()
    loss_of = compiled_dense_loss(model, amp, args.compile, device) or functools.partial(dense_loss, model, amp)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=device.type == "cuda")

    def step() -> None:
        pooled.grad = None
        loss_of(dense, pooled, label).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    start = time.perf_counter()
    for _ in range(args.warmup):
        step()
    _sync(device)
    warmup_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    _sync(device)
    step_ms = (time.perf_counter() - start) / args.steps * 1e3
    flops = _flops_per_sample(model, amp, device)
    result = {
        "model": args.model, "preset": args.preset, "batch": rows, "device": str(device), "compile": args.compile,
        "pooled_dtype": args.pooled_dtype, "mlp_backend": args.mlp_backend,
        "step_ms": step_ms, "samples_per_s": rows / step_ms * 1e3, "warmup_s": warmup_s,
        "gemm_flops_per_sample": flops, "gemm_tflops": flops * rows / step_ms / 1e9,
    }
    print(f"{args.model} ({args.preset}), batch {rows:,} on {device}, compile={args.compile}, pooled {args.pooled_dtype}, "
          f"MLPs through {args.mlp_backend}: {step_ms:.3f} ms a step "
          f"({result['samples_per_s']:,.0f} samples/s; warm-up {warmup_s:.1f} s); matrix products "
          f"{flops / 1e6:.1f} MFLOP a sample, at {result['gemm_tflops']:.3g} TFLOPS")
    if args.profile:
        result["kinds"] = _profile(step, args.profile, device)
        for kind, entry in result["kinds"].items():
            print(f"  {kind:12s} {entry['ms_per_step']:8.3f} ms a step ({entry['share']:.0%})")
            for name, ms in entry["largest"]:
                print(f"      {ms:8.3f}  {name[:110]}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _flops_per_sample(model, amp: bool, device: torch.device) -> float:
    """The dense part's matrix-product FLOPs a sample, forward and backward, counted on a small eager batch."""
    from torch.utils.flop_counter import FlopCounterMode

    from pipeline.train.loop import dense_loss

    rows = 64
    dense = torch.randn(rows, model.num_dense, device=device)
    pooled = torch.randn(rows, model.embedding.output_dim, device=device, requires_grad=True)
    label = torch.randint(0, 2, (rows,), device=device).float()
    with FlopCounterMode(display=False) as counter:
        dense_loss(model, amp, dense, pooled, label).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops() / rows


def _profile(step, steps: int, device: torch.device) -> dict:
    """Device time (CPU time on the CPU) a step of each kind of kernel, with the five largest kernels of each."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        _sync(device)
    by_kind: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for event in prof.key_averages():
        if device.type == "cuda":
            us = event.self_device_time_total if event.device_type.name == "CUDA" else 0
        else:
            us = event.self_cpu_time_total if event.key.startswith(("aten::", "cpp_fused", "triton_")) else 0
        if us > 0:
            kind = "matmul" if _GEMM.search(event.key) else "fused" if _FUSED.search(event.key) else "other"
            by_kind[kind][event.key] += us / 1e3 / steps
    total = sum(sum(kernels.values()) for kernels in by_kind.values()) or 1.0
    return {kind: {"ms_per_step": sum(kernels.values()), "share": sum(kernels.values()) / total,
                   "largest": sorted(kernels.items(), key=lambda item: -item[1])[:5]}
            for kind, kernels in sorted(by_kind.items())}


if __name__ == "__main__":
    main()
