"""pipeline: an end-to-end recommender toolkit (ETL -> async loader -> embedding training -> Triton).

The stages are sub-packages, each usable alone: ``pipeline.data`` (synthetic generator, readers),
``pipeline.etl`` (NVTabular-style ops on Dask), ``pipeline.loader``, ``pipeline.modules``,
``pipeline.train``, ``pipeline.distributed``, ``pipeline.kernels``; the Triton side is ``export``.
"""

__version__ = "0.1.0"
