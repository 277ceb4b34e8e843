"""What a serving instance of the embedding lookup does besides looking up: built from Triton's
``initialize`` arguments, refreshed to new store versions, and reporting its cache counters.

Used by the ``embedding`` model and by ``ranker`` (embedding and dense in one model). Every 0.2 s a
background thread switches to a newer store version (so an instance that gets no request switches
too, and lets go of the versions export prunes) and writes the counters to
``stats/instance-<pid>.json`` beside the store (see :func:`export.repository.cache_stats`); the
model also refreshes before each batch, so the first request after an update gets the new version.
A ``KIND_GPU`` instance caches hot rows in its GPU's memory.

Example (inside a ``model.py``)::

    self.instance = LookupInstance(args, params, pb_utils.Logger.log_error)
    self.instance.refresh()                               # before each batch
    pooled = self.instance.pooled(features)
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from export.lookup import EmbeddingLookup, LookupConfig
from export.preprocess import CATEGORICAL_IDS, MULTIHOT_IDS, MULTIHOT_LENGTHS
from pipeline.files import write_text

STATS_EVERY_S = 0.2


class LookupInstance:
    """An :class:`EmbeddingLookup` over ``<model dir>/store``, refreshed and its counters written in the background;
    ``log_error`` says why a new store version is not served."""

    def __init__(self, args: dict, params: dict[str, str], log_error: Callable[[str], None]) -> None:
        model_dir = Path(args["model_repository"])
        config = LookupConfig.load(model_dir / args["model_version"] / "layout.json")
        policy = params.get("cache_policy", "lru")
        if args.get("model_instance_kind") == "GPU" and policy != "none":
            import torch

            torch.cuda.set_device(int(args["model_instance_device_id"]))
            policy = f"gpu-{policy}"
        self.lookup = EmbeddingLookup(model_dir / "store", config, policy=policy,
                                      cache_fraction=float(params.get("cache_fraction", "0.25")))
        self._stats_path = model_dir / "stats" / f"instance-{os.getpid()}.json"
        self._stats_path.parent.mkdir(exist_ok=True)
        self._log_error = log_error
        self._lock = threading.Lock()  # one version per lookup: the background thread refreshes too
        self._stop = threading.Event()
        self._writer = threading.Thread(target=self._background_loop, daemon=True)
        self._writer.start()

    def refresh(self) -> None:
        """Switch to a newer store version; if it can't be opened, keep serving the current one and say so once."""
        with self._lock:
            try:
                self.lookup.refresh()
            except Exception as err:  # noqa: BLE001
                self._log_error(f"store version {self.lookup.version} kept, the new one in "
                                f"{self.lookup.store_root} could not be opened: {err}; it is not tried again "
                                "until another is written (export.update=true)")

    def pooled(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        with self._lock:
            return self.lookup(inputs.get(CATEGORICAL_IDS), inputs.get(MULTIHOT_IDS), inputs.get(MULTIHOT_LENGTHS))

    def close(self) -> None:
        self._stop.set()
        self._writer.join(timeout=2)

    def _background_loop(self) -> None:
        last = None
        while not self._stop.wait(STATS_EVERY_S):
            self.refresh()
            last = self._write(last)
        self._write(None)

    def _write(self, last: str | None) -> str:
        with self._lock:
            text = json.dumps(self.lookup.stats())
        if text != last:
            write_text(self._stats_path, text)
        return text
