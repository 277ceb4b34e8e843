"""The data stage's runner: make the synthetic data or ingest a Criteo / table file into the raw layout.

``ensure_raw`` is what the ETL and the notebooks call: it returns the raw dataset, generating or
ingesting only when ``cfg.paths.raw`` does not already hold data made with the same parameters
(``meta.json``'s ``params``), and says why when it (re)builds.

Example::

    cfg = load_config(None, ["data.rows=200000"])
    raw = ensure_raw(cfg)          # generates once, then reuses
    raw.splits["train"], raw.oracle["test"]["auc"]

    python -m pipeline data data.source=criteo data.path=day_0.gz data.on_bad_lines=skip
"""

from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing
import os
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor

from pipeline.data import ingest, raw_folder, synthetic
from pipeline.data.metrics import ClickMetrics
from pipeline.data.raw_folder import RawDataset
from pipeline.device import resolve_device
from pipeline.errors import UserError
from pipeline.files import FileLock, write_json
from pipeline.progress import Progress
from pipeline.stages.config import PipelineConfig

PARALLEL_FROM_ROWS = 4_000_000
"""Synthetic data of this many rows or more is made by one process per core (``data.workers=0``)."""


def run(cfg: PipelineConfig) -> dict:
    """``python -m pipeline data``: make sure the raw data exists; return a summary."""
    start = time.perf_counter()
    with raw_folder.raw_lock(cfg.paths.raw) as lock:
        raw, built = _ensure(cfg, lock)
    summary = {
        "raw": str(raw.root),
        "source": raw.source,
        "rebuilt": built,
        "rows": raw.rows,
        "columns": {"continuous": len(raw.continuous), "categorical": len(raw.categorical),
                    "multihot": len(raw.multihot)},
        "seconds": round(time.perf_counter() - start, 2),
    }
    if raw.oracle:
        summary["oracle_test_auc"] = raw.oracle["test"]["auc"]
    print(f"[data] {summary}", flush=True)
    return summary


def ensure_raw(cfg: PipelineConfig) -> RawDataset:
    """The raw dataset of ``cfg``, generated or ingested only if ``cfg.paths.raw`` lacks it."""
    with raw_in_use(cfg) as raw:
        return raw


@contextlib.contextmanager
def raw_in_use(cfg: PipelineConfig) -> Iterator[RawDataset]:
    """:func:`ensure_raw` for a reader: the raw dataset, under a lock that keeps other processes from making it
    again until the block ends."""
    with raw_folder.raw_lock(cfg.paths.raw) as lock:
        yield _ensure(cfg, lock)[0]


def raw_changes(cfg: PipelineConfig) -> list[str]:
    """Which of the settings and input files (``meta.json``'s ``params``: ``inputs``, ``rows`` ...) now differ from
    those ``cfg.paths.raw`` was made from; none: the same, no raw data yet, inputs that cannot be looked at now, or a
    dataset ingested from files and named alone (``data.name=X``), which is used as it was made."""
    meta = raw_folder.read_meta(cfg.paths.raw)
    if meta is None:
        return []
    try:
        params = raw_params(cfg)
    except UserError:
        return []
    old = meta.get("params", {})
    if old.get("source", "synthetic") != "synthetic" and cfg.data.source == "synthetic":
        return []
    return _changed(old, params)


def _changed(old: dict, new: dict) -> list[str]:
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


def _change_detail(old: dict, new: dict) -> str:
    """What differs between two ``params`` of ``meta.json``, in words: each setting's value before and after, each
    input file added, no longer given, or changed (its size, its modification time, its split)."""
    said = []
    for key in _changed(old, new):
        if key == "inputs":
            said.append(_input_changes(old.get("inputs") or [], new.get("inputs") or []))
        else:
            said.append(f"{key}: {old.get(key)!r} -> {new.get(key)!r}")
    return ", ".join(said)


def _input_changes(old: list[dict], new: list[dict]) -> str:
    before = {i.get("path"): i for i in old}
    after = {i.get("path"): i for i in new}
    said = [f"{path} added" for path in after if path not in before]
    said += [f"{path} no longer given" for path in before if path not in after]
    for path in [p for p in after if p in before and before[p] != after[p]]:
        was, now = before[path], after[path]
        what = [_input_change(key, was.get(key), now.get(key))
                for key in sorted(set(was) | set(now)) if was.get(key) != now.get(key)]
        said.append(f"{path} changed ({', '.join(what)})")
    return "input files: " + "; ".join(said)


def _input_change(key: str, was: object, now: object) -> str:
    if key == "mtime_ns":
        return "modified since"
    if key == "bytes" and isinstance(was, int) and isinstance(now, int):
        return f"{was:,} -> {now:,} bytes"
    return f"{key} {was!r} -> {now!r}"


def raw_params(cfg: PipelineConfig) -> dict:
    """The settings that determine the raw data (what ``meta.json`` records as ``params``)."""
    d = cfg.data
    params: dict = {"source": d.source, "seed": cfg.seed}
    if d.source == "synthetic":
        params.update(generator_version=synthetic.GENERATOR_VERSION, rows=d.rows, size=d.size,
                      valid_fraction=d.valid_fraction, test_fraction=d.test_fraction)
    else:
        params.update(ingest.ingest_params(d))
    return params


def text_array_module(cfg: PipelineConfig) -> str | None:
    """What parses input text (Criteo, a CSV / TSV table) as ``data.reader`` asks: ``"cupy"`` or ``"numpy"``
    (vectorized), or None (``pyarrow.csv``). ``auto`` takes the GPU where the device is cuda and CuPy works there
    (a CuPy that does not is said in one line, and Arrow parses)."""
    d = cfg.data
    has_cupy = importlib.util.find_spec("cupy") is not None
    if (d.source == "synthetic" or d.reader == "arrow" or (d.reader == "auto" and not has_cupy)
            or not ingest.reads_text(d)):
        return None
    cuda = resolve_device(cfg.device).is_cuda
    if d.reader == "vectorized" and cuda and not has_cupy:
        raise UserError("data.reader=vectorized on the GPU needs CuPy (pip install cupy-cuda13x); "
                        "or set device=cpu to parse with numpy")
    module = ("cupy" if cuda else "numpy") if d.reader == "vectorized" else ("cupy" if cuda else None)
    if module == "cupy" and d.reader == "auto" and (problem := _cupy_problem()):
        print(f"[data] CuPy does not work here ({problem}): text parsed with pyarrow (data.reader=auto)",
              flush=True)
        return None
    if module:
        print(f"[data] text parsed with {module} (data.reader={d.reader})", flush=True)
    return module


def _cupy_problem() -> str | None:
    """Why CuPy cannot run a kernel on the current GPU, or None when it can."""
    try:
        import cupy

        cupy.arange(2).sum().get()
    except Exception as err:  # noqa: BLE001 -- any failure of an installed CuPy means: parse with Arrow
        return " ".join(f"{type(err).__name__}: {err}".split())[:200]
    return None


def _ensure(cfg: PipelineConfig, lock: FileLock) -> tuple[RawDataset, bool]:
    """The dataset, and whether it was made now, with ``lock`` (:func:`raw_folder.raw_lock`) held shared: when
    :func:`_reusable` finds none to use, the lock is made exclusive, which waits for the other readers, and the data
    is made unless another process made it meanwhile. The lock stays exclusive then: given back shared, another
    process waiting to make other data could take it first (``flock`` changes are not atomic)."""
    params = raw_params(cfg)
    raw = _reusable(cfg, params)
    if raw is not None:
        return raw, False
    waited = lock.change(shared=False, wait=f"[data] {cfg.paths.raw} is read or made by another process: waiting "
                         "for it to end")
    if waited and (raw := _reusable(cfg, params)) is not None:
        return raw, False
    raw_folder.clear(cfg.paths.raw)
    try:
        if cfg.data.source == "synthetic":
            _generate(cfg, params)
        else:
            ingest.ingest(cfg.data, cfg.seed, cfg.paths.raw, params, progress=cfg.progress,
                          array_module=text_array_module(cfg))
    except BaseException:
        raw_folder.clear_splits(cfg.paths.raw)
        raise
    return RawDataset.load(cfg.paths.raw), True


def _reusable(cfg: PipelineConfig, params: dict) -> RawDataset | None:
    """The dataset as it is when its settings match, or when it was ingested from files and the settings
    do not name a source (``data.name=X`` alone); None (saying why) where it is to be made: missing, or
    synthetic with other settings, or ingested with other reading settings from the same, unchanged files.
    It is replaced by other (or changed) files only with ``data.rebuild=true``, since what it was made from
    may be gone. A dataset whose parts do not hold the rows ``meta.json`` records (a part removed, added or
    truncated) is made again from what made it."""
    root = cfg.paths.raw
    meta = raw_folder.read_meta(root)
    damage = raw_folder.damage(root, meta) if meta is not None else None
    if meta is not None and meta.get("params") == params:
        if damage is None:
            return RawDataset.load(root)
        print(f"[data] {damage}: building it again", flush=True)
    elif meta is None:
        print(f"[data] no finished raw data in {root}: building it", flush=True)
    else:
        old = meta.get("params", {})
        detail = _change_detail(old, params)
        from_files = old.get("source", "synthetic") != "synthetic"
        other_files = old.get("inputs") != params.get("inputs")
        if from_files and other_files and not cfg.data.rebuild:
            if cfg.data.source == "synthetic":
                inputs = ", ".join(i["path"] for i in old.get("inputs", [])) or "files"
                if damage is not None:
                    raise UserError(f"{damage}: the dataset is damaged; make it again from {inputs} with the "
                                    f"settings it was made with (data.source={old['source']}, data.path=...)")
                print(f"[data] using {root} as it was made (source {old['source']}, from {inputs}); "
                      "data.rebuild=true makes it again", flush=True)
                return RawDataset.load(root)
            raise UserError(f"{root} was ingested from other files, or they changed since ({detail}); "
                            f"data.rebuild=true replaces it, or give another data.name")
        print(f"[data] {root} was made with other settings ({detail}): rebuilding it", flush=True)
    return None


def _generate(cfg: PipelineConfig, params: dict) -> None:
    d = cfg.data
    root = cfg.paths.raw
    model = synthetic.ClickModel.create(cfg.seed, d.size)
    rows = synthetic.split_rows(d.rows, d.valid_fraction, d.test_fraction)
    chunks = sum(-(-n // d.chunk_rows) for n in rows.values())
    workers = d.workers or ((os.cpu_count() or 1) if d.rows >= PARALLEL_FROM_ROWS else 1)
    oracle = {}
    with contextlib.ExitStack() as stack:
        pool = None
        if workers > 1:  # blocks are independent: each process makes whole blocks, sharing no GIL
            pool = stack.enter_context(ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")))
        bar = stack.enter_context(Progress("synthetic data", total=chunks, unit="chunk", mode=cfg.progress))
        for split, n in rows.items():
            writer = raw_folder.PartWriter(root / split, d.chunk_rows)
            metrics = ClickMetrics()
            for chunk in synthetic.iter_split(model, split, n, d.chunk_rows, pool, ahead=2 * workers):
                writer.write(chunk.table)
                metrics.update(chunk.table.column(synthetic.LABEL).to_numpy(), chunk.probability)
                bar.update(1)
            writer.close()
            oracle[split] = metrics.result()
    write_json(root / raw_folder.ORACLE, oracle)
    write_json(root / raw_folder.META, {
        "version": raw_folder.RAW_VERSION,
        "source": "synthetic",
        "params": params,
        "label": synthetic.LABEL,
        "continuous": list(synthetic.CONTINUOUS),
        "categorical": list(synthetic.CATEGORICAL),
        "multihot": [],
        "rows": rows,
    })
