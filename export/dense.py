"""The dense part of a trained model, exported as TorchScript that returns click probabilities.

One artifact serves both backends: the ``dense`` python-backend model loads it with
``torch.jit.load``, and Triton's ``pytorch`` backend (``export.dense_backend=pytorch``, in a full
Triton container) loads the same file as ``model.pt``. Inputs are the continuous features
``[B, num_dense]`` and the pooled embeddings ``[B, embedding_dim_total]`` (float32), or the pooled
embeddings alone when the model has no continuous feature; the output is ``sigmoid(logits)`` as
``[B, 1]``.

Example::

    save_dense(model, "repo/dense/1/model.pt")
    probability = DenseRunner("repo/dense/1/model.pt")(dense, pooled)   # numpy [B, 1]
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn


class _Probability(nn.Module):
    def __init__(self, dense_part: nn.Module) -> None:
        super().__init__()
        self.dense_part = dense_part

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.dense_part(dense, pooled).float()).reshape(-1, 1)


class _PooledProbability(nn.Module):
    """For a model without continuous features: the pooled embeddings are the only input."""

    def __init__(self, dense_part: nn.Module) -> None:
        super().__init__()
        self.dense_part = dense_part

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        dense = pooled.new_zeros((pooled.shape[0], 0))
        return torch.sigmoid(self.dense_part(dense, pooled).float()).reshape(-1, 1)


def save_dense(model, path: str | Path) -> Path:
    """Trace ``model.dense_part()`` (a :class:`pipeline.modules.models.RecModel`) on CPU and save it; ``model``
    itself stays on its device and in its mode (a copy is traced)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pooled = torch.zeros(2, model.embedding.output_dim)
    dense_layers = copy.deepcopy(model, {id(model.embedding): None}).eval().cpu()  # the tables stay where they are
    if model.num_dense:
        wrapper, example = _Probability(dense_layers.dense_part()), (torch.zeros(2, model.num_dense), pooled)
    else:
        wrapper, example = _PooledProbability(dense_layers.dense_part()), (pooled,)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(wrapper, example, check_trace=False)
    traced.save(str(path))
    return path


class DenseRunner:
    """Runs the saved dense part: numpy in, numpy ``[B, 1]`` float32 probabilities out."""

    def __init__(self, path: str | Path, device: str = "cpu") -> None:
        self.device = torch.device(device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.module = torch.jit.load(str(path), map_location=self.device).eval()

    @classmethod
    def for_instance(cls, args: dict, params: dict[str, str]) -> "DenseRunner":
        """The runner of a Triton model instance: its version's ``model.pt``, on the instance's GPU for a
        ``KIND_GPU`` instance, else on the CPU with ``intra_op_threads`` torch threads (default 1)."""
        torch.set_num_threads(int(params.get("intra_op_threads", "1")))
        device = "cpu"
        if args.get("model_instance_kind") == "GPU":
            device = f"cuda:{args['model_instance_device_id']}"
        return cls(Path(args["model_repository"]) / args["model_version"] / "model.pt", device)

    def __call__(self, dense: np.ndarray | None, pooled: np.ndarray) -> np.ndarray:
        """``dense`` is None for a model without continuous features (its module takes ``pooled`` alone)."""
        inputs = [pooled] if dense is None else [dense, pooled]
        with torch.inference_mode():
            out = self.module(*(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(self.device)
                                for x in inputs))
        return out.cpu().numpy()
