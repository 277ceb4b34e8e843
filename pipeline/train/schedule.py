"""The learning-rate schedule: a pure function of the step, so a resumed run gets the same rates.

Linear warmup from 0 to the peak over ``warmup_steps``, flat until ``decay_start``, then a linear or
cosine decay to ``min_ratio * peak`` at ``total_steps``.

Example::

    lr_at(0, peak=0.1, warmup_steps=10, total_steps=100)            # 0.01 (the first step's lr)
    lr_at(99, peak=0.1, warmup_steps=10, total_steps=100, decay="cosine", min_ratio=0.0)  # ~0.00003
"""

from __future__ import annotations

import math


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
