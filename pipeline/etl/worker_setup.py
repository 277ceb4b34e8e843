"""Set up each worker process of the ETL's local cluster (a Dask preload: ``dask_setup`` runs in the worker).

A terminal's Ctrl-C reaches every process of its group: the workers printed a traceback each, where the
pipeline's own process ends the cluster and says ``interrupted``. The workers ignore it.
"""

from __future__ import annotations

import signal
from typing import Any


def dask_setup(worker: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
