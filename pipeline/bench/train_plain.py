"""The baseline of ``bench train``: a plain PyTorch DLRM of our shape (one ``nn.EmbeddingBag(sparse=True)`` per
table, the same MLPs and interaction), run eager, its MLPs under SGD and its tables under torch's optimizer
nearest to ours."""

from __future__ import annotations

BASELINE_OPTIMIZERS = {"sgd": "SGD", "adagrad": "Adagrad", "adam": "SparseAdam"}
"""The torch optimizer the baseline's tables take for each of ours (all accept sparse gradients)."""


def plain_training(args, sizes, device, amp: bool):
    """Trains the plain PyTorch DLRM of ``sizes`` on a list of ``StepBatch``, one step each."""
    model = _plain_dlrm(args.tables, args.rows, sizes).to(device)
    step = _plain_step(model, _baseline_optimizers(model, args.optimizer, lr=0.01), amp)

    def train_on(batches):
        for batch in batches:
            step(batch.dense, batch.ids, batch.label)

    return train_on


def _plain_step(model, optimizers: list, amp: bool):
    """One training step of the plain PyTorch model (eager) on ``(dense, ids, label)``."""
    import torch

    from pipeline.train.evaluate import autocast

    def step(dense, ids, label):
        with autocast(dense.device, amp):
            logits = model(dense, ids)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), label)
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()

    return step


def _baseline_optimizers(model, kind: str, lr: float) -> list:
    """SGD for the MLPs; the tables' sparse gradients to torch's optimizer of ``kind``."""
    import torch

    tables = list(model.tables.parameters())
    dense = [p for name, p in model.named_parameters() if not name.startswith("tables.")]
    sparse = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.SparseAdam}[kind]
    return [torch.optim.SGD(dense, lr=lr), sparse(tables, lr=lr)]


def _plain_dlrm(tables: int, rows: int, sizes):
    """DLRM in plain PyTorch: ``tables`` tables of ``rows`` rows, the MLPs of ``sizes`` (``ModelSizes``)."""
    import torch
    from torch import nn

    from pipeline.modules.models import mlp

    class PlainDLRM(nn.Module):
        """DLRM in plain PyTorch: EmbeddingBag(sparse=True) per table, bottom / top MLP, dot interaction."""

        def __init__(self, tables, rows, dim, bottom, top):
            super().__init__()
            self.tables = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum", sparse=True) for _ in range(tables))
            self.bottom = nn.Sequential(*mlp(bottom, 13, last_activation=True))  # its layers one by one
            n = tables + 1
            r, c = torch.tril_indices(n, n, offset=-1)
            self.register_buffer("pairs", r * n + c, persistent=False)
            self.top = nn.Sequential(*mlp(top, dim + r.numel(), last_activation=False))

        def forward(self, dense, ids):
            x = self.bottom(dense)
            pooled = [table(ids[:, t : t + 1]) for t, table in enumerate(self.tables)]
            vectors = torch.stack([x] + [p.to(x.dtype) for p in pooled], dim=1)
            dots = torch.bmm(vectors, vectors.transpose(1, 2)).flatten(1)[:, self.pairs]
            return self.top(torch.cat([x, dots], dim=1)).squeeze(1)

    return PlainDLRM(tables, rows, sizes.embedding_dim, sizes.bottom_mlp, sizes.top_mlp)
