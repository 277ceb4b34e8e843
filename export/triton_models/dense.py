"""Triton python model ``dense``: the trained model's dense part (TorchScript) -> click probabilities.

Runs on the instance's GPU for a ``KIND_GPU`` instance group, else on the CPU with
``intra_op_threads`` torch threads (1 by default: requests are small, and the other models and
instances need the other cores).
Exported as ``dense/1/model.py``.
"""

import json

import triton_python_backend_utils as pb_utils

from export.batching import respond
from export.dense import DenseRunner
from export.instance import pin_to_core
from export.preprocess import DENSE


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.name = config["name"]
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        pin_to_core(args, params)
        self.runner = DenseRunner.for_instance(args, params)
        self.inputs = [i["name"] for i in config["input"]]

    def _compute(self, inputs):
        return {"PREDICTION": self.runner(inputs.get(DENSE), inputs["EMBEDDINGS"])}

    def execute(self, requests):
        return respond(requests, self.inputs, self._compute, pb_utils, self.name)
