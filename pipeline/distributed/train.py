"""The training stage on several ranks: sharded embeddings, DDP, sharded checkpoints, gathered scores.

``pipeline.train.stage.run`` hands over to :func:`run` when torchrun started the process with
``WORLD_SIZE > 1``; it can also be started directly::

    torchrun --nproc-per-node 2 -m pipeline.distributed.train train.max_steps=200 device=cuda

Each rank reads its shard of every split (the Loader's ``rank`` / ``world_size``: the same number of
batches everywhere), trains the model through :class:`DistributedModelParallel`, and the scores of
valid and test are computed over the predictions gathered from every rank (padding rows dropped).
Rank 0 writes ``model.json``, ``plan.json``, ``metrics.jsonl``, ``result.json`` and the unsharded
``model.pt`` (reassembled from the final sharded checkpoint), so export does not know training ran
sharded. Checkpoints are folders ``checkpoints/step-NNNNNNNN.sharded/`` (see
:mod:`pipeline.distributed.checkpoint`) plus one ``rank-R.pt`` per rank (its loader and RNG state).
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from pipeline.distributed.checkpoint import load_sharded_checkpoint, read_meta, save_sharded_checkpoint
from pipeline.distributed.comm import init_from_env
from pipeline.distributed.config import DistributedConfig
from pipeline.distributed.model_parallel import DistributedModelParallel, make_planner
from pipeline.distributed.types import ShardingPlan
from pipeline.train.checkpoint import rng_state, set_rng_state
from pipeline.train.evaluate import predict, scores
from pipeline.train.loop import LoopState, Trainer

_SHARDED = ".sharded"


def sharded_checkpoints(folder: str | Path) -> list[Path]:
    """Finished sharded checkpoint folders (with ``meta.json``), oldest step first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [p for p in folder.glob(f"step-*{_SHARDED}") if (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: int(p.name[len("step-"):-len(_SHARDED)]))


class DistributedTrainer(Trainer):
    """The training loop of :mod:`pipeline.train.loop` with sharded checkpoints and rank-0 logging."""

    def __init__(self, model: DistributedModelParallel, cfg, device, out_dir, train_loader) -> None:
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        if self.rank != 0:
            cfg = dataclasses.replace(cfg, progress=False)
        super().__init__(model, cfg, device, out_dir, train_loader)

    def start_fresh(self) -> None:
        if self.rank == 0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            for old in self.checkpoint_dir.glob("step-*"):
                shutil.rmtree(old) if old.is_dir() else old.unlink()
            self.metrics_path.write_text("")
        _barrier()

    def save(self) -> Path:
        step = self.state.step
        folder = self.checkpoint_dir / f"step-{step:08d}{_SHARDED}"
        if self.rank == 0 and folder.exists():
            shutil.rmtree(folder)
        _barrier()
        torch.save({"loader": {**self.loader.state_dict(), "epoch": self.state.epoch, "batches": self.state.batch},
                    "rng": rng_state()}, _mkdir(folder) / f"rank-{self.rank}.pt")
        save_sharded_checkpoint(folder, self.model.sharded_collections(),
                                dense={"model": self.model.dense_state_dict(),
                                       "dense_optimizer": self.optimizer.state_dict()},
                                step=step, extra={"epoch": self.state.epoch, "batch": self.state.batch})
        if self.rank == 0:
            for old in sharded_checkpoints(self.checkpoint_dir)[: -max(1, self.cfg.keep_checkpoints)]:
                shutil.rmtree(old, ignore_errors=True)
        _barrier()
        return folder

    def resume_from(self, path: str | Path) -> None:
        """Continue from a sharded checkpoint.

        Written by as many ranks as this run has: an exact resume (loader positions and RNG states
        too). Written by another number: the tables and all optimizer states are resharded exactly,
        the loop goes on from the saved step, and the data position within the epoch is carried
        over by samples seen (each rank's shard of the data changes with the rank count, so the
        batches that follow are not the ones an uninterrupted run would have seen).
        """
        path = Path(path)
        meta = read_meta(path)
        world = dist.get_world_size() if dist.is_initialized() else 1
        saved = load_sharded_checkpoint(path, self.model.sharded_collections())
        self.model.load_dense_state_dict({k: v.to(self.device) for k, v in saved["dense"]["model"].items()})
        self.optimizer.load_state_dict(saved["dense"]["dense_optimizer"])
        if meta["world_size"] == world:
            mine = torch.load(path / f"rank-{self.rank}.pt", map_location="cpu", weights_only=True)
            self.loader.load_state_dict(mine["loader"])
            epoch, batch = int(mine["loader"]["epoch"]), int(mine["loader"]["batches"])
            set_rng_state(mine["rng"])
        else:
            epoch, batch = int(saved["extra"]["epoch"]), int(saved["extra"]["batch"]) * meta["world_size"] // world
            if batch >= self.steps_per_epoch:
                epoch, batch = epoch + 1, 0
            self.loader.load_state_dict({**self.loader.state_dict(), "epoch": epoch, "batches": batch})
            if self.rank == 0:
                print(f"[train] resuming {meta['world_size']}-rank checkpoint {path} on {world} ranks: weights and "
                      f"optimizer states resharded; data resumes at epoch {epoch}, batch {batch}", flush=True)
        self.state = LoopState(step=int(meta["step"]), epoch=epoch, batch=batch)
        if self.rank == 0 and self.metrics_path.is_file():
            kept = [line for line in self.metrics_path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= self.state.step]
            self.metrics_path.write_text("".join(line + "\n" for line in kept))
        self._log({"event": "resume", "step": self.state.step, "checkpoint": str(path),
                   "saved_by_ranks": meta["world_size"], "ranks": world})

    def _log(self, record: dict) -> None:
        if self.rank == 0:
            super()._log(record)


def distributed_evaluate(model, loader, device, amp: bool = False) -> dict[str, float]:
    """Scores over every rank's predictions (each rank's padding rows dropped); the same on every rank."""
    labels, probs = predict(model, loader, device, amp)
    padding = getattr(loader, "padding", 0)
    if padding:
        labels, probs = labels[: len(labels) - padding], probs[: len(probs) - padding]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (labels, probs))
        labels = np.concatenate([g[0] for g in gathered])
        probs = np.concatenate([g[1] for g in gathered])
    return scores(labels, probs)


def run(cfg) -> dict:
    """The train stage under torchrun (see the module docstring); returns the summary on every rank."""
    from pipeline.device import resolve_device
    from pipeline.loader import Loader
    from pipeline.schema import Schema
    from pipeline.train import stage

    start = time.perf_counter()
    dcfg: DistributedConfig = getattr(cfg, "distributed", None) or DistributedConfig()
    kind = resolve_device(cfg.device).kind
    rank, world, local_rank = init_from_env(kind, dcfg.timeout_s)
    device = torch.device(f"cuda:{local_rank}" if kind == "cuda" else "cpu")
    out = cfg.paths.train
    if rank == 0:
        stage.processed_schema(cfg)  # runs the ETL once when its output is missing
        out.mkdir(parents=True, exist_ok=True)
    _barrier()
    schema = Schema.load(cfg.paths.schema)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    t = cfg.train
    spec = stage.model_spec(cfg, schema, device.type)
    model = stage.model_from_spec(spec, backend=t.embedding_backend)
    if dcfg.plan_file:
        plans = {"embedding": ShardingPlan.load(dcfg.plan_file)}
        planner = None
    else:
        plans = None
        planner = make_planner(dcfg, world, device, batch_size=t.batch_size, optimizer=t.embedding_optimizer,
                               weight_bytes={"fp32": 4, "fp16": 2, "bf16": 2}[t.embedding_dtype])
    dmp = DistributedModelParallel(model, plans, planner, device, comm_dtype=dcfg.comm_dtype)
    if rank == 0:
        _write_json(out / "model.json", spec)
        dmp.plans["embedding"].save(out / "plan.json")
        print(f"[train] {spec['model']} on {world} x {device.type}: {len(spec['tables'])} tables, plan in "
              f"{out / 'plan.json'}", flush=True)

    processed = cfg.paths.processed
    shard = {"rank": rank, "world_size": world, "device": device}
    train_loader = Loader(processed / "train", t.batch_size, schema=schema, shuffle=True, seed=cfg.seed, **shard)
    valid_loader = Loader(processed / "valid", t.eval_batch_size, schema=schema, **shard)
    test_loader = Loader(processed / "test", t.eval_batch_size, schema=schema, **shard)
    trainer = DistributedTrainer(dmp, t, device, out, train_loader)
    found = sharded_checkpoints(trainer.checkpoint_dir) if t.resume else []
    if found:
        trainer.resume_from(found[-1])
    else:
        trainer.start_fresh()
    try:
        fitted = trainer.fit(lambda: distributed_evaluate(dmp, valid_loader, device, trainer.amp))
        test = distributed_evaluate(dmp, test_loader, device, trainer.amp)
    finally:
        for loader in (train_loader, valid_loader, test_loader):
            loader.close()
    final = sharded_checkpoints(trainer.checkpoint_dir)[-1]
    result = {"model": spec["model"], "device": device.type, "ranks": world, "steps": fitted["steps"],
              "epochs": t.epochs, "batch_size_per_rank": t.batch_size,
              "samples_per_s_per_rank": fitted["samples_per_s"], "valid": fitted["valid"], "test": test,
              "seconds": time.perf_counter() - start, "plan": str(out / "plan.json")}
    if rank == 0:
        plain = stage.model_from_spec(spec, backend="torch")
        state = load_sharded_checkpoint(final, {"embedding": plain.embedding})
        plain.load_state_dict({**plain.state_dict(), **state["dense"]["model"]})
        torch.save(plain.state_dict(), out / "model.pt.tmp")
        (out / "model.pt.tmp").replace(out / "model.pt")
        _write_json(out / "result.json", result)
        print(f"[train] {world} ranks: test AUC {test['auc']:.4f}, logloss {test['logloss']:.4f} | "
              f"{fitted['samples_per_s'] * world:,.0f} samples/s over all ranks | {out / 'result.json'}", flush=True)
    _barrier()
    return result


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _mkdir(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _write_json(path: Path, value: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2, default=str) + "\n")
    tmp.replace(path)


@record
def main(argv: list[str] | None = None) -> int:
    """``python -m pipeline.distributed.train key=value ...`` (under torchrun)."""
    from pipeline.stages.config import load_config

    argv = sys.argv[1:] if argv is None else argv
    run(load_config(None, argv))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
