"""Raw rows -> click probabilities in this process: the saved workflow, then the trained model.

This is the reference the served ensemble must equal (and the baseline ``bench serve`` measures it
against): the same ``Workflow.transform``, then the model's own ``forward`` on a
:class:`~pipeline.sparse.KeyedJaggedTensor`, with no Triton, cache or store in between. The model runs
on the device its weights are on (a GPU model against GPU instances).

Example::

    reference = InProcessModel(model, schema, Workflow.load(cfg.paths.workflow))
    probabilities = reference.predict(raw_rows)      # numpy [B], raw_rows as read from raw parquet
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import torch

from pipeline.schema import Schema
from pipeline.sparse import KeyedJaggedTensor


class InProcessModel:
    """``predict(raw DataFrame) -> probabilities``; ``features(...)`` gives the model inputs alone, on the model's
    device."""

    def __init__(self, model, schema: Schema, workflow) -> None:
        self.model = model.eval()
        self.schema = schema
        self.workflow = workflow
        self.device = next(model.parameters()).device

    def features(self, raw: pd.DataFrame) -> tuple[torch.Tensor, KeyedJaggedTensor]:
        processed = self.workflow.transform(raw)
        columns = [processed[c].to_numpy(dtype=np.float32) for c in self.schema.continuous]
        dense = torch.from_numpy(np.stack(columns, axis=1) if columns else np.zeros((len(processed), 0), np.float32))
        values, lengths = [], []
        multihot = set(self.schema.multihot)
        for name in self.schema.sparse:
            if name in multihot:
                lists = pa.array(processed[name])
                values.append(pc.list_flatten(lists).to_numpy(zero_copy_only=False).astype(np.int64))
                lengths.append(pc.fill_null(pc.list_value_length(lists), 0).to_numpy(zero_copy_only=False))
            else:
                values.append(processed[name].to_numpy(dtype=np.int64))
                lengths.append(np.ones(len(processed), dtype=np.int64))
        kjt = KeyedJaggedTensor(self.schema.sparse, torch.from_numpy(np.concatenate(values)),
                                torch.from_numpy(np.concatenate(lengths).astype(np.int64)))
        if self.device.type != "cpu":
            return dense.to(self.device, non_blocking=True), kjt.to(self.device, non_blocking=True)
        return dense, kjt

    def predict(self, raw: pd.DataFrame) -> np.ndarray:
        dense, kjt = self.features(raw)
        with torch.inference_mode():
            return torch.sigmoid(self.model(dense, kjt).float()).reshape(-1).cpu().numpy()
