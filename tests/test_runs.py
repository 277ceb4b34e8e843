"""Training runs side by side: each run in its own folder under ``train/``, ``train/latest`` on the
newest finished one, resume of the named or the newest run, and export (and serve) of a chosen run."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from export.repository import dense_fingerprint
from export.server import server_problem
from pipeline.errors import UserError
from pipeline.stages.cli import main, run_stages
from pipeline.stages.config import load_config
from pipeline.stages.train import run
from pipeline.train.model import load_trained
from pipeline.train.runs import latest_run, newest_run
from tests.test_train import SMALL, Crash, CrashAfter, _assert_same_state, _config, _train, _write_data

COMMON = ["train.epochs=2", "train.checkpoint_every=5", "seed=3"]


def _weights(folder):
    return torch.load(folder / "model.pt", weights_only=True)


def _one_error_line(capsys, argv, *expected):
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    for text in expected:
        assert text in err, err


def test_two_runs_in_a_row_keep_both_folders_and_latest_points_at_the_second(tmp_path):
    cfg = _config(tmp_path, "train.max_steps=3")
    _write_data(cfg)
    first = run(cfg)
    (cfg.paths.train / "latest.tmp").write_text("left by a killed process")
    second = run(cfg)
    root = cfg.paths.train
    assert first["run"] != second["run"]
    for result in (first, second):
        assert re.fullmatch(r"\d{8}-\d{6}-dlrm(-\d+)?", result["run"]), result["run"]
        saved = json.loads((root / result["run"] / "result.json").read_text())
        assert saved["run"] == result["run"] and saved["test"]["auc"] == result["test"]["auc"]
        assert (root / result["run"] / "model.pt").is_file()
    assert os.readlink(root / "latest") == second["run"]  # relative: the folder can move
    assert latest_run(root) == root / second["run"] and not (root / "latest.tmp").exists()


def test_a_folder_where_the_latest_link_goes_is_refused_before_training(tmp_path):
    """It was found only when the finished run was marked latest, after the whole training."""
    cfg = _config(tmp_path, "train.max_steps=2", "train.run=first")
    _write_data(cfg)
    (cfg.paths.train / "latest").mkdir(parents=True)
    with pytest.raises(UserError, match=r"train/latest is not the link to the newest finished run .*move it away"):
        run(cfg)
    assert sorted(p.name for p in cfg.paths.train.iterdir()) == ["latest"]


def test_a_run_name_in_use_is_refused_without_resume(tmp_path):
    cfg = _config(tmp_path, "train.max_steps=2", "train.run=baseline")
    _write_data(cfg)
    assert run(cfg)["run"] == "baseline"
    folder = cfg.paths.train / "baseline"
    before = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    with pytest.raises(UserError, match="train.run=baseline: .* already holds a run; continue it with train.resume"):
        run(cfg)
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()} == before


def test_a_run_being_trained_by_another_process_is_refused_until_that_process_ends(tmp_path, capsys):
    cfg = _config(tmp_path, "train.run=busy")
    _write_data(cfg)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    endless = [f"workdir={tmp_path}", *SMALL, "train.run=busy", "train.epochs=100000", "train.early_stopping=0"]
    first = subprocess.Popen([sys.executable, "-m", "pipeline", "run", "train", *endless], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (cfg.paths.train / "busy" / "metrics.jsonl").is_file() and first.poll() is None:
            assert time.monotonic() < deadline, "the first training did not start"
            time.sleep(0.05)
        assert first.poll() is None, first.stderr.read()
        capsys.readouterr()
        _one_error_line(capsys, ["run", "train", *endless, "train.resume=true"],
                        f"error: the run {cfg.paths.train / 'busy'} is being trained by another process")
        assert first.poll() is None, "the first training ended before the second one started"
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    # the lock ends with the process that held it, killed or not
    assert run(_config(tmp_path, "train.run=busy", "train.resume=true", "train.max_steps=2"))["run"] == "busy"


def test_an_interrupted_run_leaves_latest_on_the_previous_finished_run(tmp_path):
    cfg = _config(tmp_path, *COMMON)
    _write_data(cfg)
    finished = run(cfg)["run"]
    with pytest.raises(Crash):
        _train(cfg, [CrashAfter(7)])
    root = cfg.paths.train
    interrupted = newest_run(root)
    assert interrupted.name != finished and (interrupted / "checkpoints" / "step-00000005.pt").is_file()
    assert not (interrupted / "result.json").exists()
    assert os.readlink(root / "latest") == finished and latest_run(root) == root / finished


def test_resume_continues_the_named_run_or_else_the_newest(tmp_path, capsys):
    named = _config(tmp_path, *COMMON, "train.run=first")
    _write_data(named)
    root = named.paths.train
    with pytest.raises(Crash):
        _train(named, [CrashAfter(7)])
    straight = run(_config(tmp_path, *COMMON))["run"]
    with pytest.raises(Crash):
        _train(_config(tmp_path, *COMMON), [CrashAfter(12)])
    third = newest_run(root)

    capsys.readouterr()
    resumed = run(_config(tmp_path, *COMMON, "train.resume=true"))
    assert resumed["run"] == third.name
    assert f"[train] resuming from {third / 'checkpoints' / 'step-00000010.pt'}" in capsys.readouterr().out
    assert os.readlink(root / "latest") == third.name

    resumed = run(_config(tmp_path, *COMMON, "train.run=first", "train.resume=true"))
    assert resumed["run"] == "first"
    assert f"[train] resuming from {root / 'first' / 'checkpoints' / 'step-00000005.pt'}" in capsys.readouterr().out
    assert os.readlink(root / "latest") == "first"
    for folder in (root / "first", third):  # each ends as the uninterrupted run of the same settings did
        _assert_same_state(_weights(root / straight), _weights(folder))

    _one_error_line(capsys, ["run", "train", f"workdir={tmp_path}", *SMALL, *COMMON, "train.run=nope",
                             "train.resume=true"], "train.run=nope", "first", straight)
    assert not (root / "nope").exists()


@pytest.mark.parametrize("override", ["train.run=latest", "train.run=../elsewhere", "export.run=a/b",
                                      "export.run=.hidden"])
def test_a_run_name_that_is_not_a_folder_name_is_refused(capsys, override):
    _one_error_line(capsys, ["config", "show", override], override.split("=")[0], "folder name")


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Synthetic data through the ETL, then a dlrm run named ``older`` and a newer dcnv2 run."""
    workdir = tmp_path_factory.mktemp("runs")
    data = ["data.rows=3000", "etl.cluster=threads"]
    cfg = _config(workdir, *data)
    problem = server_problem(cfg.serve)
    if problem:
        pytest.fail(f"the serving tests need a Triton server and the models' environment (make serve-env): {problem}")
    run_stages(["data", "etl"], cfg)
    older = run(_config(workdir, *data, "train.run=older"))
    newer = run(_config(workdir, *data, "train.model=dcnv2"))
    return [f"workdir={workdir}", *data], older, newer


def test_export_of_a_named_older_run_exports_it_and_serve_compares_with_it(two_runs, capsys):
    data, older, newer = two_runs
    cfg = load_config(None, [*SMALL, *data, "export.run=older"])
    root = cfg.paths.train
    assert latest_run(root) == root / newer["run"]
    capsys.readouterr()
    assert main(["run", "export", *SMALL, *data, "export.run=older"]) == 0
    out = capsys.readouterr().out
    assert f": run older, dlrm, test AUC {older['test']['auc']:.4f}" in out, out

    record = json.loads((cfg.paths.export / "export.json").read_text())
    assert record["trained"] == {"run": "older", "folder": str(root / "older"), "model": "dlrm",
                                 "test_auc": older["test"]["auc"]}
    model, _ = load_trained(root / "older")
    assert record["dense_fingerprint"] == dense_fingerprint(model)

    from pipeline.stages.serve import run as serve

    served = serve(cfg, smoke=True)
    assert served["served"] and served["max_difference_from_in_process"] < 1e-5
    assert "largest difference from the in-process model of run older: " in capsys.readouterr().out


def test_export_takes_latest_and_refuses_a_missing_or_unfinished_run(two_runs, capsys):
    data, _, newer = two_runs
    assert main(["run", "export", *SMALL, *data]) == 0
    out = capsys.readouterr().out
    assert f": run {newer['run']}, dcnv2, test AUC {newer['test']['auc']:.4f}" in out
    from pipeline.stages.export import auto_instances

    assert f"[export] {auto_instances('cpu')} instance(s) of each model (one per usable core, at most" in out, out

    _one_error_line(capsys, ["run", "export", *SMALL, *data, "export.run=nope"], "export.run=nope", "older",
                    newer["run"])
    with pytest.raises(Crash):
        _train(load_config(None, [*SMALL, *data, "train.run=cut"]), [CrashAfter(1)])
    _one_error_line(capsys, ["run", "export", *SMALL, *data, "export.run=cut"], "export.run=cut", "did not finish",
                    "train.run=cut train.resume=true")
    cfg = load_config(None, [*SMALL, *data])
    assert json.loads((cfg.paths.export / "export.json").read_text())["trained"]["run"] == newer["run"]


def test_a_full_disk_under_an_export_is_one_error_line_and_leaves_the_export_before_it(two_runs, capsys,
                                                                                       monkeypatch):
    """numpy's save on a full disk says only "N requested and M written": the export ended in a traceback, its
    half-written repository left beside the export (an update's half-written version inside it)."""
    import numpy as np

    from pipeline import files

    data, _, _ = two_runs
    assert main(["run", "export", *SMALL, *data]) == 0
    export = load_config(None, [*SMALL, *data]).paths.export
    before = {p: p.read_bytes() for p in export.rglob("*") if p.is_file()}

    def short_write(*args, **kwargs):
        raise OSError("116096 requested and 40896 written")

    monkeypatch.setattr(np, "save", short_write)
    monkeypatch.setattr(files, "_full", lambda folder: True)
    capsys.readouterr()
    _one_error_line(capsys, ["run", "export", *SMALL, *data], f"{export}: No space left on device: free space")
    _one_error_line(capsys, ["run", "export", *SMALL, *data, "export.update=true"], "No space left on device")
    assert {p: p.read_bytes() for p in export.rglob("*") if p.is_file()} == before
    assert [p.name for p in export.parent.iterdir() if p.name.startswith(".export")] == []


def test_an_etl_fitted_again_under_a_run_is_refused_by_its_export_and_its_resume(tmp_path, capsys):
    """The export compared cardinalities only: a workflow fitted again with other settings (here without the
    missing indicators, a column fewer per continuous one) was exported with the model, and the server failed
    to start on a KeyError; the same columns with other statistics would have been served silently."""
    common = [f"workdir={tmp_path}", "device=cpu", "data.rows=4000", "progress=off", "etl.cluster=threads",
              "train.max_steps=4", "train.checkpoint_every=2", "train.run=r"]
    run_stages(["data", "etl", "train"], load_config(None, common))
    run_stages(["etl"], load_config(None, common))  # fitted again alike: the same workflow, exported as it is
    run_stages(["export"], load_config(None, common))
    run_stages(["etl"], load_config(None, [*common, "etl.missing_indicator=false"]))
    from pipeline.stages.serve import run as serve

    # the repository exported before holds its own workflow: it is served, and compared, with that one
    assert serve(load_config(None, common), smoke=True)["max_difference_from_in_process"] < 1e-5
    _one_error_line(capsys, ["run", "export", *common], "changed since the run", "the workflow was fitted again",
                    "run `python -m pipeline run train` again")
    _one_error_line(capsys, ["run", "train", *common, "train.resume=true", "train.max_steps=6"],
                    "ETL workflow: it was fitted again")


def test_an_etl_and_a_training_of_one_dataset_do_not_run_at_once(tmp_path):
    """Two ETLs at once left schema.json beside a split of the other (or none); an ETL under a training made the
    training's reads fail mid-run with a parquet error."""
    from pipeline.schema import processed_lock
    from pipeline.stages.etl import run as run_etl

    cfg = _config(tmp_path, "train.max_steps=2", "data.rows=3000", "etl.cluster=threads")
    run_stages(["data", "etl"], cfg)
    with processed_lock(cfg.paths.processed, shared=True):  # a training run reads it
        with pytest.raises(UserError, match=r"processed is being written by an ETL, or read by a training run"):
            run_etl(cfg)
        run(cfg)  # another training reads it alongside
    with processed_lock(cfg.paths.processed, shared=False), \
            pytest.raises(UserError, match=r"an ETL is writing .*processed in another process now"):
        run(cfg)  # while an ETL writes it
    run_etl(cfg)
