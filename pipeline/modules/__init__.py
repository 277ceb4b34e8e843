"""Plain (unsharded) modules: the embedding collection (with host-cached tables too), its configs and backends,
and the models built on it."""

from pipeline.modules.backends import register_backend, resolve_backend
from pipeline.modules.cached_collection import HostCachedCollection
from pipeline.modules.collection import EmbeddingCollection
from pipeline.modules.configs import EmbeddingOptimizerConfig, TableConfig, tables_from_schema

__all__ = [
    "EmbeddingCollection",
    "EmbeddingOptimizerConfig",
    "HostCachedCollection",
    "TableConfig",
    "register_backend",
    "resolve_backend",
    "tables_from_schema",
]
