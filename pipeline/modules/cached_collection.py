"""``HostCachedCollection``: an EmbeddingCollection some of whose tables live in host memory behind device caches.

Each table named in ``cache_rows`` keeps every row and its optimizer state in host memory and that many
rows, with their state, on the device, in the caches that one
:class:`~pipeline.modules.host_cache.RowCache` keeps the books of (segmented LRU out, dirty rows
written back); the other tables stay whole on the device, as in the plain collection. A batch's lookup
first maps the ids of the cached tables to cache slots, then runs the collection's own lookup and fused
update on the device tensors with those slots for ids, so a training step reads and writes device
memory only. The values are those of the plain collection: the same rows, updated by the same code.

A batch's prefetch (:meth:`HostCachedCollection.prefetch`, or the start of its lookup), for all the
cached tables at once, on a GPU on a side stream of its own:

1. each id of a cached table named by its global row; :meth:`RowCache.place` finds the batch's rows and
   picks the slots of the missing ones, on the device;
2. on the CPU, and on a GPU whose kernels can address page-locked host memory (:mod:`pipeline.kernels.host_rows`:
   the host tables are page-locked where they lie and mapped for the GPU once), the rows move without the host:
   the dirty rows of the slots the missing rows take are written into the host tables, then the missing rows read
   into their slots, each row crossing the bus once, every copy taking its size and each table's range from the
   device, on a stream of their own (:meth:`SideStream.beside`), queued once the books (step 4) are done, so that
   the next batch's books run beside these copies and its copies follow them at once. A training batch's counts
   are never read back in the step: the host does not wait at all. A batch that
   does not fit its caches moves nothing and is reported, as :class:`~pipeline.modules.host_cache.CacheTooSmall`,
   once the host has the copy of its overflow flags (at a later batch's prefetch, or at once on the CPU; a flush,
   a state dict or the stats wait for it), the training since then void;
3. elsewhere, and for a lookup outside training: **host wait 1**, the per-table counts read back (missing rows,
   free slots, distinct rows, evictions, write-backs); a batch that does not fit raises
   :class:`~pipeline.modules.host_cache.CacheTooSmall` here, before anything changed. Where the rows cannot move
   directly, the missing rows' numbers are copied to the host, the dirty rows of the slots they take gathered on
   the device and copied to pinned host memory (one copy per tensor for all the tables, which the next batch's
   wait 1 or a flush writes into the host tables), then **host wait 2**: the host gathers the missing rows and
   their state into pinned memory, and one copy per tensor sends them to the device, where they are scattered
   into their slots;
4. the index, the eviction order, the dirty slots and the stats are updated (:meth:`RowCache.commit`) and each
   id gets its slot. On a GPU the books (:meth:`RowCache.place`, :meth:`Placement.moves`, :meth:`RowCache.commit`)
   run compiled: their many small operations fuse into a few kernels, which the host launches in a fraction of
   the time.

The copies are asynchronous and run on the side stream or the one beside it; a host wait is for an event of
those streams only, never for the compute stream, and is the only read of the device: no ``.item()``,
``.tolist()`` of a device tensor, ``nonzero`` or boolean-mask indexing, ``unique`` or other op whose output size
depends on the data runs in a step (flushes, state dicts, stats and the halving of an evaluation batch that does
not fit may read more). The compute stream waits for both streams' work before the batch's lookup. On the CPU
the same code runs on one stream.

When the prefetch runs: at the start of each batch's lookup, after the previous batch's backward updated its rows,
the side stream first waiting for all the compute stream's work. Or one batch ahead (``prefetch(kjt,
after=event)``, ``self(prefetched)`` looks it up later), while the batch before computes: a prefetch never evicts
the rows of the training batch prefetched before it, whose update may still be pending, and its side stream waits
only for ``after``, an event of the compute stream after which the batch's ids are ready and every earlier batch's
update is queued (:class:`~pipeline.distributed.train_pipeline.PrefetchPipeline` records it), so the host waits and
copies overlap the batch before; given ``inputs``, an earlier event after which the ids are ready, the books wait
only for that one and the copies for ``after`` (the pipeline queues the next batch's prefetch so, before the step
before it). A training batch's distinct rows of a table, with those of the batch before, must fit its cache (else
:class:`~pipeline.modules.host_cache.CacheTooSmall`); a lookup outside training that does not fit is looked up in
halves of its samples.

The state dict is the plain collection's (every table whole, dirty rows written back first), so
checkpoints, ``model.pt`` and export read a host-cached collection as a plain one, and a state dict
loads into any cache size. :meth:`~pipeline.modules.collection.EmbeddingCollection.table_views` of a
cached table are its host tensors, the caches emptied (after a write-back) so that what is written
into them is what the next lookup reads.

Example::

    ec = HostCachedCollection.from_collection(model.embedding, {"t_C3": 100_000}).to("cuda")
    pooled = ec(kjt)                       # t_C3's rows of kjt prefetched into its cache, then looked up
    ec.cache_stats()["t_C3"].hit_rate      # the share of the training batches' rows found in the cache
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from pipeline.errors import UserError
from pipeline.kernels.embedding import TablePacking
from pipeline.kernels.host_rows import copy_rows, map_to_device, rows_movable
from pipeline.modules.collection import EmbeddingCollection, Prefetched, flat_views
from pipeline.modules.configs import WEIGHT_DTYPES, EmbeddingOptimizerConfig, TableConfig
from pipeline.modules.host_cache import NO_ROW, CachedTable, CacheStats, CacheTooSmall, RowCache
from pipeline.modules.side_stream import SideStream
from pipeline.sparse import KeyedJaggedTensor


@dataclass
class _WrittenBack:
    """Rows on their way from the caches to the host tables: their global rows and values (host memory), and
    the range of them in each dim group (``(group, lo, hi)``)."""

    rows: torch.Tensor
    values: dict[str, torch.Tensor]
    groups: list[tuple[int, int, int]]


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
                            f"{', '.join(dynamic)}, which a host-cached collection does not hold: remove their host_cached "
                            "pins from distributed.sharding, or give the tables room in device memory "
                            "(distributed.memory_per_rank_mb), or train on more ranks")
        super().__init__(tables, feature_names, optimizer, weights_dtype, backend, init_scale, validate_ids, generator)
        names = self.packing.table_names
        unknown = sorted(set(cache_rows) - set(names))
        if unknown:
            raise ValueError(f"cache_rows names tables {unknown} that the collection does not have; it has {names}")
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
        self.cache = RowCache([CachedTable(name, self.packing.rows[names.index(name)], slots,
                                           self.packing.row_offsets[names.index(name)])
                               for name, slots in cache_rows.items()])
        cached = [names.index(name) for name in self.cache.names]
        self._cached = set(cached)
        group_of_dim = {g.dim: i for i, g in enumerate(self.packing.groups)}
        self.groups = [group_of_dim[self.packing.dims[t]] for t in cached]
        """The dim group of each cached table (in the caches' order, which groups them)."""
        first_row, first_slot = [-1] * len(names), [0] * len(names)
        storage_row = []
        for c, t in enumerate(cached):
            first_row[t], first_slot[t] = self.packing.row_offsets[t], self.cache.slot_bounds[c]
            group = self.storage_packing.groups[self.groups[c]]
            storage_row.append(self.storage_packing.row_offsets[t] - self.cache.slot_bounds[c] - group.row_start)
        self.register_buffer("first_row", torch.tensor(first_row), persistent=False)
        self.register_buffer("first_slot", torch.tensor(first_slot), persistent=False)
        self.register_buffer("slot_group_row", torch.tensor(storage_row), persistent=False)
        spans = {}
        for c, group in enumerate(self.groups):
            spans[group] = (spans.get(group, (c, c))[0], c + 1)
        self.spans = list(spans.items())
        """``(group, (first, end))``: each dim group's cached tables, ``first`` to ``end - 1`` in the caches' order
        (which groups them)."""
        self.register_buffer("group_spans", torch.tensor([span for _, span in self.spans]), persistent=False)
        """:attr:`spans`' ``(first, end)`` on the device."""
        self._copy_resident(to_device=True)
        # The books are made on the compute stream, used and replaced on the side stream.
        self.side = SideStream(replaced=self.cache.buffers)
        self._written_back: _WrittenBack | None = None
        self._mapped: bool | None = None  # see _rows_move_directly
        self._overflow: tuple[torch.Tensor, torch.cuda.Event | None] | None = None  # see _check_overflow

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

    def _cache_rows(self) -> dict[str, torch.Tensor]:
        """:meth:`_storage` for the moves of rows in and out of the caches: the same memory, outside autograd's
        count of changes. A batch prefetched during a step moves rows of tensors that the step's lookup saved for
        its backward, never the rows that lookup reads (the slots of the batch before are spared), so the backward
        must not refuse them as changed."""
        return {key: flat.data for key, flat in self._storage().items()}

    def _copy_resident(self, to_device: bool) -> None:
        """The tables that are not cached, between the host tensors and the device ones."""
        storage = self._storage()
        with torch.no_grad():
            for t, name in enumerate(self.packing.table_names):
                if t in self._cached:
                    continue
                host, device = flat_views(self.packing, self.host, t), flat_views(self.storage_packing, storage, t)
                for key in host:
                    (device if to_device else host)[key].copy_((host if to_device else device)[key])

    def _apply(self, fn, recurse=True):
        self._mapped = None
        return super()._apply(fn, recurse)

    @property
    def prefetches(self) -> bool:
        """Always: a batch's rows move into the caches ahead of its lookup."""
        return True

    @property
    def prefetches_during_step(self) -> bool:
        """Always: a prefetch moves rows between the host tables and the caches, whose values a state dict (after a
        flush), an evaluation and an export read alike, so it may run before the step before it is queued."""
        return True

    def cache_stats(self) -> dict[str, CacheStats]:
        """Each cached table's counts of its training batches' rows: looked up, found, evicted, written back."""
        self._check_overflow(wait=True)
        return self.cache.stats

    def table_views(self, name: str) -> dict[str, torch.Tensor]:
        if name not in self.cache.names:
            return super().table_views(name)
        self._flush()
        self._drop()
        return flat_views(self.packing, self.host, self.packing.table_names.index(name))

    def prefetch(self, features: KeyedJaggedTensor, after: torch.cuda.Event | None = None,
                 inputs: torch.cuda.Event | None = None) -> Prefetched:
        """``features``' rows in the caches now, for their training lookup later (``self(prefetched)``), at
        most one batch ahead of the batch training. ``after``: on a GPU, an event of the compute stream after
        which ``features`` are ready and every batch before the one prefetched last is queued (default: all
        the compute stream's work queued so far). ``inputs``: an earlier event after which ``features`` are
        ready: where the rows move directly, the books wait only for it, and the copies, which read and write
        rows that the steps before use, for ``after``. The compute stream does not wait for the prefetch: the
        lookup does (:attr:`Prefetched.ready`), so it may be queued before the step before it."""
        inputs = inputs if self._rows_move_directly() else None  # else the books copy rows themselves
        with self.side.run(self.weights.device, after, join=False, inputs=inputs) as ready:
            self.side.uses(features.values, features.lengths, features.offsets())
            indices, offsets, batch_size = self.slot_bags(features)
            slots = self._to_slots(indices, offsets, batch_size, True)
        return Prefetched(*self.side.hand_over(slots, offsets), batch_size, self._generation, ready=tuple(ready))

    def forward(self, features: KeyedJaggedTensor | Prefetched) -> torch.Tensor:
        if isinstance(features, Prefetched):
            return super().forward(features)
        return self._cached_lookup(*self.slot_bags(features), torch.is_grad_enabled() and self.training)

    def _cached_lookup(self, indices: torch.Tensor, offsets: torch.Tensor, batch_size: int,
                       training: bool) -> torch.Tensor:
        try:
            with self.side.run(self.weights.device, None):
                slots = self._to_slots(indices, offsets, batch_size, training)
        except CacheTooSmall:
            if training or batch_size < 2:
                raise
            half = batch_size // 2
            return torch.cat([self._cached_lookup(*_samples(indices, offsets, batch_size, lo, hi), hi - lo, False)
                              for lo, hi in ((0, half), (half, batch_size))])
        pooled = self.lookup(self.side.hand_over(slots)[0], offsets, batch_size)
        self.side.follow(self.weights.device)  # a later prefetch's slots may take this lookup's rows
        return pooled

    def _to_slots(self, indices: torch.Tensor, offsets: torch.Tensor, batch_size: int, training: bool) -> torch.Tensor:
        """``indices`` (slot-major bags) with every id of a cached table replaced by its cache slot (see the
        module for the steps), on the side stream (:attr:`side`)."""
        if indices.numel() == 0:
            return indices
        self._check_overflow(wait=False)
        with torch.no_grad():
            counts = offsets[batch_size::batch_size] - offsets[:-1:batch_size]
            table = torch.repeat_interleave(self.packing.tensors(indices.device)["slot_table"], counts,
                                            output_size=indices.numel())
            first_row = self.first_row[table]
            placement = self.cache.place(torch.where(first_row >= 0, first_row + indices, NO_ROW))
            direct = self._rows_move_directly()
            if training and direct:
                moves = placement.moves()  # no host wait: the copies take their sizes from the device
            else:
                by_table = self.side.read(placement.counts, "counts").tolist()  # the host waits
                self.cache.admit(by_table)
                self._finish_write_back()
                moves = placement.moves(sum(by_table[0]), sum(by_table[4]))
            if direct:
                written_back = moves.written_back_slots
                rows = torch.where(written_back >= 0, self.cache.index.rows_of(written_back.clamp(min=0)), NO_ROW)
            elif moves.victims.numel():
                missing_rows = self.side.read(moves.missing_rows, "missing rows", wait=False)
                arrived = self.side.event(self.weights.device)
                if moves.written_back_slots.numel():
                    self._start_write_back(moves.written_back_slots, by_table[4])
                self.side.wait(arrived)  # the host waits
                self._copy_in(missing_rows, moves.victims, by_table[0])
            self.cache.commit(placement, moves, training)
            if training and direct:
                self._overflow = (self.side.read(self.cache.overflow, "overflow", wait=False),
                                  self.side.event(self.weights.device))
                self._check_overflow(wait=False)
            slots = placement.slot[placement.inverse.clamp(min=0)] - self.first_slot[table]
            if direct:
                # Queued after the books, on a stream of their own: the next batch's books then run beside these
                # copies rather than after them, and its copies follow these at once.
                with self.side.beside(self.weights.device):
                    self.side.lend(written_back, rows, moves.victims, moves.missing_rows, moves.missing_ends,
                                   moves.written_back_ends)
                    self._move_rows(written_back, rows, moves.written_back_ends, to_host=True)
                    self._move_rows(moves.victims, moves.missing_rows, moves.missing_ends, to_host=False)
            return torch.where(first_row >= 0, slots, indices)

    def _check_overflow(self, wait: bool) -> None:
        """Raise :class:`CacheTooSmall` if a training batch committed without a host wait did not fit its cache, as
        far as the host has its copy of :attr:`RowCache.overflow` (``wait``: waiting for the last one)."""
        if self._overflow is None:
            return
        overflow, copied = self._overflow
        if copied is not None:
            if not (wait or copied.query()):
                return
            self.side.wait(copied)
        self._overflow = None
        self.cache.check_overflow(overflow.tolist())

    def _groups_of(self, by_table: list[int]) -> Iterator[tuple[int, int, int]]:
        """``(group, lo, hi)``: the range of each dim group's cached tables in rows counted ``by_table``."""
        lo = 0
        for group, (first, end) in self.spans:
            hi = lo + sum(by_table[first:end])
            if hi > lo:
                yield group, lo, hi
            lo = hi

    def _rows_move_directly(self) -> bool:
        """Rows move between the host tables and the caches with no host work (:meth:`_move_rows`): on the CPU, by
        indexing; on a GPU, where the host tables are page-locked and mapped for its kernels (once). Else they move
        through the host (:meth:`_copy_in`, :meth:`_start_write_back`)."""
        if self._mapped is None:
            device = self.weights.device
            self._mapped = device.type == "cpu" or all(
                rows_movable(_group_view(self.packing, flat, g)) for flat in self.host.values()
                for g in range(len(self.packing.groups))) and all(map_to_device(flat, device)
                                                                   for flat in self.host.values())
        return self._mapped

    def _move_rows(self, slots: torch.Tensor, rows: torch.Tensor, ends: torch.Tensor, to_host: bool) -> None:
        """Between the cache ``slots`` and the host tables' global ``rows`` (both by table, each table's part ending at
        ``ends``, on the device; padding after the last), every tensor (weight, each optimizer state), copied without
        the host (:mod:`pipeline.kernels.host_rows`): ``to_host`` writes the rows back, else the rows are brought into
        the slots. The rows go in the order of their host addresses (the missing ones come sorted; the written-back
        ones, in slot order, are sorted here, padding last): on the H200 sorted rows crossed the bus at 28 GB/s
        against 16 GB/s in random order. Sorting by global row keeps the tables' ranges, whose global rows are
        ascending too."""
        if not slots.numel():
            return
        if to_host:
            rows, order = torch.sort(rows)
            slots = slots[order]
        at = slots + self.slot_group_row[self.cache.slot_table[slots]]
        bounds = torch.cat([ends.new_zeros(1), ends])[self.group_spans]
        storage = self._cache_rows()
        for k, (g, _) in enumerate(self.spans):
            host_rows = rows - self.packing.groups[g].row_start
            for key, flat in storage.items():
                cache = _group_view(self.storage_packing, flat, g)
                host = _group_view(self.packing, self.host[key], g)
                if to_host:
                    copy_rows(host, host_rows, cache, at, bounds[k])
                else:
                    copy_rows(cache, at, host, host_rows, bounds[k])

    def _start_write_back(self, slots: torch.Tensor, by_table: list[int]) -> None:
        """Copy the rows of ``slots`` (by table, counted ``by_table``) and their global rows to host memory; the
        next :meth:`_finish_write_back` writes them into the host tables."""
        groups = list(self._groups_of(by_table))
        at = slots + self.slot_group_row[self.cache.slot_table[slots]]
        values = {}
        for key, flat in self._storage().items():
            parts = [_group_view(self.storage_packing, flat, g).index_select(0, at[lo:hi]) for g, lo, hi in groups]
            values[key] = self.side.read(torch.cat([p.reshape(-1) for p in parts]), f"written back {key}", wait=False)
        rows = self.side.read(self.cache.index.rows_of(slots), "written back rows", wait=False)
        self._written_back = _WrittenBack(rows, values, groups)

    def _finish_write_back(self) -> None:
        """The rows copied out by :meth:`_start_write_back`, now in host memory, into the host tables."""
        done, self._written_back = self._written_back, None
        if done is None:
            return
        rows = [done.rows[lo:hi] - self.packing.groups[g].row_start for g, lo, hi in done.groups]
        for key, flat in self.host.items():
            at = 0
            for (g, lo, hi), group_rows in zip(done.groups, rows):
                view = _group_view(self.packing, flat, g)
                part = done.values[key][at : at + (hi - lo) * view[0].numel()].view(hi - lo, *view.shape[1:])
                view.index_copy_(0, group_rows, part)
                at += part.numel()

    def _copy_in(self, rows: torch.Tensor, victims: torch.Tensor, by_table: list[int]) -> None:
        """The host tables' ``rows`` (on the host, by table, counted ``by_table``) into the cache slots ``victims``:
        gathered into pinned memory, one copy per tensor to the device, scattered there."""
        groups = list(self._groups_of(by_table))
        at = victims + self.slot_group_row[self.cache.slot_table[victims]]
        host_rows = [rows[lo:hi] - self.packing.groups[g].row_start for g, lo, hi in groups]
        cache_rows = self._cache_rows()
        for key, flat in self.host.items():
            views = [_group_view(self.packing, flat, g) for g, _, _ in groups]
            staged = self.side.host_buffer(f"missing {key}", sum(v[0].numel() * (hi - lo)
                                                                 for v, (_, lo, hi) in zip(views, groups)),
                                           flat.dtype, pinned=self.weights.is_cuda)
            start = 0
            for view, group_rows in zip(views, host_rows):
                part = staged[start : start + group_rows.numel() * view[0].numel()].view(-1, *view.shape[1:])
                torch.index_select(view, 0, group_rows, out=part)
                start += part.numel()
            arrived = staged.to(self.weights.device, non_blocking=True)
            storage = cache_rows[key]
            start = 0
            for g, lo, hi in groups:
                view = _group_view(self.storage_packing, storage, g)
                n = (hi - lo) * view[0].numel()
                view.index_copy_(0, at[lo:hi], arrived[start : start + n].view(hi - lo, *view.shape[1:]))
                start += n

    # Whole-cache operations: not per step.

    def _flush(self) -> None:
        """Every dirty row written back to the host tables (the rows stay in the caches, clean)."""
        self._check_overflow(wait=True)
        with self.side.run(self.weights.device, None), torch.no_grad():
            self.side.join(self.weights.device)
            self.side.wait(self.side.event(self.weights.device))
            self._finish_write_back()
            slots = self.cache.dirty_slots()
            if slots.numel():
                table = self.cache.slot_table[slots].cpu()
                by_table = torch.bincount(table, minlength=len(self.cache.tables)).tolist()
                self._start_write_back(slots, by_table)
                self.side.wait(self.side.event(self.weights.device))
                self._finish_write_back()
                self.cache.cleaned(slots)

    def _drop(self) -> None:
        """Every cache emptied, without writing back (prefetched batches not yet looked up are void)."""
        with self.side.run(self.weights.device, None):
            self._written_back = self._overflow = None
            self.cache.drop()
            self.side.join(self.weights.device)  # the host tables may be written next: no copy of the GPU's under way
            self.side.wait(self.side.event(self.weights.device))
        self._generation += 1

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # The plain collection's state: every table whole, in the host tensors.
        self._flush()
        self._copy_resident(to_device=False)
        for name, buf in self._buffers.items():
            if name not in self._non_persistent_buffers_set:
                value = self.host[_key(name)] if name != "step" else buf
                destination[prefix + name] = value if keep_vars else value.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        names = [name for name in self._buffers if name not in self._non_persistent_buffers_set]
        self._drop()
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
        self._copy_resident(to_device=True)
        if strict:
            unexpected_keys.extend(key for key in state_dict if key.startswith(prefix)
                                   and key[len(prefix):].split(".", 1)[0] not in (*names, *self._modules))

    def extra_repr(self) -> str:
        return f"host-cached tables (device cache rows of rows): {self.cache.extra_repr()}"


def _buffer(key: str) -> str:
    return "weights" if key == "weight" else f"state_{key}"


def _key(buffer: str) -> str:
    return "weight" if buffer == "weights" else buffer[len("state_"):]


def _group_view(packing: TablePacking, flat: torch.Tensor, g: int) -> torch.Tensor:
    """Dim group ``g``'s part of a flat tensor laid out by ``packing``: ``[rows, dim]``, or ``[rows]`` for
    per-row state."""
    group = packing.groups[g]
    if packing.total_rows != packing.total_elements and flat.numel() == packing.total_rows:
        return flat[group.row_start : group.row_start + group.rows]
    return flat[group.start : group.start + group.rows * group.dim].view(group.rows, group.dim)


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
