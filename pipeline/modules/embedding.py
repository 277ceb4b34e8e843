"""``EmbeddingCollection``: every embedding table of a model, pooled, with its optimizer fused in.

The collection turns a :class:`~pipeline.sparse.KeyedJaggedTensor` into one ``[B, sum of dims]``
tensor (the pooled bags of every *slot*, concatenated), and in the backward pass updates the touched
rows in place with its own sparse optimizer (SGD, row-wise Adagrad or lazy Adam), HugeCTR / FBGEMM
style: no dense gradient of the tables ever exists, and the dense optimizer never sees them.

Example::

    tables = [TableConfig("t_C1", 1000, 16, ["C1"]), TableConfig("t_C2", 50, 16, ["C2"], pooling="mean")]
    emb = EmbeddingCollection(tables, ["C1", "C2"], EmbeddingOptimizerConfig("adagrad", lr=0.05))
    pooled = emb(kjt)            # [B, 32]: C1's 16 columns, then C2's
    loss_fn(head(pooled)).backward()   # rows of t_C1 / t_C2 touched by kjt are updated here
    emb.set_lr(0.01)             # the training loop sets the lr every step

Slots
    A table serves one or more features (shared tables list several). A *slot* is one
    (table, feature) pair; the output columns are the slots in order: tables in the given order, and
    within a table its features in the listed order. One table per feature, given in feature order
    (what :func:`tables_from_schema` builds), makes the output the feature order.

The seam for compute backends (fused CUDA kernels, sharded collections)
    The model code never changes with the backend. A backend is an object with two methods, registered
    by name with :func:`register_backend` (``"torch"`` is the plain-torch reference below: the CPU path
    and the test oracle; ``pipeline.kernels`` registers ``"cuda"`` when a GPU is usable; ``"auto"``
    picks ``cuda`` when registered and usable for the device, else ``torch``)::

        forward(weights, layout, indices, offsets, batch_size) -> Tensor[B, layout.total_dim] float32
        backward_update(weights, state, layout, indices, offsets, batch_size,
                        grad_output, optimizer, lr, step) -> None

    Inputs, FBGEMM table-batched-embedding style:

    - ``weights``: ONE flat 1-D tensor (fp32, fp16 or bf16) holding every table. Table ``t`` is
      ``weights[layout.weights_offsets[t] : + rows[t] * dims[t]].view(rows[t], dims[t])``, row-major.
      Tables are stored grouped by dim (``layout.groups``) so a reference may view a whole group as
      one 2-D matrix; kernels only need ``weights_offsets``.
    - ``indices`` (int64): the *local* row ids (0 <= id < rows of the slot's table), slot-major: all
      bags of slot 0 for the batch, then slot 1, ...; ``offsets`` (int64, ``S * B + 1``) are the bag
      boundaries: bag ``s * B + b`` is ``indices[offsets[s*B+b] : offsets[s*B+b+1]]``. Ids were already
      checked against the table sizes by the collection (when ``validate_ids``).
    - ``layout`` (:class:`TableLayout`): per table ``rows``, ``dims``, ``weights_offsets`` (elements),
      ``row_offsets`` (rows before this table in storage order: the index into row-wise state);
      per slot ``slot_table``, ``slot_dims``, ``output_offsets`` (``S + 1`` column offsets, the
      D_offsets), ``slot_mean`` (True: mean pooling, else sum; an empty bag pools to zeros).
      Each exists as a Python list and as an int64 tensor on the weights' device
      (``layout.tensors(device)``).
    - forward returns float32 ``[B, total_dim]``, slot ``s`` in columns
      ``output_offsets[s] : output_offsets[s+1]``.
    - backward_update gets ``grad_output`` (``[B, total_dim]``, any float dtype), must sum the
      gradient of duplicate rows (over bags, slots and shared tables) and apply ``optimizer``
      (:class:`EmbeddingOptimizerConfig`) to the touched rows only, in place, at learning rate ``lr``
      (a float) and global step ``step`` (1 at the first update; Adam's bias correction uses it).
      ``state`` is a dict of flat fp32 tensors (see :meth:`EmbeddingOptimizerConfig.state_shapes`):
      ``adagrad``: ``momentum1`` [total rows] (mean of squared row gradients, summed over steps);
      ``adam``: ``momentum1`` and ``momentum2`` shaped like ``weights`` (first and second moments).
      ``master_weights`` (only with ``optimizer.master_weights`` and 16-bit weights): an fp32 copy
      shaped like ``weights``; the update reads and writes it, then rounds it into ``weights``.
      Rows are updated in fp32 and rounded to the weights' dtype (round to nearest, or at random
      when ``optimizer.stochastic_rounding``: the ``cuda`` backend does that; the reference refuses).

    The update rules (``g`` = the summed gradient of one row, ``D`` its dim), applied per touched row:

    - ``sgd``:     ``w -= lr * (g + weight_decay * w)``
    - ``adagrad``: ``g += weight_decay * w; m += sum(g*g) / D; w -= lr * g / (sqrt(m) + eps)``
    - ``adam``:    ``g += weight_decay * w; m1 = b1*m1 + (1-b1)*g; m2 = b2*m2 + (1-b2)*g*g;
      w -= lr * (m1 / (1 - b1**step)) / (sqrt(m2 / (1 - b2**step)) + eps)`` (lazy: untouched rows keep
      their moments; ``step`` is the collection's global step, as in TF's LazyAdam and FBGEMM).

Limits: one backward per forward (no gradient accumulation over micro-batches: each backward is one
optimizer step); the weights are buffers, not parameters, so ``model.parameters()`` is the dense part.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.errors import BadInputError
from pipeline.sparse import KeyedJaggedTensor

POOLINGS = ("sum", "mean")
OPTIMIZERS = ("sgd", "adagrad", "adam")
WEIGHT_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class TableConfig:
    """One embedding table: ``rows x dim``, serving the listed features (several: a shared table)."""

    name: str
    rows: int
    dim: int
    features: list[str]
    pooling: str = "sum"

    def __post_init__(self) -> None:
        if self.rows <= 0 or self.dim <= 0:
            raise ValueError(f"table {self.name}: rows and dim must be positive, got {self.rows} x {self.dim}")
        if not self.features:
            raise ValueError(f"table {self.name}: lists no features")
        if self.pooling not in POOLINGS:
            raise ValueError(f"table {self.name}: pooling must be one of {POOLINGS}, got {self.pooling!r}")


@dataclass
class EmbeddingOptimizerConfig:
    """The sparse optimizer fused into the backward pass (see the module docstring for the rules)."""

    kind: str = "adagrad"
    lr: float = 0.01
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0
    master_weights: bool = False
    """16-bit tables: keep an fp32 copy (state ``master_weights``), update it, round it into the table."""
    stochastic_rounding: bool = False
    """16-bit tables: round updated rows up or down at random, unbiased (the ``cuda`` backend only)."""

    def __post_init__(self) -> None:
        if self.kind not in OPTIMIZERS:
            raise ValueError(f"embedding optimizer: expected one of {OPTIMIZERS}, got {self.kind!r}")

    def state_shapes(self, total_rows: int, total_elements: int) -> dict[str, int]:
        """Name -> length of each flat fp32 state tensor this optimizer keeps."""
        if self.kind == "adagrad":
            return {"momentum1": total_rows}
        if self.kind == "adam":
            return {"momentum1": total_elements, "momentum2": total_elements}
        return {}


@dataclass
class DimGroup:
    """Tables of one dim, stored contiguously: ``weights[start : start + rows * dim].view(rows, dim)``."""

    dim: int
    start: int
    rows: int
    row_start: int
    slots: list[int]


def check_features(tables: Sequence[TableConfig], feature_names: Sequence[str]) -> None:
    """Every feature a table serves must be among the input features."""
    unknown = sorted({f for t in tables for f in t.features} - set(feature_names))
    if unknown:
        raise ValueError(f"tables serve features {unknown} that are not among the inputs {list(feature_names)}")


@dataclass
class TableLayout:
    """Where every table and slot lives in the flat storage and in the output (see the module docstring)."""

    table_names: list[str]
    rows: list[int]
    dims: list[int]
    weights_offsets: list[int]
    row_offsets: list[int]
    slot_table: list[int]
    slot_features: list[str]
    slot_dims: list[int]
    slot_mean: list[bool]
    output_offsets: list[int]
    groups: list[DimGroup]
    slot_group_row_base: list[int]
    """Per slot: the row of its table's row 0 within its dim group (for a group-wide 2-D view)."""
    _tensor_cache: dict = field(default_factory=dict, repr=False)

    @property
    def num_slots(self) -> int:
        return len(self.slot_table)

    @property
    def total_dim(self) -> int:
        return self.output_offsets[-1]

    @property
    def total_rows(self) -> int:
        return sum(self.rows)

    @property
    def total_elements(self) -> int:
        return sum(r * d for r, d in zip(self.rows, self.dims))

    def tensors(self, device: torch.device | str) -> dict[str, torch.Tensor]:
        """The per-table and per-slot lists as int64 tensors on ``device`` (cached)."""
        key = str(device)
        if key not in self._tensor_cache:
            names = ("rows", "dims", "weights_offsets", "row_offsets", "slot_table", "slot_dims", "output_offsets",
                     "slot_group_row_base")
            out = {n: torch.tensor(getattr(self, n), dtype=torch.int64, device=device) for n in names}
            out["slot_mean"] = torch.tensor(self.slot_mean, dtype=torch.bool, device=device)
            out["slot_rows"] = out["rows"][out["slot_table"]]
            self._tensor_cache[key] = out
        return self._tensor_cache[key]

    @classmethod
    def build(cls, tables: Sequence[TableConfig]) -> "TableLayout":
        order = sorted(range(len(tables)), key=lambda t: tables[t].dim)
        weights_offsets = [0] * len(tables)
        row_offsets = [0] * len(tables)
        group_row_of_table = [0] * len(tables)
        groups: list[DimGroup] = []
        elem = row = 0
        for t in order:
            dim = tables[t].dim
            if not groups or groups[-1].dim != dim:
                groups.append(DimGroup(dim, elem, 0, row, []))
            weights_offsets[t], row_offsets[t] = elem, row
            group_row_of_table[t] = groups[-1].rows
            groups[-1].rows += tables[t].rows
            elem += tables[t].rows * dim
            row += tables[t].rows
        slot_table, slot_features = [], []
        for t, table in enumerate(tables):
            for feature in table.features:
                slot_table.append(t)
                slot_features.append(feature)
        slot_dims = [tables[t].dim for t in slot_table]
        output_offsets = [0]
        for d in slot_dims:
            output_offsets.append(output_offsets[-1] + d)
        group_of_dim = {g.dim: g for g in groups}
        for s, d in enumerate(slot_dims):
            group_of_dim[d].slots.append(s)
        return cls(
            table_names=[t.name for t in tables],
            rows=[t.rows for t in tables],
            dims=[t.dim for t in tables],
            weights_offsets=weights_offsets,
            row_offsets=row_offsets,
            slot_table=slot_table,
            slot_features=slot_features,
            slot_dims=slot_dims,
            slot_mean=[tables[t].pooling == "mean" for t in slot_table],
            output_offsets=output_offsets,
            groups=groups,
            slot_group_row_base=[group_row_of_table[t] for t in slot_table],
        )


class EmbeddingBackend(Protocol):
    """What a compute backend implements (see "The seam" in the module docstring)."""

    name: str

    def forward(self, weights: torch.Tensor, layout: TableLayout, indices: torch.Tensor, offsets: torch.Tensor,
                batch_size: int) -> torch.Tensor: ...

    def backward_update(self, weights: torch.Tensor, state: dict[str, torch.Tensor], layout: TableLayout,
                        indices: torch.Tensor, offsets: torch.Tensor, batch_size: int, grad_output: torch.Tensor,
                        optimizer: EmbeddingOptimizerConfig, lr: float, step: int) -> None: ...


@dataclass
class _Registration:
    factory: Callable[[], EmbeddingBackend]
    usable: Callable[[torch.device, torch.dtype], bool]


_BACKENDS: dict[str, _Registration] = {}


def register_backend(name: str, factory: Callable[[], EmbeddingBackend],
                     usable: Callable[[torch.device, torch.dtype], bool] = lambda device, dtype: True) -> None:
    """Make a backend available by name; ``usable(device, weights_dtype)`` says where it can run.

    Example (what ``pipeline.kernels`` does on a GPU machine)::

        register_backend("cuda", CudaEmbeddingBackend, lambda device, dtype: device.type == "cuda")
    """
    _BACKENDS[name] = _Registration(factory, usable)


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def resolve_backend(name: str, device: torch.device | str, dtype: torch.dtype = torch.float32) -> EmbeddingBackend:
    """``torch`` | ``cuda`` | any registered name | ``auto`` (cuda when registered and usable, else torch)."""
    device = torch.device(device)
    if name == "auto":
        if "cuda" not in _BACKENDS and device.type == "cuda":
            _try_register_kernels()
        reg = _BACKENDS.get("cuda")
        name = "cuda" if reg is not None and reg.usable(device, dtype) else "torch"
    elif name not in _BACKENDS:
        _try_register_kernels()
    if name not in _BACKENDS:
        raise ValueError(f"embedding backend {name!r} is not registered; available: {available_backends()} or auto")
    reg = _BACKENDS[name]
    if not reg.usable(device, dtype):
        raise ValueError(f"embedding backend {name!r} cannot run on {device} with {dtype} weights")
    return reg.factory()


def _try_register_kernels() -> None:
    try:
        import pipeline.kernels  # noqa: F401  (registers "cuda" when a GPU is usable)
    except ImportError:
        pass


class TorchBackend:
    """The plain-torch reference: the CPU path and the oracle of every other backend.

    Forward is one ``F.embedding_bag`` (sum) per dim group over a 2-D view of the group's storage;
    backward sums duplicate rows with ``unique`` + ``scatter_add_`` and updates those rows only.
    """

    name = "torch"

    def forward(self, weights, layout, indices, offsets, batch_size):
        out_dtype = torch.float64 if weights.dtype == torch.float64 else torch.float32
        out = torch.empty(batch_size, layout.total_dim, dtype=out_dtype, device=weights.device)
        if batch_size == 0:
            return out
        for group in layout.groups:
            ids, bag_offsets = _group_bags(layout, group, indices, offsets, batch_size)
            table = _group_view(weights, group)
            if weights.dtype in (torch.float32, torch.float64):
                pooled = F.embedding_bag(ids, table, bag_offsets[:-1], mode="sum")
            else:
                bag_of_value = _bag_of_value(bag_offsets, ids.numel())
                pooled = torch.zeros(bag_offsets.numel() - 1, group.dim, dtype=torch.float32, device=weights.device)
                pooled.index_add_(0, bag_of_value, table.index_select(0, ids).float())
            pooled = _scale_mean(layout, group, pooled, bag_offsets, batch_size)
            _scatter_columns(out, layout, group, pooled.view(len(group.slots), batch_size, group.dim))
        return out

    def backward_update(self, weights, state, layout, indices, offsets, batch_size, grad_output, optimizer, lr, step):
        if optimizer.stochastic_rounding and weights.dtype in (torch.float16, torch.bfloat16):
            raise ValueError("stochastic rounding of 16-bit tables is done by the cuda backend only; "
                             "on the torch backend use master_weights=True (an fp32 copy) instead")
        if batch_size == 0:
            return
        grad_output = grad_output.float()
        for group in layout.groups:
            ids, bag_offsets = _group_bags(layout, group, indices, offsets, batch_size)
            if ids.numel() == 0:
                continue
            grad_bags = _gather_columns(grad_output, layout, group, batch_size)
            grad_bags = _scale_mean(layout, group, grad_bags, bag_offsets, batch_size)
            if ids.numel() == grad_bags.shape[0] and bool((bag_offsets[1:] - bag_offsets[:-1]).eq(1).all()):
                grad_values = grad_bags
            else:
                grad_values = grad_bags.index_select(0, _bag_of_value(bag_offsets, ids.numel()))
            table = _group_view(weights, group)
            if optimizer.kind == "sgd" and optimizer.weight_decay == 0 and weights.dtype == torch.float32:
                table.scatter_add_(0, _expand_rows(ids, group.dim), grad_values * -lr)
                continue
            rows, inverse = torch.unique(ids, return_inverse=True)
            grad = torch.zeros(rows.numel(), group.dim, dtype=torch.float32, device=weights.device)
            grad.scatter_add_(0, _expand_rows(inverse, group.dim), grad_values)
            _apply_rows(table, rows, grad, group, state, optimizer, lr, step)


def _expand_rows(rows: torch.Tensor, dim: int) -> torch.Tensor:
    # An expanded (stride-0) index takes scatter_add_'s sorted, vectorized path on CPU: faster than index_add_.
    return rows.unsqueeze(1).expand(-1, dim)


def _group_view(weights: torch.Tensor, group: DimGroup) -> torch.Tensor:
    return weights[group.start : group.start + group.rows * group.dim].view(group.rows, group.dim)


def _bag_of_value(bag_offsets: torch.Tensor, nnz: int) -> torch.Tensor:
    lengths = bag_offsets[1:] - bag_offsets[:-1]
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths, output_size=nnz)


def _group_bags(layout: TableLayout, group: DimGroup, indices: torch.Tensor, offsets: torch.Tensor,
                batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's bags (ids shifted to rows of the group's 2-D view) and their ``len(slots) * B + 1`` offsets."""
    b = batch_size
    tensors = layout.tensors(indices.device)
    if len(group.slots) == layout.num_slots:
        counts = offsets[b::b] - offsets[:-1:b]
        base = tensors["slot_group_row_base"]
        if not any(layout.slot_group_row_base):
            return indices, offsets
        return indices + torch.repeat_interleave(base, counts, output_size=indices.numel()), offsets
    pieces, piece_offsets, start = [], [offsets.new_zeros(1)], 0
    for s in group.slots:
        lo, hi = int(offsets[s * b]), int(offsets[(s + 1) * b])
        pieces.append(indices[lo:hi] + layout.slot_group_row_base[s])
        piece_offsets.append(offsets[s * b + 1 : (s + 1) * b + 1] - lo + start)
        start += hi - lo
    return torch.cat(pieces), torch.cat(piece_offsets)


def _scale_mean(layout: TableLayout, group: DimGroup, pooled: torch.Tensor, bag_offsets: torch.Tensor,
                batch_size: int) -> torch.Tensor:
    means = [layout.slot_mean[s] for s in group.slots]
    if not any(means):
        return pooled
    lengths = (bag_offsets[1:] - bag_offsets[:-1]).view(len(group.slots), batch_size).to(pooled.dtype)
    is_mean = torch.tensor(means, device=pooled.device).unsqueeze(1)
    scale = torch.where(is_mean, 1.0 / lengths.clamp(min=1), torch.ones_like(lengths))
    return pooled * scale.view(-1, 1)


def _contiguous_columns(layout: TableLayout, group: DimGroup) -> tuple[int, int] | None:
    slots = group.slots
    if slots == list(range(slots[0], slots[-1] + 1)):
        return layout.output_offsets[slots[0]], layout.output_offsets[slots[-1] + 1]
    return None


def _scatter_columns(out: torch.Tensor, layout: TableLayout, group: DimGroup, pooled: torch.Tensor) -> None:
    span = _contiguous_columns(layout, group)
    if span is not None:
        out[:, span[0] : span[1]].view(out.shape[0], len(group.slots), group.dim).copy_(pooled.transpose(0, 1))
        return
    for i, s in enumerate(group.slots):
        out[:, layout.output_offsets[s] : layout.output_offsets[s + 1]] = pooled[i]


def _gather_columns(grad: torch.Tensor, layout: TableLayout, group: DimGroup, batch_size: int) -> torch.Tensor:
    span = _contiguous_columns(layout, group)
    if span is not None:
        block = grad[:, span[0] : span[1]].reshape(batch_size, len(group.slots), group.dim)
        return block.transpose(0, 1).reshape(-1, group.dim)
    return torch.cat([grad[:, layout.output_offsets[s] : layout.output_offsets[s + 1]] for s in group.slots])


def _apply_rows(table: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor, group: DimGroup,
                state: dict[str, torch.Tensor], opt: EmbeddingOptimizerConfig, lr: float, step: int) -> None:
    master = _group_view(state["master_weights"], group) if "master_weights" in state else None
    w = (master if master is not None else table).index_select(0, rows).float()
    if opt.weight_decay:
        grad = grad + opt.weight_decay * w
    if opt.kind == "sgd":
        w -= lr * grad
    elif opt.kind == "adagrad":
        m = state["momentum1"][group.row_start : group.row_start + group.rows]
        m_rows = m.index_select(0, rows) + grad.pow(2).mean(1)
        m.index_copy_(0, rows, m_rows)
        w -= lr * grad / (m_rows.sqrt().unsqueeze(1) + opt.eps)
    else:
        m1 = _group_view(state["momentum1"], group)
        m2 = _group_view(state["momentum2"], group)
        m1_rows = m1.index_select(0, rows).mul_(opt.beta1).add_(grad, alpha=1 - opt.beta1)
        m2_rows = m2.index_select(0, rows).mul_(opt.beta2).addcmul_(grad, grad, value=1 - opt.beta2)
        m1.index_copy_(0, rows, m1_rows)
        m2.index_copy_(0, rows, m2_rows)
        m1_hat = m1_rows / (1 - opt.beta1**step)
        m2_hat = m2_rows / (1 - opt.beta2**step)
        w -= lr * m1_hat / (m2_hat.sqrt() + opt.eps)
    if master is not None:
        master.index_copy_(0, rows, w)
    table.index_copy_(0, rows, w.to(table.dtype))


register_backend("torch", TorchBackend)


class _PooledLookup(torch.autograd.Function):
    """Forward: the backend's pooled concat. Backward: the backend's fused sparse update; no gradient flows."""

    @staticmethod
    def forward(ctx, trigger, collection, indices, offsets, batch_size):  # noqa: ARG004
        ctx.collection = collection
        ctx.batch_size = batch_size
        ctx.save_for_backward(indices, offsets)
        return collection.backend.forward(collection.weights, collection.layout, indices, offsets, batch_size)

    @staticmethod
    def backward(ctx, grad_output):
        indices, offsets = ctx.saved_tensors
        ctx.collection._update(indices, offsets, ctx.batch_size, grad_output)
        return None, None, None, None, None


class EmbeddingCollection(nn.Module):
    """All embedding tables of a model: ``kjt -> [B, sum of slot dims]``, optimizer fused in backward.

    ``feature_names`` is the key order of the incoming KeyedJaggedTensor (the schema's sparse order).
    ``weights_dtype``: ``fp32`` | ``fp16`` | ``bf16``. ``backend``: ``torch`` | ``cuda`` | ``auto``,
    resolved for the weights' device on first use (and again after ``.to(device)``).
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
        self.layout = TableLayout.build(self.tables)
        self.optimizer = optimizer or EmbeddingOptimizerConfig()
        self.lr = self.optimizer.lr
        self.backend_name = backend
        self.validate_ids = validate_ids
        self._backend: EmbeddingBackend | None = None
        self._backend_key: tuple | None = None
        self._key_of_slot = [self.feature_names.index(f) for f in self.layout.slot_features]
        self._identity_slots = self._key_of_slot == list(range(len(self.feature_names)))

        weights = torch.empty(self.layout.total_elements, dtype=torch.float32)
        for t, table in enumerate(self.tables):
            bound = init_scale if init_scale is not None else table.rows ** -0.5
            start = self.layout.weights_offsets[t]
            weights[start : start + table.rows * table.dim].uniform_(-bound, bound, generator=generator)
        self.register_buffer("weights", weights.to(WEIGHT_DTYPES[weights_dtype]))
        if self.optimizer.master_weights and weights_dtype != "fp32":
            self.register_buffer("state_master_weights", weights)
        for name, size in self.optimizer.state_shapes(self.layout.total_rows, self.layout.total_elements).items():
            self.register_buffer(f"state_{name}", torch.zeros(size, dtype=torch.float32))
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))
        self._host_step: int | None = None
        self.register_load_state_dict_post_hook(lambda module, keys: setattr(module, "_host_step", None))

    @property
    def output_dim(self) -> int:
        return self.layout.total_dim

    @property
    def backend(self) -> EmbeddingBackend:
        key = (self.backend_name, self.weights.device, self.weights.dtype)
        if self._backend is None or self._backend_key != key:
            self._backend = resolve_backend(self.backend_name, self.weights.device, self.weights.dtype)
            self._backend_key = key
        return self._backend

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        return {name[len("state_"):]: buf for name, buf in self.named_buffers() if name.startswith("state_")}

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next sparse update (the training loop calls this every step)."""
        self.lr = float(lr)

    def table_weight(self, name: str) -> torch.Tensor:
        """Table ``name`` as a ``[rows, dim]`` view of the flat storage (for export and tests)."""
        t = self.layout.table_names.index(name)
        start = self.layout.weights_offsets[t]
        return self.weights[start : start + self.layout.rows[t] * self.layout.dims[t]].view(
            self.layout.rows[t], self.layout.dims[t])

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        indices, offsets, batch_size = self._slot_bags(features)
        if torch.is_grad_enabled() and self.training:
            trigger = torch.empty(0, device=self.weights.device, requires_grad=True)
            return _PooledLookup.apply(trigger, self, indices, offsets, batch_size)
        return self.backend.forward(self.weights, self.layout, indices, offsets, batch_size)

    def _update(self, indices: torch.Tensor, offsets: torch.Tensor, batch_size: int, grad_output: torch.Tensor) -> None:
        if self._host_step is None:  # read the device counter once, then mirror it: no sync per step
            self._host_step = int(self.step)
        self._host_step += 1
        self.step += 1
        self.backend.backward_update(self.weights, self.optimizer_state(), self.layout, indices, offsets, batch_size,
                                     grad_output, self.optimizer, self.lr, self._host_step)

    def _slot_bags(self, kjt: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        if kjt.keys != self.feature_names:
            raise BadInputError(f"expected sparse features {self.feature_names} in this order, got {kjt.keys}")
        b = kjt.batch_size
        values = kjt.values.to(device=self.weights.device, dtype=torch.int64)
        offsets = kjt.offsets().to(self.weights.device)
        if not self._identity_slots:
            values, offsets = _select_keys(values, offsets, b, self._key_of_slot)
        if self.validate_ids and values.numel():
            self._check_ids(values, offsets, b)
        return values, offsets, b

    def _check_ids(self, values: torch.Tensor, offsets: torch.Tensor, batch_size: int) -> None:
        slot_rows = self.layout.tensors(values.device)["slot_rows"]
        counts = offsets[batch_size::batch_size] - offsets[:-1:batch_size] if batch_size else None
        limit = torch.repeat_interleave(slot_rows, counts, output_size=values.numel())
        bad = (values < 0) | (values >= limit)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            s = int(torch.searchsorted(offsets[::batch_size].contiguous(), torch.tensor(i, device=offsets.device), right=True)) - 1
            table = self.layout.slot_table[s]
            raise BadInputError(
                f"feature {self.layout.slot_features[s]}: id {int(values[i])} is outside table "
                f"{self.layout.table_names[table]} (expected 0 <= id < {self.layout.rows[table]})"
            )


def _select_keys(values: torch.Tensor, offsets: torch.Tensor, batch_size: int,
                 keys: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Bags of ``keys`` (repeats allowed), in that order, from key-major ``values`` / ``offsets``."""
    b = batch_size
    pieces, piece_offsets, start = [], [offsets.new_zeros(1)], 0
    for k in keys:
        lo, hi = int(offsets[k * b]), int(offsets[(k + 1) * b])
        pieces.append(values[lo:hi])
        piece_offsets.append(offsets[k * b + 1 : (k + 1) * b + 1] - lo + start)
        start += hi - lo
    return torch.cat(pieces), torch.cat(piece_offsets)


def tables_from_schema(schema, dim: int, pooling: str = "sum", shared: dict[str, list[str]] | None = None,
                       dims: dict[str, int] | None = None, prefix: str = "t_") -> list[TableConfig]:
    """One table per sparse feature of ``schema`` (in feature order), sized by its cardinality.

    ``shared`` maps a table name to the features it serves (sized by the largest cardinality);
    ``dims`` overrides the dim per feature; multi-hot features use ``pooling``.

    Example::

        tables_from_schema(Schema.load(cfg.paths.schema), dim=16)
    """
    cards = schema.cardinalities()
    multihot = set(schema.multihot)
    shared = shared or {}
    dims = dims or {}
    in_shared = {f: name for name, feats in shared.items() for f in feats}
    tables, done = [], set()
    for feature in schema.sparse:
        if feature in in_shared:
            name = in_shared[feature]
            if name in done:
                continue
            feats = shared[name]
            done.add(name)
            tables.append(TableConfig(name, max(cards[f] for f in feats), dims.get(feature, dim), list(feats),
                                      pooling if any(f in multihot for f in feats) else "sum"))
        else:
            tables.append(TableConfig(f"{prefix}{feature}", cards[feature], dims.get(feature, dim), [feature],
                                      pooling if feature in multihot else "sum"))
    return tables
