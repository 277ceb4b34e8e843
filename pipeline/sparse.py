"""``KeyedJaggedTensor``: the one batch format of the sparse features, from the loader to export.

Layout (torchrec's): for ``F`` keys (features) and a batch of ``B`` samples, ``lengths`` has ``F * B``
entries, key-major (all samples of key 0, then key 1, ...), and ``values`` holds the ids of every
bag concatenated in that same order. A one-hot feature has length 1 per sample (0 when missing
after the ETL is impossible: the ETL maps missing to index 0); a multi-hot feature has any length,
0 included (an empty bag pools to zeros). ``length_per_key``, when the maker knows it on the host (the
loader does, and ``from_dense``), is each key's number of ids: a consumer then cuts ``values`` by key
without reading the device.

Example::

    kjt = KeyedJaggedTensor.from_lists(["C1", "C2"], [[[3], [5]], [[1, 2], []]])
    kjt.batch_size        # 2
    kjt["C2"].offsets     # tensor([0, 2, 2])
    kjt.offsets()         # tensor([0, 1, 2, 4, 4]) : F * B + 1 bag boundaries
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class JaggedTensor:
    """The bags of one key: ``values[offsets[i]:offsets[i+1]]`` is sample ``i``'s bag."""

    values: torch.Tensor
    offsets: torch.Tensor

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]


class KeyedJaggedTensor:
    """Sparse features of a batch: ``keys``, ``values`` (int ids), ``lengths`` (``F * B``, key-major) and, when
    known on the host, ``length_per_key`` (the ids of each key: ``F`` ints summing to ``len(values)``)."""

    __slots__ = ("_offsets", "keys", "length_per_key", "lengths", "values")

    def __init__(self, keys: Sequence[str], values: torch.Tensor, lengths: torch.Tensor,
                 length_per_key: Sequence[int] | None = None) -> None:
        self.keys = list(keys)
        self.values = values
        self.lengths = lengths
        self.length_per_key = list(length_per_key) if length_per_key is not None else None
        self._offsets: torch.Tensor | None = None
        if self.keys and lengths.numel() % len(self.keys):
            raise ValueError(f"lengths has {lengths.numel()} entries, not a multiple of {len(self.keys)} keys")
        if self.length_per_key is not None and (len(self.length_per_key) != len(self.keys)
                                                or sum(self.length_per_key) != values.numel()):
            raise ValueError(f"length_per_key {self.length_per_key} does not give each of the {len(self.keys)} keys "
                             f"its ids of the {values.numel()} values")

    @property
    def batch_size(self) -> int:
        return self.lengths.numel() // len(self.keys) if self.keys else 0

    def offsets(self) -> torch.Tensor:
        """``F * B + 1`` bag boundaries into ``values`` (int64), computed once."""
        if self._offsets is None:
            out = torch.zeros(self.lengths.numel() + 1, dtype=torch.int64, device=self.lengths.device)
            torch.cumsum(self.lengths, 0, out=out[1:])
            self._offsets = out
        return self._offsets

    def __getitem__(self, key: str) -> JaggedTensor:
        k = self.keys.index(key)
        b = self.batch_size
        offsets = self.offsets()[k * b : (k + 1) * b + 1]
        start = int(offsets[0])
        return JaggedTensor(self.values[start : int(offsets[-1])], offsets - start)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(
            self.keys, self.values.to(device, non_blocking=non_blocking), self.lengths.to(device, non_blocking=non_blocking),
            self.length_per_key,
        )

    def pin_memory(self) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(self.keys, self.values.pin_memory(), self.lengths.pin_memory(), self.length_per_key)

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        self.values.record_stream(stream)
        self.lengths.record_stream(stream)

    @classmethod
    def from_lists(cls, keys: Sequence[str], bags: Sequence[Sequence[Sequence[int]]]) -> KeyedJaggedTensor:
        """From nested lists, ``bags[key][sample] = [ids...]``: a small batch written out by hand."""
        lengths = [len(bag) for per_key in bags for bag in per_key]
        values = [v for per_key in bags for bag in per_key for v in bag]
        return cls(keys, torch.tensor(values, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64))

    @classmethod
    def from_dense(cls, keys: Sequence[str], ids: torch.Tensor) -> KeyedJaggedTensor:
        """One-hot features from a ``[B, F]`` id matrix."""
        if ids.dim() != 2 or ids.shape[1] != len(keys):
            raise ValueError(f"expected ids of shape [batch, {len(keys)}], got {tuple(ids.shape)}")
        values = ids.t().reshape(-1).to(torch.int64)
        return cls(keys, values, torch.ones(values.numel(), dtype=torch.int64, device=ids.device),
                   [ids.shape[0]] * len(keys))

    def __repr__(self) -> str:
        return f"KeyedJaggedTensor(keys={self.keys}, batch_size={self.batch_size}, nnz={self.values.numel()})"
