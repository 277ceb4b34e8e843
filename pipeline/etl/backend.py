"""The dataframe backend: pandas on CPU, cuDF on GPU, chosen explicitly and imported lazily.

``backend_for(device)`` maps the resolved device to a backend (cpu -> pandas, cuda -> cudf).
cuDF is imported only when it is chosen; if it is missing, the error says so and how to proceed.

Example::

    backend = backend_for(resolve_device("auto"))   # "pandas" on a machine without a GPU
    read_parquet("data/raw/train", ["C1", "I1"], backend)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.errors import UserError

BACKENDS = ("pandas", "cudf")


class BackendError(UserError):
    """The chosen dataframe backend cannot be used here."""


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "cudf":
        try:
            import cudf  # noqa: F401
            import dask_cudf  # noqa: F401
        except ImportError as err:
            raise BackendError(
                f"the cudf backend was chosen (device cuda) but {err.name or 'cudf'} is not importable: "
                "install RAPIDS (environment.yml, or the [gpu] extra) or use --device cpu"
            ) from err
    return backend


def backend_for(device: Any) -> str:
    """``"cudf"`` for a CUDA device, ``"pandas"`` for the CPU."""
    return "cudf" if getattr(device, "is_cuda", False) else "pandas"


def read_parquet(path: str | Path | list, columns: list[str] | None, backend: str) -> Any:
    """A lazy Dask DataFrame over parquet files, with arrow-backed dtypes on the pandas backend."""
    import dask
    import dask.dataframe as dd

    check_backend(backend)
    paths = [str(p) for p in path] if isinstance(path, list) else str(path)
    if backend == "cudf":
        with dask.config.set({"dataframe.backend": "cudf"}):
            return dd.read_parquet(paths, columns=columns)
    return dd.read_parquet(paths, columns=columns, dtype_backend="pyarrow")
