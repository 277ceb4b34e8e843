"""Triton python model ``embedding``: pooled embeddings through a cache of hot rows and the host store.

Before each batch it switches to a newer store version if export wrote one (no restart); its
cache counters go to ``stats/`` beside the store (export/instance.py). Exported as
``embedding/1/model.py``.
"""

import json

import triton_python_backend_utils as pb_utils

from export.batching import respond
from export.instance import LookupInstance, pin_to_core


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.name = config["name"]
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        pin_to_core(args, params)
        self.instance = LookupInstance(
            args, params, lambda message: pb_utils.Logger.log_error(f"{self.name}: {message}"))
        self.inputs = [i["name"] for i in config["input"]]

    def _compute(self, inputs):
        with self.instance.timed("lookup"):
            return {"EMBEDDINGS": self.instance.pooled(inputs)}

    def execute(self, requests):
        with self.instance.timed("refresh"):
            self.instance.refresh()
        self.instance.count_batch()
        return respond(requests, self.inputs, self._compute, pb_utils, self.name, self.instance.timed)

    def finalize(self):
        self.instance.close()
