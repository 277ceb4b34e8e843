"""The learning-rate schedule: a pure function of the step, so a resumed run gets the same rates.

Linear warmup from 0 to the peak over ``warmup_steps``, flat until ``decay_start``, then a linear or
cosine decay to ``min_ratio * peak`` at ``total_steps``. :func:`warmup_steps` sizes the warmup as a
fraction of the run, so a short run reaches its peak and decays as a long one does. :func:`epochs_for`
sizes the run itself when ``train.epochs`` is left to choose.

Example::

    warmup_steps(36, fraction=0.2)                                  # 8

    lr_at(0, peak=0.1, warmup_steps=10, total_steps=100)            # 0.01 (the first step's lr)
    lr_at(99, peak=0.1, warmup_steps=10, total_steps=100, decay="cosine", min_ratio=0.0)  # ~0.00003
"""

from __future__ import annotations

import math

# Fewer optimizer steps than this do not train a model to its quality, whatever the learning rate.
MIN_AUTO_STEPS = 300


def epochs_for(steps_per_epoch: int, epochs: int = 0) -> int:
    """``epochs`` when set, else one pass over the data, or as many passes as give ``MIN_AUTO_STEPS`` steps when
    one pass is shorter (a small table: early stopping then ends the run when validation stops improving)."""
    if epochs > 0:
        return epochs
    return max(1, math.ceil(MIN_AUTO_STEPS / max(1, steps_per_epoch)))


def warmup_steps(total_steps: int, fraction: float, steps: int = 0) -> int:
    """The warmup of a run of ``total_steps``: ``steps`` when set, else ``fraction`` of the run (at least one
    step when ``fraction > 0``), always leaving the last step to the decay."""
    if steps > 0:
        return steps
    if fraction <= 0 or total_steps <= 1:
        return 0
    return min(total_steps - 1, max(1, math.ceil(fraction * total_steps)))


def lr_at(step: int, peak: float, warmup_steps: int, total_steps: int, decay: str = "cosine",
          decay_start: int = 0, min_ratio: float = 0.1) -> float:
    """The lr of step ``step`` (0-based) of ``total_steps``."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    start = max(decay_start, warmup_steps)
    if decay == "none" or step < start or total_steps <= start:
        return peak
    progress = min(1.0, (step - start) / max(1, total_steps - 1 - start))
    if decay == "linear":
        factor = 1.0 - progress
    elif decay == "cosine":
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"decay: expected none, linear or cosine, got {decay!r}")
    return peak * (min_ratio + (1.0 - min_ratio) * factor)
