"""Training: ``python -m pipeline run train``.

``stage`` (``run(cfg)``, ``load_trained(cfg)``), ``loop`` (``Trainer``), ``checkpoint``, ``schedule``
(``lr_at``), ``evaluate`` and ``config`` (``TrainConfig``). Nothing is imported here, so that reading
the settings (``pipeline.config`` imports ``pipeline.train.config``) stays light.
"""
