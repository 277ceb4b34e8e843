"""Set up each worker process of the ETL's local cluster (a Dask preload: ``dask_setup`` runs in the worker).

A terminal's Ctrl-C reaches every process of its group: the workers printed a traceback each, where the
pipeline's own process ends the cluster and says ``interrupted``. The workers ignore it.

A task that refuses its input (a :class:`~pipeline.errors.UserError`, such as a Cast of missing values) is said by
the pipeline's own process in one ``error:`` line; the worker's log of it ("Compute Failed", with the task and its
traceback) is left out. Any other failure is still logged.
"""

from __future__ import annotations

import logging
import signal
from typing import Any

from pipeline.errors import UserError


def dask_setup(worker: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.getLogger("distributed.worker").addFilter(_refusals_said_elsewhere)


def _refusals_said_elsewhere(record: logging.LogRecord) -> bool:
    """False for Dask's log of a task that failed with a UserError (its args: key, state, task, the exception's
    text, its traceback)."""
    if not str(record.msg).startswith("Compute Failed") or not isinstance(record.args, tuple) or len(record.args) < 4:
        return True
    return not str(record.args[3]).startswith(tuple(f"{name}(" for name in _user_error_names(UserError)))


def _user_error_names(kind: type) -> set[str]:
    """The names of ``kind`` and of its subclasses loaded in this process (the failed task loaded its own)."""
    return {kind.__name__}.union(*(_user_error_names(sub) for sub in kind.__subclasses__()))
