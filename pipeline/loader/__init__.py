"""The asynchronous dataloader: the ETL's parquet files -> ``Batch(dense, sparse, label)`` on a device.

Example::

    from pipeline.loader import Loader

    with Loader("data/synthetic/processed/train", batch_size=4096, shuffle=True, device="cuda") as loader:
        for batch in loader:
            batch.dense, batch.sparse, batch.label   # [B, n_continuous] float32, KeyedJaggedTensor, [B] float32
"""

from pipeline.loader.batch import Batch
from pipeline.loader.loader import Loader, LoaderStateError

__all__ = ["Batch", "Loader", "LoaderStateError"]
