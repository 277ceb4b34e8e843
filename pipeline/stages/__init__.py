"""The pipeline's runners: the one place that knows every stage and the whole pipeline's settings.

``config`` composes the library packages' own config dataclasses into :class:`PipelineConfig`;
``cli`` is ``python -m pipeline``; ``data``, ``etl``, ``train``, ``export`` and ``serve`` run their stage from a
``PipelineConfig`` (each module's ``run``). Library packages never import this package.

Example::

    from pipeline.stages import data
    from pipeline.stages.config import load_config

    data.run(load_config(None, ["data.rows=200000"]))
"""
