"""The training driver: processed data -> a trained model, its metrics and checkpoints, on 1..N ranks.

:func:`train` builds the model of ``cfg.model`` from the schema, trains it on ``<data>/train`` with
the :class:`~pipeline.loader.Loader`, scores ``valid`` along the way and ``test`` at the end. The
:class:`~pipeline.distributed.world.World` it is given decides the rest: on a world of one the
plain model with ``.pt`` checkpoints, its tables that do not fit ``distributed.memory_per_rank_mb``
(or that ``distributed.sharding`` names ``host_cached``) in host memory behind device caches of their
hot rows (:mod:`pipeline.modules.cached_collection`), each batch's rows prefetched into them (and the ids of
its dynamic tables placed) while the batch before trains (``distributed.pipeline``); on N ranks each rank reads its shard of every split, the
model trains through :class:`~pipeline.distributed.model_parallel.DistributedModelParallel` with
sharded checkpoints, each batch's id exchange started while the batch before it trains
(``distributed.pipeline``, :mod:`pipeline.distributed.train_pipeline`), and the scores are computed
over the predictions of every rank. Launch::

    python -m pipeline run train                                  # one process: CPU or the GPU, by device
    python -m pipeline run train train.model=dcnv2 train.resume=true
    python -m pipeline run train --nproc 2                        # 2 ranks on this node, through torchrun
    torchrun --nproc-per-node 2 -m pipeline run train
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 --rdzv-id job1 \\
        -m pipeline run train workdir=/shared/pipeline            # on each of 2 nodes, workdir shared (README.md)

Each training writes its own run folder under ``runs`` (``<workdir>/<dataset>/train``), named by
``train.run`` or by its start and model, and moves ``runs/latest`` to it once it finished (see
:mod:`pipeline.train.runs`); ``train.resume=true`` continues a run in its folder. Outputs in the run
folder (written by global rank 0, which names it for every rank)::

    model.json          what was built (see :mod:`pipeline.train.model`)
    plan.json           N ranks: where each table lives
    model.pt            the kept ``model.state_dict()`` as one process holds it (``load_trained`` reads it):
                        the best epoch's by valid log loss with ``train.early_stopping``, else the last
    checkpoints/        see :mod:`pipeline.train.checkpoint`
    metrics.jsonl       one JSON object per line: training loss / lr / samples/s, valid scores
    result.json         the run's name, test AUC (with its standard error) and log loss (one process: and the
                        oracle's, the gap), throughput, and ``kept``: the epoch and step whose weights were
                        scored (null: the last); with host-cached tables, ``embedding_cache``: each one's
                        training rows found in its device cache; with dynamic tables, ``dynamic_tables``: each
                        one's ids, rows, evictions and admission candidates (both also printed); written last,
                        so a run with a result.json is finished

Example::

    result = train(cfg.train, cfg.paths.processed, cfg.paths.train, schema=schema, seed=cfg.seed)
    cfg.paths.train / result["run"]      # the run's folder; cfg.paths.train / "latest" points at it
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn

from pipeline.distributed.config import DistributedConfig
from pipeline.distributed.model_parallel import DistributedModelParallel, make_planner
from pipeline.distributed.planner import Topology
from pipeline.distributed.planner.estimators import min_cache_rows
from pipeline.distributed.train_pipeline import PrefetchPipeline, SparseDistPipeline
from pipeline.distributed.types import ShardingPlan
from pipeline.distributed.world import World
from pipeline.errors import UserError
from pipeline.files import atomic_open, read_json, remove_tmp_files, write_json
from pipeline.kernels import compile_ahead
from pipeline.loader import Loader
from pipeline.modules.backends import check_backend
from pipeline.modules.cached_collection import HostCachedCollection
from pipeline.modules.configs import WEIGHT_DTYPES
from pipeline.modules.dynamic import DynamicTable
from pipeline.modules.host_cache import CacheStats
from pipeline.modules.models import ModelSizes, lr_width, use_mlp_backend
from pipeline.schema import Schema, processed_lock
from pipeline.train.checkpoint import PlainCheckpoints, ShardedCheckpoints
from pipeline.train.config import TrainConfig
from pipeline.train.evaluate import evaluate
from pipeline.train.loop import Callback, Trainer
from pipeline.train.model import check_same_model, model_from_spec, model_spec
from pipeline.train.runs import LOCK_FILE, choose_run, mark_latest

_WEIGHT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def train(cfg: TrainConfig, data: str | Path, runs: str | Path, *, schema: Schema, seed: int = 0,
          world: World | None = None, distributed: DistributedConfig | None = None, oracle: str | Path | None = None,
          callbacks: Sequence[Callback] = (), progress: str | bool = "auto") -> dict:
    """Train on the splits under ``data`` into a run folder under ``runs``; returns the summary (also
    printed, and on every rank), whose ``run`` names the folder.

    ``distributed`` says how N ranks shard the tables; ``oracle`` is the data generator's
    ``oracle.json`` (the AUC of the true click probabilities), compared with on a world of one;
    ``progress`` is a mode of :mod:`pipeline.progress`, shown by the writer rank.
    """
    world = world or World()
    threads = torch.get_num_threads()
    if world.size == 1:
        # The loader's thread takes one core; torchrun's ranks get their share in World.from_env.
        torch.set_num_threads(cfg.threads if cfg.threads > 0 else max(1, (os.cpu_count() or 2) - 1))
    try:
        with contextlib.ExitStack() as held:  # the run folder's lock, released however the training ends
            return _train(cfg, Path(data), Path(runs), schema, seed, world, distributed or DistributedConfig(),
                          Path(oracle) if oracle else None, callbacks, progress, held)
    finally:
        torch.set_num_threads(threads)


def _train(cfg: TrainConfig, data: Path, runs: Path, schema: Schema, seed: int, world: World,
           distributed: DistributedConfig, oracle_path: Path | None, callbacks: Sequence[Callback],
           progress: str | bool, held: contextlib.ExitStack) -> dict:
    start = time.perf_counter()
    device = world.device
    compile_ahead(device)  # the CUDA kernels the step launches compile meanwhile, side by side
    random.seed(seed)
    torch.manual_seed(seed)

    held.enter_context(processed_lock(data, shared=True))
    check_splits(data, schema)
    oracle = read_json(oracle_path, "remove its raw folder and make the data again (`python -m pipeline data`)") \
        if oracle_path and oracle_path.is_file() else None
    rate = positive_rate(data / "train", schema.label)
    cfg = cfg.for_data(_split_rows(data, schema, "train"), rate, len(schema.sparse),
                       lr_width(cfg.model, ModelSizes.from_train_config(cfg, device.type), schema))
    spec = model_spec(cfg, schema, device.type, seed)
    _check_before_the_run(cfg, spec, distributed, device)
    out = _run_folder(runs, cfg, world, held)
    if world.is_writer:
        remove_tmp_files(out)
        print(f"[train] run {out.name} in {runs}", flush=True)
        print(f"[train] {cfg.optimizer} at lr {cfg.lr:.3g}, tables {cfg.embedding_optimizer} at {cfg.embedding_lr:.3g}, "
              f"weight decay {cfg.weight_decay:.3g}; {rate:.2%} of the training labels positive", flush=True)
        if cfg.mlp_backend == "cublaslt" and device.type != "cuda":
            print(f"[train] train.mlp_backend=cublaslt: cuBLASLt runs the MLPs on a GPU; on {device.type} torch's layers "
                  "run them", flush=True)
        elif cfg.mlp_backend == "cublaslt" and cfg.amp == "off":
            print("[train] train.mlp_backend=cublaslt: cuBLASLt runs the MLPs in half precision; with train.amp=off "
                  "they compute in float32, through torch's layers", flush=True)
        if cfg.amp == "bf16" and device.type != "cuda":
            print(f"[train] train.amp=bf16: bf16 autocast runs on a GPU; on {device.type} the dense part computes in "
                  "float32", flush=True)
    model = model_from_spec(spec, backend=cfg.embedding_backend)
    use_mlp_backend(model, cfg.mlp_backend)
    model.start_at_rate(rate)
    try:
        model, checkpoints = _place(model, cfg, world, distributed, out / "checkpoints", schema)
    except UserError:  # a plan the machine cannot hold: the new run's folder, its lock alone, goes
        if world.is_writer and all(p.name == LOCK_FILE for p in out.iterdir()):
            shutil.rmtree(out, ignore_errors=True)
        raise
    if cfg.resume and checkpoints.candidates():
        for change in check_same_model(spec, out):
            if world.is_writer:
                print(f"[train] resuming with {change}", flush=True)
    world.barrier()  # every rank has read the old model.json before it is replaced
    if world.is_writer:
        write_json(out / "model.json", spec)
        _describe(model, spec, world, out)

    shard = {"rank": world.rank, "world_size": world.size, "device": device, "reader": cfg.reader}
    train_loader = Loader(data / "train", cfg.batch_size, schema=schema, shuffle=True, seed=seed, **shard)
    valid_loader = Loader(data / "valid", cfg.eval_batch_size, schema=schema, **shard)
    test_loader = Loader(data / "test", cfg.eval_batch_size, schema=schema, **shard)
    pipeline = None
    if distributed.pipeline and world.size > 1:
        pipeline = SparseDistPipeline(model, device)
    elif distributed.pipeline and model.embedding.prefetches:
        pipeline = PrefetchPipeline(model, device)
    trainer = Trainer(model, cfg, out, train_loader, world, checkpoints, pipeline)
    if cfg.resume and not checkpoints.candidates() and world.is_writer:
        print(f"[train] train.resume=true but no checkpoint in {checkpoints.folder}: starting fresh", flush=True)
    found = checkpoints.newest_readable() if cfg.resume else None
    if found is not None:
        if world.is_writer:
            checkpoints.remove_stale()
            print(f"[train] resuming from {found}", flush=True)
        world.barrier()
        trainer.resume_from(found)
    else:
        trainer.start_fresh()
    try:
        fitted = trainer.fit(lambda: evaluate(model, valid_loader, device, trainer.amp, world), callbacks, progress)
        kept = fitted["kept"]
        restored = bool(kept) and kept["step"] != kept["last_step"]
        state = checkpoints.model_state(model, spec, restored)  # every rank: a sharded model's parts come together
        if world.is_writer:
            with atomic_open(out / "model.pt") as f:
                torch.save(state, f)
        test = evaluate(model, test_loader, device, trainer.amp, world)
    except KeyboardInterrupt:
        if world.is_writer:
            _how_to_continue(out, trainer.state.step, next(iter(checkpoints.candidates()), None))
        raise
    finally:
        for loader in (train_loader, valid_loader, test_loader):
            loader.close()
    result = _summary(cfg, spec, world, fitted, test, oracle, out, time.perf_counter() - start)
    caches = _cache_stats(model, world)
    if caches:
        result["embedding_cache"] = caches
    dynamic = _dynamic_stats(model, world)
    if dynamic:
        result["dynamic_tables"] = dynamic
    if world.is_writer:
        for name, c in caches.items():
            print(f"[train] device cache of {name}: {c['hit_rate']:.1%} of the training batches' rows found there "
                  f"({c['rows'] - c['hits']:,} of {c['rows']:,} copied in from host memory, "
                  f"{c['evictions']:,} evicted, {c['writebacks']:,} of them written back)", flush=True)
        for name, d in dynamic.items():
            print(f"[train] dynamic table {name}: {d['ids']:,} ids in its {d['rows']:,} rows, {d['evictions']:,} "
                  f"evicted, {d['candidates']:,} counted toward admission", flush=True)
        write_json(out / "result.json", result)
        mark_latest(out)
        _report(result, out / "result.json")
    world.barrier()
    return result


def _how_to_continue(out: Path, step: int, checkpoint: Path | None) -> None:
    """Say, on Ctrl-C, how the interrupted run continues."""
    where = f"from its checkpoint {checkpoint.name}" if checkpoint else "from its start (no checkpoint was saved yet)"
    print(f"[train] interrupted at step {step}: rerun the same command with train.resume=true train.run={out.name} "
          f"to continue it {where}", flush=True)


def check_splits(data: Path, schema: Schema) -> None:
    """Refuse processed splits whose files do not hold the rows ``schema.json`` promises (a mix of two
    ETL runs, a file removed, added or truncated by hand) or that hold no rows, before any training on
    them."""
    for split, expected in schema.rows.items():
        if expected == 0:
            raise UserError(f"the {split} split has no rows ({data / 'schema.json'}): training needs rows in train, "
                            f"valid and test; give the {split} split rows (more input rows, a larger "
                            "data.valid_fraction / data.test_fraction, or data.valid_path / data.test_path) and run "
                            "the data and ETL stages again")
        files = sorted((data / split).glob("*.parquet"))
        found = 0
        for f in files:
            try:
                found += pq.read_metadata(f).num_rows
            except (OSError, pa.ArrowException) as err:
                raise UserError(f"{f} is not a readable parquet file ({(str(err).splitlines() or [''])[0]}): the "
                                "ETL output is damaged; run `python -m pipeline run etl` again") from err
        if found != expected:
            raise UserError(f"{data / split} holds {found:,} rows in {len(files)} files where {data / 'schema.json'} "
                            f"says {expected:,}: the ETL output is incomplete or mixed; run "
                            "`python -m pipeline run etl` again")


def positive_rate(split: Path, label: str, rows: int = 1 << 20) -> float:
    """The share of positive labels in about ``rows`` rows of a processed split: the first row group of each file
    in turn, then the next ones, until that many are read (the files' order may follow time)."""
    files = [pq.ParquetFile(f) for f in sorted(split.glob("*.parquet"))]
    total = positives = 0.0
    for group in range(max((f.metadata.num_row_groups for f in files), default=0)):
        for f in files:
            if group < f.metadata.num_row_groups and total < rows:
                values = f.read_row_group(group, columns=[label]).column(0).to_numpy(zero_copy_only=False)
                total += len(values)
                positives += float(values.sum())
    return positives / total if total else float("nan")


def _split_rows(data: Path, schema: Schema, split: str) -> int:
    """The rows of a processed split: as ``schema.json`` says (checked by :func:`check_splits`), else its files'."""
    if split in schema.rows:
        return schema.rows[split]
    return sum(pq.read_metadata(f).num_rows for f in sorted((data / split).glob("*.parquet")))


def _check_before_the_run(cfg: TrainConfig, spec: dict, distributed: DistributedConfig, device: torch.device) -> None:
    """Refuse, before a run folder is made, an embedding backend this device cannot run and a sharding of tables
    the model does not have (the settings most often carried over from another machine or another dataset)."""
    check_backend(f"train.embedding_backend={cfg.embedding_backend}", cfg.embedding_backend, device,
                  WEIGHT_DTYPES[cfg.embedding_dtype])
    if cfg.mlp_backend == "cublaslt" and device.type == "cuda":
        from pipeline.kernels.mlp.cublaslt import library_problem

        problem = library_problem()
        if problem:
            raise UserError(f"train.mlp_backend=cublaslt: {problem}; train with train.mlp_backend=torch")
    tables = [t["name"] for t in spec["tables"]]
    unknown = sorted(set(distributed.sharding) - set(tables))
    if unknown:
        raise UserError(f"distributed.sharding names tables {unknown} that the model does not have; it has {tables} "
                        "(a table is named after its feature, t_<feature>, or after the features it holds)")


def _run_folder(runs: Path, cfg: TrainConfig, world: World, held: contextlib.ExitStack) -> Path:
    """The run folder rank 0 chose (:func:`~pipeline.train.runs.choose_run`) and locked until ``held`` closes, on
    every rank; its refusal on every rank."""
    chosen: Path | UserError | None = None
    if world.is_writer:
        try:
            chosen = held.enter_context(choose_run(runs, cfg))
        except UserError as err:
            chosen = err
    chosen = world.gather_objects(chosen)[0]
    if isinstance(chosen, UserError):
        raise chosen
    return chosen


def _place(model: nn.Module, cfg: TrainConfig, world: World, distributed: DistributedConfig,
           folder: Path, schema: Schema) -> tuple[nn.Module, PlainCheckpoints | ShardedCheckpoints]:
    """The model as the loop trains it and its checkpoint format in ``folder``.

    On a world of one: the model itself, the tables the plan host-caches (those over the memory
    budget, or named by ``distributed.sharding``) in host memory behind device caches, and ``.pt``
    checkpoints. On N ranks: the model sharded by ``DistributedModelParallel`` and sharded checkpoints.
    A host-cached table's least cache holds two batches of its multi-hot columns' longest lists.
    """
    longest = {c: max(1, schema.column(c).max_length) for c in schema.multihot}
    if distributed.plan_file:
        plan = _plan_file(distributed.plan_file, model.embedding.tables, world.size)
        _check_cache_rows(plan, model.embedding.tables, world.size, cfg.batch_size, longest, distributed.plan_file)
        plans, planner = {"embedding": plan}, None
    else:
        plans = None
        planner = make_planner(distributed, world.size, world.device, batch_size=cfg.batch_size,
                               optimizer=cfg.embedding_optimizer, weight_bytes=_WEIGHT_BYTES[cfg.embedding_dtype],
                               max_ids_per_sample=longest)
    if world.size == 1:
        plan = plans["embedding"] if plans else planner.plan(model.embedding.tables)
        cached = {name: p.cache_rows for name, p in plan.tables.items() if p.cache_rows}
        if cached:
            model.embedding = HostCachedCollection.from_collection(model.embedding, cached)
        model = model.to(world.device)
        # The loader checks every id against its table while reading (on the host); checking again on a
        # GPU would cost a device sync per step.
        model.embedding.validate_ids = world.device.type != "cuda"
        return model, PlainCheckpoints(folder, cfg.keep_checkpoints, model)
    dmp = DistributedModelParallel(model, plans, planner, world.device, comm_dtype=distributed.comm_dtype)
    return dmp, ShardedCheckpoints(folder, world, cfg.keep_checkpoints)


def _check_cache_rows(plan: ShardingPlan, tables: Sequence, world_size: int, batch_size: int,
                      longest: dict[str, int], path: str) -> None:
    """Refuse a plan file's device cache that cannot hold two training batches of its table's ids from every
    rank (a batch, and the one prefetched while it trains), each sample with its multi-hot columns' longest
    lists."""
    topology = Topology(world_size, batch_size=batch_size, max_ids_per_sample=longest)
    for table in tables:
        rows = plan.tables[table.name].cache_rows
        need = min_cache_rows(table, topology)
        if rows and rows < need:
            ranks = f" on each of {world_size} ranks" if world_size > 1 else ""
            raise UserError(f"distributed.plan_file={path}: the device cache of {table.name} holds "
                            f"{rows:,} rows, but two batches of train.batch_size={batch_size}{ranks} need "
                            f"{need:,}: give it cache_rows of at least {need:,}, or lower train.batch_size")


def _plan_file(path: str, tables: Sequence, world_size: int) -> ShardingPlan:
    """The plan saved in ``path``, checked against the model's tables and the world."""
    try:
        plan = ShardingPlan.load(path)
        plan.validate(tables, world_size)
    except (OSError, ValueError, KeyError, TypeError) as err:  # PlanError and a JSON error are ValueErrors
        raise UserError(f"distributed.plan_file={path}: {err}") from err
    return plan


def _describe(model: nn.Module, spec: dict, world: World, out: Path) -> None:
    tables = spec["tables"]
    if isinstance(model, DistributedModelParallel):
        model.plans["embedding"].save(out / "plan.json")
        print(f"[train] {spec['model']} on {world.size} x {world.device.type}: {len(tables)} tables, plan in "
              f"{out / 'plan.json'}", flush=True)
        return
    print(f"[train] {spec['model']} on {world.device.type}: {len(tables)} tables, "
          f"{sum(t['rows'] for t in tables):,} embedding rows, "
          f"{sum(p.numel() for p in model.parameters()):,} dense parameters, "
          f"embedding backend {model.embedding.backend.name}", flush=True)
    if isinstance(model.embedding, HostCachedCollection):
        slots = {t.name: t.slots for t in model.embedding.cache.tables}
        cached = ", ".join(f"{t['name']} ({slots[t['name']]:,} of {t['rows']:,} rows)" for t in tables
                           if t["name"] in slots)
        print(f"[train] host-cached tables, in host memory behind a device cache of their hot rows: {cached}",
              flush=True)


def _cache_stats(model: nn.Module, world: World) -> dict[str, dict]:
    """Each host-cached table's counts of its training batches' rows (see ``CacheStats``), summed over the
    ranks, with the share found in the device cache (``hit_rate``)."""
    total: dict[str, CacheStats] = {}
    mine = [m.cache_stats() for m in model.modules() if isinstance(m, HostCachedCollection)]
    for part in (stats for rank in world.gather_objects(mine) for stats in rank):
        for name, stats in part.items():
            total[name] = total.get(name, CacheStats()) + stats
    return {name: {**dataclasses.asdict(s), "hit_rate": s.hit_rate} for name, s in sorted(total.items())}


def _dynamic_stats(model: nn.Module, world: World) -> dict[str, dict]:
    """Each dynamic table's ids holding a row, rows, evictions and admission candidates, summed over its parts
    on every rank."""
    mine = [(m.name, {"rows": m.capacity, **m.stats()}) for m in model.modules() if isinstance(m, DynamicTable)]
    total: dict[str, dict] = {}
    for name, stats in (part for rank in world.gather_objects(mine) for part in rank):
        total[name] = {key: total.get(name, {}).get(key, 0) + value for key, value in stats.items()}
    return dict(sorted(total.items()))


def _summary(cfg: TrainConfig, spec: dict, world: World, fitted: dict, test: dict, oracle: dict | None,
             out: Path, seconds: float) -> dict:
    """What ``result.json`` holds."""
    if world.size > 1:
        return {"run": out.name, "model": spec["model"], "device": world.device.type, "ranks": world.size,
                "steps": fitted["steps"], "epochs": fitted["epochs"], "batch_size_per_rank": cfg.batch_size,
                "samples_per_s_per_rank": fitted["samples_per_s"], "valid": fitted["valid"], "kept": fitted["kept"],
                "test": test,
                "seconds": seconds, "plan": str(out / "plan.json")}
    gap = oracle["test"]["auc"] - test["auc"] if oracle else None
    settings = dataclasses.asdict(cfg)
    settings.update({k: v for k, v in spec["sizes"].items() if k in settings})  # the sizes used, not 0 / [] for "auto"
    settings.update(epochs=fitted["epochs"], lr=cfg.dense_lr, embedding_lr=cfg.table_lr)
    return {"run": out.name, "model": spec["model"], "device": world.device.type, "steps": fitted["steps"],
            "epochs": fitted["epochs"], "batch_size": cfg.batch_size, "samples_per_s": fitted["samples_per_s"],
            "valid": fitted["valid"],
            "kept": fitted["kept"], "test": test, "oracle": oracle, "test_auc_gap_to_oracle": gap, "seconds": seconds,
            "settings": settings}


def _report(result: dict, path: Path) -> None:
    test = result["test"]
    scores = f"test AUC {test['auc']:.4f}{_uncertainty(test)}, logloss {test['logloss']:.4f}"
    oracle = result.get("oracle")
    if oracle:
        scores += (f" | oracle AUC {oracle['test']['auc']:.4f}, logloss {oracle['test']['logloss']:.4f}"
                   f" | gap {result['test_auc_gap_to_oracle']:.4f}")
    kept = result["kept"]
    if kept and kept["step"] != kept["last_step"]:
        scores += (f" | kept epoch {kept['epoch']} (step {kept['step']}, the best valid logloss "
                   f"{kept['valid']['logloss']:.4f}, AUC {kept['valid']['auc']:.4f})")
    if "ranks" in result:
        rate = result["samples_per_s_per_rank"]
        speed = _speed(rate * result["ranks"] if rate is not None else None, " over all ranks")
        print(f"[train] {result['ranks']} ranks: {scores} | {speed} | {path}", flush=True)
        return
    print(f"[train] {scores} | {_speed(result['samples_per_s'])} | {path}", flush=True)


SHOWN_AUC_SE = 0.002
"""A test AUC's standard error from which the run's last line shows it: the AUC's third decimal is then noise."""


def _uncertainty(test: dict) -> str:
    """`` ± 0.009`` after an AUC whose test split is small enough to leave its standard error at least
    :data:`SHOWN_AUC_SE` (a few thousand rows), else nothing."""
    se = test.get("auc_se", float("nan"))
    return f" ± {se:.3f}" if se >= SHOWN_AUC_SE else ""


def _speed(samples_per_s: float | None, where: str = "") -> str:
    """The training speed for the last line of a run; a run resumed after its last step trained none."""
    if samples_per_s is None:
        return "no step trained (the run had finished)"
    return f"{samples_per_s:,.0f} samples/s{where}"
