"""One response per request, and a bad request answered alone: the shared ``execute`` of the python models.

Triton hands a python model several requests at once (dynamic batching). The requests' inputs are
stacked and computed in one call; if that call fails, each request is computed on its own, so a bad
request gets its own error response naming the problem while the others succeed (the pattern of
triton-inference-server/python_backend's examples). Inputs and outputs are numpy arrays, or torch
tensors where they are in GPU memory (a model whose config lets its inputs stay there, an output computed
there): those go through DLPack, without a copy to the host.

Example (inside a ``model.py``)::

    def execute(self, requests):
        return respond(requests, ["DENSE", "EMBEDDINGS"], self._compute, pb_utils, self.name)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

import numpy as np

from pipeline.errors import UserError

Compute = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]
Timed = Callable[[str], AbstractContextManager]


def respond(requests: list, input_names: list[str], compute: Compute, pb_utils, model: str,
            timed: Timed = lambda phase: contextlib.nullcontext()) -> list:
    """Run ``compute`` on the requests' inputs; return exactly one response per request, in order. ``timed(phase)``
    times reading the inputs (``inputs``) and making the responses (``outputs``)."""
    with timed("inputs"):
        inputs: list[dict[str, np.ndarray] | Exception] = [_read(r, input_names) for r in requests]
    good = [i for i, x in enumerate(inputs) if not isinstance(x, Exception)]
    results: list[dict[str, np.ndarray] | Exception | None] = list(inputs)
    merged = _stack([inputs[i] for i in good]) if len(good) > 1 else None
    if merged is not None:
        try:
            outputs = compute(merged[0])
            for i, part in zip(good, _split(outputs, merged[1])):
                results[i] = part
            good = []
        except Exception:  # noqa: BLE001, S110  (retried one by one below, where each gets its own error)
            pass
    for i in good:
        try:
            results[i] = compute(inputs[i])
        except Exception as err:  # noqa: BLE001
            results[i] = err
    with timed("outputs"):
        return [_response(x, pb_utils, model) for x in results]


def _read(request, names: list[str]) -> dict[str, np.ndarray] | Exception:
    """The request's inputs by name, read in one pass (``pb_utils.get_input_tensor_by_name`` scans them all per name):
    numpy, or a torch tensor where an input is in GPU memory (a model whose inputs may stay there)."""
    given = {tensor.name(): tensor for tensor in request.inputs()}
    missing = [name for name in names if name not in given]
    if missing:
        return UserError(f"missing input {missing[0]}")
    return {name: given[name].as_numpy() if given[name].is_cpu() else _from_device(given[name]) for name in names}


def _from_device(tensor):
    from torch.utils.dlpack import from_dlpack

    return from_dlpack(tensor.to_dlpack())


def _stack(parts: list[dict[str, np.ndarray]]) -> tuple[dict[str, np.ndarray], list[int]] | None:
    names = parts[0].keys()
    for name in names:
        shapes = {tuple(p[name].shape[1:]) for p in parts}
        if len(shapes) > 1:
            return None
    sizes = [len(next(iter(p.values()))) for p in parts]
    return {n: _concatenated([p[n] for p in parts]) for n in names}, sizes


def _concatenated(arrays: list):
    """One input of several requests, stacked: numpy, or a torch tensor on the device of the first one on a device."""
    if all(isinstance(a, np.ndarray) for a in arrays):
        return np.concatenate(arrays)
    import torch

    device = next(a.device for a in arrays if isinstance(a, torch.Tensor))
    return torch.cat([torch.as_tensor(a, device=device) for a in arrays])


def _split(outputs: dict[str, np.ndarray], sizes: list[int]) -> list[dict[str, np.ndarray]]:
    bounds = np.cumsum([0] + sizes)
    return [{n: a[bounds[k]: bounds[k + 1]] for n, a in outputs.items()} for k in range(len(sizes))]


def _response(result, pb_utils, model: str):
    if isinstance(result, Exception):
        # The request's fault (a value the model cannot take) is INVALID_ARG: HTTP 400, gRPC INVALID_ARGUMENT;
        # anything else stays INTERNAL (HTTP 500), so a client can tell the two apart.
        by_request = isinstance(result, (UserError, ValueError))
        kind = "" if by_request else f"{type(result).__name__}: "
        code = pb_utils.TritonError.INVALID_ARG if by_request else pb_utils.TritonError.INTERNAL
        return pb_utils.InferenceResponse(output_tensors=[],
                                          error=pb_utils.TritonError(f"{model}: {kind}{result}", code))
    return pb_utils.InferenceResponse(output_tensors=[_output(n, a, pb_utils) for n, a in result.items()])


def _output(name: str, values, pb_utils):
    """An output tensor: from numpy, or from a torch tensor where it is (GPU memory too) through DLPack."""
    if isinstance(values, np.ndarray):
        return pb_utils.Tensor(name, np.ascontiguousarray(values))
    from torch.utils.dlpack import to_dlpack

    return pb_utils.Tensor.from_dlpack(name, to_dlpack(values.contiguous()))
