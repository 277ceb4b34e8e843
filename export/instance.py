"""What a serving instance of the embedding lookup does besides looking up: built from Triton's
``initialize`` arguments, refreshed to new store versions, and reporting its cache counters.

Used by the ``embedding`` model and by ``ranker`` (embedding and dense in one model). Counters are
written every 0.2 s to ``stats/instance-<pid>.json`` beside the store (see
:func:`export.repository.cache_stats`); a ``KIND_GPU`` instance caches hot rows in its GPU's memory.

Example (inside a ``model.py``)::

    self.instance = LookupInstance(args, params)
    self.instance.refresh(pb_utils.Logger.log_error)      # before each batch
    pooled = self.instance.lookup(categorical_ids)
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
    """An :class:`EmbeddingLookup` over ``<model dir>/store``, with its counters written in the background."""

    def __init__(self, args: dict, params: dict[str, str]) -> None:
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
        self._stop = threading.Event()
        self._writer = threading.Thread(target=self._write_loop, daemon=True)
        self._writer.start()

    def refresh(self, log_error: Callable[[str], None]) -> None:
        """Switch to a newer store version; if it can't be opened, keep serving the current one and say so once."""
        try:
            self.lookup.refresh()
        except Exception as err:  # noqa: BLE001
            log_error(f"store version {self.lookup.version} kept, the new one in {self.lookup.store_root} could not "
                      f"be opened: {err}; it is not tried again until another is written (export.update=true)")

    def pooled(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        return self.lookup(inputs.get(CATEGORICAL_IDS), inputs.get(MULTIHOT_IDS), inputs.get(MULTIHOT_LENGTHS))

    def close(self) -> None:
        self._stop.set()
        self._writer.join(timeout=2)

    def _write_loop(self) -> None:
        last = None
        while not self._stop.wait(STATS_EVERY_S):
            last = self._write(last)
        self._write(None)

    def _write(self, last: str | None) -> str:
        text = json.dumps(self.lookup.stats())
        if text != last:
            write_text(self._stats_path, text)
        return text
