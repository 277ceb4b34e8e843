"""``CudaEmbeddingBackend``: the fused CUDA kernels behind the ``EmbeddingCollection`` seam.

Registered as backend ``"cuda"`` by :mod:`pipeline.kernels` when a GPU and CuPy are usable; the
collection's autograd function calls :meth:`forward` in its forward pass and :meth:`backward_update`
in its backward pass, so models run unchanged. Its oracle is the collection's ``TorchBackend``.

Example::

    emb = EmbeddingCollection(tables, features, EmbeddingOptimizerConfig("adam"), backend="cuda").cuda()
    loss_fn(head(emb(kjt))).backward()     # sort by row, then one fused sum + Adam update launch

16-bit weights are updated in fp32 and rounded to nearest, as the seam specifies; two options change
that: a ``master_weights`` entry in the optimizer state (flat fp32, like ``weights``) is updated
instead and rounded into the weights; ``stochastic_rounding=True`` (here, or an optimizer config
attribute of that name) rounds up or down at random, unbiased.
"""

from __future__ import annotations

import torch

from pipeline.kernels.embedding_ops import SlotArrays, backward_update, pooled_forward


class CudaEmbeddingBackend:
    """Table-batched forward and fused backward + sparse optimizer, as CUDA kernels compiled by NVRTC."""

    name = "cuda"

    def __init__(self, stochastic_rounding: bool | None = None, seed: int = 0) -> None:
        self.stochastic_rounding = stochastic_rounding
        self.seed = seed
        self._slots: dict[tuple[int, str], tuple[object, SlotArrays]] = {}

    def slots(self, layout, device: torch.device) -> SlotArrays:
        key = (id(layout), str(device))
        hit = self._slots.get(key)
        if hit is None or hit[0] is not layout:
            hit = (layout, SlotArrays.from_layout(layout, device))
            self._slots[key] = hit
        return hit[1]

    def forward(self, weights, layout, indices, offsets, batch_size):
        return pooled_forward(weights, self.slots(layout, weights.device), indices, offsets, batch_size)

    def backward_update(self, weights, state, layout, indices, offsets, batch_size, grad_output, optimizer, lr, step):
        stochastic = self.stochastic_rounding
        if stochastic is None:
            stochastic = bool(getattr(optimizer, "stochastic_rounding", False))
        backward_update(
            weights, state, self.slots(layout, weights.device), indices, offsets, batch_size, grad_output,
            optimizer.kind, lr, step, eps=optimizer.eps, beta1=optimizer.beta1, beta2=optimizer.beta2,
            weight_decay=optimizer.weight_decay, master_weights=state.get("master_weights"),
            stochastic_rounding=stochastic and weights.dtype != torch.float32, seed=self.seed,
        )
