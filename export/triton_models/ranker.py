"""Triton python model ``ranker``: the embedding lookup and the dense part in one model
(``export.fuse_dense=true``), one hop less than ``embedding`` then ``dense``.

Exported as ``ranker/1/model.py``, with the store beside it as for ``embedding``.
"""

import json
import triton_python_backend_utils as pb_utils

from export.batching import respond
from export.dense import DenseRunner
from export.instance import LookupInstance
from export.preprocess import DENSE


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.name = config["name"]
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.runner = DenseRunner.for_instance(args, params)
        self.instance = LookupInstance(args, params)
        self.inputs = [i["name"] for i in config["input"]]

    def _compute(self, inputs):
        return {"PREDICTION": self.runner(inputs.get(DENSE), self.instance.pooled(inputs))}

    def execute(self, requests):
        self.instance.refresh(lambda message: pb_utils.Logger.log_error(f"{self.name}: {message}"))
        return respond(requests, self.inputs, self._compute, pb_utils, self.name)

    def finalize(self):
        self.instance.close()
