"""Settings of the training stage."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from pipeline.errors import check_range

MODELS = ("dlrm", "dcnv2", "deepfm", "wide_deep", "logistic")
PRESETS = ("auto", "small", "mlperf")
DENSE_OPTIMIZERS = ("sgd", "adam", "adagrad")
EMBEDDING_OPTIMIZERS = ("sgd", "adagrad", "adam")
DECAYS = ("none", "linear", "cosine")
AMP = ("auto", "bf16", "off")
COMPILE_MODES = ("auto", "on", "off", "max-autotune")
READERS = ("auto", "pyarrow", "cudf")
"""The loader's readers (``pipeline.loader.cudf_read.READERS``, which imports torch; this module does not)."""
MLP_BACKENDS = ("torch", "cublaslt")
"""The MLPs' backends (``pipeline.modules.models.MLP_BACKENDS``, in a module that imports torch)."""
LATEST = "latest"  # <train>/latest: the newest finished run (see pipeline.train.runs)


MAX_RUN_NAME = 200
"""The longest run name: a folder name (255 bytes at most on most file systems), with room for what is appended."""


def check_run_name(setting: str, name: str) -> None:
    """Raise ``ValueError`` unless ``name`` is empty or can be a run's folder name under ``train/``."""
    if name and (name == LATEST or name.endswith(".tmp") or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name)):
        raise ValueError(f"{setting}: expected a folder name of letters, digits, '.', '_' and '-' (not {LATEST!r}, "
                         f"not ending in .tmp), got {name!r}")
    if len(name) > MAX_RUN_NAME:
        raise ValueError(f"{setting}: expected a folder name of at most {MAX_RUN_NAME} characters, got {len(name)}")


@dataclass
class TrainConfig:
    """Model, optimizer and loop settings.

    Sizes left at 0 / empty come from ``preset``: ``mlperf`` is MLPerf's DLRM (embedding dim 128,
    bottom MLP 512-256-128, top MLP 1024-1024-512-256-1); ``small`` is a CPU-sized model (dim 32,
    bottom 64-32, top 128-64-1); ``auto`` takes ``mlperf`` on a GPU and ``small`` on CPU.
    """

    model: str = field(default="dlrm", metadata={
        "help": "dlrm | dcnv2 | deepfm | wide_deep | logistic (the linear baseline)"})
    preset: str = field(default="auto", metadata={"help": "auto | small | mlperf: default sizes (auto: by device)"})
    embedding_dim: int = field(default=0, metadata={"help": "dim of every embedding table (0: from preset)"})
    bottom_mlp: list[int] = field(default_factory=list, metadata={
        "help": "DLRM bottom MLP widths, the last = embedding dim (empty: from preset)"})
    top_mlp: list[int] = field(default_factory=list, metadata={
        "help": "top / deep MLP widths ending in 1 (empty: from preset)"})
    cross_layers: int = field(default=3, metadata={
        "help": "dcnv2: cross layers (0: none, the deep MLP alone)"})
    cross_rank: int = field(default=0, metadata={
        "help": "dcnv2: rank of each cross layer (0: the preset's, 512 for mlperf as MLPerf's DLRM-DCNv2, 128 for "
                "small, or full rank where that is half the layers' width or more; the width itself: full rank)"})
    multihot_pooling: str = field(default="mean", metadata={"help": "sum | mean pooling of multi-hot features"})

    epochs: int = field(default=0, metadata={
        "help": "passes over the training split (0: one, or as many as give 300 steps when one pass is shorter; "
                "early stopping ends the run when validation stops improving)"})
    max_steps: int = field(default=0, metadata={"help": "stop after this many steps (0: run all epochs)"})
    batch_size: int = field(default=2048, metadata={"help": "samples per step (per rank)"})
    eval_batch_size: int = field(default=16384, metadata={"help": "samples per evaluation batch"})
    eval_every: int = field(default=0, metadata={"help": "evaluate on valid every N steps (0: at each epoch's end)"})

    optimizer: str = field(default="adam", metadata={"help": "dense optimizer: sgd | adam | adagrad"})
    lr: float = field(default=0.0, metadata={
        "help": "peak learning rate of the dense part (0: the optimizer's: adam and adagrad 0.01, dcnv2 less on wide "
                "cross layers (adam 0.001, adagrad 0.005 at the mlperf sizes), dlrm less over more than 26 sparse "
                "features (0.01 x 479 / its top MLP's input width); sgd 0.75 per 2048 samples of the "
                "batch, the linear scaling rule (24 at MLPerf's 65536), times up to 1/(positive rate) on labels "
                "with fewer positives than a quarter)"})
    embedding_optimizer: str = field(default="adagrad", metadata={
        "help": "fused sparse optimizer of the tables: sgd | adagrad (row-wise) | adam (lazy)"})
    embedding_lr: float = field(default=0.0, metadata={
        "help": "peak learning rate of the embedding tables (0: the optimizer's: adagrad 0.2, adam 0.01, sgd 16 "
                "(as train.lr, more on rarer positives); deepfm: at most 2.6 / its sparse features of that, 0.02 "
                "on Criteo's 26; dlrm's adagrad: at most 26 / its sparse features of that)"})
    weight_decay: float = field(default=0.0, metadata={
        "help": "L2 weight decay of the dense part and the tables (0: from train.l2_prior and the training rows)"})
    l2_prior: float = field(default=5.0, metadata={
        "help": "when train.weight_decay is 0: the precision of a Gaussian prior on every weight against the loss "
                "summed over the training rows, so the weight decay is l2_prior / training rows (less on labels with "
                "fewer positives than a quarter, as their gradients are smaller): it keeps a small table's model "
                "from memorising its rows and fades on a large one (0: no weight decay)"})
    warmup_fraction: float = field(default=0.2, metadata={
        "help": "linear warmup from 0 to the peak lr over this fraction of the run's steps"})
    warmup_steps: int = field(default=0, metadata={
        "help": "warmup over this many steps instead of warmup_fraction (0: use warmup_fraction)"})
    decay: str = field(default="cosine", metadata={"help": "none | linear | cosine decay after warmup"})
    decay_start: int = field(default=0, metadata={
        "help": "step where decay begins (0: right after warmup); it ends at the run's last step"})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "lr at the last step, as a fraction of the peak"})

    embedding_dtype: str = field(default="fp32", metadata={"help": "fp32 | fp16 | bf16 embedding weights"})
    embedding_master_weights: bool = field(default=False, metadata={
        "help": "fp16/bf16 tables: keep an fp32 master copy that the optimizer updates"})
    embedding_stochastic_rounding: bool = field(default=False, metadata={
        "help": "fp16/bf16 tables: stochastic rounding of updated rows (cuda backend)"})
    admit_after: int = field(default=1, metadata={
        "help": "dynamic tables (the columns of etl.hash_ids): an id gets its row at its N-th occurrence in "
                "training batches (1: at first sight); until then it reads a zero row and is not updated"})
    embedding_backend: str = field(default="auto", metadata={
        "help": "torch | cuda | auto: embedding compute (auto: fused CUDA kernels when usable)"})
    mlp_backend: str = field(default="torch", metadata={
        "help": "torch | cublaslt: the MLPs' Linear + ReLU layers in training on a GPU in half precision (cublaslt: "
                "each layer's bias and ReLU inside cuBLASLt's product with a bit mask beside its output, the ReLU's "
                "and bias's gradients one pass over that mask; elsewhere torch's layers either way)"})
    amp: str = field(default="auto", metadata={"help": "auto | bf16 | off: bf16 autocast (auto: on GPU only)"})
    compile: str = field(default="auto", metadata={
        "help": "auto | on | off | max-autotune: torch.compile the dense part and the loss of a one-process run, "
                "fusing its small kernels (auto: on GPU only; the first steps then take the compile time); "
                "max-autotune also times generated matrix-product kernels, with the element-wise work after "
                "them fused in, against the library's at the first step (minutes), and keeps the fastest"})

    reader: str = field(default="auto", metadata={
        "help": "auto | pyarrow | cudf: what decodes the processed parquet for training (auto: cuDF on the GPU where "
                "it is installed, several times faster than the host's cores; else pyarrow on the host); the batches "
                "are the same"})

    threads: int = field(default=0, metadata={
        "help": "torch CPU threads while training (0: all cores but one, which the loader's thread uses)"})

    early_stopping: int = field(default=2, metadata={
        "help": "keep the epoch of the best valid log loss (scored on test, saved as model.pt) and stop after N "
                "epochs without improvement, not counting those that end before the lr has decayed to half its peak "
                "(0: off, the last epoch is kept)"})

    checkpoint_every: int = field(default=200, metadata={
        "help": "save a checkpoint every N steps (0: only at the end)"})
    keep_checkpoints: int = field(default=2, metadata={"help": "checkpoints kept on disk (the newest)"})
    run: str = field(default="", metadata={
        "help": "this run's folder under train/ (empty: a new one named by UTC time and model, e.g. "
                "20261201-171500-dlrm); a name in use is refused unless train.resume=true"})
    resume: bool = field(default=False, metadata={
        "help": "continue a run from its newest checkpoint: the run train.run names (it must exist), else the "
                "run most recently started or resumed, finished or not (none yet: a new run)"})
    log_every: int = field(default=20, metadata={"help": "write a metrics line every N steps"})

    def __post_init__(self) -> None:
        for name, allowed in (("model", MODELS), ("preset", PRESETS), ("optimizer", DENSE_OPTIMIZERS),
                              ("embedding_optimizer", EMBEDDING_OPTIMIZERS), ("decay", DECAYS), ("amp", AMP),
                              ("compile", COMPILE_MODES), ("reader", READERS), ("mlp_backend", MLP_BACKENDS),
                              ("embedding_dtype", ("fp32", "fp16", "bf16")),
                              ("multihot_pooling", ("sum", "mean"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"train.{name}: expected one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        for name in ("batch_size", "eval_batch_size", "keep_checkpoints", "log_every", "admit_after"):
            check_range(f"train.{name}", getattr(self, name), 1)
        for name in ("epochs", "embedding_dim", "cross_layers", "cross_rank", "max_steps", "eval_every", "warmup_steps",
                     "decay_start", "threads", "checkpoint_every", "early_stopping"):
            check_range(f"train.{name}", getattr(self, name), 0)
        for name in ("bottom_mlp", "top_mlp"):
            for width in getattr(self, name):
                check_range(f"train.{name} (each width)", width, 1)
        if self.top_mlp and self.top_mlp[-1] != 1:
            raise ValueError(f"train.top_mlp: the last width must be 1 (one logit), got {self.top_mlp}")
        check_range("train.lr", self.lr, 0)
        check_range("train.embedding_lr", self.embedding_lr, 0)
        check_range("train.weight_decay", self.weight_decay, 0)
        check_range("train.l2_prior", self.l2_prior, 0)
        check_range("train.min_lr_ratio", self.min_lr_ratio, 0, 1)
        check_range("train.warmup_fraction", self.warmup_fraction, 0, 1, high_open=True)
        check_run_name("train.run", self.run)

    def decay_for(self, rows: int, positive_rate: float) -> float:
        """The weight decay of a run on ``rows`` training rows with this share of positive labels: ``weight_decay``,
        else ``l2_prior / rows`` over :func:`sgd_rate_scale`. The L2 term is added to the gradient of each batch's
        mean loss, so against the loss summed over the rows it is a prior of precision ``weight_decay * rows``: a
        fixed prior is a decay inversely proportional to the rows. The loss's gradients shrink with rarer positives,
        and a decay of the same size would then outweigh them (at 0.45% positives DCNv2 answered the base rate, test
        AUC 0.45 to 0.50 against logistic regression's 0.69): the prior shrinks with them, and balanced labels
        keep it whole."""
        if self.weight_decay > 0:
            return self.weight_decay
        return self.l2_prior / rows / sgd_rate_scale(positive_rate) if rows > 0 else 0.0

    @property
    def dense_lr(self) -> float:
        """The dense part's peak lr: ``lr``, or the optimizer's default for this batch size on Criteo-like data
        (:meth:`for_data` scales it to a run's data)."""
        return self.lr if self.lr > 0 else self._default_dense_lr(MLPERF_WIDTHS.get(self.model, 0))

    def _default_dense_lr(self, width: int) -> float:
        if self.optimizer == "sgd":
            return 0.75 * self.batch_size / 2048
        if self.model == "dcnv2":
            return dcnv2_lr(self.optimizer, width)
        return dlrm_lr(width) if self.model == "dlrm" else 0.01

    @property
    def decoupled_decay(self) -> bool:
        """Whether the dense part's Adam or Adagrad decays the weights apart from their gradients (AdamW,
        ``pipeline.train.loop.AdagradW``): for DLRM. Added to the gradients, the decay passes through the optimizer's
        scaling of each weight's step, which moves a weight of small gradient towards zero by about the lr every step,
        however small the decay. DLRM's ids reach its output only
        through products of weights (its dot interaction): on a table of a few thousand rows, where the prior's decay is
        largest, they all went to zero that way and the model answered the base rate. The other models' ids also act
        alone (DCNv2's and Wide&Deep's networks read the embeddings, DeepFM has a weight per id), and for them the
        decay in the gradients holds the dense part back from memorising a small table (Wide&Deep's test logloss at
        16,000 rows: 0.504 against 0.539 decoupled; docs/BENCHMARKS.md, Model quality)."""
        return self.model == "dlrm"

    @property
    def table_lr(self) -> float:
        """The tables' peak lr: ``embedding_lr``, or the optimizer's default on Criteo-like data (:meth:`for_data`
        scales it to a run's data). SGD tables get a large one: a row's gradient is its occurrences' share of the
        batch's mean loss, so a rare row moves little."""
        return self.embedding_lr if self.embedding_lr > 0 else self._default_table_lr(CRITEO_SPARSE_FEATURES)

    def _default_table_lr(self, sparse_features: int) -> float:
        if self.model == "deepfm" and self.embedding_optimizer in ("adagrad", "sgd"):
            return deepfm_table_lr(self.embedding_optimizer, sparse_features)
        if self.model == "dlrm" and self.embedding_optimizer == "adagrad":
            return dlrm_table_lr(sparse_features)
        return TABLE_LRS[self.embedding_optimizer]

    def for_data(self, rows: int, positive_rate: float, sparse_features: int, width: int) -> TrainConfig:
        """These settings with ``lr``, ``embedding_lr`` and ``weight_decay`` left at 0 chosen for a run's data:
        ``rows`` training rows with this share of positive labels, ``sparse_features`` of them, the layer that the
        dense lr follows ``width`` wide (:func:`pipeline.modules.models.lr_width`: DCNv2's cross layers, DLRM's top
        MLP). The weight decay is :meth:`decay_for` the rows and rate; SGD's lrs (dense part and tables) are scaled by
        :func:`sgd_rate_scale`; DCNv2's dense lr follows :func:`dcnv2_lr`, DLRM's :func:`dlrm_lr` and its row-wise
        Adagrad tables :func:`dlrm_table_lr`, DeepFM's table lr :func:`deepfm_table_lr`. Set values are kept."""
        scale = sgd_rate_scale(positive_rate)
        lr = self.lr or self._default_dense_lr(width) * (scale if self.optimizer == "sgd" else 1.0)
        embedding_lr = self.embedding_lr or self._default_table_lr(sparse_features) * (
            scale if self.embedding_optimizer == "sgd" else 1.0)
        return dataclasses.replace(self, lr=lr, embedding_lr=embedding_lr, weight_decay=self.decay_for(rows, positive_rate))


TABLE_LRS = {"adagrad": 0.2, "adam": 0.01, "sgd": 16.0}
"""The tables' default lr by optimizer (row-wise Adagrad, lazy Adam, SGD)."""

REFERENCE_POSITIVE_RATE = 0.25
"""The share of positive labels the default lrs are set for (Criteo's click data)."""

CRITEO_SPARSE_FEATURES = 26
MLPERF_CROSS_WIDTH = 3456
"""DCNv2's cross layers at the MLPerf sizes on Criteo: 26 embeddings and the bottom MLP's output, 128 each."""
MLPERF_TOP_WIDTH = 479
"""DLRM's top MLP input at the MLPerf sizes on Criteo: the bottom MLP's 128 and the 351 dot products of 27 vectors."""
MLPERF_WIDTHS = {"dcnv2": MLPERF_CROSS_WIDTH, "dlrm": MLPERF_TOP_WIDTH}

DCNV2_LR_WIDTH = {"adam": 3.456, "adagrad": 17.28}
"""DCNv2's dense lr times its cross layers' width: Adam 0.001 and Adagrad 0.005 (MLPerf's) at the MLPerf width."""

DEEPFM_REFERENCE_FEATURES = 2.6
"""DeepFM's tables take the other models' lr times this over its sparse features, at most all of it: a tenth at 26."""


def sgd_rate_scale(positive_rate: float) -> float:
    """How many times larger SGD's lrs are on labels with this share of positives than on Criteo's quarter.

    The log loss's gradient at the logit is ``p - y``; with the model at the base rate ``r`` its mean size is
    ``2 r (1 - r)``, so every gradient behind it, and plain SGD's steps, shrink with the positives (19x at 1%: DLRM's
    test AUC stayed at 0.64 where, scaled, it reaches 0.81 and the logistic baseline 0.82; at 0.1%, 0.74 as with
    Adam against 0.47). Adam and Adagrad divide the gradient's size out themselves. Never below 1: balanced labels
    keep the defaults. The default prior's decay is divided by it for the same reason (:meth:`TrainConfig.decay_for`)."""
    if not 0 < positive_rate < 1:
        return 1.0
    reference = 2 * REFERENCE_POSITIVE_RATE * (1 - REFERENCE_POSITIVE_RATE)
    return max(1.0, reference / (2 * positive_rate * (1 - positive_rate)))


def dcnv2_lr(optimizer: str, width: int) -> float:
    """DCNv2's dense lr (Adam or Adagrad) for cross layers ``width`` wide: inversely proportional to the width, up to
    the other models' 0.01.

    A cross layer multiplies ``x0`` by its product of weights, each of which the optimizer moves by about the lr a
    step, so the layer's output moves with the lr times the width: Adam at 0.01 blew the loss up at the end of the
    warmup at the MLPerf width (test AUC 0.50 on the 10M-row synthetic split, 0.7912 at 0.001), while 0.001
    underfits narrow layers (64 wide: test AUC 0.858 against 0.892 at 0.01 on a table of 8 continuous features)."""
    return min(0.01, DCNV2_LR_WIDTH[optimizer] / max(width, 1))


def dlrm_lr(width: int) -> float:
    """DLRM's dense lr (Adam or Adagrad) for a top MLP whose input is ``width`` wide: the other models' 0.01 up to its
    width at the MLPerf sizes on Criteo (:data:`MLPERF_TOP_WIDTH`), less in inverse proportion beyond it (a table
    of many sparse features: 60 make 1,830 dot products).

    As in :func:`dcnv2_lr`: a unit of the top MLP's first layer sums ``width`` inputs, each weight moved by about the
    lr a step. At 0.01 over 60 features of 8 values each (20,000 rows, a label of their effects added) DLRM's
    validation AUC swung between 0.65 and 0.84 from one pass to the next, and its test AUC was 0.83 where logistic
    regression's is 0.89 (docs/BENCHMARKS.md, "Many sparse features")."""
    return min(0.01, 0.01 * MLPERF_TOP_WIDTH / max(width, 1))


def dlrm_table_lr(sparse_features: int) -> float:
    """DLRM's row-wise Adagrad table lr with ``sparse_features``: the default (:data:`TABLE_LRS`) up to Criteo's 26,
    less in inverse proportion beyond.

    Every embedding enters a dot product with every other, so a step of every row moves more of the top MLP's inputs
    the more features there are; a few values each (every row in every batch, whose first Adagrad steps move each
    weight by about the lr) made the 60-feature table above swing. With both this and :func:`dlrm_lr` its test AUC is
    0.86 over three seeds (0.83 to 0.84 before); either alone did not help. Adam and SGD tables, whose defaults move a
    row less, did better without it (Adam 0.87 and 0.85 with :func:`dlrm_lr` alone, 0.83 and 0.80 with both)."""
    return TABLE_LRS["adagrad"] / max(1.0, sparse_features / CRITEO_SPARSE_FEATURES)


def deepfm_table_lr(optimizer: str, sparse_features: int) -> float:
    """DeepFM's table lr (row-wise Adagrad or SGD) with ``sparse_features`` paired by its factorization machine.

    A step of every row moves each pair of features, so the step that suits a few sparse features sends the loss up
    over many (SGD tables at 4 sent it to infinity over Criteo's 26), and the tenth of the other models' lr that 26
    need left DeepFM at the logistic baseline over two (test AUC 0.62 against 0.69 at the full lr on a table of user
    and item ids; 0.60 against 0.70 on an item and a multi-hot list)."""
    return TABLE_LRS[optimizer] / max(1.0, sparse_features / DEEPFM_REFERENCE_FEATURES)
