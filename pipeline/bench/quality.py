"""Model quality on one dataset: the training stage's test AUC for each model against logistic regression.

Every model is trained by the real stage with the same settings (the config's, only ``train.model``
changes) on the same processed splits, so the table shows what a user gets from the defaults, and
whether a model beats the linear baseline (``logistic``: one weight per category and per dense
feature) on their data, and how far apart two models must be for the test split to tell them apart (the standard
error of its AUC).

    python -m pipeline bench quality                                   # the synthetic default
    python -m pipeline bench quality data.source=table data.path=clicks.csv data.name=clicks \\
        "data.categorical=[user,item]" "data.continuous=[age]" data.time_column=ts
"""

from __future__ import annotations

import argparse
import math

from pipeline.train.config import MODELS

BASELINE = "logistic"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated models to train ({BASELINE} is always added as the baseline)")


def run(args: argparse.Namespace, cfg) -> dict:
    import dataclasses
    import time

    from pipeline.errors import UserError
    from pipeline.stages.train import run as run_train
    from pipeline.train.runs import mark_latest

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        raise UserError(f"--models: unknown {unknown}; choose from {', '.join(MODELS)}")
    models = [m for m in models if m != BASELINE] + [BASELINE]
    if cfg.train.run:
        raise UserError(f"train.run={cfg.train.run}: bench quality trains a run for each model, named by its start; "
                        "leave train.run unset")
    rows, runs = {}, {}
    for model in models:
        print(f"[bench quality] training {model} ...", flush=True)
        started = time.perf_counter()
        summary = run_train(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, model=model)))
        runs[model] = summary["run"]
        kept = summary.get("kept") or {}
        test = summary["test"]
        rows[model] = {"test_auc": test["auc"], "test_auc_se": test.get("auc_se"), "test_logloss": test["logloss"],
                       "valid_auc": summary["valid"]["auc"], "epochs": summary["epochs"],
                       "kept_epoch": kept.get("epoch"), "seconds": round(time.perf_counter() - started, 1),
                       "gap_to_oracle": summary.get("test_auc_gap_to_oracle")}
    base = rows[BASELINE]["test_auc"]
    print(f"\n{'model':<10} {'test AUC':>9} {'vs ' + BASELINE:>12} {'logloss':>8} {'epochs':>7} {'kept':>5} "
          f"{'oracle gap':>11} {'seconds':>8}")
    for model, r in rows.items():
        gap = "" if r["gap_to_oracle"] is None else f"{r['gap_to_oracle']:.4f}"
        print(f"{model:<10} {r['test_auc']:>9.4f} {r['test_auc'] - base:>+12.4f} {r['test_logloss']:>8.4f} "
              f"{r['epochs']:>7} {r['kept_epoch'] or '':>5} {gap:>11} {r['seconds']:>8.1f}")
    se = rows[BASELINE]["test_auc_se"]  # the models share one test split; `test` is the baseline's (trained last)
    if se is not None and not math.isnan(se):
        print(f"\nThe test split's AUC has a standard error of about {se:.4f} ({test['rows']:,} rows, "
              f"{test['positive_rate']:.1%} positive): differences between models under about {2 * se:.3f} are within "
              "its noise", flush=True)
    # the baseline trains last, so `latest` (what `run export` takes) is moved back to the first model asked for
    mark_latest(cfg.paths.train / runs[models[0]])
    print(f"\n[bench quality] {cfg.paths.train / 'latest'} -> {runs[models[0]]} ({models[0]})", flush=True)
    return {"dataset": cfg.data.dataset_name, "models": rows, "runs": runs}
