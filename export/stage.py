"""The export and serve stages: ``python -m pipeline run export`` and ``python -m pipeline run serve``.

``run_export`` reads what earlier stages wrote (the raw layout, ``schema.json``, the saved workflow
and the trained checkpoint) and writes the Triton repository under ``cfg.paths.export``
(``export.update=true``: only a new embedding store version). ``run_serve`` starts a real Triton
server on it, waits until it is ready, sends a smoke request of raw test rows, prints the
endpoints and serves until Ctrl-C / SIGTERM (``smoke=True``, as in ``run all``: stops right after
the smoke request, and says plainly when no server is available here).

Example::

    python -m pipeline run export export.cache_policy=lfu
    python -m pipeline run serve serve.http_port=8000 serve.grpc_port=8001
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq

from export.pbtxt import ModelOptions
from export.preprocess import RawColumns
from export.repository import write_repository
from pipeline.config import PipelineConfig
from pipeline.errors import UserError
from pipeline.schema import Schema


def run_export(cfg: PipelineConfig) -> dict:
    """Write the model repository (or, with ``export.update``, a new embedding store version)."""
    from pipeline.data.raw_folder import RawDataset

    model, schema = load_trained_model(cfg)
    etl_schema = Schema.load(cfg.paths.schema)
    if etl_schema.cardinalities() != schema.cardinalities():
        raise UserError(f"the ETL output in {cfg.paths.processed} changed since the model was trained "
                        "(other cardinalities): run `python -m pipeline run train` again before exporting")
    raw_data = RawDataset.load(cfg.paths.raw)
    summary = write_repository(model, schema, cfg.paths.workflow, raw_columns(raw_data, cfg),
                               cfg.paths.export, model_options(cfg), update=cfg.export.update)
    what = f"embedding store version {summary['store_version']}" if cfg.export.update else "model repository"
    print(f"[export] wrote the {what} to {cfg.paths.export}", flush=True)
    return summary


def raw_columns(raw_data, cfg: PipelineConfig) -> RawColumns:
    """The request columns, typed as the raw parquet files are."""
    files = [f for split in ("train", "test", "valid") for f in raw_data.splits.get(split, [])]
    if not files:
        raise UserError(f"no raw parquet files under {cfg.paths.raw}: run `python -m pipeline data` first")
    arrow_schema = pq.read_schema(files[0])
    return RawColumns.from_arrow(arrow_schema, raw_data.continuous, raw_data.categorical, raw_data.multihot,
                                 cfg.data.list_separator, label=raw_data.label)


def model_options(cfg: PipelineConfig) -> ModelOptions:
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
    from pipeline.train.stage import load_trained

    model, schema = load_trained(cfg, device="cpu")
    return model.eval(), schema


def sample_rows(cfg: PipelineConfig, rows: int, split: str = "test") -> pd.DataFrame:
    """The first ``rows`` raw rows of ``split``, as the ETL reads them (arrow-backed pandas)."""
    from pipeline.data.raw_folder import RawDataset

    files = RawDataset.load(cfg.paths.raw).splits.get(split) or []
    if not files:
        raise UserError(f"no raw {split} rows under {cfg.paths.raw}")
    table = pq.read_table(files[0])
    return table.slice(0, rows).to_pandas(types_mapper=pd.ArrowDtype)


def server_problem(cfg: PipelineConfig) -> str | None:
    """``None`` when a Triton server and the models' environment are available, else what is missing."""
    from export.environment import find_models_env, find_server

    try:
        env = find_models_env(cfg.serve.models_env or None)
        if find_server(cfg.serve.binary, env) is None:
            return "no Triton server: run `make serve-env` or put tritonserver on PATH"
    except UserError as err:
        return str(err)
    return None


def start_server(cfg: PipelineConfig):
    from export.server import TritonServer

    return TritonServer(cfg.paths.export, host=cfg.serve.host, http_port=cfg.serve.http_port,
                        grpc_port=cfg.serve.grpc_port, binary=cfg.serve.binary,
                        models_env=cfg.serve.models_env or None, startup_timeout=cfg.serve.startup_timeout).start()


def run_serve(cfg: PipelineConfig, smoke: bool = False) -> dict:
    """Serve the exported repository; ``smoke``: stop after one served request."""
    from pipeline.client import Client

    if not (Path(cfg.paths.export) / "ensemble" / "config.pbtxt").is_file():
        raise UserError(f"no model repository at {cfg.paths.export}: run `python -m pipeline run export` first")
    problem = server_problem(cfg)
    if problem:
        if smoke:
            print(f"[serve] NOT SERVED: no Triton server can run here: {problem}", flush=True)
            return {"served": False, "reason": problem}
        raise UserError(problem)
    started = time.perf_counter()
    server = start_server(cfg)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        ready_s = time.perf_counter() - started
        print(f"[serve] {server.binary.name} ready in {ready_s:.1f} s (pid {server.pid})", flush=True)
        print(f"[serve] HTTP  {server.http_url}   gRPC  {server.grpc_url}   model: ensemble", flush=True)
        rows = sample_rows(cfg, cfg.serve.smoke_rows)
        with Client(server.grpc_url, "grpc") as client:
            probabilities = client.predict(rows)
        print(f"[serve] smoke request: {len(rows)} raw rows -> probabilities "
              f"{[round(float(p), 4) for p in probabilities]}", flush=True)
        summary = {"served": True, "http": server.http_url, "grpc": server.grpc_url, "ready_s": round(ready_s, 2),
                   "smoke_rows": len(rows), "smoke_predictions": probabilities.tolist()}
        difference = _difference_from_in_process(cfg, rows, probabilities)
        if difference is not None:
            summary["max_difference_from_in_process"] = difference
            print(f"[serve] largest difference from the in-process model: {difference:.2e}", flush=True)
        if smoke:
            return summary
        print("[serve] serving; Ctrl-C or SIGTERM stops the server", flush=True)
        while server.is_alive():
            time.sleep(0.5)
        raise UserError(f"the server exited by itself (code {server.process.returncode}):\n{server.log_tail()}")
    except KeyboardInterrupt:
        print("[serve] stopping", flush=True)
        return {"served": True, "http": server.http_url, "grpc": server.grpc_url, "stopped": "signal"}
    finally:
        server.stop()
        signal.signal(signal.SIGTERM, previous)


def _difference_from_in_process(cfg: PipelineConfig, rows: pd.DataFrame, served) -> float | None:
    """How far the served probabilities are from the trained model's own, when it is available here."""
    if not (cfg.paths.train / "model.pt").is_file():
        return None
    from export.inprocess import InProcessModel
    from pipeline.etl.workflow import Workflow

    model, schema = load_trained_model(cfg)
    expected = InProcessModel(model, schema, Workflow.load(cfg.paths.workflow)).predict(rows)
    return float(abs(expected - served).max())


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt
