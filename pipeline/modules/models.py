"""CTR models built from the schema: DLRM, DCNv2, DeepFM, Wide&Deep, and logistic regression.

Every model is an embedding part and a dense part that can run apart (export serves them as two
Triton models)::

    pooled = model.embedding(batch.sparse)              # [B, embedding.output_dim]
    logits = model.dense_forward(batch.dense, pooled)   # [B]
    logits = model(batch.dense, batch.sparse)           # the same, in one call

Example::

    sizes = ModelSizes.preset("small")
    model = build_model("dlrm", Schema.load(cfg.paths.schema), sizes, EmbeddingOptimizerConfig("adagrad"))

The embedding tables are one :class:`~pipeline.modules.collection.EmbeddingCollection` (optimizer
fused in backward); ``model.parameters()`` holds only the dense part, for a regular torch optimizer.
DeepFM and Wide&Deep add a dim-1 "wide" table per sparse feature to the same collection, after the
deep tables, so one lookup serves both parts. Logistic regression has only those dim-1 tables and a
linear term per dense feature: the baseline every other model has to beat on the same data.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from pipeline.errors import BadInputError
from pipeline.kernels.interaction import dot_interaction, pair_count
from pipeline.kernels.mlp import relu_mlp
from pipeline.kernels.mlp.reference import ALIGN
from pipeline.modules.collection import EmbeddingCollection
from pipeline.modules.configs import EmbeddingOptimizerConfig, TableConfig, tables_from_schema
from pipeline.schema import Schema

PRESETS = {
    "mlperf": dict(embedding_dim=128, bottom_mlp=[512, 256, 128], top_mlp=[1024, 1024, 512, 256, 1], cross_rank=512),
    "small": dict(embedding_dim=32, bottom_mlp=[64, 32], top_mlp=[128, 64, 1], cross_rank=128),
}
"""Model sizes by name. The cross ranks keep MLPerf's ratio of rank to width (512 to 3456 on Criteo) at each
preset's width on Criteo (864 for small); on narrower tables a preset's rank gives way to full rank
(:meth:`ModelSizes.for_width`)."""


@dataclass
class ModelSizes:
    """Widths of a model. ``top_mlp`` ends in 1; DLRM's ``bottom_mlp`` ends in ``embedding_dim``."""

    embedding_dim: int
    bottom_mlp: list[int]
    top_mlp: list[int]
    cross_layers: int = 3
    cross_rank: int = 0
    multihot_pooling: str = "mean"
    extra: dict = field(default_factory=dict)

    @classmethod
    def preset(cls, name: str, **overrides) -> ModelSizes:
        if name not in PRESETS:
            raise ValueError(f"model preset: expected one of {sorted(PRESETS)}, got {name!r}")
        values = {k: (list(v) if isinstance(v, list) else v) for k, v in PRESETS[name].items()}
        values.update({k: v for k, v in overrides.items() if v not in (None, 0, [])})
        return cls(**values)

    def for_width(self, width: int, rank_set: bool) -> ModelSizes:
        """These sizes for DCNv2 cross layers ``width`` wide: a preset's rank (``rank_set`` false) where it is below
        half the width, else full rank (a low-rank layer is the larger one from there: ``2 * width * rank`` weights
        against ``width ** 2``). A rank that was set is kept, the width itself meaning full rank (a rank above it is
        refused where the sizes are checked)."""
        low_rank = 2 * self.cross_rank < width if not rank_set else self.cross_rank != width
        return self if low_rank or self.cross_rank <= 0 else dataclasses.replace(self, cross_rank=0)

    @staticmethod
    def preset_name(preset: str, device_kind: str) -> str:
        """The preset that ``preset`` names on ``device_kind`` (``auto``: mlperf on cuda, small on cpu)."""
        return preset if preset != "auto" else ("mlperf" if device_kind == "cuda" else "small")

    @classmethod
    def from_train_config(cls, train, device_kind: str) -> ModelSizes:
        """The preset of ``train.preset`` (``auto``: mlperf on cuda, small on cpu) with the set sizes on top."""
        sizes = cls.preset(cls.preset_name(train.preset, device_kind), embedding_dim=train.embedding_dim,
                           bottom_mlp=list(train.bottom_mlp), top_mlp=list(train.top_mlp), cross_rank=train.cross_rank,
                           multihot_pooling=train.multihot_pooling)
        sizes.cross_layers = train.cross_layers  # no preset sets it, and 0 (no cross layer) is a size of its own
        if not train.bottom_mlp and train.embedding_dim and sizes.bottom_mlp[-1] != train.embedding_dim:
            sizes.bottom_mlp = sizes.bottom_mlp[:-1] + [train.embedding_dim]
        return sizes


NO_SPARSE_FEATURE = ("no categorical or multi-hot feature, and every model embeds at least one: give the data some "
                     "with data.categorical or data.multihot")

FM_INIT_SCALE = 0.01


class PadColumns(nn.Module):
    """Appends ``pad`` zero columns, so the next layer's input width is a multiple of :data:`ALIGN`."""

    def __init__(self, pad: int) -> None:
        super().__init__()
        self.pad = pad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.pad(x, (0, self.pad))


MLP_BACKENDS = ("torch", "cublaslt")


class MLP(nn.Sequential):
    """Linear + ReLU layers (after an optional :class:`PadColumns`), an ``nn.Sequential``. With ``backend``
    ``"cublaslt"`` (:func:`use_mlp_backend`), its training forward on a GPU in half precision (bf16 autocast, or half
    weights) runs as the ``pipeline::relu_mlp`` op: each layer's bias and ReLU inside cuBLASLt's product, its ReLU
    gradient and bias gradient one pass over the ReLU's bit mask (:mod:`pipeline.kernels.mlp`). Otherwise, and while
    ``torch.jit`` traces, its layers run one by one."""

    backend = "torch"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layers = list(self)
        linears = [layer for layer in layers if isinstance(layer, nn.Linear)]
        if not (self.backend == "cublaslt" and linears and x.is_cuda and self.training and torch.is_grad_enabled()
                and not torch.jit.is_tracing()):
            return super().forward(x)
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else linears[0].weight.dtype
        if dtype not in (torch.bfloat16, torch.float16):
            return super().forward(x)
        if isinstance(layers[0], PadColumns):
            x = layers.pop(0)(x)
        return relu_mlp(x.to(dtype), [layer.weight.to(dtype) for layer in linears],
                        [layer.bias.to(dtype) for layer in linears], last_relu=isinstance(layers[-1], nn.ReLU))


def use_mlp_backend(model: nn.Module, backend: str) -> None:
    """Every :class:`MLP` of ``model`` trains through ``backend`` (one of :data:`MLP_BACKENDS`)."""
    if backend not in MLP_BACKENDS:
        raise ValueError(f"mlp backend: expected one of {', '.join(MLP_BACKENDS)}, got {backend!r}")
    for module in model.modules():
        if isinstance(module, MLP):
            module.backend = backend


def mlp(widths: list[int], in_dim: int, last_activation: bool) -> MLP:
    """Linear + ReLU layers of the given widths; the last layer without ReLU unless ``last_activation``.
    An input width that is not a multiple of :data:`ALIGN` is padded with zero columns first."""
    layers: list[nn.Module] = []
    if in_dim % ALIGN:
        layers.append(PadColumns(-in_dim % ALIGN))
        in_dim += -in_dim % ALIGN
    for i, width in enumerate(widths):
        layers.append(nn.Linear(in_dim, width))
        if i < len(widths) - 1 or last_activation:
            layers.append(nn.ReLU())
        in_dim = width
    return MLP(*layers)


class RecModel(nn.Module):
    """Base of the CTR models: ``embedding`` (the tables) + ``dense_forward(dense, pooled)`` (the rest)."""

    name = "base"

    def __init__(self, embedding: EmbeddingCollection, num_dense: int) -> None:
        super().__init__()
        self.embedding = embedding
        self.num_dense = num_dense

    def forward(self, dense: torch.Tensor, sparse) -> torch.Tensor:
        return self.dense_forward(dense, self.embedding(sparse))

    def dense_forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dense_part(self) -> nn.Module:
        """The dense part alone, as a module ``(dense, pooled) -> logits`` (for tracing / export)."""
        return _DensePart(self)

    def output_bias(self) -> nn.Parameter:
        """The bias added last to the logit."""
        raise NotImplementedError

    def start_at_rate(self, positive_rate: float) -> None:
        """Start predicting ``positive_rate`` for every row: the output bias set to its log-odds, so the first steps
        do not spend themselves learning the base rate (most of the loss on a table of rare clicks) while the
        rest of the model is pushed around by it. A rate of 0 or 1 leaves the bias as it is."""
        if 0 < positive_rate < 1:
            with torch.no_grad():
                self.output_bias().fill_(math.log(positive_rate / (1 - positive_rate)))


class _DensePart(nn.Module):
    def __init__(self, model: RecModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return self.model.dense_forward(dense, pooled)


class DLRM(RecModel):
    """DLRM: bottom MLP on the dense features, pairwise dot interaction with the embeddings, top MLP.

    Without dense features the bottom MLP's output is a learned vector (what an MLP of no inputs is): its dots
    with the embeddings are their first-order terms. Without it, one table alone would reach the top MLP through
    no pair at all, and two only through their dot."""

    name = "dlrm"

    def __init__(self, embedding: EmbeddingCollection, num_dense: int, sizes: ModelSizes) -> None:
        super().__init__(embedding, num_dense)
        dim = sizes.embedding_dim
        self.num_slots = embedding.packing.num_slots
        self.dim = dim
        if num_dense:
            if sizes.bottom_mlp[-1] != dim:
                raise ValueError(f"DLRM: the bottom MLP must end in the embedding dim {dim}, got {sizes.bottom_mlp}")
            self.bottom = mlp(sizes.bottom_mlp, num_dense, last_activation=True)
        else:
            self.bottom_vector = nn.Parameter(torch.randn(dim) / math.sqrt(dim))
        self.top = mlp(sizes.top_mlp, self._top_input(dim, self.num_slots), last_activation=False)

    @staticmethod
    def top_width(sizes: ModelSizes, schema: Schema) -> int:
        """The width of the top MLP's input on ``schema``: the bottom MLP's output (or the learned vector) and the
        dot products of it and every sparse feature's embedding, each pair once."""
        return DLRM._top_input(sizes.embedding_dim, len(schema.sparse))

    @staticmethod
    def _top_input(dim: int, sparse_features: int) -> int:
        return dim + pair_count(sparse_features + 1)

    def output_bias(self) -> nn.Parameter:
        return self.top[-1].bias

    def dense_forward(self, dense, pooled):
        b = pooled.shape[0]
        x = self.bottom(dense) if self.num_dense else self.bottom_vector.to(pooled.dtype).expand(b, -1)
        # <v_i, v_j> for j < i of the vectors x, then the pooled rows, row by row (torch.tril_indices' order): the
        # fused kernels on CUDA, which read both parts where they lie
        dots = dot_interaction(x, pooled.view(b, self.num_slots, self.dim).to(x.dtype))
        return self.top(torch.cat([x, dots], dim=1)).squeeze(1)


class DCNv2(RecModel):
    """DCN-V2 (stacked), as MLPerf's DLRM-DCNv2: the bottom MLP's output and the embeddings concatenated
    into ``x0``, cross layers ``x = x0 * (W x + b) + x`` (full rank, or low rank ``W = U V``), then the
    top MLP."""

    name = "dcnv2"

    def __init__(self, embedding: EmbeddingCollection, num_dense: int, sizes: ModelSizes) -> None:
        super().__init__(embedding, num_dense)
        if num_dense:
            self.bottom = mlp(sizes.bottom_mlp, num_dense, last_activation=True)
        width = (sizes.bottom_mlp[-1] if num_dense else 0) + embedding.output_dim
        rank = sizes.cross_rank
        self.cross = nn.ModuleList(
            nn.Linear(width, width) if rank <= 0 else nn.Sequential(nn.Linear(width, rank, bias=False),
                                                                    nn.Linear(rank, width))
            for _ in range(sizes.cross_layers)
        )
        self.deep = mlp(sizes.top_mlp, width, last_activation=False)

    @staticmethod
    def x0_width(sizes: ModelSizes, schema: Schema) -> int:
        """The width of ``x0`` and of the cross layers on ``schema``: the bottom MLP's output (with continuous
        features) and every sparse feature's embedding."""
        return (sizes.bottom_mlp[-1] if schema.continuous else 0) + sizes.embedding_dim * len(schema.sparse)

    def output_bias(self) -> nn.Parameter:
        return self.deep[-1].bias

    def dense_forward(self, dense, pooled):
        if self.num_dense:
            bottom = self.bottom(dense)
            x0 = torch.cat([bottom, pooled.to(bottom.dtype)], dim=1)
        else:
            x0 = pooled
        x = x0
        for layer in self.cross:
            x = x0 * layer(x) + x
        return self.deep(x).squeeze(1)


def lr_width(model: str, sizes: ModelSizes, schema: Schema) -> int:
    """The width of the input of ``model``'s layer that its default dense lr follows on ``schema``
    (:meth:`pipeline.train.config.TrainConfig.for_data`): DCNv2's cross layers, DLRM's top MLP; 0 for the others."""
    if model == "dcnv2":
        return DCNv2.x0_width(sizes, schema)
    return DLRM.top_width(sizes, schema) if model == "dlrm" else 0


class _WideDeepBase(RecModel):
    """Shared by DeepFM and Wide&Deep: deep slots (dim D) first, then one dim-1 wide slot per feature."""

    def __init__(self, embedding: EmbeddingCollection, num_dense: int, sizes: ModelSizes) -> None:
        super().__init__(embedding, num_dense)
        self.num_features = embedding.packing.num_slots // 2
        self.dim = sizes.embedding_dim
        self.deep_width = self.num_features * self.dim
        self.wide_dense = nn.Linear(num_dense, 1) if num_dense else None
        self.deep = mlp(sizes.top_mlp, num_dense + self.deep_width, last_activation=False)

    def output_bias(self) -> nn.Parameter:
        return self.deep[-1].bias

    def _parts(self, dense, pooled):
        deep_emb = pooled[:, : self.deep_width]
        wide = pooled[:, self.deep_width :].sum(1)
        if self.wide_dense is not None:
            wide = wide + self.wide_dense(dense).squeeze(1)
        deep = self.deep(torch.cat([dense, deep_emb.to(dense.dtype)], dim=1)).squeeze(1)
        return deep_emb, wide, deep


class WideDeep(_WideDeepBase):
    """Wide & Deep: a linear model over the sparse ids (dim-1 tables) and dense features, plus a deep MLP."""

    name = "wide_deep"

    def dense_forward(self, dense, pooled):
        _, wide, deep = self._parts(dense, pooled)
        return wide + deep


class DeepFM(_WideDeepBase):
    """DeepFM: first-order (wide) terms + factorization-machine pairwise terms + a deep MLP."""

    name = "deepfm"

    def dense_forward(self, dense, pooled):
        deep_emb, wide, deep = self._parts(dense, pooled)
        v = deep_emb.view(-1, self.num_features, self.dim).float()
        fm = 0.5 * (v.sum(1).pow(2) - v.pow(2).sum(1)).sum(1)
        return wide + fm.to(deep.dtype) + deep


class LogisticRegression(RecModel):
    """One weight per category of each sparse feature (dim-1 tables) and per dense feature, plus a bias."""

    name = "logistic"

    def __init__(self, embedding: EmbeddingCollection, num_dense: int, sizes: ModelSizes) -> None:
        super().__init__(embedding, num_dense)
        self.linear = nn.Linear(num_dense, 1) if num_dense else None
        self.bias = nn.Parameter(torch.zeros(1)) if not num_dense else None

    def output_bias(self) -> nn.Parameter:
        return self.linear.bias if self.linear is not None else self.bias

    def dense_forward(self, dense, pooled):
        logit = pooled.float().sum(1)
        if self.linear is not None:
            return logit + self.linear(dense.float()).squeeze(1)
        return logit + self.bias


MODEL_CLASSES = {cls.name: cls for cls in (DLRM, DCNv2, DeepFM, WideDeep, LogisticRegression)}


def model_tables(name: str, schema: Schema, sizes: ModelSizes, admit_after: int = 1) -> list[TableConfig]:
    """The embedding tables of model ``name``: one per sparse feature, plus dim-1 wide ones for deepfm / wide_deep
    (logistic: only the dim-1 ones). The schema's dynamic features get dynamic tables that admit an id after
    ``admit_after`` occurrences."""
    tables = tables_from_schema(schema, sizes.embedding_dim, pooling=sizes.multihot_pooling, admit_after=admit_after)
    if name == "deepfm":  # factorization-machine factors start small (N(0, 0.01) in the FM literature)
        tables = [dataclasses.replace(t, init_scale=FM_INIT_SCALE) for t in tables]
    # A linear model's weights start at zero.
    wide = [dataclasses.replace(t, name=f"w_{t.features[0]}", dim=1, init_scale=0.0) for t in tables]
    if name == "logistic":
        return wide
    return tables + wide if name in ("deepfm", "wide_deep") else tables


def build_model(name: str, schema: Schema, sizes: ModelSizes, optimizer: EmbeddingOptimizerConfig | None = None,
                weights_dtype: str = "fp32", backend: str = "auto", seed: int = 0, admit_after: int = 1) -> RecModel:
    """A model of kind ``name`` (dlrm | dcnv2 | deepfm | wide_deep | logistic) for the features of ``schema``
    (``admit_after``: of its dynamic tables, see :func:`model_tables`)."""
    if name not in MODEL_CLASSES:
        raise ValueError(f"model: expected one of {sorted(MODEL_CLASSES)}, got {name!r}")
    if not schema.sparse:
        raise BadInputError(f"the schema has {NO_SPARSE_FEATURE}")
    generator = torch.Generator().manual_seed(seed)
    tables = model_tables(name, schema, sizes, admit_after)
    embedding = EmbeddingCollection(tables, schema.sparse, optimizer, weights_dtype=weights_dtype, backend=backend,
                                    generator=generator)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MODEL_CLASSES[name](embedding, len(schema.continuous), sizes)
