"""The dense part of a trained model, exported as TorchScript that returns click probabilities.

One artifact serves both backends: the ``dense`` python-backend model loads it with
``torch.jit.load``, and Triton's ``pytorch`` backend (``export.dense_backend=pytorch``, in a full
Triton container) loads the same file as ``model.pt``. Inputs are the continuous features
``[B, num_dense]`` and the pooled embeddings ``[B, embedding_dim_total]`` (float32), or the pooled
embeddings alone when the model has no continuous feature; the output is ``sigmoid(logits)`` as
``[B, 1]``.

On a GPU the forward of a few small layers is bound by its kernel launches, not by its arithmetic.
So a runner on a GPU (``cuda_graphs=True``, ``export.cuda_graphs``) replays CUDA graphs: one captured
per padded batch size (:func:`padded_batch`: the powers of two up to ``max_batch``, then
``max_batch``) on first use, into whose static inputs a batch's continuous features and pooled
embeddings are copied: from the host in one host-to-device copy from a page-locked buffer, and the
pooled embeddings of a GPU cache (a tensor on the device) from where they are, never through the host;
the rows past the batch are padding (the model computes each row on its own), the answer is the batch's
rows. A batch larger than ``max_batch``, and every batch on the CPU, runs the module as it is.

A batch whose rows a GPU cache holds may also come as those rows and each id's slot
(:class:`export.cache_torch.CachedRows`), not gathered: the graph then gathers them itself, the slots going over in
the same copy as the continuous features, and brings the probabilities back with one more copy and one wait; the
lookup queues nothing on the device, and the whole batch costs two copies and one launch.

Example::

    save_dense(model, "repo/dense/1/model.pt")
    probability = DenseRunner("repo/dense/1/model.pt")(dense, pooled)   # numpy [B, 1]
"""

from __future__ import annotations

import copy
import itertools
import json
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from export.cache_torch import CachedRows


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


def padded_batch(rows: int, max_batch: int) -> int | None:
    """The batch size whose CUDA graph serves ``rows`` rows: the next power of two, or ``max_batch`` where that
    is larger; None beyond ``max_batch`` (run without a graph)."""
    if rows > max_batch:
        return None
    return min(1 << max(rows - 1, 0).bit_length(), max_batch)


def capture(forward: Callable[[], torch.Tensor], device: torch.device) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``forward`` captured as a CUDA graph on ``device``, after three runs outside the capture (TorchScript profiles
    its first runs), and the output tensor its replays write."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            forward()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # other threads may use CUDA
        output = forward()
    return graph, output


class _Graph:
    """The module captured for ``batch`` rows of inputs of ``widths`` columns (continuous, then pooled).

    Its static inputs lie one after the other in one device buffer, and a page-locked host buffer of the same
    layout holds the host's inputs: when every input comes from the host, the buffer goes over in one copy;
    an input already on the device (the pooled rows of a GPU cache) is copied there from where it is.
    """

    def __init__(self, module, batch: int, widths: list[int], device: torch.device) -> None:
        self.host = torch.zeros(batch * sum(widths), pin_memory=True)
        self.buffer = torch.zeros(batch * sum(widths), device=device)
        bounds = np.cumsum([0] + [batch * w for w in widths]).tolist()
        host = self.host.numpy()
        self._host_inputs = [host[start:end].reshape(batch, -1) for start, end in itertools.pairwise(bounds)]
        self._pinned = [self.host[start:end].view(batch, -1) for start, end in itertools.pairwise(bounds)]
        self.inputs = [self.buffer[start:end].view(batch, -1) for start, end in itertools.pairwise(bounds)]
        self.graph, self.output = capture(lambda: module(*self.inputs), device)

    def __call__(self, columns: list, rows: int) -> np.ndarray:
        on_host = [isinstance(x, np.ndarray) for x in columns]
        for x, host, is_host in zip(columns, self._host_inputs, on_host):
            if is_host:
                host[:rows] = x
        if all(on_host):
            self.buffer.copy_(self.host, non_blocking=True)
        else:
            for x, pinned, static, is_host in zip(columns, self._pinned, self.inputs, on_host):
                static[:rows].copy_(pinned[:rows] if is_host else x, non_blocking=True)
        self.graph.replay()
        return self.output[:rows].cpu().numpy()


class _GatheringGraph:
    """The module captured for ``batch`` rows whose pooled embeddings it gathers itself from a device cache's
    ``rows`` (:class:`export.cache_torch.CachedRows`), of ``columns`` slots a row, beside ``width`` continuous
    features (None: the module takes the pooled embeddings alone).

    The slots and the continuous features lie one after the other in one page-locked host buffer and go over in
    one copy; the graph gathers the rows, runs the module and leaves the probabilities where one copy brings them
    back to a page-locked buffer: a batch costs two copies, one launch and one wait, whatever its columns. The rows
    past the batch keep slots of earlier batches (any slot is a row) and are not answered.
    """

    def __init__(self, module, batch: int, columns: int, width: int | None, rows: torch.Tensor) -> None:
        device = rows.device
        slot_bytes, dense_bytes = batch * columns * 8, batch * (width or 0) * 4
        self.host = torch.zeros(slot_bytes + dense_bytes, dtype=torch.uint8, pin_memory=True)
        self.buffer = torch.zeros(slot_bytes + dense_bytes, dtype=torch.uint8, device=device)
        self.rows = rows
        host = self.host.numpy()
        self._slots = host[:slot_bytes].view(np.int64).reshape(batch, columns)
        self._dense = host[slot_bytes:].view(np.float32).reshape(batch, width) if width is not None else None
        slots = self.buffer[:slot_bytes].view(torch.int64)
        dense = self.buffer[slot_bytes:].view(torch.float32).view(batch, width or 0)

        def forward() -> torch.Tensor:
            pooled = rows.index_select(0, slots).view(batch, -1).float()
            return module(dense, pooled) if width is not None else module(pooled)

        self.graph, self.output = capture(forward, device)
        self.answer = torch.zeros(self.output.shape, pin_memory=True)
        self._answered = torch.cuda.Event()

    def __call__(self, dense: np.ndarray | None, slots: np.ndarray) -> np.ndarray:
        rows = len(slots)
        self._slots[:rows] = slots
        if self._dense is not None:
            self._dense[:rows] = dense
        self.buffer.copy_(self.host, non_blocking=True)
        self.graph.replay()
        self.answer.copy_(self.output, non_blocking=True)
        self._answered.record()
        self._answered.synchronize()
        return self.answer.numpy()[:rows].copy()


class DenseRunner:
    """Runs the saved dense part: numpy (or, for the pooled embeddings, a tensor) in, numpy ``[B, 1]`` float32
    probabilities out."""

    def __init__(self, path: str | Path, device: str = "cpu", cuda_graphs: bool = False,
                 max_batch: int = 1024) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # as a cache's rows name it
            self.device = torch.device("cuda", torch.cuda.current_device())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.module = torch.jit.load(str(path), map_location=self.device).eval()
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.max_batch = max_batch
        self._graphs: dict[int, _Graph] = {}
        self._gathered_from: torch.Tensor | None = None
        self._gathering_graphs: dict[int, _GatheringGraph] = {}

    @classmethod
    def for_instance(cls, args: dict, params: dict[str, str]) -> DenseRunner:
        """The runner of a Triton model instance: its version's ``model.pt``, on the instance's GPU for a
        ``KIND_GPU`` instance (with CUDA graphs up to the model's ``max_batch_size`` unless the ``cuda_graphs``
        parameter is ``false``), else on the CPU with ``intra_op_threads`` torch threads (default 1)."""
        torch.set_num_threads(int(params.get("intra_op_threads", "1")))
        device = "cpu"
        if args.get("model_instance_kind") == "GPU":
            device = f"cuda:{args['model_instance_device_id']}"
        return cls(Path(args["model_repository"]) / args["model_version"] / "model.pt", device,
                   cuda_graphs=params.get("cuda_graphs", "true") == "true",
                   max_batch=json.loads(args["model_config"])["max_batch_size"])

    def __call__(self, dense: np.ndarray | None, pooled) -> np.ndarray:
        """``dense`` is None for a model without continuous features (its module takes ``pooled`` alone). ``pooled``
        is numpy, or a tensor (the answer of a cache whose rows are on a device), taken where it is, or the rows
        where a device cache holds them (:class:`export.cache_torch.CachedRows`), gathered in the CUDA graph."""
        if isinstance(pooled, CachedRows):
            batch = padded_batch(len(pooled), self.max_batch) if self.cuda_graphs and len(pooled) else None
            if batch is None or pooled.rows.device != self.device:
                pooled = pooled.gathered()
            else:
                dense = None if dense is None else np.ascontiguousarray(dense, dtype=np.float32)
                with torch.inference_mode(), torch.cuda.device(self.device):
                    return self._gathering(batch, pooled, dense)(dense, pooled.slots)
        inputs = [x if isinstance(x, torch.Tensor) else np.ascontiguousarray(x, dtype=np.float32)
                  for x in ([pooled] if dense is None else [dense, pooled])]
        rows = len(pooled)
        batch = padded_batch(rows, self.max_batch) if self.cuda_graphs and rows else None
        with torch.inference_mode():
            if batch is not None:
                with torch.cuda.device(self.device):  # the graph's device, whichever the process made current
                    return self._graph(batch, inputs)(inputs, rows)
            out = self.module(*(x.to(self.device, torch.float32) if isinstance(x, torch.Tensor)
                                else torch.from_numpy(x).to(self.device) for x in inputs))
        return out.cpu().numpy()

    def _gathering(self, batch: int, pooled, dense: np.ndarray | None) -> _GatheringGraph:
        """The graph for ``batch`` rows gathering from ``pooled.rows`` (a cache's rows: new ones, after a store
        version of other shapes, drop the graphs of the old)."""
        if self._gathered_from is not pooled.rows:
            self._gathered_from, self._gathering_graphs = pooled.rows, {}
        graph = self._gathering_graphs.get(batch)
        if graph is None:
            graph = self._gathering_graphs[batch] = _GatheringGraph(
                self.module, batch, pooled.slots.shape[1], None if dense is None else dense.shape[1], pooled.rows)
        return graph

    def _graph(self, batch: int, inputs: list) -> _Graph:
        graph = self._graphs.get(batch)
        if graph is None:
            graph = self._graphs[batch] = _Graph(self.module, batch, [x.shape[1] for x in inputs], self.device)
        return graph
