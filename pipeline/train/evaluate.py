"""Scoring a model on a split: exact ROC AUC and log loss of its click probabilities.

Example::

    labels, probs = predict(model, loader, device)
    evaluate(model, loader, device)   # {"rows": 100000, "auc": 0.79, "auc_se": 0.0015, "logloss": 0.47, ...}
    evaluate(dmp, loader, device, world=world)   # on N ranks: over every rank's rows, the same on each
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import numpy as np
import torch

from pipeline.data.metrics import auc_standard_error, log_loss, roc_auc
from pipeline.distributed.world import World


def autocast(device: torch.device, enabled: bool) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA when ``enabled``; a no-op otherwise."""
    if enabled and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def predict(model: torch.nn.Module, batches: Iterable, device: torch.device,
            amp: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Labels and predicted click probabilities of every batch, in order (the model is left as it was)."""
    was_training = model.training
    model.eval()
    labels, probs = [], []
    try:
        for batch in batches:
            batch = batch.to(device, non_blocking=True)
            with autocast(device, amp):
                logits = model(batch.dense, batch.sparse)
            probs.append(torch.sigmoid(logits.float()).cpu())
            labels.append(batch.label.cpu())
    finally:
        model.train(was_training)
    if not labels:
        return np.zeros(0, dtype=np.float32), np.zeros(0, dtype=np.float32)
    return torch.cat(labels).numpy(), torch.cat(probs).numpy()


def scores(labels: np.ndarray, probs: np.ndarray) -> dict[str, float]:
    """``rows``, ``positive_rate``, ``auc`` (exact), ``auc_se`` (its standard error for this many rows of each label)
    and ``logloss`` of probabilities against 0/1 labels."""
    positives = int(np.count_nonzero(labels))
    auc = roc_auc(labels, probs)
    return {
        "rows": int(labels.size),
        "positive_rate": float(labels.mean()) if labels.size else float("nan"),
        "auc": auc,
        "auc_se": auc_standard_error(auc, positives, int(labels.size) - positives),
        "logloss": log_loss(labels, probs) if labels.size else float("nan"),
    }


def evaluate(model: torch.nn.Module, batches: Iterable, device: torch.device, amp: bool = False,
             world: World | None = None) -> dict[str, float]:
    """:func:`scores` of ``model`` on ``batches``; with a ``world``, over the predictions of all its ranks.

    The rows a rank's loader repeats to even out the shards (its ``padding``) are left out.
    """
    labels, probs = predict(model, batches, device, amp)
    padding = getattr(batches, "padding", 0)
    if padding:
        labels, probs = labels[: len(labels) - padding], probs[: len(probs) - padding]
    if world is not None:
        labels, probs = world.gather_arrays(labels, probs)
    return scores(labels, probs)
