"""A GPU instance's whole batch in one CUDA graph: raw request tensors in, click probabilities out.

Where the fused model's GPU instance runs the workflow on its GPU (:mod:`export.device_preprocess`) and its
embedding cache holds every row of the one-hot tables (:meth:`export.lookup.EmbeddingLookup.resident`: tables that
fit the cache's capacity, fetched into it at the first batch), the cache's index on the host has nothing to find: each
categorical code has one place in the cache's rows, known beforehand. So one graph per padded batch size and text
width runs the workflow's operators, finds each code's row there (a gather of a table of places), gathers the rows
and runs the dense part; a batch costs one copy in, one replay, one copy of the probabilities back and one wait,
where the workflow, the lookup and the dense part otherwise take two graphs, the index's work on the host and two
waits. A batch the device preprocess leaves to the host, and any batch of a model without a resident cache, takes that
other way (``None`` from :meth:`DeviceRanker.__call__`).

Example (a GPU instance of the fused model)::

    ranker = DeviceRanker.of(device_preprocessor, dense_runner)       # None: the usual way
    probabilities = ranker(request_tensors, lookup.resident())        # numpy [B, 1], or None
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from export.dense import DenseRunner
from export.device_preprocess import DevicePreprocessor, on_device, place
from export.lookup import ResidentRows
from export.preprocess import CATEGORICAL_IDS, DENSE, Preprocessor

PREDICTION = "PREDICTION"
_OUTPUTS = [(PREDICTION, 1, np.dtype(np.float32))]


class DeviceRanker:
    """The batches of ``preprocess``'s model whose rows a resident cache holds, run on the GPU as one graph each
    with ``runner``'s dense part."""

    def __init__(self, preprocess: DevicePreprocessor, runner: DenseRunner) -> None:
        self.preprocess = preprocess
        self.module = runner.module
        self._onehot = len(preprocess.host.onehot)
        self._continuous = len(preprocess.host.continuous)
        self._cardinalities = np.array([preprocess.host.schema.column(name).cardinality
                                        for name in preprocess.host.onehot], dtype=np.int64)
        self._rows: torch.Tensor | None = None
        self._places: torch.Tensor | None = None
        self._offsets: torch.Tensor | None = None
        self._graphs: dict = {}
        self._checked: ResidentRows | None = None
        self._fits = False

    @classmethod
    def of(cls, preprocess: Preprocessor | DevicePreprocessor, runner: DenseRunner) -> DeviceRanker | None:
        """The whole-batch graphs of a model whose workflow runs on the GPU with a dense part there in CUDA graphs,
        of one-hot categorical features only; else None."""
        if (not isinstance(preprocess, DevicePreprocessor) or not runner.cuda_graphs
                or runner.device != preprocess.device or preprocess.host.multihot or not preprocess.host.onehot):
            return None
        return cls(preprocess, runner)

    def __call__(self, tensors: Mapping[str, np.ndarray], resident: ResidentRows) -> np.ndarray | None:
        """The probabilities ``[B, 1]`` of a request whose rows ``resident`` holds; None where the batch goes the
        usual way (the device preprocess leaves it to the host, or a table holds fewer rows than its column's
        codes)."""
        if resident is not self._checked:  # a table may hold fewer rows than its column's codes: checked once each
            self._checked = resident
            self._fits = len(resident.table_rows) == self._onehot and bool(
                (resident.table_rows >= self._cardinalities).all())
        if not self._fits:
            return None
        request = self.preprocess.checked(tensors)
        if request is None:
            return None
        with torch.inference_mode(), on_device(self.preprocess.device):
            if self._rows is not resident.rows:  # a new cache (a store version of other shapes): new graphs
                device = self.preprocess.device
                self._rows, self._graphs = resident.rows, {}
                self._places = torch.from_numpy(np.ascontiguousarray(resident.slots, dtype=np.int64)).to(device)
                self._offsets = torch.from_numpy(resident.offsets.astype(np.int64)).to(device)
            found = self.preprocess.run(request, _OUTPUTS, self._scored, self._graphs)
        return None if found is None else found[PREDICTION]

    def _scored(self, runs: list, targets: list[torch.Tensor]) -> None:
        """The probabilities of the model's tensors (in runs): each code's row found and gathered, the dense part
        run on them."""
        outputs = dict(zip(self.preprocess.tensor_names, runs))
        batch = targets[0].shape[0]
        codes = _assembled(outputs[CATEGORICAL_IDS], batch, self._onehot, torch.int64)
        pooled = self._rows.index_select(0, self._places[(codes + self._offsets).view(-1)]).view(batch, -1).float()
        if self._continuous:
            dense = _assembled(outputs[DENSE], batch, self._continuous, torch.float32)
            targets[0].copy_(self.module(dense, pooled))
        else:
            targets[0].copy_(self.module(pooled))


def _assembled(runs: list[tuple[int, torch.Tensor]], batch: int, columns: int, dtype: torch.dtype) -> torch.Tensor:
    """``[batch, columns]`` of runs of columns."""
    return place(torch.empty((batch, columns), dtype=dtype, device=runs[0][1].device), runs)
