"""Triton python model ``preprocess``: raw request tensors -> model features, with the saved ETL workflow.

The same ``Workflow.transform`` as offline runs here (export/preprocess.py), so what the model sees
when served is what it saw in training. Its inputs are one tensor per kind of raw column (export/request.py),
the text read in place at its fixed width.
Exported as ``preprocess/1/model.py`` (``export.fuse=none``; the fused model does this work otherwise).
"""

import json
from pathlib import Path

import triton_python_backend_utils as pb_utils

from export.batching import respond
from export.instance import pin_to_core
from export.preprocess import Preprocessor


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.name = config["name"]
        pin_to_core(args, {k: v["string_value"] for k, v in config.get("parameters", {}).items()})
        folder = Path(args["model_repository"]) / args["model_version"] / "artifacts"
        self.preprocessor = Preprocessor.load(folder)
        self.inputs = [i["name"] for i in config["input"]]

    def execute(self, requests):
        return respond(requests, self.inputs, self.preprocessor, pb_utils, self.name)
