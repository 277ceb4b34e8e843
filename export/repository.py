"""Write the Triton model repository of a trained model: raw rows -> probabilities, served as ``ensemble``.

Layout (``<workdir>/<dataset>/export``)::

    ensemble/config.pbtxt     1/model.py   1/artifacts/{raw_columns.json, schema.json, workflow/}
                              1/layout.json   1/model.pt   store/{CURRENT, v000001/00000.npy ...}
    export.json               what was exported, from where (``trained``: the training run), the store version,
                              and every other file written but the store's, with its size (``files``)

``ensemble`` is there one python model (``triton_models/ranker.py``) that runs the workflow, the lookup and the dense
part. With ``ModelOptions(fused=False)`` (``export.fuse=none``), ``ensemble`` is a Triton ensemble of the three
models of the chain, each with its part of the files above::

    ensemble/config.pbtxt     1/
    preprocess/config.pbtxt   1/model.py   1/artifacts/{raw_columns.json, schema.json, workflow/}
    embedding/config.pbtxt    1/model.py   1/layout.json   store/
    dense/config.pbtxt        1/model.py   1/model.pt      (TorchScript; the pytorch backend reads it too)

:func:`check_repository` finds a file of those that is gone or of another size, or a store whose current
version does not open, before a server is started on the repository.

``update=True`` writes only a new version of the embedding store (every running instance of the model
that holds it switches to it, without a restart: see :mod:`export.instance`); the dense part must be unchanged, since
serving new tables with an old dense part (or the reverse) would mix two models.

Example::

    raw = raw_columns(RawDataset.load("data/synthetic/raw"), list_separator="|")
    summary = write_repository(model, schema, "data/synthetic/workflow", raw, "data/synthetic/export")
    summary["store_version"]     # 1
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from export.dense import save_dense
from export.instance import live_stats
from export.lookup import LookupConfig
from export.pbtxt import ENTRY, EnsembleSpec, ModelOptions, model_configs
from export.preprocess import RawColumns
from export.store import current_version, open_current, write_version
from pipeline.data.raw_folder import RawDataset
from pipeline.errors import UserError
from pipeline.files import full_disk_named, write_json
from pipeline.schema import Schema

MODELS_SOURCE = Path(__file__).parent / "triton_models"
FUSED_SOURCE = "ranker.py"
"""The python model of a fused export (the workflow, the lookup and the dense part in one), served as ``ensemble``."""
EXPORT_RECORD = "export.json"


def dense_fingerprint(model) -> str:
    """A hash of the dense part's parameters and buffers (what ``update`` must leave unchanged)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.dense_part().state_dict().items()):
        if name.startswith("model.embedding."):
            continue
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def embedding_tables(model) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Every table of the model's embedding collection, as ``[rows, dim]`` numpy arrays, and the ids of the
    dynamic ones: the rows of their ids in ascending order of the ids, then a zero row (see :mod:`export.store`)."""
    collection = model.embedding
    tables, keys = {}, {}
    for name in collection.packing.table_names:
        weight = collection.table_weight(name).detach()
        if collection.dynamic is not None and name in collection.dynamic.tables:
            content = collection.dynamic[name].content({"weight": weight})
            order = torch.argsort(content["keys"])
            keys[name] = content["keys"][order].cpu().numpy()
            weight = torch.cat([content["rows"]["weight"][order], weight.new_zeros(1, weight.shape[1])])
        weight = weight.cpu()
        if weight.dtype == torch.bfloat16:
            weight = weight.float()  # numpy has no bfloat16; the widening is exact
        tables[name] = weight.numpy()
    return tables, keys


def raw_columns(raw_data: RawDataset, list_separator: str) -> RawColumns:
    """The request columns, typed as the raw parquet files are. Every file's footer is read: a column of integers in
    one file and of floats in another (as a user's files may type it) takes floats, so every file's rows can be
    served. Inside a multi-hot cell items are cut at the dataset's own ``data.list_separator`` (``list_separator``
    where it records none); the label column a request may carry is the table's own (``data.label``)."""
    files = [f for split in ("train", "test", "valid") for f in raw_data.splits.get(split, [])]
    if not files:
        raise UserError(f"no raw parquet files under {raw_data.root}: run `python -m pipeline data` first")
    arrow_schema = pa.unify_schemas([pq.read_schema(f) for f in files], promote_options="permissive")
    made_with = raw_data.params or {}
    return RawColumns.from_arrow(arrow_schema, raw_data.continuous, raw_data.categorical, raw_data.multihot,
                                 made_with.get("list_separator", list_separator), label=raw_data.label,
                                 table_label=made_with.get("roles", {}).get("label", ""),
                                 integer_text=integer_text_columns(files[0], raw_data.categorical + raw_data.multihot),
                                 unread=unread_columns(raw_data))


def unread_columns(raw_data: RawDataset) -> list[str]:
    """The columns of the user's table that no role makes a feature: its time column (``data.time_column``, which
    orders the splits) where no role lists it, and those of ``data.ignore``. Rows read from that table carry them."""
    made_with = raw_data.params or {}
    time_column = made_with.get("time_column") or ""
    features = {*raw_data.continuous, *raw_data.categorical, *raw_data.multihot}
    return [*([time_column] if time_column and time_column not in features else []),
            *made_with.get("roles", {}).get("ignore", [])]


INTEGER_TEXT_ROWS = 100_000
"""The training rows whose text tells whether a categorical column holds integers written as such."""


def integer_text_columns(path: Path, names: list[str]) -> list[str]:
    """Those of the text columns ``names`` whose first :data:`INTEGER_TEXT_ROWS` values in the raw parquet file
    ``path`` (items, for a list column) are all integers written as such (``-?[0-9]+``), and there is one at least."""
    file = pq.ParquetFile(path)
    names = [n for n in names if n in file.schema_arrow.names]
    if not names or file.metadata.num_rows == 0:
        return []
    table = next(file.iter_batches(batch_size=INTEGER_TEXT_ROWS, columns=names))
    found = []
    for name in names:
        column = table.column(name)
        values = pc.list_flatten(column) if pa.types.is_list(column.type) or pa.types.is_large_list(column.type) \
            else column
        if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
            continue
        values = values.drop_null()
        if len(values) and pc.all(pc.match_substring_regex(values, r"^-?[0-9]+$")).as_py():
            found.append(name)
    return found


def write_repository(model, schema: Schema, workflow_dir: str | Path, raw: RawColumns, out: str | Path,
                     options: ModelOptions | None = None, update: bool = False, trained: dict | None = None) -> dict:
    """Export ``model`` (a trained RecModel) with its ETL workflow; returns a summary dict.

    ``trained`` describes where the model comes from (its training run, model kind, test AUC); it is
    recorded in ``export.json`` as it is.
    """
    options = options or ModelOptions()
    out = Path(out)
    model = model.eval()
    fingerprint = dense_fingerprint(model)
    workflow_dir = Path(workflow_dir)
    if update:
        return _update_tables(model, out, fingerprint, workflow_dir, trained)
    if not (workflow_dir / "workflow.json").is_file():
        raise UserError(f"no saved workflow at {workflow_dir}: run `python -m pipeline run etl` first")
    spec = EnsembleSpec.build(raw, schema, model.embedding.output_dim)
    configs = model_configs(spec, options)

    staging = out.with_name(f".{out.name}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    try:  # a repository half written (a full disk, an error) leaves nothing behind
        with full_disk_named(out):
            summary = _write_models(staging, model, raw, schema, workflow_dir, configs, options, fingerprint, trained)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    # The previous repository is renamed aside, then removed: the instances of a server running on it write their
    # counters into it, so removing it in place could meet a new file and fail half done.
    old = out.with_name(f".{out.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    staging.rename(out)
    shutil.rmtree(old, ignore_errors=True)
    return {**summary, "repository": str(out)}


def _write_models(staging: Path, model, raw: RawColumns, schema: Schema, workflow_dir: Path, configs: dict[str, str],
                  options: ModelOptions, fingerprint: str, trained: dict | None) -> dict:
    """Every model of the repository under ``staging`` and its record (``export.json``), which it returns."""
    for name, text in configs.items():
        (staging / name / "1").mkdir(parents=True)
        (staging / name / "config.pbtxt").write_text(text)
        if 'backend: "python"' in text:
            source = FUSED_SOURCE if options.fused else f"{name}.py"
            shutil.copyfile(MODELS_SOURCE / source, staging / name / "1" / "model.py")
    preprocess_model, lookup_model, dense_model = (ENTRY,) * 3 if options.fused else \
        ("preprocess", "embedding", "dense")

    artifacts = staging / preprocess_model / "1" / "artifacts"
    shutil.copytree(workflow_dir, artifacts / "workflow")
    raw.save(artifacts / "raw_columns.json")
    schema.save(artifacts / "schema.json")

    LookupConfig.from_collection(model.embedding, schema).save(staging / lookup_model / "1" / "layout.json")
    tables, keys = embedding_tables(model)
    version = write_version(staging / lookup_model / "store", tables, keys=keys, dense=fingerprint)
    save_dense(model, staging / dense_model / "1" / "model.pt")

    summary = {
        "models": list(configs), "preprocess_model": preprocess_model, "lookup_model": lookup_model,
        "store_version": version,
        "dense_fingerprint": fingerprint,
        "embedding_dim_total": model.embedding.output_dim, "tables": model.embedding.packing.table_names,
        "options": vars(options), "trained": trained,
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "files": _file_sizes(staging),
    }
    (staging / EXPORT_RECORD).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _update_tables(model, out: Path, fingerprint: str, workflow_dir: Path, trained: dict | None) -> dict:
    record_path = out / EXPORT_RECORD
    if not record_path.is_file():
        raise UserError(f"export.update=true needs an existing export at {out}; run the export once without it")
    try:
        record = json.loads(record_path.read_text())
        if not {"dense_fingerprint", "tables"} <= set(record):
            raise ValueError("it has no dense_fingerprint or no tables")
    except (OSError, ValueError, TypeError) as err:
        raise UserError(f"{record_path} cannot be read ({err}): export with export.update=false and restart the "
                        "server") from None
    served_workflow = artifacts_dir(out) / "workflow" / "workflow.json"
    if (workflow_dir / "workflow.json").read_bytes() != served_workflow.read_bytes():
        raise UserError("export.update=true replaces only the embedding tables, but the ETL workflow changed since "
                        "the export (ids would no longer match rows): export with export.update=false and restart")
    if record["dense_fingerprint"] != fingerprint:
        raise UserError(
            "export.update=true replaces only the embedding tables, but the checkpoint's dense part differs "
            "from the exported one: export with export.update=false and restart the server")
    tables, keys = embedding_tables(model)
    if sorted(tables) != sorted(record["tables"]):
        raise UserError(f"export.update=true: the model's tables {sorted(tables)} are not the exported "
                        f"{sorted(record['tables'])}; export with export.update=false")
    version = write_version(lookup_dir(out) / "store", tables, keys=keys, dense=fingerprint)
    record["store_version"] = version
    record["trained"] = trained
    record["updated_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    write_json(record_path, record)
    return {**record, "repository": str(out), "updated": True, "previous_version": version - 1}


def _file_sizes(root: Path) -> dict[str, int]:
    """Every file under ``root`` but those of the embedding store (its versions change with updates and carry
    their own manifest), by path relative to ``root``, with its size in bytes."""
    files = (path for path in sorted(root.rglob("*")) if path.is_file())
    return {str(path.relative_to(root)): path.stat().st_size for path in files
            if path.relative_to(root).parts[1:2] != ("store",)}


def check_repository(out: str | Path) -> None:
    """Raise a :class:`UserError` naming what is wrong with the repository at ``out``: no ``export.json``, a file
    export wrote that is gone or of another size, or an embedding store whose current version does not open."""
    out = Path(out)
    again = "run `python -m pipeline run export` again"
    try:
        record = json.loads((out / EXPORT_RECORD).read_text())
    except FileNotFoundError:
        raise UserError(f"no model repository at {out} (no {EXPORT_RECORD}): run `python -m pipeline run export` "
                        "first") from None
    except (OSError, ValueError) as err:
        raise UserError(f"{out / EXPORT_RECORD} cannot be read ({err}): {again}") from None
    for name, size in record.get("files", {}).items():
        path = out / name
        if not path.is_file():
            raise UserError(f"the model repository at {out} is damaged: {name} is missing; {again}")
        if path.stat().st_size != size:
            raise UserError(f"the model repository at {out} is damaged: {name} has {path.stat().st_size} bytes, "
                            f"export wrote {size}; {again}")
    store = lookup_dir(out) / "store"
    try:
        open_current(store)
    except (OSError, ValueError, KeyError, UserError) as err:
        raise UserError(f"the embedding store {store} does not open ({err}); {again}") from None


def store_version(out: str | Path) -> int:
    """The embedding store version the repository at ``out`` serves now."""
    return current_version(lookup_dir(out) / "store")


def lookup_dir(out: str | Path) -> Path:
    """The folder of the model that holds the store: ``ensemble``, or ``embedding`` in the chain of three."""
    return Path(out) / _recorded(out, "lookup_model", "embedding")


def artifacts_dir(out: str | Path) -> Path:
    """The folder of the saved workflow, schema and raw columns: in ``ensemble``, or ``preprocess`` in the chain."""
    return Path(out) / _recorded(out, "preprocess_model", "preprocess") / "1" / "artifacts"


def _recorded(out: str | Path, key: str, default: str) -> str:
    try:
        return json.loads((Path(out) / EXPORT_RECORD).read_text()).get(key, default)
    except FileNotFoundError:
        return default


def cache_stats(out: str | Path) -> dict:
    """The embedding cache counters of the running instances that look up embeddings, summed (written every 0.2 s),
    with ``instances``: how many there are (each warms a cache of its own) and ``model``: the model they serve.

    Only the files of instances whose process runs now count (:func:`export.instance.live_stats`). ``hit_rate``
    is over distinct ids per batch (a GPU instance that holds its tables whole counts every id of the batches it
    serves in one graph as a hit, :meth:`export.lookup.EmbeddingLookup.count_resident`). ``batches`` and ``phases_ns``: the batches that model executed and the host time
    it spent in each phase of them (refresh, inputs, preprocess, lookup, dense, outputs), summed.
    """
    totals = {"model": lookup_dir(out).name, "instances": 0, "hits": 0, "misses": 0, "evictions": 0, "versions": [],
              "batches": 0, "phases_ns": {}}
    for stats in live_stats(lookup_dir(out)):
        totals["instances"] += 1
        for key in ("hits", "misses", "evictions", "batches"):
            totals[key] += stats.get(key, 0)
        for phase, ns in stats.get("phases_ns", {}).items():
            totals["phases_ns"][phase] = totals["phases_ns"].get(phase, 0) + ns
        totals["versions"].append(stats["version"])
        totals.setdefault("policy", stats["policy"])
    seen = totals["hits"] + totals["misses"]
    totals["hit_rate"] = totals["hits"] / seen if seen else 0.0
    return totals
