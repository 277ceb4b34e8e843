"""The training stage's runner: ``python -m pipeline run train`` (see :mod:`pipeline.train.driver`).

``run(cfg)`` joins the world torchrun describes (one process when not launched by torchrun), runs
the ETL stage first when its output is missing (after refusing settings that training would refuse), and
trains with the settings of ``cfg`` into a run folder of ``cfg.paths.train`` (see :mod:`pipeline.train.runs`).

Example::

    summary = run(load_config(None, ["train.epochs=2"]))
    cfg.paths.train / summary["run"]      # its folder; cfg.paths.train / "latest" points at it
"""

from __future__ import annotations

from pipeline.device import resolve_device
from pipeline.distributed.world import World
from pipeline.errors import BadInputError
from pipeline.schema import Schema
from pipeline.stages.config import PipelineConfig
from pipeline.stages.data import raw_changes
from pipeline.train.driver import train


def run(cfg: PipelineConfig) -> dict:
    """Train, evaluate on valid and test, write the run's outputs; return the summary (also printed)."""
    if not cfg.paths.schema.is_file():
        refuse_what_training_would(cfg)
    world = World.from_env(resolve_device(cfg.device).kind, cfg.distributed.timeout_s)
    if world.is_writer and not cfg.paths.schema.is_file():
        print(f"[train] no ETL output at {cfg.paths.processed}: running the ETL stage first", flush=True)
        from pipeline.stages.etl import run as run_etl

        run_etl(cfg)
    elif world.is_writer and (changes := raw_changes(cfg)):
        print(f"[train] note: the ETL output at {cfg.paths.processed} comes from raw data made with other settings or "
              f"input files than these (changed: {', '.join(changes)}); `python -m pipeline run all` makes both again "
              "(data.rebuild=true where the input files changed)", flush=True)
    try:
        world.barrier()
        summary = train(cfg.train, cfg.paths.processed, cfg.paths.train, schema=Schema.load(cfg.paths.schema),
                        seed=cfg.seed, world=world, distributed=cfg.distributed, oracle=cfg.paths.oracle,
                        progress=cfg.progress)
    except BaseException:
        world.close(wait=False)
        raise
    world.close()
    return summary


def refuse_what_training_would(cfg: PipelineConfig) -> None:
    """Settings that training would refuse, refused before the data and ETL stages run for it."""
    from pipeline.modules.backends import check_backend
    from pipeline.modules.configs import WEIGHT_DTYPES

    t = cfg.train
    check_backend(f"train.embedding_backend={t.embedding_backend}", t.embedding_backend,
                  resolve_device(cfg.device).kind, WEIGHT_DTYPES[t.embedding_dtype])
    d = cfg.data
    if d.source == "table" and not (d.categorical or d.multihot):
        from pipeline.data.roles import table_role_hint, table_roles
        from pipeline.modules.models import NO_SPARSE_FEATURE

        table_roles(d)  # no roles at all: the error that asks for them
        hint = table_role_hint(d)
        raise BadInputError(f"the table's roles name {NO_SPARSE_FEATURE}" + (f"; {hint}" if hint else ""))
    empty = d.splits_without_rows()
    if empty:
        one = len(empty) == 1
        settings = " and ".join(f"data.{split}_fraction={getattr(d, split + '_fraction'):g}" for split in empty)
        if d.source == "synthetic":
            settings, fix = f"{settings} of data.rows={d.rows:,}", " or more data.rows"
        else:
            fix = f" or files of {'its' if one else 'their'} own ({' / '.join(f'data.{split}_path' for split in empty)})"
        raise BadInputError(f"{settings} give{'s' if one else ''} the {' and '.join(empty)} split{'' if one else 's'} "
                            f"no rows, and training needs rows in train, valid and test: give {'it' if one else 'them'} "
                            f"a larger fraction{fix}")
