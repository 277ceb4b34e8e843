"""The serve stage's runner: ``python -m pipeline run serve``.

``run`` starts a real Triton server on the exported repository, waits until it is ready, sends a
smoke request of raw test rows over HTTP, prints the endpoints and serves until Ctrl-C / SIGTERM. It
stops right after the smoke request with ``serve.once=true``, and with ``smoke=True`` (as in ``run
all``, which also says plainly when no server is available here instead of failing).

The HTTP port is a guard in this process (``export.guard``): it refuses bodies over
``serve.max_request_mb`` (413), JSON nested deeper than ``serve.max_json_depth`` (400) and malformed
framing without passing them on, and forwards the rest to Triton's own HTTP port on 127.0.0.1. The
gRPC port is Triton's. When ``tritonserver`` dies while serving (a crash, ``kill -9``), the stage
says how on one line and starts it again on the same ports (HTTP requests meanwhile get 503), up to
``serve.max_restarts`` times within ``serve.restart_window_s``; then it gives up with one error.
Triton's log is ``<workdir>/<dataset>/serve/tritonserver.log``, kept through restarts.

Example::

    python -m pipeline run serve serve.http_port=8000 serve.grpc_port=8001
    python -m pipeline run serve serve.once=true          # one smoke request, then exit
"""

from __future__ import annotations

import signal
import time

import pandas as pd
import pyarrow.parquet as pq

from export.client import Client
from export.config import ServeConfig
from export.repository import check_repository
from export.server import ServerError, TritonServer, server_problem, start_server
from pipeline.errors import UserError
from pipeline.stages.config import PipelineConfig


def run(cfg: PipelineConfig, smoke: bool = False) -> dict:
    """Serve the exported repository (checked first: a file missing or damaged is named before any server
    starts); ``smoke``: stop after one served request."""
    check_repository(cfg.paths.export)
    problem = server_problem(cfg.serve)
    if problem:
        if smoke:
            print(f"[serve] NOT SERVED: no Triton server can run here: {problem}", flush=True)
            return {"served": False, "reason": problem}
        raise UserError(problem)
    started = time.perf_counter()
    server = start_server(cfg.paths.export, cfg.serve, log_path=cfg.paths.serve_log)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    restarts: list[float] = []
    try:
        ready_s = time.perf_counter() - started
        print(f"[serve] {server.binary.name} ready in {ready_s:.1f} s (pid {server.pid})", flush=True)
        print(f"[serve] HTTP  {server.http_url}   gRPC  {server.grpc_url}   model: ensemble", flush=True)
        rows = sample_rows(cfg, cfg.serve.smoke_rows)
        with Client(server.http_url, "http") as client:
            probabilities = client.predict(rows)
        print(f"[serve] smoke request: {len(rows)} raw rows -> probabilities "
              f"{[round(float(p), 4) for p in probabilities]}", flush=True)
        summary = {"served": True, "http": server.http_url, "grpc": server.grpc_url, "ready_s": round(ready_s, 2),
                   "smoke_rows": len(rows), "smoke_predictions": probabilities.tolist(), "restarts": 0}
        compared = _difference_from_in_process(cfg, rows, probabilities)
        if compared is not None:
            run_name, difference = compared
            summary["max_difference_from_in_process"] = difference
            print(f"[serve] largest difference from the in-process model of run {run_name}: {difference:.2e}",
                  flush=True)
        if smoke or cfg.serve.once:
            return summary
        print("[serve] serving; Ctrl-C or SIGTERM stops the server", flush=True)
        supervise(server, cfg.serve, restarts)
    except KeyboardInterrupt:
        print(f"[serve] stopping (tritonserver restarts: {len(restarts)})", flush=True)
        return {"served": True, "http": server.http_url, "grpc": server.grpc_url, "stopped": "signal",
                "restarts": len(restarts)}
    finally:
        server.stop()
        signal.signal(signal.SIGTERM, previous)


def supervise(server: TritonServer, serve: ServeConfig, restarts: list[float]) -> None:
    """Watch the server until interrupted and start it again when it dies (also while starting again),
    appending the time of each restart to ``restarts``; give up with a UserError when it died after
    ``serve.max_restarts`` restarts within ``serve.restart_window_s``."""
    while True:
        how, now = _watch(server), time.monotonic()
        recent = [t for t in restarts if now - t < serve.restart_window_s]
        if len(recent) >= serve.max_restarts:
            raise UserError(f"tritonserver (pid {server.pid}) {how}, after {len(recent)} restarts within "
                            f"serve.restart_window_s={serve.restart_window_s:g} s: gave up (its log: {server.log_path}); "
                            "find out why it dies, or raise serve.max_restarts")
        print(f"[serve] tritonserver (pid {server.pid}) {how}; restarting it on the same ports "
              f"(restart {len(recent) + 1} of at most {serve.max_restarts} within {serve.restart_window_s:g} s; "
              f"its log: {server.log_path})", flush=True)
        restarts.append(now)
        started = time.perf_counter()
        try:
            server.restart()
        except ServerError as err:
            print(f"[serve] tritonserver did not start again: {str(err).splitlines()[0]}", flush=True)
            continue
        print(f"[serve] tritonserver restarted in {time.perf_counter() - started:.1f} s (pid {server.pid})",
              flush=True)


def _watch(server: TritonServer) -> str:
    """Wait until the server ends, or one of its model instance processes does (Triton does not start one again,
    and the requests given to it fail while the server reports itself ready); how it ended."""
    while server.is_alive():
        lost = server.lost_instances()
        if lost:
            return f"lost the model instance process(es) {lost}"
        time.sleep(0.2)
    return server.exit_description()


def sample_rows(cfg: PipelineConfig, rows: int, split: str = "test") -> pd.DataFrame:
    """The first ``rows`` raw rows of ``split``, as the ETL reads them (arrow-backed pandas)."""
    from pipeline.data.raw_folder import RawDataset

    files = RawDataset.load(cfg.paths.raw).splits.get(split) or []
    if not files:
        raise UserError(f"no raw {split} rows under {cfg.paths.raw}")
    table = pq.read_table(files[0])
    return table.slice(0, rows).to_pandas(types_mapper=pd.ArrowDtype)


def _difference_from_in_process(cfg: PipelineConfig, rows: pd.DataFrame, served) -> tuple[str, float] | None:
    """The exported run's name and how far the served probabilities are from its model's, run in this process
    (None when ``export.json`` names no run or its model is not here)."""
    from export.inprocess import InProcessModel
    from export.repository import artifacts_dir
    from pipeline.etl.workflow import Workflow
    from pipeline.stages.export import exported_run
    from pipeline.train.model import load_trained

    folder = exported_run(cfg)
    if folder is None or not (folder / "model.pt").is_file():
        return None
    model, schema = load_trained(folder, device="cpu")
    served_workflow = Workflow.load(artifacts_dir(cfg.paths.export) / "workflow")  # the ETL may have run again since
    expected = InProcessModel(model, schema, served_workflow).predict(rows)
    return folder.name, float(abs(expected - served).max())


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt
