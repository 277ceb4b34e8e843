"""What every model of ``bench train`` shares: the pre-made batches, our DLRM as the training stage builds it,
its training step, and the printing of the rates."""

from __future__ import annotations

from typing import Any, NamedTuple


class StepBatch(NamedTuple):
    """One pre-made batch, as each model takes it."""

    dense: Any  # float32 [batch, 13]
    ids: Any  # int64 [batch, tables]: the rows, for the plain PyTorch model
    kjt: Any  # the rows as a KeyedJaggedTensor, for our static tables
    raw: Any  # each row as a 64-bit id of its own, as a KeyedJaggedTensor, for dynamic tables (None without)
    label: Any  # float32 [batch]


def step_batches(ids: list, rows: int, device, raw: bool) -> list[StepBatch]:
    """The batches of the rows ``ids`` (numpy ``[batch, tables]`` each) on ``device``; with ``raw``, also as the
    ids of dynamic tables: row ``r`` of table ``t`` becomes ``mix64(t * rows + r)`` (distinct rows, distinct ids,
    spread over 64 bits)."""
    import torch

    from pipeline.kernels.hashtable.reference import mix64
    from pipeline.sparse import KeyedJaggedTensor

    out = []
    for table_ids in ids:
        batch, tables = table_ids.shape
        keys = [f"C{i + 1}" for i in range(tables)]
        table_ids = torch.from_numpy(table_ids)
        dense = torch.randn(batch, 13)
        label = torch.randint(0, 2, (batch,)).float()
        raw_ids = None
        if raw:
            raw_ids = KeyedJaggedTensor.from_dense(keys, mix64(table_ids + torch.arange(tables) * rows)).to(device)
        out.append(StepBatch(dense.to(device), table_ids.to(device),
                             KeyedJaggedTensor.from_dense(keys, table_ids).to(device), raw_ids, label.to(device)))
    return out


def our_dlrm(args, sizes, device, capacity: int = 0, admit_after: int = 1):
    """Our DLRM of ``sizes`` (``ModelSizes``) as the training stage builds it from a schema: static tables of
    ``args.rows`` rows, or with ``capacity``, dynamic tables of that capacity (the schema's columns of raw
    64-bit ids)."""
    from pipeline.modules.configs import EmbeddingOptimizerConfig
    from pipeline.modules.models import build_model, use_mlp_backend
    from pipeline.schema import Column, Schema

    sparse = [Column(f"C{i + 1}", "categorical", "int64", cardinality=capacity, dynamic=True) if capacity else
              Column(f"C{i + 1}", "categorical", "int32", cardinality=args.rows) for i in range(args.tables)]
    schema = Schema([Column("label", "label", "float32")]
                    + [Column(f"I{i + 1}", "continuous", "float32") for i in range(13)] + sparse)
    model = build_model("dlrm", schema, sizes, EmbeddingOptimizerConfig(args.optimizer, lr=0.01),
                        backend=args.backend, admit_after=admit_after)
    model.embedding.validate_ids = False  # the baseline does not check ids either
    use_mlp_backend(model, args.mlp_backend)
    return model.to(device)


def our_step(model, amp: bool, compiled: str):
    """One training step of our ``model`` on ``(dense, sparse, label)`` as the training stage takes it: the
    lookup (and a dynamic table's mapping of ids to rows) eager, the dense part and loss compiled as
    ``compiled`` (a ``train.compile`` setting) says, the tables updated in the backward, the MLPs by SGD."""
    import functools

    import torch

    from pipeline.train.evaluate import autocast
    from pipeline.train.loop import compiled_dense_loss, dense_loss

    device = next(model.parameters()).device
    loss_of = compiled_dense_loss(model, amp, compiled, device) or functools.partial(dense_loss, model, amp)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(dense, sparse, label):
        with autocast(device, amp):
            pooled = model.embedding(sparse)
        loss = loss_of(dense, pooled, label)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def our_training(model, amp: bool, compiled: str):
    """Trains our ``model`` (static tables, all in device memory) on the ``kjt`` of a list of ``StepBatch``, one
    step each."""
    step = our_step(model, amp, compiled)

    def train_on(batches):
        for batch in batches:
            step(batch.dense, batch.kjt, batch.label)

    return train_on


class PipelinedSteps:
    """``step`` on the batches of a run through the training stage's
    :class:`~pipeline.distributed.train_pipeline.PrefetchPipeline`, one pass over the run's whole ``stream`` (warm-up,
    rounds, profiled steps, in order) taken in stretches: as in the stage, whose pipeline runs over an epoch, a round
    starts with its first batches prefetched while the round before trained, rather than with the pipeline filling up
    again (which the stage does once an epoch). ``sparse_of``: a ``StepBatch``'s ids as the model takes them."""

    def __init__(self, model, step, device, stream: list[StepBatch], sparse_of) -> None:
        from pipeline.distributed.train_pipeline import PrefetchPipeline
        from pipeline.loader import Batch

        self._step = step
        self._batches = PrefetchPipeline(model, device)(Batch(b.dense, sparse_of(b), b.label) for b in stream)

    def __call__(self, batches: list[StepBatch]) -> None:
        for expected in batches:
            batch = next(self._batches)
            if batch.label is not expected.label:
                raise ValueError("a stretch of batches that is not the next of the run's stream")
            self._step(batch.dense, batch.sparse, batch.label)


def print_rates(rates: list[tuple[str, float]], ratios: list[tuple[str, float]]) -> None:
    """Labelled samples/s, then labelled ratios, in one column."""
    width = max(len(label) for label, _ in rates + ratios)
    for label, rate in rates:
        print(f"  {label:<{width}} {rate:>12,.0f} samples/s")
    for label, ratio in ratios:
        print(f"  {label:<{width}} {ratio:>12.2f}")
