"""Where a served request's time goes: the client, the transport and Triton, the python backend, the model's work.

On a copy of an export's model repository (``python -m pipeline run export``, or the one ``bench serve`` makes
under its workdir), started with the project's server code, beside the served models:

- ``floor``: a python model with the served entry's inputs and output that reads the request as the served models
  do (``export.batching.respond``) and answers zeros: what a request costs with
  no work at all (client, gRPC, Triton, the python backend's hand-over of these tensors);
- ``ensemble_floor`` (a fused export): its one model as exported with its work taken out (its process, refresh and
  counters as served, its inputs read, zeros answered);
- every python model wrapped to record when its ``execute`` starts and ends, on the clock the client reads too
  (``CLOCK_MONOTONIC``, one machine).

For each batch size, ``--requests`` sequential gRPC requests (after 30) to the served entry (``ensemble``) and to the
floors, in turn, and a gRPC call that reaches no model (``ModelReady``): the
client's p50; Triton's own times per request (queue, compute input / infer / output, and ``success``: the whole time
in the server); and from the model's clock, the p50 of client -> ``execute``, ``execute``, ``execute`` -> client.

    python tools/serve_profile.py --export data/bench-serve/bench-serve-50000/export --batches 1,32,1024
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

_WRAPPER = '''"""{name}, as exported (served.py), its execute's start and end recorded (serve_profile)."""
import importlib.util
import json
import os
import threading
import time
from pathlib import Path

_spec = importlib.util.spec_from_file_location("served_{name}", Path(__file__).with_name("served.py"))
_served = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_served)


class TritonPythonModel(_served.TritonPythonModel):
    def initialize(self, args):
        super().initialize(args)
        self._times = []
        self._path = Path(args["model_repository"]) / f"times-{{os.getpid()}}.json"
        threading.Thread(target=self._flush, daemon=True).start()

    def _flush(self):
        written = 0
        while True:
            time.sleep(0.1)
            if len(self._times) != written:
                written = len(self._times)
                self._path.write_text(json.dumps(self._times[:written]))
{floor}
    def execute(self, requests):
        start = time.perf_counter_ns()
        out = super().execute(requests)
        self._times.append((start, time.perf_counter_ns()))
        return out
'''
_NO_WORK = '''
    def _compute(self, inputs):
        import numpy as np
        return {"PREDICTION": np.zeros((len(next(iter(inputs.values()))), 1), np.float32)}
'''
_FLOOR = '''"""Reads a request as the served models do and answers zeros (serve_profile)."""
import json

import numpy as np
import triton_python_backend_utils as pb_utils

from export.batching import respond


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.name = config["name"]
        self.inputs = [i["name"] for i in config["input"]]

    def _compute(self, inputs):
        return {"PREDICTION": np.zeros((len(next(iter(inputs.values()))), 1), np.float32)}

    def execute(self, requests):
        return respond(requests, self.inputs, self._compute, pb_utils, self.name)
'''


def _copy_repository(export: Path, work: Path, instances: int = 0, pin: bool = False) -> list[str]:
    """The export's models in ``work`` (the stores linked, not copied), each python model wrapped, the floors added,
    with ``instances`` instances each where given, pinned to cores with ``pin`` (``export.pin_instances``); the names
    of the models to time, the served entry first."""
    from export.pbtxt import instance_groups, regrouped

    for model in sorted(p for p in export.iterdir() if (p / "config.pbtxt").is_file()):
        target = work / model.name
        shutil.copytree(model, target, ignore=shutil.ignore_patterns("store", "stats"))
        if (model / "store").exists():
            (target / "store").symlink_to((model / "store").resolve())
        if (target / "1" / "model.py").is_file():
            (target / "1" / "model.py").rename(target / "1" / "served.py")
            (target / "1" / "model.py").write_text(_WRAPPER.format(name=model.name, floor=""))
    timed = ["ensemble"]
    entry = (work / "ensemble" / "config.pbtxt").read_text()
    fused = 'backend: "python"' in entry  # the entry is the fused model itself, not a Triton ensemble
    if fused:
        floor = work / "ensemble_floor"
        shutil.copytree(work / "ensemble", floor, symlinks=True)
        (floor / "config.pbtxt").write_text(entry.replace('name: "ensemble"', 'name: "ensemble_floor"'))
        (floor / "1" / "model.py").write_text(_WRAPPER.format(name="ensemble_floor", floor=_NO_WORK))
        timed.append("ensemble_floor")
    first = "ensemble" if fused else entry.split('model_name: "')[1].split('"')[0]
    kind, count = _instances((work / first / "config.pbtxt").read_text())
    io = re.search(r"max_batch_size: \d+\ninput \[.*?\n\]\noutput \[.*?\n\]\n", entry, re.DOTALL).group(0)
    head = f'name: "floor"\nbackend: "python"\n{io}'
    (work / "floor" / "1").mkdir(parents=True)
    batching = "dynamic_batching { max_queue_delay_microseconds: 0 }\n" if "dynamic_batching" in entry else ""
    (work / "floor" / "config.pbtxt").write_text(f"{head}{instance_groups(kind, count)}{batching}")
    (work / "floor" / "1" / "served.py").write_text(_FLOOR)
    (work / "floor" / "1" / "model.py").write_text(_WRAPPER.format(name="floor", floor=""))
    timed.append("floor")
    for config in work.glob("*/config.pbtxt"):
        text = config.read_text()
        if instances and "instance_group" in text:
            text = regrouped(text, instances)
        if pin and 'backend: "python"' in text and "pin_cores" not in text:
            text += 'parameters { key: "pin_cores" value: { string_value: "true" } }\n'
        config.write_text(text)
    return timed


def _instances(config: str) -> tuple[str, int]:
    """The kind of a model's instances (``cpu``, ``gpu``) and their count, from its ``config.pbtxt``."""
    return (re.search(r"KIND_(\w+)", config).group(1).lower(),
            sum(int(n) for n in re.findall(r"count: ([0-9]+)", config)))


def _stats(client, model: str) -> dict[str, int]:
    """Triton's counters of ``model`` (``Client.inference_statistics``): requests, and ns in each part."""
    stats = next(m for m in client.inference_statistics()["model_stats"] if m["name"] == model)["inference_stats"]
    kinds = ("success", "queue", "compute_input", "compute_infer", "compute_output")
    return {"count": int(stats["success"].get("count", 0)), **{k: int(stats[k].get("ns", 0)) for k in kinds}}


def _model_times(work: Path, model: str, since: int) -> list[tuple[int, int]]:
    """The ``execute`` spans the model's instances recorded that started after ``since``, in order."""
    spans = []
    for path in (work / model).glob("times-*.json"):
        spans += [tuple(s) for s in json.loads(path.read_text()) if s[0] >= since]
    return sorted(spans)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--export", required=True, help="an export folder (python -m pipeline run export)")
    parser.add_argument("--raw", default="", help="raw parquet rows for the requests (default: <export>/../raw/test)")
    parser.add_argument("--batches", default="1,32,1024", help="batch sizes, comma-separated")
    parser.add_argument("--requests", type=int, default=320, help="timed requests per model and batch size")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over the models, each batch size")
    parser.add_argument("--instances", type=int, default=0, help="instances of each model (default: as exported)")
    parser.add_argument("--pin", action="store_true", help="each instance on a core of its own (export.pin_instances)")
    parser.add_argument("--json", metavar="FILE", help="also write the timings as JSON")
    args = parser.parse_args(argv)

    import numpy as np
    import pyarrow.parquet as pq

    from export.client import Client
    from export.server import TritonServer

    export = Path(args.export)
    rows = pq.read_table(args.raw or export.parent / "raw" / "test").to_pandas()
    results: dict = {"export": str(export), "requests": args.requests, "instances": args.instances or "as exported",
                     "pinned": args.pin, "batches": {}}
    with tempfile.TemporaryDirectory(prefix="serve-profile-") as tmp:
        work = Path(tmp)
        models = _copy_repository(export, work, args.instances, args.pin)
        with TritonServer(work) as server:
            clients = {m: Client(server.grpc_url, "grpc", model=m) for m in models}
            ready = clients["ensemble"]
            for batch in [int(b) for b in args.batches.split(",") if b]:
                tensors = ready.tensors(rows.iloc[:batch])
                figures: dict = {}
                for _ in range(args.rounds):
                    spans = []
                    for _ in range(30 + args.requests):
                        start = time.perf_counter_ns()
                        ready._call(ready._stub.ModelReady, ready._messages.ModelReadyRequest(name="ensemble"))
                        spans.append(time.perf_counter_ns() - start)
                    figures.setdefault("ModelReady (no model)", []).append({"client": np.median(spans[30:]) / 1e6})
                    for model in (models if len(figures) % 2 else models[::-1]):
                        client = clients[model]
                        for _ in range(30):
                            client.infer(tensors)
                        before = _stats(client, model)
                        calls = []
                        for _ in range(args.requests):
                            start = time.perf_counter_ns()
                            client.infer(tensors)
                            calls.append((start, time.perf_counter_ns()))
                        after = _stats(client, model)
                        time.sleep(0.25)  # the models' records written
                        count = after["count"] - before["count"]
                        row = {"client": np.median([e - s for s, e in calls]) / 1e6}
                        row.update({k: (after[k] - before[k]) / count / 1e6 for k in after if k != "count"})
                        executed = model if (work / model / "1" / "served.py").is_file() else ""  # a python model
                        spans = _model_times(work, executed, calls[0][0]) if executed else []
                        if len(spans) == len(calls):
                            row["to execute"] = np.median([x[0] - c[0] for c, x in zip(calls, spans)]) / 1e6
                            row["execute"] = np.median([x[1] - x[0] for x in spans]) / 1e6
                            row["from execute"] = np.median([c[1] - x[1] for c, x in zip(calls, spans)]) / 1e6
                        figures.setdefault(model, []).append(row)
                results["batches"][batch] = {m: {k: float(np.median([r[k] for r in rs if k in r])) for k in rs[0]}
                                             for m, rs in figures.items()}
                _print(batch, results["batches"][batch])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


def _print(batch: int, figures: dict) -> None:
    keys = ["client", "to execute", "execute", "from execute", "success", "queue", "compute_input", "compute_infer",
            "compute_output"]
    print(f"[serve profile] batch {batch}, ms (median over rounds of each p50 / mean per request for Triton's):")
    print("  " + f"{'model':22}" + "".join(f"{k:>15}" for k in keys))
    for model, row in figures.items():
        print("  " + f"{model:22}" + "".join(f"{row[k]:15.3f}" if k in row else f"{'':>15}" for k in keys))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
