"""The training stage: the ETL's parquet + schema -> a trained model, its metrics and checkpoints.

``python -m pipeline run train`` (or ``run(cfg)``) builds the model of ``train.model`` from
``schema.json``, trains it on ``processed/train`` with the :class:`~pipeline.loader.Loader`, scores
``valid`` along the way and ``test`` at the end, and compares with the data generator's oracle (the
AUC of the true click probabilities) when there is one. It runs the ETL first when its output is
missing. Launch::

    python -m pipeline run train                                  # CPU or the GPU, by device=auto
    python -m pipeline run train train.model=dcnv2 train.epochs=2 --device cuda
    python -m pipeline run train train.resume=true                # continue from the last checkpoint
    torchrun --nproc-per-node 2 -m pipeline run train             # sharded: pipeline.distributed.train

Outputs under ``cfg.paths.train`` (``data/synthetic/train``)::

    model.json          what was built: model kind, sizes, tables, embedding optimizer, the schema
    model.pt            the final ``model.state_dict()`` (tensors only; ``load_trained`` reads it)
    checkpoints/        step-NNNNNNNN.pt, see :mod:`pipeline.train.checkpoint`
    metrics.jsonl       one JSON object per line: training loss / lr / samples/s, valid scores
    result.json         test AUC and log loss, the oracle's, the gap, throughput

Example::

    summary = run(load_config(None, ["train.epochs=2"]))
    model, schema = load_trained(cfg)     # for export: model.embedding and model.dense_forward
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import asdict
from pathlib import Path

import torch

from pipeline.config import PipelineConfig, to_dict
from pipeline.device import resolve_device
from pipeline.errors import UserError
from pipeline.loader import Loader
from pipeline.modules.configs import EmbeddingOptimizerConfig, TableConfig
from pipeline.modules.models import ModelSizes, RecModel, build_model, model_tables
from pipeline.schema import Schema
from pipeline.train.checkpoint import latest_checkpoint
from pipeline.train.evaluate import evaluate
from pipeline.train.loop import Trainer

MODEL_SPEC_VERSION = 1


def run(cfg: PipelineConfig) -> dict:
    """Train, evaluate on valid and test, write the outputs above; return the summary (also printed)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from pipeline.distributed.train import run as run_distributed

        return run_distributed(cfg)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.train.threads if cfg.train.threads > 0 else max(1, (os.cpu_count() or 2) - 1))
    try:
        return _run(cfg)
    finally:
        torch.set_num_threads(threads)


def _run(cfg: PipelineConfig) -> dict:
    start = time.perf_counter()
    device = torch.device(resolve_device(cfg.device).kind)
    schema = processed_schema(cfg)
    out = cfg.paths.train
    out.mkdir(parents=True, exist_ok=True)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)

    spec = model_spec(cfg, schema, device.type)
    model = model_from_spec(spec, backend=cfg.train.embedding_backend).to(device)
    # The loader checks every id against its table while reading (on the host); checking again on a GPU
    # would cost a device sync per step.
    model.embedding.validate_ids = device.type != "cuda"
    _check_same_model_if_resuming(cfg, spec, out)
    _write_json(out / "model.json", spec)
    print(f"[train] {spec['model']} on {device.type}: {len(spec['tables'])} tables, "
          f"{sum(t['rows'] for t in spec['tables']):,} embedding rows, "
          f"{sum(p.numel() for p in model.parameters()):,} dense parameters, "
          f"embedding backend {model.embedding.backend.name}", flush=True)

    t = cfg.train
    processed = cfg.paths.processed
    train_loader = Loader(processed / "train", t.batch_size, schema=schema, shuffle=True, seed=cfg.seed, device=device)
    valid_loader = Loader(processed / "valid", t.eval_batch_size, schema=schema, device=device)
    test_loader = Loader(processed / "test", t.eval_batch_size, schema=schema, device=device)
    trainer = Trainer(model, t, device, out, train_loader)
    checkpoint = latest_checkpoint(trainer.checkpoint_dir) if t.resume else None
    if checkpoint is not None:
        print(f"[train] resuming from {checkpoint}", flush=True)
        trainer.resume_from(checkpoint)
    else:
        if t.resume:
            print(f"[train] train.resume=true but no checkpoint in {trainer.checkpoint_dir}: starting fresh", flush=True)
        trainer.start_fresh()
    try:
        fitted = trainer.fit(lambda: evaluate(model, valid_loader, device, trainer.amp))
        torch.save(model.state_dict(), _tmp(out / "model.pt"))
        _tmp(out / "model.pt").replace(out / "model.pt")
        test = evaluate(model, test_loader, device, trainer.amp)
    finally:
        for loader in (train_loader, valid_loader, test_loader):
            loader.close()
    oracle = _read_oracle(cfg.paths.oracle)
    result = {
        "model": spec["model"],
        "device": device.type,
        "steps": fitted["steps"],
        "epochs": t.epochs,
        "batch_size": t.batch_size,
        "samples_per_s": fitted["samples_per_s"],
        "valid": fitted["valid"],
        "test": test,
        "oracle": oracle,
        "test_auc_gap_to_oracle": oracle["test"]["auc"] - test["auc"] if oracle else None,
        "seconds": time.perf_counter() - start,
        "settings": to_dict(t),
    }
    _write_json(out / "result.json", result)
    line = f"[train] test AUC {test['auc']:.4f}, logloss {test['logloss']:.4f}"
    if oracle:
        line += (f" | oracle AUC {oracle['test']['auc']:.4f}, logloss {oracle['test']['logloss']:.4f}"
                 f" | gap {result['test_auc_gap_to_oracle']:.4f}")
    print(line + f" | {fitted['samples_per_s']:,.0f} samples/s | {out / 'result.json'}", flush=True)
    return result


def model_spec(cfg: PipelineConfig, schema: Schema, device_kind: str) -> dict:
    """What to build, as plain data (saved as ``model.json``; :func:`model_from_spec` builds it)."""
    t = cfg.train
    sizes = ModelSizes.from_train_config(t, device_kind)
    optimizer = EmbeddingOptimizerConfig(t.embedding_optimizer, lr=t.embedding_lr, weight_decay=t.weight_decay,
                                         master_weights=t.embedding_master_weights,
                                         stochastic_rounding=t.embedding_stochastic_rounding)
    tables = model_tables(t.model, schema, sizes)
    return {
        "version": MODEL_SPEC_VERSION,
        "model": t.model,
        "sizes": asdict(sizes),
        "embedding_optimizer": asdict(optimizer),
        "embedding_dtype": t.embedding_dtype,
        "seed": cfg.seed,
        "feature_names": list(schema.sparse),
        "tables": [asdict(table) for table in tables],
        "embedding_output_dim": sum(table.dim * len(table.features) for table in tables),
        "num_dense": len(schema.continuous),
        "schema": schema.to_dict(),
    }


def model_from_spec(spec: dict, backend: str = "auto") -> RecModel:
    """The (untrained) model a ``model.json`` describes."""
    if spec.get("version") != MODEL_SPEC_VERSION:
        raise UserError(f"model.json version {spec.get('version')} is not supported (expected {MODEL_SPEC_VERSION})")
    schema = Schema.from_dict(spec["schema"])
    model = build_model(spec["model"], schema, ModelSizes(**spec["sizes"]),
                        EmbeddingOptimizerConfig(**spec["embedding_optimizer"]), weights_dtype=spec["embedding_dtype"],
                        backend=backend, seed=spec["seed"])
    built = [asdict(t) for t in model.embedding.tables]
    if built != spec["tables"]:
        raise UserError("model.json lists other tables than its schema builds; retrain the model")
    return model


def load_trained(cfg: PipelineConfig, device: str | torch.device = "cpu",
                 backend: str = "auto") -> tuple[RecModel, Schema]:
    """The trained model (in eval mode, on ``device``) and the schema it was trained with.

    Example::

        model, schema = load_trained(cfg)
        pooled = model.embedding(kjt)                  # the embedding part (one Triton model)
        logits = model.dense_forward(dense, pooled)    # the dense part (another)
        model.embedding.table_weight("t_C1")           # a table's [rows, dim] weights
    """
    folder = cfg.paths.train
    spec_path, weights_path = folder / "model.json", folder / "model.pt"
    if not spec_path.is_file() or not weights_path.is_file():
        raise UserError(f"no trained model in {folder}: run `python -m pipeline run train` first")
    spec = json.loads(spec_path.read_text())
    model = model_from_spec(spec, backend=backend)
    model.load_state_dict(torch.load(weights_path, map_location="cpu", weights_only=True))
    return model.to(device).eval(), Schema.from_dict(spec["schema"])


def tables_of(spec: dict) -> list[TableConfig]:
    """The table configs listed in a ``model.json``."""
    return [TableConfig(**t) for t in spec["tables"]]


def processed_schema(cfg: PipelineConfig) -> Schema:
    """The ETL output's schema, running the ETL stage first when its output is missing."""
    if not cfg.paths.schema.is_file():
        print(f"[train] no ETL output at {cfg.paths.processed}: running the ETL stage first", flush=True)
        from pipeline.etl.stage import run as run_etl

        run_etl(cfg)
    return Schema.load(cfg.paths.schema)


def _check_same_model_if_resuming(cfg: PipelineConfig, spec: dict, out: Path) -> None:
    previous = out / "model.json"
    if not cfg.train.resume or not previous.is_file() or latest_checkpoint(out / "checkpoints") is None:
        return
    old = json.loads(previous.read_text())
    differ = [k for k in ("model", "sizes", "embedding_optimizer", "embedding_dtype", "tables", "feature_names")
              if old.get(k) != spec.get(k)]
    if differ:
        raise UserError(f"train.resume=true, but the checkpoints in {out / 'checkpoints'} are of another model "
                        f"(different {', '.join(differ)}); rerun without train.resume or with the same settings")


def _read_oracle(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _tmp(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def _write_json(path: Path, value: dict) -> None:
    tmp = _tmp(path)
    tmp.write_text(json.dumps(value, indent=2, default=str) + "\n")
    tmp.replace(path)
