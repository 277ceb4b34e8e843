"""``python -m pipeline``: the command line.

    python -m pipeline data                      # make (or ingest) the raw data
    python -m pipeline run all                   # data -> etl -> train -> export -> serve smoke test
    python -m pipeline run etl --scheduler tcp://10.0.0.5:8786 data.rows=20000000
    python -m pipeline bench etl --rows 2000000
    python -m pipeline config show train.epochs=3   # the effective settings, as YAML

Settings come from the dataclasses in ``pipeline/stages/config.py``: defaults, then ``--config FILE``
(YAML), then ``key=value`` overrides. ``python -m pipeline settings`` lists every one.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Callable
from typing import NoReturn

import yaml

from pipeline.stages import config as config_mod

STAGES: dict[str, tuple[str, str]] = {
    # name: (module, function); each function takes the PipelineConfig and returns a summary dict
    "data": ("pipeline.stages.data", "run"),
    "etl": ("pipeline.stages.etl", "run"),
    "train": ("pipeline.stages.train", "run"),
    "export": ("pipeline.stages.export", "run"),
    "serve": ("pipeline.stages.serve", "run"),
}
ALL = ["data", "etl", "train", "export", "serve"]

BENCHES = {
    "data": "pipeline.bench.data",
    "etl": "pipeline.bench.etl",
    "loader": "pipeline.bench.loader",
    "train": "pipeline.bench.train",
    "e2e": "pipeline.bench.e2e",
    "train_distributed": "pipeline.bench.train_distributed",
    "embedding": "pipeline.bench.embedding",
    "hashtable": "pipeline.bench.hashtable",
    "serve": "pipeline.bench.serve",
    "quality": "pipeline.bench.quality",
}


def stage_function(name: str) -> Callable[..., dict]:
    module, attr = STAGES[name]
    return getattr(importlib.import_module(module), attr)


def _settings_epilog() -> str:
    rows = config_mod.describe()
    width = max(len(k) for k, _, _ in rows)
    lines = ["settings (key=value, or in the --config YAML file as nested sections):"]
    for key, default, help_ in rows:
        lines.append(f"  {key:<{width}}  {help_} [default: {default}]")
    return "\n".join(lines)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="YAML file with settings (sections data:, etl:, train:, ...)")
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], help="shortcut for device=...")
    p.add_argument("overrides", nargs="*", metavar="key=value", default=[], help="settings, e.g. data.rows=2000000")


EXAMPLES = {
    # command: lines of its --help's examples
    "pipeline": ["python -m pipeline run all                           # data, ETL, training, export, a served request",
                 "python -m pipeline run train train.model=dcnv2 train.epochs=2",
                 "python -m pipeline config show --config my.yaml     # the settings a run would use",
                 "python -m pipeline settings                         # every setting, its default and meaning"],
    "data": ["python -m pipeline data data.rows=2000000",
             "python -m pipeline data data.source=criteo data.path=day_0.gz --on-bad-lines skip",
             ("python -m pipeline data data.source=table data.path=clicks.csv data.label=clicked "
              "data.categorical=[user,item]")],
    "run": ["python -m pipeline run all workdir=/tmp/work data.rows=200000",
            "python -m pipeline run etl --scheduler tcp://10.0.0.5:8786",
            "python -m pipeline run train train.model=deepfm train.run=deepfm-1",
            "python -m pipeline run train train.resume=true train.run=deepfm-1   # continue it after Ctrl-C",
            "python -m pipeline run train --nproc 2 --device cuda",
            "python -m pipeline run export export.run=deepfm-1 && python -m pipeline run serve"],
    "bench": ["python -m pipeline bench train --preset cpu",
              "python -m pipeline bench quality workdir=/tmp/work data.rows=200000"],
    "config": ["python -m pipeline config show train.epochs=3",
               "python -m pipeline config show --config my.yaml > effective.yaml"],
    "settings": ["python -m pipeline settings | grep train."],
}


def _examples(command: str) -> str:
    return "examples:\n" + "\n".join(f"  {line}" for line in EXAMPLES[command])


class _Parser(argparse.ArgumentParser):
    """A command line's error as one line, what is wrong and where the options are listed (not argparse's usage
    text first); its subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (`{self.prog} --help` lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = _Parser(
        prog="python -m pipeline",
        description="An end-to-end recommender pipeline: data -> ETL -> training -> Triton export -> serving.",
        epilog=_examples("pipeline") + "\n\n`python -m pipeline COMMAND --help` says more of each; see README.md "
        "for the stages.",
        formatter_class=fmt,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("data", help="make the synthetic data, or ingest a Criteo / table file into parquet",
                       description="Make the raw data under workdir/<dataset>/raw/: the synthetic Criteo-like rows "
                       "(data.source=synthetic), or a Criteo TSV or a table (CSV, TSV, parquet) read into parquet "
                       "splits, its malformed rows counted in raw/ingest_report.json.",
                       epilog=_examples("data") + "\n\n" + _settings_epilog(), formatter_class=fmt)
    p.add_argument("--on-bad-lines", choices=["error", "skip"], help="malformed input rows (data.on_bad_lines=...)")
    _common(p)

    p = sub.add_parser("run", help="run one stage, or all of them in order",
                       description="Run a stage. `all` runs data, etl, train, export and a served smoke request, "
                       "each stage reading what the previous one wrote under workdir/<dataset>/.",
                       epilog=_examples("run") + "\n\n" + _settings_epilog(), formatter_class=fmt)
    p.add_argument("stage", choices=list(STAGES) + ["all"], help="etl | train | export | serve | all (and data)")
    p.add_argument("--scheduler", metavar="ADDRESS", help="ETL on an existing Dask scheduler (etl.scheduler=...)")
    p.add_argument("--on-bad-lines", choices=["error", "skip"], help="malformed input rows (data.on_bad_lines=...)")
    p.add_argument("--nproc", type=int, metavar="N",
                   help="train on N processes (GPUs) of this node, started through torchrun's launcher")
    _common(p)

    p = sub.add_parser("bench", help="measure a stage against its baseline (figures for docs/BENCHMARKS.md)",
                       description="Time a stage or a part against its baseline in the same run and print both; "
                       "`python -m pipeline bench WHAT --help` says what each one measures and its options.",
                       epilog=_examples("bench"), formatter_class=fmt)
    bench_sub = p.add_subparsers(dest="bench", required=True, metavar="WHAT")
    for name, module in BENCHES.items():
        mod = importlib.import_module(module)
        bp = bench_sub.add_parser(name, help=(mod.__doc__ or "").strip().splitlines()[0],
                                  description=mod.__doc__, formatter_class=fmt)
        mod.add_arguments(bp)
        _common(bp)

    p = sub.add_parser("config", help="print the effective settings as YAML",
                       description="Print the settings a command would use (defaults, then --config, then "
                       "key=value) as YAML, which --config reads back.",
                       epilog=_examples("config"), formatter_class=fmt)
    p.add_argument("action", choices=["show"])
    _common(p)

    sub.add_parser("settings", help="list every setting with its default and meaning",
                   description="List every setting (key=value, or nested sections of a --config YAML file) with "
                   "its default and meaning.", epilog=_examples("settings"), formatter_class=fmt)
    return parser


def _config_from(args: argparse.Namespace) -> config_mod.PipelineConfig:
    overrides = list(getattr(args, "overrides", []) or [])
    if getattr(args, "device", None):
        overrides.append(f"device={args.device}")
    if getattr(args, "scheduler", None):
        overrides.append(f"etl.scheduler={args.scheduler}")
    if args.command == "run" and args.nproc is not None:  # bench train_distributed has an --nproc of its own
        overrides.append(f"distributed.nproc={args.nproc}")
    if getattr(args, "on_bad_lines", None):
        overrides.append(f"data.on_bad_lines={args.on_bad_lines}")
    return config_mod.load_config(args.config, overrides)


def run_stages(names: list[str], cfg: config_mod.PipelineConfig) -> dict[str, dict]:
    """Run stages in order; ``serve`` after other stages only sends its smoke request."""
    from pipeline.device import resolve_device

    if "train" in names[1:]:
        from pipeline.stages.train import refuse_what_training_would

        refuse_what_training_would(cfg)
    device = resolve_device(cfg.device)
    print(f"[pipeline] device: {device.kind} ({device.reason})", flush=True)
    results: dict[str, dict] = {}
    for name in names:
        fn = stage_function(name)
        print(f"[pipeline] stage {name} ...", flush=True)
        start = time.perf_counter()
        results[name] = fn(cfg, smoke=True) if name == "serve" and len(names) > 1 else fn(cfg)
        print(f"[pipeline] stage {name} done in {time.perf_counter() - start:.1f} s", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # key=value overrides may come anywhere on the line, also after options.
    args, extra = parser.parse_known_args(argv)
    unknown = [a for a in extra if a.startswith("-") or "=" not in a]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if hasattr(args, "overrides"):
        args.overrides = list(args.overrides or []) + extra
    cfg = None
    try:
        if args.command == "settings":
            print(_settings_epilog())
            return 0
        cfg = _config_from(args)
        _refuse_all_but_training_under_torchrun(args)
        if args.command == "run" and cfg.distributed.nproc > 1:
            from pipeline.distributed.launch import relaunch, under_torchrun

            if args.stage != "train":
                parser.error("--nproc (distributed.nproc) applies to `run train` only")
            if not under_torchrun():
                return relaunch(sys.argv[1:] if argv is None else list(argv), cfg.distributed.nproc)
        if args.command == "config":
            print(yaml.safe_dump(config_mod.to_dict(cfg), sort_keys=False), end="")
        elif args.command == "data":
            run_stages(["data"], cfg)
        elif args.command == "run":
            run_stages(ALL if args.stage == "all" else [args.stage], cfg)
        elif args.command == "bench":
            importlib.import_module(BENCHES[args.bench]).run(args, cfg)
        return 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        # Errors the user can act on are printed plainly; anything else keeps its traceback.
        if _is_user_error(err):
            print(f"error: {err}", file=sys.stderr)
            return 2
        from pipeline.errors import environment_problem

        problem = environment_problem(err, where=f"writing under workdir={cfg.workdir}" if cfg else None)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
        raise


def _refuse_all_but_training_under_torchrun(args: argparse.Namespace) -> None:
    """Only the training stage runs on the processes torchrun started; every other command, run by each
    of them, would write the same files at once."""
    from pipeline.distributed.launch import launched_processes
    from pipeline.errors import UserError

    launched = launched_processes()
    if launched > 1 and not (args.command == "run" and args.stage == "train"):
        what = f"run {args.stage}" if args.command == "run" else args.command
        raise UserError(f"`{what}` under torchrun ({launched} processes): only `run train` runs on several "
                        f"processes; run `python -m pipeline {what}` once without torchrun, then train under it")


def _is_user_error(err: Exception) -> bool:
    from pipeline.device import DeviceError
    from pipeline.errors import UserError
    from pipeline.schema import SchemaError

    return isinstance(err, (config_mod.ConfigError, DeviceError, SchemaError, UserError, FileNotFoundError))
