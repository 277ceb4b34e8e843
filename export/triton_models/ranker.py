"""The fused Triton python model: raw request tensors -> click probabilities, in one model, served as ``ensemble``.

The saved ETL workflow (export/preprocess.py; on a GPU instance, on its GPU where the workflow allows:
export/device_preprocess.py), the embedding lookup through its cache and the host
store (export/instance.py) and the dense part (export/dense.py) run one after the other in this
process (a batch whose rows a GPU cache holds reaches the dense part's CUDA graph as those rows, gathered there):
on a GPU instance whose cache holds every row, all three as one CUDA graph a batch
(export/device_ranker.py); one python-backend hop per request, where the chain ``preprocess`` -> ``embedding`` ->
``dense`` (``export.fuse=none``) takes three and a Triton ensemble in front. Its inputs are one tensor per kind of raw
column (export/request.py), the text read in place at its fixed width.
Exported as ``ensemble/1/model.py``, with ``artifacts/``, ``layout.json`` and ``model.pt`` beside it
and the store in ``ensemble/store``.
"""

import json
from pathlib import Path

import triton_python_backend_utils as pb_utils

from export import device_preprocess
from export.batching import respond
from export.dense import DenseRunner
from export.device_ranker import DeviceRanker
from export.instance import LookupInstance, pin_to_core
from export.preprocess import DENSE, Preprocessor


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.name = config["name"]
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        pin_to_core(args, params)
        self.preprocessor = device_preprocess.for_instance(
            Preprocessor.load(Path(args["model_repository"]) / args["model_version"] / "artifacts"), args, params)
        self.runner = DenseRunner.for_instance(args, params)
        self.instance = LookupInstance(
            args, params, lambda message: pb_utils.Logger.log_error(f"{self.name}: {message}"))
        self.inputs = [i["name"] for i in config["input"]]
        self.whole = DeviceRanker.of(self.preprocessor, self.runner)

    def _compute(self, inputs):
        if self.whole is not None:
            answer = self.instance.resident_scored(lambda resident: self.whole(inputs, resident))
            if answer is not None:
                return {"PREDICTION": answer}
        with self.instance.timed("preprocess"):
            features = self.preprocessor(inputs)
        dense = features.get(DENSE)
        return {"PREDICTION": self.instance.scored(features, lambda embeddings: self.runner(dense, embeddings))}

    def execute(self, requests):
        with self.instance.timed("refresh"):
            self.instance.refresh()
        self.instance.count_batch()
        return respond(requests, self.inputs, self._compute, pb_utils, self.name, self.instance.timed)

    def finalize(self):
        self.instance.close()
