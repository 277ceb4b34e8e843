"""The embedding compute backends: ``torch`` (the plain-torch reference) and ``cuda`` (the NVRTC kernels).

A backend is what an ``EmbeddingCollection`` calls; both run through the ``pipeline::`` custom ops
of :mod:`pipeline.kernels.embedding.ops` (``torch`` through their ``*_reference`` twins), so a model
compiles the same way on either. The contract is in ``docs/EMBEDDING.md``.

Example::

    backend = CudaBackend()                   # or TorchBackend(); usable(device, dtype) says where
    pooled = backend.forward(weights, packing, indices, offsets, batch_size)
    backend.backward_update(weights, state, packing, indices, offsets, batch_size, grad, optimizer, lr, step)

16-bit weights are updated in fp32 and rounded to nearest; a ``master_weights`` entry in the state
(flat fp32, like the weights) is updated instead and rounded into the weights; the ``cuda`` backend
also rounds at random, unbiased, with ``stochastic_rounding=True`` (here or on the optimizer config).
"""

from __future__ import annotations

import torch

from pipeline.kernels.embedding import ops
from pipeline.kernels.embedding.ops import KERNEL_DTYPES


class TorchBackend:
    """The plain-torch reference: the CPU path and the oracle of every other backend."""

    name = "torch"
    forward_op = staticmethod(ops.embedding_forward_reference)
    update_op = staticmethod(ops.embedding_update_reference)
    lookup_op = staticmethod(ops.embedding_lookup_reference)

    def __init__(self, stochastic_rounding: bool | None = None, seed: int = 0) -> None:
        self.stochastic_rounding = stochastic_rounding
        self.seed = seed

    @staticmethod
    def problem(device: torch.device, dtype: torch.dtype) -> str | None:
        """``None`` where this backend can run for ``device`` and weights ``dtype``, else why not."""
        return None

    @classmethod
    def usable(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return cls.problem(device, dtype) is None

    def forward(self, weights, packing, indices, offsets, batch_size):
        return self.forward_op(weights, indices, offsets, batch_size, *packing.op_args())

    def stochastic(self, optimizer) -> bool:
        if self.stochastic_rounding is not None:
            return self.stochastic_rounding
        return bool(getattr(optimizer, "stochastic_rounding", False))

    def backward_update(self, weights, state, packing, indices, offsets, batch_size, grad_output, optimizer, lr, step):
        hyper = torch.tensor([float(lr), float(step)], dtype=torch.float64)
        self.update_op(weights, state.get("momentum1"), state.get("momentum2"), state.get("master_weights"), indices,
                       offsets, batch_size, grad_output, *packing.op_args(), optimizer.kind, hyper, optimizer.eps,
                       optimizer.beta1, optimizer.beta2, optimizer.weight_decay, self.stochastic(optimizer), self.seed)


class CudaBackend(TorchBackend):
    """Table-batched forward and fused backward + sparse optimizer, as CUDA kernels compiled by NVRTC."""

    name = "cuda"
    forward_op = staticmethod(ops.embedding_forward)
    update_op = staticmethod(ops.embedding_update)
    lookup_op = staticmethod(ops.embedding_lookup)

    @staticmethod
    def problem(device: torch.device, dtype: torch.dtype) -> str | None:
        """``None`` where the kernels can run for ``device`` and weights ``dtype``, else why not."""
        from pipeline.kernels import kernels_problem

        if device.type != "cuda":
            return f"the CUDA kernels need CUDA tensors, got {device}"
        if dtype not in KERNEL_DTYPES:
            return f"the CUDA kernels take fp32, fp16 or bf16 weights, got {dtype}"
        return kernels_problem()

    @classmethod
    def usable(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return cls.problem(device, dtype) is None
