"""Triton python model ``embedding``: pooled embeddings through a cache of hot rows and the host store.

A ``KIND_GPU`` instance keeps its cache in its GPU's memory (``gpu-lru`` / ``gpu-lfu``).

Before each batch it switches to a newer store version if export wrote one (no restart), and a
background thread writes its cache counters to ``stats/instance-<pid>.json`` beside the store.
Exported as ``embedding/1/model.py``.
"""

import json
import os
import threading
from pathlib import Path

import triton_python_backend_utils as pb_utils

from export.batching import respond
from export.lookup import EmbeddingLookup, LookupLayout
from export.preprocess import CATEGORICAL_IDS, MULTIHOT_IDS, MULTIHOT_LENGTHS

STATS_EVERY_S = 0.2


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.name = config["name"]
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        model_dir = Path(args["model_repository"])
        layout = LookupLayout.load(model_dir / args["model_version"] / "layout.json")
        policy = params.get("cache_policy", "lru")
        if args.get("model_instance_kind") == "GPU" and policy != "none":
            import torch

            torch.cuda.set_device(int(args["model_instance_device_id"]))
            policy = f"gpu-{policy}"  # the cache of hot rows in this GPU's memory
        self.lookup = EmbeddingLookup(model_dir / "store", layout, policy=policy,
                                      cache_fraction=float(params.get("cache_fraction", "0.25")))
        self.inputs = [i["name"] for i in config["input"]]
        self._stats_path = model_dir / "stats" / f"instance-{os.getpid()}.json"
        self._stats_path.parent.mkdir(exist_ok=True)
        self._stop = threading.Event()
        self._writer = threading.Thread(target=self._write_stats_loop, daemon=True)
        self._writer.start()

    def _compute(self, inputs):
        pooled = self.lookup(inputs[CATEGORICAL_IDS], inputs.get(MULTIHOT_IDS), inputs.get(MULTIHOT_LENGTHS))
        return {"EMBEDDINGS": pooled}

    def execute(self, requests):
        try:
            self.lookup.refresh()
        except Exception as err:  # noqa: BLE001  (an unreadable new version: keep serving the current one)
            pb_utils.Logger.log_error(f"{self.name}: store version {self.lookup.version} kept, the new one "
                                      f"could not be opened: {err}")
        return respond(requests, self.inputs, self._compute, pb_utils, self.name)

    def _write_stats_loop(self):
        last = None
        while not self._stop.wait(STATS_EVERY_S):
            last = self._write_stats(last)
        self._write_stats(None)

    def _write_stats(self, last):
        stats = self.lookup.stats()
        text = json.dumps(stats)
        if text != last:
            tmp = self._stats_path.with_suffix(".tmp")
            tmp.write_text(text)
            os.replace(tmp, self._stats_path)
        return text

    def finalize(self):
        self._stop.set()
        self._writer.join(timeout=2)
