"""The export stage's runner: ``python -m pipeline run export``.

``run`` reads what earlier stages wrote (the raw layout, ``schema.json``, the saved workflow and a
finished training run: ``export.run``, or ``train/latest``) and writes the Triton repository under
``cfg.paths.export`` (``export.update=true``: only a new embedding store version). It says which run,
model and test AUC it exports, and records them in the repository's ``export.json`` (``trained``).

Example::

    python -m pipeline run export export.cache_policy=lfu
    python -m pipeline run export export.run=20261201-171500-dlrm
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from export.config import AUTO_INSTANCES_MAX
from export.pbtxt import ModelOptions
from export.repository import EXPORT_RECORD, raw_columns, write_repository
from pipeline.errors import UserError
from pipeline.files import read_json
from pipeline.schema import Schema
from pipeline.stages.config import PipelineConfig
from pipeline.train.runs import is_finished, latest_run, runs


def run(cfg: PipelineConfig) -> dict:
    """Write the model repository (or, with ``export.update``, a new embedding store version)."""
    from pipeline.data.raw_folder import RawDataset
    from pipeline.etl.workflow import Workflow
    from pipeline.train.model import load_trained

    Workflow.load(cfg.paths.workflow)  # a corrupt or incomplete workflow stops here, not in the server
    folder = trained_run(cfg)
    model, schema = load_trained(folder, device="cpu")
    etl_schema = Schema.load(cfg.paths.schema)
    fitted_again = schema.workflow and schema.workflow != Workflow.fingerprint(cfg.paths.workflow)
    if fitted_again or etl_schema.cardinalities() != schema.cardinalities():
        why = "the workflow was fitted again" if fitted_again else "other cardinalities"
        raise UserError(f"the ETL output in {cfg.paths.processed} changed since the run {folder} was trained "
                        f"({why}: its model would be served another preprocessing): run `python -m pipeline run "
                        "train` again before exporting, or export a run trained since the ETL ran")
    trained = trained_record(folder)
    raw = raw_columns(RawDataset.load(cfg.paths.raw), cfg.data.list_separator)
    summary = write_repository(model, schema, cfg.paths.workflow, raw, cfg.paths.export, model_options(cfg),
                               update=cfg.export.update, trained=trained)
    what = f"embedding store version {summary['store_version']}" if cfg.export.update else "model repository"
    print(f"[export] wrote the {what} to {cfg.paths.export}: run {trained['run']}, {trained['model']}, "
          f"test AUC {trained['test_auc']:.4f}", flush=True)
    if not cfg.export.update:
        print(_instances_line(cfg, summary), flush=True)
    return summary


def _instances_line(cfg: PipelineConfig, summary: dict) -> str:
    """How many instances serve each model, and the memory their caches of hot rows take together."""
    from export.lookup import capacities
    from export.store import open_current

    instances = summary["options"]["instances"]
    tables = open_current(Path(summary["repository"]) / summary["lookup_model"] / "store").tables
    whole_mb = cfg.export.gpu_whole_tables_mb if summary["options"]["instance_kind"] == "gpu" else 0.0
    held = capacities(tables, cfg.export.cache_fraction, whole_mb=whole_mb)
    per_instance = sum(held[name] * t.shape[1] * t.itemsize for name, t in tables.items())
    how = f"one per usable core, at most {AUTO_INSTANCES_MAX}" if cfg.export.instances == 0 else "export.instances"
    what = ("every row of the tables (export.gpu_whole_tables_mb)" if all(held[n] == t.shape[0] for n, t in tables.items())
            and whole_mb else f"export.cache_fraction={cfg.export.cache_fraction}")
    return (f"[export] {instances} instance(s) of each model ({how}), each a process of its own with its own cache "
            f"of hot rows: {instances * per_instance / 2**20:,.1f} MiB of caches in all at {what}")


def trained_run(cfg: PipelineConfig) -> Path:
    """The folder of the finished training run to export: ``export.run``, or the one ``train/latest`` points at."""
    root = cfg.paths.train
    name = cfg.export.run
    if not name:
        folder = latest_run(root)
        if folder is None:
            raise UserError(f"no finished training run in {root} (train/latest): run `python -m pipeline run train` "
                            "first, or name a finished run with export.run=NAME")
        return folder
    folder = root / name
    if not (folder / "model.json").is_file():
        known = ", ".join(p.name for p in runs(root)) or "none"
        raise UserError(f"export.run={name}: there is no training run {folder} (runs there: {known}); name one of "
                        "them, or leave export.run empty for train/latest")
    if not is_finished(folder):
        raise UserError(f"export.run={name}: the run in {folder} did not finish (no model.pt or result.json); "
                        f"continue it with `python -m pipeline run train train.run={name} train.resume=true`")
    return folder


def trained_record(folder: Path) -> dict:
    """What is exported, from the finished run in ``folder``: its name and folder, model kind and test AUC."""
    result = read_json(folder / "result.json", "train again (`python -m pipeline run train`), or export another run (export.run=NAME)")
    return {"run": folder.name, "folder": str(folder), "model": result["model"], "test_auc": result["test"]["auc"]}


def exported_run(cfg: PipelineConfig) -> Path | None:
    """The folder of the training run the repository at ``cfg.paths.export`` was exported from (None: not recorded)."""
    record = json.loads((cfg.paths.export / EXPORT_RECORD).read_text()).get("trained")
    return cfg.paths.train / record["run"] if record else None


def model_options(cfg: PipelineConfig) -> ModelOptions:
    """The repository's model options: ``cfg.export``, with the instance kind decided for this machine."""
    kind = _instance_kind(cfg)
    return ModelOptions(
        max_batch_size=cfg.export.max_batch_size, instance_kind=kind,
        instances=cfg.export.instances or auto_instances(kind),
        dynamic_batching=cfg.export.dynamic_batching, max_queue_delay_us=cfg.export.max_queue_delay_us,
        dense_backend=cfg.export.dense_backend, cache_policy=cfg.export.cache_policy,
        cache_fraction=cfg.export.cache_fraction, gpu_whole_tables_mb=cfg.export.gpu_whole_tables_mb,
        dense_threads=cfg.export.dense_threads,
        cuda_graphs=cfg.export.cuda_graphs, preprocess_on_gpu=cfg.export.preprocess_on_gpu,
        pin_instances=cfg.export.pin_instances,
        fused={"all": True, "none": False, "auto": None}[cfg.export.fuse])


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: ``taskset``, a container's cpuset), not the host's."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def auto_instances(kind: str) -> int:
    """Instances of each model for ``export.instances=0``: one per usable core (:func:`usable_cores`), at most
    ``AUTO_INSTANCES_MAX``; of a GPU model (Triton counts those per GPU), those cores shared among the GPUs.

    A python model's instance is one process that computes one request at a time on one core (one torch thread),
    so concurrent clients are served at once only by several; on 2 cores, 8 clients got up to 40 % more rows/s
    from 2 instances than from 1 (not in every run), and no more from 4 (docs/BENCHMARKS.md, Serving)."""
    cores = usable_cores()
    if kind == "gpu":
        import torch

        cores //= max(1, torch.cuda.device_count())
    return max(1, min(AUTO_INSTANCES_MAX, cores))


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
