"""The export stage's runner: ``python -m pipeline run export``.

``run`` reads what earlier stages wrote (the raw layout, ``schema.json``, the saved workflow and the
trained checkpoint) and writes the Triton repository under ``cfg.paths.export``
(``export.update=true``: only a new embedding store version).

Example::

    python -m pipeline run export export.cache_policy=lfu
"""

from __future__ import annotations

import json
from pathlib import Path

from export.pbtxt import ModelOptions
from export.repository import raw_columns, write_repository
from pipeline.errors import UserError
from pipeline.schema import Schema
from pipeline.stages.config import PipelineConfig


def run(cfg: PipelineConfig) -> dict:
    """Write the model repository (or, with ``export.update``, a new embedding store version)."""
    from pipeline.data.raw_folder import RawDataset
    from pipeline.etl.workflow import Workflow

    Workflow.load(cfg.paths.workflow)  # a corrupt or incomplete workflow stops here, not in the server
    model, schema = load_trained_model(cfg)
    etl_schema = Schema.load(cfg.paths.schema)
    if etl_schema.cardinalities() != schema.cardinalities():
        raise UserError(f"the ETL output in {cfg.paths.processed} changed since the model was trained "
                        "(other cardinalities): run `python -m pipeline run train` again before exporting")
    raw = raw_columns(RawDataset.load(cfg.paths.raw), cfg.data.list_separator)
    summary = write_repository(model, schema, cfg.paths.workflow, raw, cfg.paths.export, model_options(cfg),
                               update=cfg.export.update)
    what = f"embedding store version {summary['store_version']}" if cfg.export.update else "model repository"
    summary["trained"] = trained_model_summary(cfg.paths.train)
    print(f"[export] wrote the {what} to {cfg.paths.export}: {summary['trained']}", flush=True)
    return summary


def trained_model_summary(folder: Path) -> str:
    """Which model is exported, in words: its kind, its folder, and its test AUC when training finished."""
    spec = json.loads((folder / "model.json").read_text())
    result_path = folder / "result.json"
    result = json.loads(result_path.read_text()) if result_path.is_file() else None
    if result is None or "test" not in result:
        return f"{spec['model']} from {folder} (no test score: {result_path} is missing)"
    return f"{spec['model']} from {folder}, test AUC {result['test']['auc']:.4f}"


def model_options(cfg: PipelineConfig) -> ModelOptions:
    """The repository's model options: ``cfg.export``, with the instance kind decided for this machine."""
    kind = _instance_kind(cfg)
    return ModelOptions(
        max_batch_size=cfg.export.max_batch_size, instance_kind=kind, instances=cfg.export.instances,
        dynamic_batching=cfg.export.dynamic_batching, max_queue_delay_us=cfg.export.max_queue_delay_us,
        dense_backend=cfg.export.dense_backend, cache_policy=cfg.export.cache_policy,
        cache_fraction=cfg.export.cache_fraction, dense_threads=cfg.export.dense_threads,
        fuse_dense=cfg.export.fuse_dense)


def _instance_kind(cfg: PipelineConfig) -> str:
    """``cpu`` or ``gpu``; ``auto`` takes the GPU only when both this process and the models' torch can."""
    from export.environment import cuda_problem, find_models_env
    from pipeline.device import resolve_device

    kind = cfg.export.instance_kind
    if kind == "cpu" or (kind == "auto" and not resolve_device(cfg.device).is_cuda):
        return "cpu"
    problem = cuda_problem(find_models_env(cfg.serve.models_env or None))
    if problem is None:
        return "gpu"
    if kind == "gpu":
        raise UserError(f"export.instance_kind=gpu, but {problem}")
    print(f"[export] instance_kind auto: CPU instances, because {problem}", flush=True)
    return "cpu"


def load_trained_model(cfg: PipelineConfig):
    """The trained model of ``cfg.paths.train`` (on the CPU, in eval mode) and the schema it was trained with."""
    from pipeline.train.model import load_trained

    model, schema = load_trained(cfg.paths.train, device="cpu")
    return model.eval(), schema
