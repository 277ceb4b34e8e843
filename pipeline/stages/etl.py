"""The ETL stage's runner: raw parquet -> processed parquet + ``schema.json`` + the saved workflow.

``python -m pipeline run etl`` (or ``run(cfg)``) makes sure the raw data exists, builds the
default workflow from the column roles in ``raw/meta.json`` (:mod:`pipeline.etl.defaults`), fits
it on ``train``, transforms ``train``, ``valid`` and ``test``, and writes
(:mod:`pipeline.etl.output`)::

    processed/{train,valid,test}/part-*.parquet   label float32, continuous float32 (no nulls),
                                                  categorical int32 codes, multi-hot list<int32>
    processed/schema.json                         roles, dtypes, cardinalities, rows per split
    workflow/                                     the fitted workflow (Workflow.load)

Example::

    python -m pipeline run etl data.rows=200000 etl.freq_threshold=2 'etl.hash_buckets={C3: 100000}'
"""

from __future__ import annotations

import time
from typing import Any

from pipeline.etl.cluster import etl_client
from pipeline.etl.defaults import default_workflow, roles_of
from pipeline.etl.frame_library import choose_frame_library, read_parquet
from pipeline.etl.ops import Categorify, Normalize
from pipeline.etl.output import SPLITS, write_outputs
from pipeline.etl.raw_check import check_labels, check_raw_files
from pipeline.etl.workflow import Workflow
from pipeline.schema import processed_lock
from pipeline.stages.config import PipelineConfig
from pipeline.stages.data import raw_in_use


def run(cfg: PipelineConfig) -> dict:
    """Fit on train, transform every split, write parquet + schema + workflow; return a summary."""
    start = time.perf_counter()
    library, reason = choose_frame_library(cfg.device)
    print(f"[etl] {library} backend ({reason})", flush=True)
    with raw_in_use(cfg) as raw, processed_lock(cfg.paths.processed, shared=False):
        return _run(cfg, raw, library, start)


def _run(cfg: PipelineConfig, raw: Any, library: str, start: float) -> dict:
    """The ETL of ``raw`` (a :class:`~pipeline.data.raw_folder.RawDataset`), under the lock on its output."""
    roles = roles_of(raw)
    check_raw_files(raw.splits, roles)
    check_labels(raw.splits, roles["label"])
    workflow = default_workflow(roles, cfg.etl, library=library)
    files = [f for split in SPLITS for f in raw.splits[split]]
    input_bytes = sum(f.stat().st_size for f in files)
    timings = {}
    with etl_client(cfg.etl, input_bytes=input_bytes, library=library) as where:
        print(f"[etl] running on {where}", flush=True)
        t = time.perf_counter()
        workflow.fit(read_parquet(raw.splits["train"], workflow.input_columns, library), progress=cfg.progress)
        timings["fit_s"] = round(time.perf_counter() - t, 2)
        _note_unservable_values(workflow)
        _note_uninformative_features(workflow)
        t = time.perf_counter()
        rows, schema = write_outputs(workflow, raw.splits, roles, cfg.etl, cfg.paths.processed, cfg.paths.workflow,
                                     cfg.paths.schema, library, progress=cfg.progress)
        timings["transform_s"] = round(time.perf_counter() - t, 2)
    summary = {
        "processed": str(cfg.paths.processed),
        "schema": str(cfg.paths.schema),
        "workflow": str(cfg.paths.workflow),
        "backend": library,
        "cluster": where,
        "rows": rows,
        "cardinalities": schema.cardinalities(),
        **timings,
        "seconds": round(time.perf_counter() - start, 2),
    }
    print(f"[etl] wrote {rows} rows to {cfg.paths.processed} in {summary['seconds']} s", flush=True)
    return summary


def _note_unservable_values(workflow: Workflow) -> None:
    """Say which categorical values a served request cannot carry (they train, but a request holding one is
    refused), so that it is known before the serving stage meets them."""
    for op, _ in workflow.operators():
        if isinstance(op, Categorify):
            for name, values in op.values_ending_in_zero_byte().items():
                shown = ", ".join(repr(v) for v in values[:3]) + (", ..." if len(values) > 3 else "")
                print(f"[etl] note: column {name}: {len(values)} of its values end in a zero byte ({shown}), which a "
                      "served request cannot carry (requests holding one are refused): strip the zero bytes in the "
                      "input if they are padding", flush=True)


def _note_uninformative_features(workflow: Workflow) -> None:
    """Name the features whose training rows tell the model nothing, so that a column read wrong or left empty by
    an export is seen before training on it: a categorical one with no value in its vocabulary (each row missing, or
    every value rarer than ``etl.freq_threshold``: only its being missing is left), a continuous one holding one value
    or none (the model sees 0 for it)."""
    empty, constant = [], []
    for op, _ in workflow.operators():
        if isinstance(op, Categorify):
            empty += [name for name, vocabulary in op.vocabularies.items() if len(vocabulary) == 0]
        elif isinstance(op, Normalize):
            constant += [name for name in op.stds if op.divisor(name) == float("inf")]
    said = []
    if empty:
        said.append(f"{', '.join(empty)} kept no value in the training rows (each missing, or rarer than "
                    "etl.freq_threshold): only whether it is missing is left")
    if constant:
        said.append(f"{', '.join(constant)} held one value or none in the training rows: the model sees 0 for it")
    if said:
        print(f"[etl] note: {'; '.join(said)}. A column that tells nothing can be dropped with data.ignore",
              flush=True)
