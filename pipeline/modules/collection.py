"""``EmbeddingCollection``: every embedding table of a model, pooled, with its optimizer fused in.

The collection turns a :class:`~pipeline.sparse.KeyedJaggedTensor` into one ``[B, sum of dims]``
tensor (the pooled bags of every *slot*, concatenated), and in the backward pass updates the touched
rows in place with its own sparse optimizer (SGD, row-wise Adagrad or lazy Adam), HugeCTR / FBGEMM
style: no dense gradient of the tables ever exists, and the dense optimizer never sees them. The
lookups and the update are ``pipeline::`` custom ops, so ``torch.compile`` traces the collection.

Example::

    tables = [TableConfig("t_C1", 1000, 16, ["C1"]), TableConfig("t_C2", 50, 16, ["C2"], pooling="mean")]
    emb = EmbeddingCollection(tables, ["C1", "C2"], EmbeddingOptimizerConfig("adagrad", lr=0.05))
    pooled = emb(kjt)            # [B, 32]: C1's 16 columns, then C2's
    loss_fn(head(pooled)).backward()   # rows of t_C1 / t_C2 touched by kjt are updated here
    emb.set_lr(0.01)             # the training loop sets the lr every step

With dynamic tables (:mod:`pipeline.modules.dynamic`), a training batch's ids may be placed a step ahead,
while the batch before computes: ``prefetched = emb.prefetch(kjt)``, then ``emb(prefetched)`` (the training
pipeline does it, :class:`~pipeline.distributed.train_pipeline.PrefetchPipeline`).

A *slot* is one (table, feature) pair; the output columns are the slots in order: tables in the
given order, and within a table its features in the listed order. The backend (``torch`` | ``cuda``
| ``auto``, see :mod:`pipeline.modules.backends`) never changes the model code; the contract and the
update rules are in ``docs/EMBEDDING.md``.

Limits: one backward per forward (no gradient accumulation over micro-batches: each backward is one
optimizer step); the weights are buffers, not parameters, so ``model.parameters()`` is the dense part.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from pipeline.errors import BadInputError
from pipeline.kernels.embedding import TablePacking
from pipeline.kernels.embedding.ops import check_ids
from pipeline.modules.backends import resolve_backend
from pipeline.modules.configs import WEIGHT_DTYPES, EmbeddingOptimizerConfig, TableConfig, check_features
from pipeline.modules.dynamic import DynamicTables, NewRows
from pipeline.modules.side_stream import SideStream
from pipeline.sparse import KeyedJaggedTensor


@dataclass
class Prefetched:
    """A batch whose lookup's work ahead :meth:`EmbeddingCollection.prefetch` did: its bags in slot order, ids as the
    rows they read, and what its lookup still does (start the new rows of dynamic tables, whose ``mean`` slots
    divide by the bags' ``lengths``)."""

    indices: torch.Tensor
    offsets: torch.Tensor
    batch_size: int
    generation: int
    lengths: torch.Tensor | None = None  # the batch's, key-major
    new_rows: list[NewRows] = field(default_factory=list)
    ready: tuple = ()  # on a GPU, the events of the prefetch's streams that its lookup waits for first

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Prefetched:
        """Itself: its ids are placed on the collection's device."""
        return self


INIT_CHUNK = 1 << 22
"""Elements filled by one task of :func:`uniform_init` (16 MiB of float32)."""


def uniform_init(fills: Sequence[tuple[torch.Tensor, float, int]]) -> None:
    """Fill each contiguous CPU tensor ``out`` of ``(out, bound, seed)`` with values drawn uniformly from
    ``[-bound, bound)``, on torch's CPU threads side by side: chunks of :data:`INIT_CHUNK` elements, each drawn by
    a generator of its own seeded by ``(seed, chunk)``, so the values do not depend on how many threads drew them
    (one generator over a table draws on one thread alone)."""
    chunks = [(out.view(-1)[start : start + INIT_CHUNK], bound, seed, k)
              for out, bound, seed in fills for k, start in enumerate(range(0, out.numel(), INIT_CHUNK))]

    def fill(chunk: tuple[torch.Tensor, float, int, int]) -> None:
        out, bound, seed, k = chunk
        generator = torch.Generator().manual_seed((seed * 1_000_003 + k) % 2**63)
        out.uniform_(-bound, bound, generator=generator)

    with ThreadPoolExecutor(max(1, min(torch.get_num_threads(), len(chunks)))) as pool:
        list(pool.map(fill, chunks))


class EmbeddingCollection(nn.Module):
    """All embedding tables of a model: ``kjt -> [B, sum of slot dims]``, optimizer fused in backward.

    ``feature_names`` is the key order of the incoming KeyedJaggedTensor (the schema's sparse order).
    ``weights_dtype``: ``fp32`` | ``fp16`` | ``bf16``. ``backend``: ``torch`` | ``cuda`` | ``auto``,
    resolved for the weights' device and dtype when built and after every ``.to()`` (a backend that
    cannot run there yet, ``cuda`` before ``.cuda()``, is resolved and refused on first use instead).
    ``validate_ids``: check every id against its table size (one vectorized comparison per batch) and
    raise :class:`~pipeline.errors.BadInputError` naming the feature and the value.
    """

    def __init__(self, tables: Sequence[TableConfig], feature_names: Sequence[str],
                 optimizer: EmbeddingOptimizerConfig | None = None, weights_dtype: str = "fp32",
                 backend: str = "auto", init_scale: float | None = None, validate_ids: bool = True,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        if weights_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weights_dtype: expected one of {list(WEIGHT_DTYPES)}, got {weights_dtype!r}")
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate table names: {names}")
        self.tables = list(tables)
        self.feature_names = list(feature_names)
        check_features(self.tables, self.feature_names)
        # The ops pool a dynamic table's bags as sums: ids without a row leave them, and a mean divides by
        # the whole bag after the lookup (pipeline.modules.dynamic).
        self.packing = TablePacking.build([replace(t, pooling="sum") if t.dynamic else t for t in self.tables])
        # The layout of the tensors the ops read (``weights``, ``state_*``): here the tables themselves; a
        # collection with host-cached tables (:mod:`pipeline.modules.cached_collection`) holds their caches.
        self.storage_packing = self.packing
        self.optimizer = optimizer or EmbeddingOptimizerConfig()
        self.lr = self.optimizer.lr
        self.backend_name = backend
        self.validate_ids = validate_ids
        self._backend = None
        self._backend_key: tuple | None = None
        self._key_of_slot = [self.feature_names.index(f) for f in self.packing.slot_features]
        self._identity_slots = self._key_of_slot == list(range(len(self.feature_names)))
        # Every feature in the same number of slots (a reordering, or DeepFM's deep and wide tables): the
        # slots hold that many times the batch's ids, a count known without reading the device.
        uses = [self._key_of_slot.count(k) for k in range(len(self.feature_names))]
        self._slot_repeats = uses[0] if uses and len(set(uses)) == 1 else 0
        self._slot_keys: dict[str, torch.Tensor] = {}

        weights = torch.empty(self.packing.total_elements, dtype=torch.float32)
        fills = []
        for t, table in enumerate(self.tables):
            start = self.packing.weights_offsets[t]
            rows = weights[start : start + table.rows * table.dim]
            if table.dynamic:  # its rows start as their ids come
                rows.zero_()
                continue
            bound = next(b for b in (init_scale, table.init_scale, table.rows ** -0.5) if b is not None)
            fills.append((rows, bound, int(torch.randint(0, 2**62, (1,), generator=generator))))
        uniform_init(fills)
        self.register_buffer("weights", weights.to(WEIGHT_DTYPES[weights_dtype]))
        if self.optimizer.master_weights and weights_dtype != "fp32":
            self.register_buffer("state_master_weights", weights)
        for name, size in self.optimizer.state_shapes(self.packing.total_rows, self.packing.total_elements).items():
            self.register_buffer(f"state_{name}", torch.zeros(size, dtype=torch.float32))
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))
        dynamic = [t for t in self.tables if t.dynamic]
        seeds = torch.randint(0, 2**62, (len(dynamic),), generator=generator).tolist() if dynamic else []
        self.dynamic = DynamicTables(dynamic, self.packing, self.feature_names, seeds) if dynamic else None
        # Host-side [lr, step, step known] the ops read without a device sync; the step is re-read from the
        # device counter after a checkpoint load. Plain attributes: not in the state dict, not moved by .to().
        self._hyper = torch.tensor([self.lr, 0.0, 0.0], dtype=torch.float64)
        self._trigger = torch.empty(0, requires_grad=True)  # makes autograd run the fused update in backward
        self._slot_names = ("\n".join(self.packing.slot_features),
                                   "\n".join(self.packing.table_names[t] for t in self.packing.slot_table))
        self.side = SideStream()  # where a batch's work ahead of its lookup runs (pipeline.modules.side_stream)
        self._generation = 0  # counts the state dicts loaded: a batch prefetched before one is void
        self.register_load_state_dict_post_hook(lambda module, keys: module._loaded())
        self._resolve_backend_if_usable()

    @property
    def output_dim(self) -> int:
        return self.packing.total_dim

    @property
    def backend(self):
        key = (self.backend_name, self.weights.device, self.weights.dtype)
        if self._backend is None or self._backend_key != key:
            self._backend = resolve_backend(self.backend_name, self.weights.device, self.weights.dtype)
            self._backend_key = key
        return self._backend

    def _apply(self, fn, recurse=True):
        # Resolve the backend for the new device and dtype now, outside any compiled region; one that
        # cannot run there yet (cuda before .cuda()) is resolved, and refused, on first use instead.
        out = super()._apply(fn, recurse)
        self._resolve_backend_if_usable()
        return out

    def _resolve_backend_if_usable(self) -> None:
        self.packing.tensors(self.weights.device)
        try:
            self.backend  # noqa: B018
        except ValueError:
            self._backend = None

    def _loaded(self) -> None:
        """After a state dict was loaded: the step is read again, batches prefetched before are void, and the side
        stream's next work waits for what the load wrote."""
        self._hyper[2] = 0.0
        self._generation += 1
        self.side.follow(self.weights.device)

    @property
    def prefetches(self) -> bool:
        """Whether :meth:`prefetch` does a batch's work ahead of its lookup (here: placing the ids of dynamic
        tables), so that a training pipeline runs it while the batch before trains."""
        return self.dynamic is not None

    @property
    def prefetches_during_step(self) -> bool:
        """Whether a training pipeline may prefetch the next batch while the step before is queued and runs: only
        where a prefetch changes nothing that a state dict, an evaluation or an export reads, since the loop may
        evaluate or save between the two steps (here: no, a dynamic table's placement admits ids)."""
        return False

    @property
    def generation(self) -> int:
        """Counts the state dicts loaded (and the caches emptied): a batch prefetched in another generation is void."""
        return self._generation

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        return {name[len("state_"):]: buf for name, buf in self.named_buffers() if name.startswith("state_")}

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next sparse update (the training loop calls this every step)."""
        self.lr = float(lr)
        self._hyper[0] = self.lr

    def table_weight(self, name: str) -> torch.Tensor:
        """Table ``name`` as a ``[rows, dim]`` view of its storage (for export and tests)."""
        return self.table_views(name)["weight"]

    def table_views(self, name: str) -> dict[str, torch.Tensor]:
        """Views of table ``name``: ``weight`` ``[rows, dim]`` and each optimizer state by row (what checkpoints
        read and write)."""
        t = self.packing.table_names.index(name)
        return flat_views(self.storage_packing, {"weight": self.weights, **self.optimizer_state()}, t)

    def forward(self, features: KeyedJaggedTensor | Prefetched) -> torch.Tensor:
        if not isinstance(features, Prefetched):
            features = self._placed(features, torch.is_grad_enabled() and self.training)
        elif features.generation != self._generation:
            raise RuntimeError("a batch prefetched before a state dict was loaded (or the caches of host-cached "
                               "tables emptied, their table views taken): prefetch it again")
        self.side.ready(self.weights.device, features.ready)
        pooled = self.lookup(*self._ready(features))
        return pooled if self.dynamic is None else self.dynamic.pool_means(pooled, features.lengths,
                                                                          features.batch_size)

    def prefetch(self, features: KeyedJaggedTensor, after: torch.cuda.Event | None = None) -> Prefetched:
        """``features``' ids placed in the dynamic tables now, for their training lookup later (``self(prefetched)``,
        once), at most one batch ahead of the batch training. ``after``: on a GPU, an event of the compute stream
        after which ``features`` are ready and every batch before the one prefetched last is queued (default: all
        the compute stream's work queued so far).

        Only the ids' placement runs here (on a GPU on the side stream, after ``after``): the hash tables change,
        the collection's rows do not. The rows of the ids placed anew are written at the lookup, on the compute
        stream, after the update of the batch before: that batch may have used the slot an id of this batch takes
        now (its id evicted here), and the new row must land after that update, never under it. The batch before
        reads and updates its slots as placed for it, which this placement does not move, so the rows and the
        hash tables end as they do with each batch placed at its lookup (see :mod:`pipeline.modules.dynamic`)."""
        return self._placed(features, True, after)

    def lookup(self, indices: torch.Tensor, offsets: torch.Tensor, batch_size: int) -> torch.Tensor:
        """The pooled bags of :meth:`slot_bags`' ``(indices, offsets, batch_size)``, ids of ``storage_packing``'s
        rows; in training, the fused update of those rows in backward, and under autocast the pooled rows in its
        dtype, as a linear layer's output would be (summed in fp32, rounded once: no cast reads them again)."""
        backend = self.backend
        if torch.is_grad_enabled() and self.training:
            state, opt = self.optimizer_state(), self.optimizer
            device_type = self.weights.device.type
            out_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) \
                else torch.float32
            return backend.lookup_op(
                self._trigger, self.weights, state.get("momentum1"), state.get("momentum2"),
                state.get("master_weights"), self.step, self._hyper, indices, offsets, batch_size,
                *self.storage_packing.op_args(), opt.kind, opt.eps, opt.beta1, opt.beta2, opt.weight_decay,
                backend.stochastic(opt), backend.seed, out_dtype)
        return backend.forward(self.weights, self.storage_packing, indices, offsets, batch_size)

    def slot_bags(self, kjt: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``(indices, offsets, batch_size)`` of ``kjt`` in slot order on the weights' device, ids checked
        when ``validate_ids``: what the backends take. The ids of dynamic tables become their slots (placed
        in training, as the update will follow, and the new rows started), those without a slot left out.
        ``kjt.length_per_key``, when given, saves reading the keys' sizes from the device."""
        return self._ready(self._placed(kjt, torch.is_grad_enabled() and self.training))

    def _placed(self, kjt: KeyedJaggedTensor, train: bool, after: torch.cuda.Event | None = None) -> Prefetched:
        """:meth:`slot_bags` of ``kjt`` but the start of new rows: with dynamic tables, their ids placed (``train``)
        or found on the side stream (after ``after``, or all the compute stream's work), the results handed over to
        the compute stream, which waits for them."""
        if kjt.keys != self.feature_names:
            raise BadInputError(f"expected sparse features {self.feature_names} in this order, got {kjt.keys}")
        b = kjt.batch_size
        device = self.weights.device
        new_rows: list[NewRows] = []
        with self.side.run(device, after) if self.dynamic is not None else contextlib.nullcontext():
            values = kjt.values.to(device=device, dtype=torch.int64)
            offsets = kjt.offsets().to(device)
            per_key = kjt.length_per_key
            slot_counts = [per_key[k] for k in self._key_of_slot] if per_key is not None else None
            if not self._identity_slots:
                if str(device) not in self._slot_keys:
                    self._slot_keys[str(device)] = torch.tensor(self._key_of_slot, dtype=torch.int64, device=device)
                size = self._slot_repeats * values.numel() if self._slot_repeats else \
                    sum(slot_counts) if slot_counts is not None else None
                values, offsets = _select_keys(values, offsets, b, self._slot_keys[str(device)], size)
            if self.dynamic is not None:
                values, offsets, new_rows = self.dynamic.place(values, offsets, b, train, slot_counts, self.side)
            if self.validate_ids and b:
                check_ids(values, offsets, b, self.packing.tensors(device)["slot_rows"], *self._slot_names)
        if self.dynamic is not None:
            self.side.hand_over(values, offsets, *(t for rows in new_rows for t in (rows.rows, rows.weights)))
        return Prefetched(values, offsets, b, self._generation, kjt.lengths, new_rows)

    def _ready(self, batch: Prefetched) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``batch``'s ``(indices, offsets, batch_size)`` for the lookup, its new rows started first (on the current
        stream, after the work queued on it before: the update of the batch before)."""
        if batch.new_rows:
            self.dynamic.start_rows(batch.new_rows, {"weight": self.weights, **self.optimizer_state()})
        return batch.indices, batch.offsets, batch.batch_size


def flat_views(packing: TablePacking, flat: dict[str, torch.Tensor], t: int) -> dict[str, torch.Tensor]:
    """Table ``t``'s part of each flat tensor laid out by ``packing`` (weights and per-element state:
    ``[rows, dim]``; per-row state: ``[rows]``)."""
    rows, dim = packing.rows[t], packing.dims[t]
    per_row = packing.total_rows != packing.total_elements
    out = {}
    for key, buf in flat.items():
        if per_row and buf.numel() == packing.total_rows:
            out[key] = buf[packing.row_offsets[t] : packing.row_offsets[t] + rows]
        else:
            start = packing.weights_offsets[t]
            out[key] = buf[start : start + rows * dim].view(rows, dim)
    return out


def _select_keys(values: torch.Tensor, offsets: torch.Tensor, batch_size: int, keys: torch.Tensor,
                 size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Bags of ``keys`` (int64 on the values' device, repeats allowed), in that order, from key-major
    ``values`` / ``offsets``, gathered on the device. ``size``: how many ids the keys select, when the
    caller knows it; else it is read from the device (one sync)."""
    b = batch_size
    if b == 0:
        return values[:0], offsets.new_zeros(1)
    starts = offsets[::b]  # where each key's ids begin, then the end
    key_starts = starts[keys]
    lengths = starts[1:][keys] - key_starts
    begins = torch.cumsum(lengths, 0) - lengths  # where each selected key's ids go
    if size is None:
        size = int(lengths.sum())
    piece = torch.repeat_interleave(torch.arange(keys.numel(), device=keys.device), lengths, output_size=size)
    index = torch.arange(size, device=keys.device) - begins[piece] + key_starts[piece]
    bag_ends = keys[:, None] * b + torch.arange(1, b + 1, device=keys.device)
    selected = offsets[bag_ends] - key_starts[:, None] + begins[:, None]
    return values.index_select(0, index), torch.cat([offsets.new_zeros(1), selected.flatten()])
