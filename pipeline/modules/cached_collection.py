"""``HostCachedCollection``: an EmbeddingCollection some of whose tables live in host memory behind device caches.

Each table named in ``cache_rows`` keeps every row and its optimizer state in host memory (pinned once
the collection is on a GPU) and that many rows, with their state, on the device in a
:class:`~pipeline.modules.host_cache.RowCache` (least recently used out, dirty rows written back); the
other tables stay whole on the device, as in the plain collection. A batch's lookup first maps the
ids of the cached tables to cache slots (:meth:`RowCache.prefetch`: misses copied in, evicted dirty
rows written back), then runs the collection's own lookup and fused update on the device tensors
with those slots for ids, so a training step reads and writes device memory only. The values are
those of the plain collection: the same rows, updated by the same code.

When the prefetch runs: at the start of each batch's lookup, after the previous batch's backward
updated its rows (on a GPU, after it in stream order). :meth:`HostCachedCollection.prefetch` may also
run one batch ahead (``self(prefetched)`` looks it up later), while the batch before computes: a
prefetch never evicts the rows of the training batch prefetched before it, whose update may still be
pending. A training batch's distinct rows of a table, with those of the batch before, must fit its
cache (else :class:`~pipeline.modules.host_cache.CacheTooSmall`); a lookup outside training that
does not fit is looked up in halves of its samples.

The state dict is the plain collection's (every table whole, dirty rows written back first), so
checkpoints, ``model.pt`` and export read a host-cached collection as a plain one, and a state dict
loads into any cache size. :meth:`~pipeline.modules.collection.EmbeddingCollection.table_views` of a
cached table are its host tensors, its cache emptied (after a write-back) so that what is written
into them is what the next lookup reads.

Example::

    ec = HostCachedCollection.from_collection(model.embedding, {"t_C3": 100_000}).to("cuda")
    pooled = ec(kjt)                       # t_C3's rows of kjt prefetched into its cache, then looked up
    ec.cache_stats()["t_C3"].hit_rate      # the share of the training batches' rows found in the cache
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pipeline.errors import UserError
from pipeline.kernels.embedding import TablePacking
from pipeline.modules.collection import EmbeddingCollection, flat_views
from pipeline.modules.configs import WEIGHT_DTYPES, EmbeddingOptimizerConfig, TableConfig
from pipeline.modules.host_cache import CacheStats, CacheTooSmall, RowCache
from pipeline.sparse import KeyedJaggedTensor


@dataclass
class Prefetched:
    """A batch whose rows :meth:`HostCachedCollection.prefetch` put in the caches: its bags, ids as slots."""

    indices: torch.Tensor
    offsets: torch.Tensor
    batch_size: int


class HostCachedCollection(EmbeddingCollection):
    """The tables of an :class:`EmbeddingCollection`, those in ``cache_rows`` (name -> device cache rows) in
    host memory behind a device cache. The other arguments, and the values drawn, are the plain
    collection's; :meth:`from_collection` copies an existing collection instead."""

    def __init__(self, tables: Sequence[TableConfig], feature_names: Sequence[str], cache_rows: dict[str, int],
                 optimizer: EmbeddingOptimizerConfig | None = None, weights_dtype: str = "fp32",
                 backend: str = "auto", init_scale: float | None = None, validate_ids: bool = True,
                 generator: torch.Generator | None = None) -> None:
        dynamic = [t.name for t in tables if t.dynamic]
        if dynamic:
            raise UserError(f"tables {sorted(cache_rows)} would be host-cached beside the dynamic tables "
                            f"{', '.join(dynamic)}, which a host-cached collection does not hold: give the tables room "
                            "in device memory (distributed.memory_per_rank_mb), or train on more ranks")
        super().__init__(tables, feature_names, optimizer, weights_dtype, backend, init_scale, validate_ids, generator)
        names = self.packing.table_names
        unknown = sorted(set(cache_rows) - set(names))
        if unknown:
            raise ValueError(f"cache_rows names tables {unknown} that the collection does not have; it has {names}")
        for name, slots in cache_rows.items():
            rows = self.packing.rows[names.index(name)]
            if not 1 <= slots <= rows:
                raise ValueError(f"table {name}: expected a cache of 1 to {rows} rows, got {slots}")
        # super() built every table whole, in host memory: those tensors become the host tables, and the
        # device tensors shrink to the other tables and the caches.
        self.host = self._storage()
        self.storage_packing = TablePacking.build(
            [dataclasses.replace(t, rows=cache_rows.get(t.name, t.rows)) for t in self.tables])
        per_row = self.packing.total_rows != self.packing.total_elements
        for key, full in self.host.items():
            size = self.storage_packing.total_rows if per_row and full.numel() == self.packing.total_rows \
                else self.storage_packing.total_elements
            setattr(self, _buffer(key), full.new_zeros(size))
        self.caches = nn.ModuleDict({name: RowCache(name, slots) for name, slots in cache_rows.items()})
        self._copy_resident(to_device=True)

    @classmethod
    def from_collection(cls, ec: EmbeddingCollection, cache_rows: dict[str, int]) -> HostCachedCollection:
        """``ec``'s tables and values (on ``ec``'s device), those in ``cache_rows`` host-cached."""
        dtype = {v: k for k, v in WEIGHT_DTYPES.items()}[ec.weights.dtype]
        out = cls(ec.tables, ec.feature_names, cache_rows, ec.optimizer, dtype, ec.backend_name,
                  validate_ids=ec.validate_ids, generator=torch.Generator())
        out.load_state_dict(ec.state_dict())
        out.set_lr(ec.lr)
        return out.to(ec.weights.device)

    def _storage(self) -> dict[str, torch.Tensor]:
        """The flat device tensors by view key: ``weight`` and each optimizer state."""
        return {"weight": self.weights, **self.optimizer_state()}

    def _views(self, name: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Cached table ``name``'s host tensors ``[rows, ...]`` and its cache's device tensors ``[slots, ...]``."""
        t = self.packing.table_names.index(name)
        return flat_views(self.packing, self.host, t), flat_views(self.storage_packing, self._storage(), t)

    def _copy_resident(self, to_device: bool) -> None:
        """The tables that are not cached, between the host tensors and the device ones."""
        storage = self._storage()
        with torch.no_grad():
            for t, name in enumerate(self.packing.table_names):
                if name in self.caches:
                    continue
                host, device = flat_views(self.packing, self.host, t), flat_views(self.storage_packing, storage, t)
                for key in host:
                    (device if to_device else host)[key].copy_((host if to_device else device)[key])

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        if self.weights.is_cuda and not self.host["weight"].is_pinned():
            self.host = {key: value.pin_memory() for key, value in self.host.items()}
        return out

    def cache_stats(self) -> dict[str, CacheStats]:
        """Each cached table's counts of its training batches' rows: looked up, found, evicted, written back."""
        return {name: cache.stats for name, cache in self.caches.items()}

    def table_views(self, name: str) -> dict[str, torch.Tensor]:
        if name not in self.caches:
            return super().table_views(name)
        host, device = self._views(name)
        self.caches[name].flush(host, device)
        self.caches[name].drop()
        return host

    def prefetch(self, features: KeyedJaggedTensor) -> Prefetched:
        """``features``' rows in the caches now, for their training lookup later (``self(prefetched)``), at
        most one batch ahead of the batch training."""
        indices, offsets, batch_size = self.slot_bags(features)
        return Prefetched(self._to_slots(indices, offsets, batch_size, training=True), offsets, batch_size)

    def forward(self, features: KeyedJaggedTensor | Prefetched) -> torch.Tensor:
        if isinstance(features, Prefetched):
            return self.lookup(features.indices, features.offsets, features.batch_size)
        return self._cached_lookup(*self.slot_bags(features), torch.is_grad_enabled() and self.training)

    def _cached_lookup(self, indices: torch.Tensor, offsets: torch.Tensor, batch_size: int,
                       training: bool) -> torch.Tensor:
        try:
            slots = self._to_slots(indices, offsets, batch_size, training)
        except CacheTooSmall:
            if training or batch_size < 2:
                raise
            half = batch_size // 2
            return torch.cat([self._cached_lookup(*_samples(indices, offsets, batch_size, lo, hi), hi - lo, False)
                              for lo, hi in ((0, half), (half, batch_size))])
        return self.lookup(slots, offsets, batch_size)

    def _to_slots(self, indices: torch.Tensor, offsets: torch.Tensor, batch_size: int,
                  training: bool) -> torch.Tensor:
        """``indices`` (slot-major bags) with every id of a cached table replaced by its cache slot."""
        if indices.numel() == 0:
            return indices
        counts = offsets[batch_size::batch_size] - offsets[:-1:batch_size]
        table_of_id = torch.repeat_interleave(self.packing.tensors(indices.device)["slot_table"], counts,
                                              output_size=indices.numel())
        out = indices.clone()
        for name, cache in self.caches.items():
            mine = (table_of_id == self.packing.table_names.index(name)).nonzero().squeeze(1)
            if mine.numel():
                out[mine] = cache.prefetch(indices[mine], *self._views(name), training)
        return out

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # The plain collection's state: every table whole, in the host tensors.
        for name, cache in self.caches.items():
            cache.flush(*self._views(name))
        self._copy_resident(to_device=False)
        for name, buf in self._buffers.items():
            if name not in self._non_persistent_buffers_set:
                value = self.host[_key(name)] if name != "step" else buf
                destination[prefix + name] = value if keep_vars else value.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        names = [name for name in self._buffers if name not in self._non_persistent_buffers_set]
        with torch.no_grad():
            for name in names:
                target = self.host[_key(name)] if name != "step" else self.step
                given = state_dict.get(prefix + name)
                if given is None:
                    missing_keys.append(prefix + name)
                elif given.shape != target.shape:
                    error_msgs.append(f"size mismatch for {prefix + name}: copying a tensor of shape "
                                      f"{tuple(given.shape)}, the collection's is {tuple(target.shape)}")
                else:
                    target.copy_(given)
        for cache in self.caches.values():
            cache.drop()
        self._copy_resident(to_device=True)
        if strict:
            unexpected_keys.extend(key for key in state_dict if key.startswith(prefix)
                                   and key[len(prefix):].split(".", 1)[0] not in (*names, *self._modules))

    def extra_repr(self) -> str:
        cached = ", ".join(f"{c.table}: {c.slots:,} of {self.packing.rows[self.packing.table_names.index(c.table)]:,}"
                           for c in self.caches.values())
        return f"host-cached tables (device cache rows of rows): {cached}"


def _buffer(key: str) -> str:
    return "weights" if key == "weight" else f"state_{key}"


def _key(buffer: str) -> str:
    return "weight" if buffer == "weights" else buffer[len("state_"):]


def _samples(indices: torch.Tensor, offsets: torch.Tensor, batch_size: int, lo: int,
             hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples ``lo..hi`` of slot-major bags: their ``(indices, offsets)``, slot-major."""
    device = offsets.device
    slots = (offsets.numel() - 1) // batch_size
    bags = (torch.arange(slots, device=device)[:, None] * batch_size + torch.arange(lo, hi, device=device)).reshape(-1)
    starts, lengths = offsets[bags], offsets[bags + 1] - offsets[bags]
    new_offsets = torch.zeros(bags.numel() + 1, dtype=offsets.dtype, device=device)
    torch.cumsum(lengths, 0, out=new_offsets[1:])
    n = int(new_offsets[-1])
    index = torch.repeat_interleave(starts - new_offsets[:-1], lengths, output_size=n) + torch.arange(n, device=device)
    return indices[index], new_offsets
