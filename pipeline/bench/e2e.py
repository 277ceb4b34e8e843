"""The training stage end to end on one device: its samples/s beside its step alone and its loader alone.

On the processed data the settings select (``<workdir>/<dataset>/processed``, which ``python -m
pipeline run etl`` makes), in one process, with the batch size and optimizers given here and every
other training setting as configured:

* (a) **stage**: the training stage's own code (:func:`pipeline.train.driver.train`: the model of
  ``train.model``, the shuffled loader, the loop with its logging, progress bar, evaluation and
  checkpoints at their configured intervals), timed over ``--steps`` steps after ``--warmup``, and
  stopped after them (no final evaluation, save or test scoring);
* (b) **step alone**: the same model and optimizers (the stage's, trained on) stepping through 4
  batches of the same split made beforehand on the device: ``Trainer.train_step`` and nothing else;
* (c) **loader alone**: a loader like the stage's (same split, batch, shuffling, seed, device and reader)
  reading whole shuffled passes over the split, the consumer doing nothing with the batches: the best of
  two passes, each timed from its start (a window of the timed steps alone would count the windows its
  reader threads read ahead during the warm-up);
* the dense part's GEMM work: its matrix products' FLOPs per sample, forward and backward (counted by
  ``torch.utils.flop_counter`` on a small batch), the rate (b) does them at, and on a GPU that rate
  against a bf16 GEMM of 16384 x 4096 x 4096 timed in the same run;
* (d) **where the stage's time goes**: the loop's own timers (``Trainer.timings``) over the timed
  steps, which add up to their wall time, and the difference (a) - (b) split into the regions beyond
  the step (waiting for batches, logging, progress bar, evaluation, checkpoints) and the rest: the
  stage's step and loss reads minus the step alone (negative where compute overlapped the others).

On a GPU, times are taken after ``torch.cuda.synchronize()`` at the ends of each timed run (never
inside it), and the host syncs of the ``train.log_every`` steps after the timed ones are counted by
the line of code that made them (``torch.cuda.set_sync_debug_mode("warn")``). ``--profile N``
profiles N steps after that with ``torch.profiler`` (``trace.json``, ``profile.txt``). Everything is
written under ``--out``: ``e2e.json`` (the figures and settings) and ``train/<run>/`` (the stage's outputs,
named in ``e2e.json`` as ``stage_run``).

    python -m pipeline bench e2e                                  # the configured dataset and model
    python -m pipeline bench e2e --device cuda --steps 400 --batch 65536 --optimizer adam --profile 20
"""

from __future__ import annotations

import argparse
import math

from pipeline.bench.arguments import integer

BATCHES_ALONE = 4
STEP_REGIONS = ("step", "loss read", "end sync")
"""The loop's regions where a step's own work is done or waited for; the others are beyond the step."""
OTHER_REGIONS = ("batch wait", "log", "progress", "evaluation", "checkpoint", "callbacks")
BEYOND_STEP = "step + loss read + end sync - (b)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=integer(1), default=200, help="timed steps of each measurement")
    parser.add_argument("--warmup", type=integer(1), default=20, help="untimed steps of the stage before them")
    parser.add_argument("--batch", type=integer(0), default=0, help="samples per step (0: train.batch_size)")
    parser.add_argument("--optimizer", choices=["sgd", "adagrad", "adam"],
                        help="the tables' fused optimizer (default: train.embedding_optimizer)")
    parser.add_argument("--dense-optimizer", choices=["sgd", "adam", "adagrad"],
                        help="the dense part's optimizer (default: train.optimizer)")
    parser.add_argument("--profile", type=integer(0), default=0, metavar="N",
                        help="also profile N steps of the stage with torch.profiler (trace.json under --out)")
    parser.add_argument("--out", default="", metavar="DIR",
                        help="folder of e2e.json, the stage's outputs and the trace "
                             "(default: <workdir>/bench/e2e-<dataset>)")


def run(args: argparse.Namespace, cfg) -> dict:
    import os
    from pathlib import Path

    import torch

    from pipeline.bench.stage_probe import StageProbe, StopRun
    from pipeline.device import resolve_device
    from pipeline.distributed.world import World
    from pipeline.errors import UserError
    from pipeline.files import write_json
    from pipeline.schema import Schema
    from pipeline.train.driver import train

    if not cfg.paths.schema.is_file():
        raise UserError(f"no processed data at {cfg.paths.processed} (no schema.json there): run "
                        "`python -m pipeline run etl` with the same data settings first")
    schema = Schema.load(cfg.paths.schema)
    device = torch.device(resolve_device(cfg.device).kind)
    out = Path(args.out) if args.out else Path(cfg.workdir) / "bench" / f"e2e-{cfg.data.dataset_name}"
    settings = _stage_settings(cfg.train, args, schema)
    sync_steps = settings.log_every if device.type == "cuda" else 0
    probe = StageProbe(args.warmup, args.steps, sync_steps, args.profile, settings.batch_size, schema.rows["train"],
                       device, out)
    print(f"[bench e2e] the training stage: {args.warmup} warm-up steps, {args.steps} timed"
          + (f", {sync_steps} counting host syncs" if sync_steps else "")
          + (f", {args.profile} profiled" if args.profile else ""), flush=True)
    try:
        train(settings, cfg.paths.processed, out / "train", schema=schema, seed=cfg.seed, world=World(device=device),
              callbacks=[probe], progress=cfg.progress)
    except StopRun:
        pass
    finally:
        probe.close()
    if probe.window is None:
        raise UserError(f"the training stage ended at step {probe.last_step}, before the {probe.end} steps this "
                        "bench runs (early stopping? see train.early_stopping); ask fewer --steps or --warmup")
    trainer = probe.trainer

    threads = torch.get_num_threads()
    if device.type == "cpu":  # as the stage trains (pipeline.train.driver)
        torch.set_num_threads(settings.threads if settings.threads > 0 else max(1, (os.cpu_count() or 2) - 1))
    try:
        step_rate = _step_alone(trainer, cfg.paths.processed, schema, settings.batch_size, cfg.seed, device,
                                args.steps)
    finally:
        torch.set_num_threads(threads)
    loader_rate = _loader_alone(cfg.paths.processed, schema, settings.batch_size, cfg.seed, device, settings.reader)
    result = _result(args, cfg, settings, trainer, probe, step_rate, loader_rate, device, out)
    result.update(_gemm_work(trainer, step_rate, device))
    _report(result)
    write_json(out / "e2e.json", result)
    print(f"[bench e2e] {out / 'e2e.json'}", flush=True)
    return result


def _stage_settings(train_cfg, args, schema):
    """The stage's settings: the configured ones with this bench's batch and optimizers, started fresh, and
    enough epochs for every step the bench runs (it stops the run itself)."""
    import dataclasses

    batch = args.batch or train_cfg.batch_size
    if batch > schema.rows["train"]:
        from pipeline.errors import UserError

        option = f"--batch {args.batch}" if args.batch else f"train.batch_size={train_cfg.batch_size}"
        raise UserError(f"{option} is more than the {schema.rows['train']:,} training rows, so each step would train "
                        "fewer: give a smaller batch, or more rows")
    needed = args.warmup + args.steps + train_cfg.log_every + args.profile + 1
    per_epoch = math.ceil(schema.rows["train"] / batch)
    return dataclasses.replace(
        train_cfg, batch_size=batch, resume=False,
        embedding_optimizer=args.optimizer or train_cfg.embedding_optimizer,
        optimizer=args.dense_optimizer or train_cfg.optimizer,
        epochs=max(train_cfg.epochs, math.ceil(needed / per_epoch) + 1),
        max_steps=max(train_cfg.max_steps, needed) if train_cfg.max_steps else 0)


def _step_alone(trainer, data, schema, batch: int, seed: int, device, steps: int) -> float:
    """Samples/s of ``trainer.train_step`` over a few batches of the split, already on the device."""
    import itertools
    import time

    from pipeline.bench.stage_probe import sync
    from pipeline.loader import Loader

    with Loader(data / "train", batch, schema=schema, shuffle=True, seed=seed, device=device) as loader:
        batches = list(itertools.islice(iter(loader), BATCHES_ALONE))
    for batch_ in batches[:2]:
        trainer.train_step(batch_)
    sync(device)
    start, samples = time.perf_counter(), 0
    for i in range(steps):
        trainer.train_step(batches[i % len(batches)])
        samples += batches[i % len(batches)].batch_size
    sync(device)
    return samples / (time.perf_counter() - start)


def _loader_alone(data, schema, batch: int, seed: int, device, reader: str, passes: int = 2) -> float:
    """Samples/s of a loader like the stage's over whole shuffled passes, each timed from its start: the best."""
    import time

    from pipeline.bench.stage_probe import sync
    from pipeline.loader import Loader

    best = 0.0
    loader = Loader(data / "train", batch, schema=schema, shuffle=True, seed=seed, device=device, reader=reader)
    with loader:
        for epoch in range(passes):
            loader.load_state_dict({**loader.state_dict(), "epoch": epoch, "batches": 0})
            sync(device)
            start, samples = time.perf_counter(), 0
            for item in loader:
                samples += item.batch_size
            sync(device)
            best = max(best, samples / (time.perf_counter() - start))
    return best


def _gemm_work(trainer, step_rate: float, device) -> dict:
    """The dense part's matrix-product FLOPs per sample (forward + backward, counted on a small batch), the
    rate the step alone does them at, and on a GPU a bf16 GEMM's rate in this run for scale."""
    import time

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from pipeline.bench.stage_probe import sync
    from pipeline.train.loop import dense_loss

    model, rows = trainer.model, 64
    dense = torch.randn(rows, model.num_dense, device=device)
    pooled = torch.randn(rows, model.embedding.output_dim, device=device, requires_grad=True)
    label = torch.randint(0, 2, (rows,), device=device).float()
    with FlopCounterMode(display=False) as counter:
        dense_loss(model, trainer.amp, dense, pooled, label).backward()
    model.zero_grad(set_to_none=True)
    per_sample = counter.get_total_flops() / rows
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    result = {"dense_weights": weights, "dense_gemm_flops_per_sample": per_sample, "dense_gemm_tflops_at_step_alone": per_sample * step_rate / 1e12,
              "reference_gemm_tflops": None}
    if device.type == "cuda":
        a = torch.randn(16384, 4096, device=device, dtype=torch.bfloat16)
        b = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
        for _ in range(3):
            a @ b
        sync(device)
        start, reps = time.perf_counter(), 20
        for _ in range(reps):
            a @ b
        sync(device)
        result["reference_gemm_tflops"] = 2 * 16384 * 4096 * 4096 * reps / (time.perf_counter() - start) / 1e12
    return result


def _result(args, cfg, settings, trainer, probe, step_rate, loader_rate, device, out) -> dict:
    import torch

    window = probe.window
    wall, samples = window["seconds"], window["samples"]
    measured = window["regions"]
    regions = {k: measured[k] for k in (*STEP_REGIONS, *OTHER_REGIONS) if k in measured}
    regions.update(measured)  # regions of callbacks other than the bench's, after the loop's own
    step_alone_s = samples / step_rate
    beyond = {k: v for k, v in regions.items() if k not in STEP_REGIONS}
    beyond[BEYOND_STEP] = sum(regions.get(k, 0.0) for k in STEP_REGIONS) - step_alone_s
    unscored = wall - regions.get("evaluation", 0.0) - regions.get("checkpoint", 0.0)
    return {
        "device": device.type,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "data": str(cfg.paths.processed),
        "train_rows": trainer.loader.total_rows,
        "batches_per_epoch": trainer.steps_per_epoch,
        "model": settings.model,
        "embedding_backend": trainer.model.embedding.backend.name,
        "mlp_backend": settings.mlp_backend,
        "batch": settings.batch_size,
        "embedding_optimizer": settings.embedding_optimizer,
        "dense_optimizer": settings.optimizer,
        "amp_bf16": trainer.amp,
        "threads": settings.threads or None,
        "log_every": settings.log_every,
        "eval_every": settings.eval_every,
        "checkpoint_every": settings.checkpoint_every,
        "progress": cfg.progress,
        "warmup": args.warmup,
        "steps": window["steps"],
        "stage_samples_per_s": samples / wall,
        "stage_without_evaluation_and_checkpoints_samples_per_s": samples / unscored,
        "step_alone_samples_per_s": step_rate,
        "loader_alone_samples_per_s": loader_rate,
        "stage_seconds": wall,
        "stage_samples": samples,
        "regions_seconds": regions,
        "step_alone_seconds": step_alone_s,
        "difference_seconds": beyond,
        "host_syncs": probe.syncs,
        "profile": probe.profile,
        "profile_also": probe.profile_also,
        "out": str(out),
        "stage_run": str(trainer.out_dir),
    }


def _report(r: dict) -> None:
    where = f"{r['device']} ({r['gpu']})" if r["gpu"] else r["device"]
    evaluation = f"every {r['eval_every']} steps" if r["eval_every"] else "at each epoch's end"
    checkpoint = f"every {r['checkpoint_every']} steps" if r["checkpoint_every"] else "at the end only"
    print(f"\nbench e2e on {where}: {r['model']}, batch {r['batch']}, tables {r['embedding_optimizer']}, "
          f"dense {r['dense_optimizer']}, bf16 autocast {r['amp_bf16']}, embedding backend {r['embedding_backend']}, "
          f"MLPs through {r['mlp_backend']}")
    print(f"  data {r['data']}: {r['train_rows']:,} train rows, {r['batches_per_epoch']:,} batches per epoch; "
          f"loss logged every {r['log_every']} steps, evaluation {evaluation}, checkpoint {checkpoint}, "
          f"progress {r['progress']}")
    print(f"  {r['warmup']} warm-up steps, then {r['steps']} timed ({r['stage_samples']:,} samples)\n")
    rates = [("(a) training stage, as run", r["stage_samples_per_s"]),
             ("    without its evaluation and checkpoints", r["stage_without_evaluation_and_checkpoints_samples_per_s"]),
             (f"(b) step alone, batches already on {r['device']}", r["step_alone_samples_per_s"]),
             (f"(c) loader alone, shuffled, to {r['device']}", r["loader_alone_samples_per_s"])]
    width = max(len(name) for name, _ in rates)
    print(f"  {'':<{width}}  {'samples/s':>14}")
    for name, rate in rates:
        print(f"  {name:<{width}}  {rate:>14,.0f}")

    steps, wall = r["steps"], r["stage_seconds"]
    rows = list(r["regions_seconds"].items())
    width = max([len(k) for k, _ in rows] + [len(k) for k in r["difference_seconds"]] + [24])
    print(f"\n  (d) the stage's {wall:.3f} s, by the loop's regions")
    print(f"    {'region':<{width}}  {'seconds':>9}  {'ms/step':>9}  {'share':>6}")
    for name, seconds in rows:
        print(f"    {name:<{width}}  {seconds:>9.3f}  {1000 * seconds / steps:>9.2f}  {seconds / wall:>6.1%}")
    print(f"    {'sum':<{width}}  {sum(s for _, s in rows):>9.3f}")
    gap = wall - r["step_alone_seconds"]
    print(f"\n    (a) - (b): {wall:.3f} s - {r['step_alone_seconds']:.3f} s = {gap:.3f} s "
          f"({1000 * gap / steps:.2f} ms/step), of which")
    for name, seconds in r["difference_seconds"].items():
        print(f"    {name:<{width}}  {seconds:>9.3f}  {1000 * seconds / steps:>9.2f}")
    syncs = r["host_syncs"]
    if syncs is None:
        print("\n  host syncs: not counted on the CPU (there is no device to wait for)")
    else:
        print(f"\n  host syncs in {syncs['steps']} steps after the timed ones: {syncs['count']}"
              + (f" ({syncs['per_step']:.2f} per step)" if syncs["steps"] else ""))
        for site, count in list(syncs["sites"].items())[:10]:
            print(f"    {count:>6}  {site}")
    gemm = (f"; a bf16 GEMM of 16384 x 4096 x 4096 ran at {r['reference_gemm_tflops']:,.0f} TFLOPS here"
            if r["reference_gemm_tflops"] else "")
    print(f"\n  the dense part's matrix products: {r['dense_gemm_flops_per_sample'] / 1e6:,.1f} MFLOP a sample "
          f"(forward + backward), done at {r['dense_gemm_tflops_at_step_alone']:.3g} TFLOPS in (b){gemm}")
    if r["profile"]:
        print(f"\n  profile: {r['profile']} (and profile.txt beside it)")
        if r["profile_also"]:
            also = ", ".join(f"{region} {seconds:.2f} s" for region, seconds in r["profile_also"].items())
            print(f"  the profiled steps also hold the stage's {also}: profile fewer steps, or more before them "
                  "(--warmup, --steps), to keep them out")

