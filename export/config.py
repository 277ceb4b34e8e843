"""Settings of the export and serving stages."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ExportConfig:
    """What the Triton model repository holds."""

    max_batch_size: int = field(default=1024, metadata={"help": "largest batch one request may carry"})


@dataclass
class ServeConfig:
    """How the Triton server is started."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to bind (loopback unless asked)"})
    http_port: int = field(default=0, metadata={"help": "HTTP port (0: a free one)"})
    grpc_port: int = field(default=0, metadata={"help": "gRPC port (0: a free one)"})
