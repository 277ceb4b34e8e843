"""Click metrics: exact ROC AUC and log loss, and a streaming accumulator for big splits.

The oracle (``oracle.json``) scores the true click probabilities against the drawn labels; the
streaming :class:`ClickMetrics` does that chunk by chunk without holding a split in memory, by
counting positives and negatives per probability bin (2**20 bins, so its AUC agrees with the exact
:func:`roc_auc` to about 1e-6).

Example::

    roc_auc(np.array([0, 1, 1]), np.array([0.2, 0.9, 0.4]))   # 1.0
    m = ClickMetrics(); m.update(labels, probs); m.result()      # {"rows", "positive_rate", "auc", "logloss"}
"""

from __future__ import annotations

import math

import numpy as np

_BINS = 1 << 20
_EPS = 1e-7


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Exact ROC AUC (Mann-Whitney, ties count one half); NaN when only one class is present."""
    labels = np.asarray(labels).astype(bool)
    scores = np.asarray(scores, dtype=np.float64)
    if labels.shape != scores.shape:
        raise ValueError(f"labels and scores must have the same shape, got {labels.shape} and {scores.shape}")
    positives = int(labels.sum())
    negatives = labels.size - positives
    if positives == 0 or negatives == 0:
        return float("nan")
    order = np.argsort(scores, kind="stable")
    sorted_scores = scores[order]
    # Average ranks over ties: each run of equal scores shares the mean of its ranks.
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], sorted_scores.size]
    mean_rank = (starts + ends + 1) / 2.0
    ranks = np.empty(scores.size, dtype=np.float64)
    ranks[order] = np.repeat(mean_rank, ends - starts)
    return float((ranks[labels].sum() - positives * (positives + 1) / 2.0) / (positives * negatives))


def auc_standard_error(auc: float, positives: int, negatives: int) -> float:
    """The standard error of an AUC measured on this many positive and negative rows (Hanley and McNeil, 1982): how
    far another draw of as many rows would move it, typically; NaN without both classes.

    The test split of a table of a few thousand rows leaves an AUC uncertain in its second decimal (about 0.01 at
    2,000 rows), so that models a few thousandths apart there are not told apart."""
    if not positives or not negatives or math.isnan(auc):
        return float("nan")
    q1, q2 = auc / (2 - auc), 2 * auc * auc / (1 + auc)
    variance = (auc * (1 - auc) + (positives - 1) * (q1 - auc * auc) + (negatives - 1) * (q2 - auc * auc)) / (
        positives * negatives)
    return float(np.sqrt(max(variance, 0.0)))


def log_loss(labels: np.ndarray, probabilities: np.ndarray) -> float:
    """Mean binary cross-entropy, probabilities clipped to [1e-7, 1 - 1e-7]."""
    p = np.clip(np.asarray(probabilities, dtype=np.float64), _EPS, 1 - _EPS)
    y = np.asarray(labels).astype(bool)
    return float(-np.mean(np.where(y, np.log(p), np.log1p(-p))))


class ClickMetrics:
    """Streaming AUC / log loss / positive rate over chunks of (labels, probabilities)."""

    def __init__(self) -> None:
        self._pos = np.zeros(_BINS, dtype=np.int64)
        self._neg = np.zeros(_BINS, dtype=np.int64)
        self._loss = 0.0
        self._rows = 0

    def update(self, labels: np.ndarray, probabilities: np.ndarray) -> None:
        y = np.asarray(labels).astype(bool)
        p = np.asarray(probabilities, dtype=np.float64)
        bins = np.minimum((p * _BINS).astype(np.int64), _BINS - 1)
        self._pos += np.bincount(bins[y], minlength=_BINS)
        self._neg += np.bincount(bins[~y], minlength=_BINS)
        pc = np.clip(p, _EPS, 1 - _EPS)
        self._loss += float(-np.sum(np.where(y, np.log(pc), np.log1p(-pc))))
        self._rows += y.size

    def result(self) -> dict[str, float | int]:
        positives = int(self._pos.sum())
        negatives = int(self._neg.sum())
        if positives and negatives:
            negatives_below = np.cumsum(self._neg) - self._neg
            auc = float((self._pos * (negatives_below + 0.5 * self._neg)).sum() / (positives * negatives))
        else:
            auc = float("nan")
        return {
            "rows": self._rows,
            "positive_rate": positives / self._rows if self._rows else float("nan"),
            "auc": auc,
            "logloss": self._loss / self._rows if self._rows else float("nan"),
        }
