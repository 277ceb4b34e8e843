"""Training: ``python -m pipeline run train``.

``stage`` (``run(cfg)``, the stage's runner), ``driver`` (``train``: one process or N ranks),
``loop`` (``Trainer``, ``Callback``), ``model`` (``model_spec``, ``model_from_spec``,
``load_trained``), ``runs`` (a folder per run and ``latest``), ``checkpoint`` (plain and sharded
formats), ``schedule`` (``lr_at``), ``evaluate`` and ``config`` (``TrainConfig``). Nothing is imported here, so that reading the
settings (``pipeline.stages.config`` imports ``pipeline.train.config``) stays light.
"""
