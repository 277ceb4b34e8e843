"""Plain (unsharded) modules: the embedding collection, its configs and backends, and the models built on it."""

from pipeline.modules.backends import register_backend, resolve_backend
from pipeline.modules.collection import EmbeddingCollection
from pipeline.modules.configs import EmbeddingOptimizerConfig, TableConfig, tables_from_schema

__all__ = [
    "EmbeddingCollection",
    "EmbeddingOptimizerConfig",
    "TableConfig",
    "register_backend",
    "resolve_backend",
    "tables_from_schema",
]
