"""Settings of the training stage."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainConfig:
    """Model, optimizer and loop settings."""

    model: str = field(default="dlrm", metadata={"help": "dlrm | dcnv2 | deepfm | wide_deep"})
    epochs: int = field(default=1, metadata={"help": "passes over the training split"})
    batch_size: int = field(default=2048, metadata={"help": "samples per step (per rank)"})
