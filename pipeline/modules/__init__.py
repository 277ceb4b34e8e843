"""Plain (unsharded) modules: the embedding collection and the models built on it."""

from pipeline.modules.embedding import (
    EmbeddingCollection,
    EmbeddingOptimizerConfig,
    TableConfig,
    TableLayout,
    register_backend,
    resolve_backend,
    tables_from_schema,
)

__all__ = [
    "EmbeddingCollection",
    "EmbeddingOptimizerConfig",
    "TableConfig",
    "TableLayout",
    "register_backend",
    "resolve_backend",
    "tables_from_schema",
]
