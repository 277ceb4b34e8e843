"""``Batch``: what the loader yields, one training step's worth of samples.

Example::

    batch.dense.shape          # torch.Size([B, n_continuous]), float32
    batch.sparse["C1"].values  # ids of feature C1 (a KeyedJaggedTensor, keys in schema.sparse order)
    batch.label.shape          # torch.Size([B]), float32 0/1
    batch = batch.to("cuda", non_blocking=True)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.sparse import KeyedJaggedTensor


@dataclass
class Batch:
    """Continuous features ``[B, n_cont]``, sparse features (int64 ids and lengths) and labels ``[B]``."""

    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    label: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.label.shape[0]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch(
            self.dense.to(device, non_blocking=non_blocking),
            self.sparse.to(device, non_blocking=non_blocking),
            self.label.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> Batch:
        return Batch(self.dense.pin_memory(), self.sparse.pin_memory(), self.label.pin_memory())

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Mark the tensors as used on ``stream`` (they were made on the loader's side stream)."""
        self.dense.record_stream(stream)
        self.sparse.record_stream(stream)
        self.label.record_stream(stream)
