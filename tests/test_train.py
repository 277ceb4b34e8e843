"""The training stage on small processed data: outputs, load_trained, checkpoints, exact resume."""

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeline.errors import BadInputError, UserError
from pipeline.loader.synthetic import criteo_schema, write_processed
from pipeline.schema import Schema, SchemaError
from pipeline.stages.config import load_config
from pipeline.stages.train import run
from pipeline.train.checkpoint import CheckpointError, checkpoints, latest_checkpoint, load_checkpoint, save_checkpoint
from pipeline.train.driver import train
from pipeline.train.loop import Callback
from pipeline.train.model import load_trained
from pipeline.train.runs import newest_run
from pipeline.train.schedule import lr_at

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["device=cpu", "train.batch_size=128", "train.eval_batch_size=512", "train.embedding_dim=8",
         "train.bottom_mlp=[16,8]", "train.top_mlp=[16,1]", "progress=off", "train.log_every=4",
         "train.warmup_steps=3", "train.threads=1", "train.epochs=1"]


def _config(workdir, *overrides):
    return load_config(None, [f"workdir={workdir}", *SMALL, *overrides])


def _write_data(cfg, train_rows=1500):
    schema = criteo_schema(size=0.0001, categorical=5, continuous=3, multihot={"M1": 3})
    write_processed(cfg.paths.processed, schema, {"train": train_rows, "valid": 300, "test": 300},
                    row_group_rows=500, seed=7)


class Crash(RuntimeError):
    """Stops a run as a crash would."""


class CrashAfter(Callback):
    """Raises ``error`` (:class:`Crash`; ``KeyboardInterrupt`` as Ctrl-C does) at the end of step ``step``
    (after its checkpoint, if one is due)."""

    def __init__(self, step: int, error: type[BaseException] = Crash) -> None:
        self.step, self.error = step, error

    def on_step(self, trainer) -> None:
        if trainer.state.step == self.step:
            raise self.error(f"stopping after step {self.step}")


def _train(cfg, callbacks=()):
    """What ``run(cfg)`` does in one process, with ``callbacks`` passed to the loop."""
    return train(cfg.train, cfg.paths.processed, cfg.paths.train, schema=Schema.load(cfg.paths.schema),
                 seed=cfg.seed, callbacks=callbacks, progress=cfg.progress)


def _final_state(cfg):
    return torch.load(cfg.paths.train / "latest" / "model.pt", weights_only=True)


def _assert_same_state(a, b):
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], msg=lambda m: f"{key}: {m}")


def test_lr_schedule_is_a_pure_function_of_the_step():
    assert lr_at(0, 1.0, warmup_steps=4, total_steps=20) == 0.25
    assert lr_at(3, 1.0, warmup_steps=4, total_steps=20) == 1.0
    assert lr_at(19, 1.0, warmup_steps=4, total_steps=20, decay="cosine", min_ratio=0.1) == pytest.approx(0.1)
    assert lr_at(19, 1.0, warmup_steps=4, total_steps=20, decay="linear", min_ratio=0.0) == pytest.approx(0.0)
    mid = 4 + (20 - 1 - 4) / 2
    assert lr_at(mid, 1.0, warmup_steps=4, total_steps=20, decay="cosine", min_ratio=0.0) == pytest.approx(0.5)
    assert lr_at(10, 1.0, warmup_steps=4, total_steps=20, decay="none") == 1.0
    assert lr_at(6, 1.0, warmup_steps=4, total_steps=20, decay="linear", decay_start=8) == 1.0


def test_checkpoints_are_atomic_kept_newest_and_hold_no_code(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, {"step": step, "model": {"w": torch.full((2,), float(step))}}, keep=2)
    (tmp_path / "step-00000009.pt.tmp").write_bytes(b"half written")
    assert [p.name for p in checkpoints(tmp_path)] == ["step-00000002.pt", "step-00000003.pt"]
    assert load_checkpoint(latest_checkpoint(tmp_path))["model"]["w"].tolist() == [3.0, 3.0]
    torch.save({"version": 1, "step": 4, "code": Crash("pickled object")}, tmp_path / "step-00000004.pt")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_checkpoint(tmp_path / "step-00000004.pt")
    torch.save({"version": 99, "step": 5}, tmp_path / "step-00000005.pt")
    with pytest.raises(CheckpointError, match="expected version 1, found 99"):
        load_checkpoint(tmp_path / "step-00000005.pt")


def test_stage_writes_outputs_and_load_trained_reproduces_the_test_scores(tmp_path, capsys):
    cfg = _config(tmp_path, "train.checkpoint_every=5", "train.model=dcnv2")
    _write_data(cfg)
    result = run(cfg)
    out = cfg.paths.train / "latest"
    saved = json.loads((out / "result.json").read_text())
    # 300 test rows: the AUC's third decimal is noise, and the last line says how much
    said = f"[train] test AUC {result['test']['auc']:.4f} ± {saved['test']['auc_se']:.3f}, logloss"
    assert said in capsys.readouterr().out
    assert saved["test"]["rows"] == 300 and 0 <= saved["test"]["auc"] <= 1 and 0.02 < saved["test"]["auc_se"] < 0.1
    assert saved["steps"] == 12 and saved["oracle"] is None and result["model"] == "dcnv2"
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in lines if "loss" in r]
    assert train_steps == [4, 8, 12] and any(r.get("split") == "valid" for r in lines)
    assert [p.name for p in checkpoints(out / "checkpoints")] == ["step-00000010.pt", "step-00000012.pt"]

    model, schema = load_trained(out)
    from pipeline.loader import Loader
    from pipeline.train.evaluate import evaluate

    again = evaluate(model, Loader(cfg.paths.processed / "test", 512, schema=schema), torch.device("cpu"))
    assert again["auc"] == pytest.approx(saved["test"]["auc"], abs=1e-6)
    assert schema.sparse == ["C1", "C2", "C3", "C4", "C5", "M1"]


def test_result_records_the_sizes_used_not_the_auto_settings(tmp_path):
    cfg = _config(tmp_path, "train.embedding_dim=0", "train.bottom_mlp=[]", "train.top_mlp=[]", "train.max_steps=2")
    _write_data(cfg, train_rows=300)
    run(cfg)
    sizes = json.loads((cfg.paths.train / "latest" / "model.json").read_text())["sizes"]
    settings = json.loads((cfg.paths.train / "latest" / "result.json").read_text())["settings"]
    assert sizes["embedding_dim"] > 0 and sizes["bottom_mlp"] and sizes["top_mlp"]
    assert [settings[k] for k in ("embedding_dim", "bottom_mlp", "top_mlp")] == \
        [sizes[k] for k in ("embedding_dim", "bottom_mlp", "top_mlp")]


def test_resume_after_a_crash_mid_epoch_ends_with_the_same_weights(tmp_path):
    common = ["train.epochs=2", "train.checkpoint_every=5", "train.embedding_optimizer=adam", "seed=3"]
    straight = _config(tmp_path / "straight", *common)
    _write_data(straight)
    run(straight)

    crashed = _config(tmp_path / "crashed", *common)
    _write_data(crashed)
    with pytest.raises(Crash):
        _train(crashed, [CrashAfter(17)])
    interrupted = newest_run(crashed.paths.train)
    assert latest_checkpoint(interrupted / "checkpoints").name == "step-00000015.pt"
    assert not (interrupted / "model.pt").exists()
    run(_config(tmp_path / "crashed", *common, "train.resume=true"))

    _assert_same_state(_final_state(straight), _final_state(crashed))
    lines = [json.loads(line) for line in (interrupted / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in lines if "loss" in r]
    assert steps == sorted(set(steps)) and steps[-1] == 24
    assert any(r.get("event") == "resume" and r["step"] == 15 for r in lines)


def test_resume_after_killing_the_process(tmp_path):
    common = ["train.checkpoint_every=4", "train.keep_checkpoints=3", "seed=5", "train.epochs=2"]
    straight = _config(tmp_path / "straight", *common)
    _write_data(straight, train_rows=4000)
    run(straight)

    victim = _config(tmp_path / "victim", *common)
    _write_data(victim, train_rows=4000)
    args = [f"workdir={tmp_path / 'victim'}", *SMALL, *common, "train.run=killed"]
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "run", "train", *args], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    folder = victim.paths.train / "killed" / "checkpoints"
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if latest_checkpoint(folder) is not None:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, f"the training ended before it could be killed: {proc.stderr.read()}"
    assert not (victim.paths.train / "killed" / "model.pt").exists()
    run(_config(tmp_path / "victim", *common, "train.run=killed", "train.resume=true"))
    _assert_same_state(_final_state(straight), _final_state(victim))


def test_resume_with_another_model_is_refused(tmp_path):
    cfg = _config(tmp_path, "train.max_steps=3", "train.checkpoint_every=2")
    _write_data(cfg)
    run(cfg)
    with pytest.raises(UserError, match="another model"):
        run(_config(tmp_path, "train.max_steps=3", "train.resume=true", "train.model=deepfm"))


def test_resume_with_other_loop_settings_is_refused_and_another_length_said(tmp_path, capsys):
    """The command Ctrl-C printed (train.resume=true train.run=NAME) resumed with the defaults of every setting it did
    not repeat: another lr, no early stopping, and the run's result recorded them as if trained so."""
    common = ["train.checkpoint_every=2", "train.run=r", "train.lr=0.003", "train.early_stopping=0"]
    cfg = _config(tmp_path, *common, "train.max_steps=3")
    _write_data(cfg)
    run(cfg)
    with pytest.raises(UserError, match=r"run in .* was trained with train.lr=0.003 train.early_stopping=0, and this "
                                        r"command gives train.lr=0.01 train.early_stopping=1: resume it with the run's"):
        run(_config(tmp_path, "train.max_steps=3", "train.resume=true", "train.run=r", "train.checkpoint_every=2",
                    "train.lr=0.01", "train.early_stopping=1"))
    (cfg.paths.train / "r" / "model.json").write_text("{}")
    with pytest.raises(UserError, match="model.json is not the record of a model"):
        run(_config(tmp_path, *common, "train.max_steps=3", "train.resume=true"))


def test_a_resumed_run_may_train_longer_and_says_so(tmp_path, capsys):
    common = ["train.checkpoint_every=2", "train.run=r"]
    cfg = _config(tmp_path, *common, "train.max_steps=3")
    _write_data(cfg)
    run(cfg)
    result = run(_config(tmp_path, *common, "train.max_steps=5", "train.resume=true"))
    assert result["steps"] == 5
    assert "[train] resuming with train.max_steps=5 where the run was started with train.max_steps=3: its schedule " \
           "follows the new length" in capsys.readouterr().out


def test_settings_this_machine_or_model_cannot_train_are_refused_before_a_run_folder(tmp_path):
    """A CUDA embedding backend on a CPU machine and a sharding of a table the model does not have (the column's name
    in place of the table's) were tracebacks, and left run folders holding a lock (and a model.json) behind."""
    cfg = _config(tmp_path)
    _write_data(cfg)
    for setting, message in (("train.embedding_backend=cuda", (r"train.embedding_backend=cuda: embedding backend "
                                                              r"'cuda' cannot run on cpu.*use auto \(or torch\) here")),
                             ("distributed.sharding={C1: host_cached}",
                              (r"distributed.sharding names tables \['C1'\] that the model does not have; it has "
                              r"\['t_C1',"))):
        with pytest.raises(UserError, match=message):
            run(_config(tmp_path, setting))
    assert not cfg.paths.train.exists() or not list(cfg.paths.train.iterdir())
    with pytest.raises(UserError, match="distributed.memory_per_rank_mb"):
        run(_config(tmp_path, "distributed.memory_per_rank_mb=0.01"))
    assert not list(cfg.paths.train.iterdir()), "a plan the machine cannot hold leaves no run folder"


def test_resume_past_a_metrics_line_cut_short(tmp_path):
    """A metrics.jsonl whose last line was cut short (a crash or a full disk while it was written) failed the resume
    with a JSONDecodeError traceback."""
    common = ["train.checkpoint_every=2", "train.run=r", "train.max_steps=5", "train.log_every=1"]
    cfg = _config(tmp_path, *common)
    _write_data(cfg)
    with pytest.raises(Crash):
        _train(cfg, [CrashAfter(3)])
    metrics = cfg.paths.train / "r" / "metrics.jsonl"
    metrics.write_bytes(metrics.read_bytes() + b'{"step": 4, "lo')
    assert run(_config(tmp_path, *common, "train.resume=true"))["steps"] == 5
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == sorted(steps) and steps[-1] >= 5


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_resume_with_another_dense_optimizer_is_refused(tmp_path, optimizer):
    """Torch loads Adam's state into SGD and fails at the first step (KeyError: 'momentum')."""
    cfg = _config(tmp_path, "train.max_steps=3", "train.checkpoint_every=2", "train.run=r")
    _write_data(cfg)
    run(cfg)
    with pytest.raises(UserError, match=rf"was trained with train.optimizer=adam, and this command gives "
                                        rf"train.optimizer={optimizer}: resume it with the run's settings"):
        run(_config(tmp_path, "train.max_steps=4", "train.resume=true", "train.run=r", f"train.optimizer={optimizer}"))


def test_resume_on_the_output_of_another_etl_with_other_dense_features_is_refused(tmp_path):
    """The ETL run again with fewer continuous columns (etl.missing_indicator=false) under a run: its bottom
    MLP would take other inputs, and every checkpoint would be passed over for a fresh start."""
    cfg = _config(tmp_path, "train.max_steps=3", "train.checkpoint_every=2", "train.run=r")
    _write_data(cfg)
    run(cfg)
    schema = criteo_schema(size=0.0001, categorical=5, continuous=2, multihot={"M1": 3})
    shutil.rmtree(cfg.paths.processed)
    write_processed(cfg.paths.processed, schema, {"train": 1500, "valid": 300, "test": 300}, row_group_rows=500, seed=7)
    with pytest.raises(UserError, match=r"another model \(different [a-z_, ]*num_dense\).*ETL output"):
        run(_config(tmp_path, "train.max_steps=3", "train.resume=true", "train.run=r"))


def test_ids_beyond_the_table_are_reported_with_feature_and_value(tmp_path):
    cfg = _config(tmp_path, "train.max_steps=2")
    _write_data(cfg)
    schema = json.loads(cfg.paths.schema.read_text())
    for column in schema["columns"]:
        if column["name"] == "C2":
            column["cardinality"] = 2  # the data holds ids up to the real cardinality
    cfg.paths.schema.write_text(json.dumps(schema))
    with pytest.raises(BadInputError) as err:
        run(cfg)
    assert "C2" in str(err.value) and "outside" in str(err.value)


@pytest.mark.parametrize("override,message", [("train.model=bert", "train.model"),
                                              ("train.top_mlp=[8,2]", "last width must be 1")])
def test_bad_settings_name_what_was_expected(override, message, tmp_path):
    from pipeline.stages.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        _config(tmp_path, override)


@pytest.mark.gpu
def test_stage_trains_on_gpu_with_bf16_autocast(tmp_path):
    cfg = _config(tmp_path, "device=cuda", "train.epochs=2")
    _write_data(cfg, train_rows=3000)
    result = run(cfg)
    assert result["device"] == "cuda" and result["steps"] == 48
    lines = [json.loads(line) for line in (cfg.paths.train / "latest" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in lines if "loss" in r]
    assert all(0 < loss < 2 for loss in losses)
    model, _ = load_trained(cfg.paths.train / "latest", device="cuda")
    assert model.embedding.weights.is_cuda


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_dense_optimizer_on_gpu_is_fused_and_steps_like_the_unfused_one(name):
    from pipeline.train.loop import dense_optimizer
    torch.manual_seed(0)
    weights = [torch.randn(64, 32, device="cuda"), torch.randn(32, device="cuda")]
    grads = [[torch.randn_like(w) for w in weights] for _ in range(3)]
    results = []
    for device in ("cuda", "cpu"):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        opt = dense_optimizer(name, params, 0.01, 1e-4, torch.device(device))
        assert bool(opt.param_groups[0].get("fused")) == (device == "cuda")
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.clone()
            opt.step()
        results.append([p.detach() for p in params])
    for fused, plain in zip(*results):
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)


class Recorder(Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    def on_step(self, trainer) -> None:
        self.seen.append(("step", trainer.state.step))

    def on_checkpoint(self, trainer, path) -> None:
        self.seen.append((path.name, trainer.state.step))

    def on_evaluation(self, trainer, scores) -> None:
        self.seen.append(("valid", scores["rows"]))


def test_validation_every_n_steps_and_at_the_end(tmp_path):
    cfg = _config(tmp_path, "train.eval_every=5", "train.checkpoint_every=0")
    _write_data(cfg)
    recorder = Recorder()
    result = _train(cfg, [recorder])
    assert [s for kind, s in recorder.seen if kind == "step"] == list(range(1, 13))
    assert [e for e in recorder.seen if e[0] != "step"] == [("valid", 300), ("valid", 300), ("valid", 300),
                                                           ("step-00000012.pt", 12)]
    out = cfg.paths.train / result["run"]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    valid = [r for r in lines if r.get("split") == "valid"]
    assert [r["step"] for r in valid] == [5, 10, 12]
    assert result["valid"]["auc"] == valid[-1]["auc"]
    assert [p.name for p in checkpoints(out / "checkpoints")] == ["step-00000012.pt"]


def test_a_split_that_does_not_hold_the_schemas_rows_is_refused(tmp_path):
    cfg = _config(tmp_path)
    _write_data(cfg)
    train_dir = cfg.paths.processed / "train"
    extra = min(train_dir.glob("*.parquet"))
    shutil.copy(extra, train_dir / "part-99999.parquet")  # a file of another run left in the split
    with pytest.raises(UserError, match=r"train holds .* rows in .* files where .*schema.json says 1,500"):
        run(cfg)
    assert not cfg.paths.train.exists()


def test_a_truncated_split_file_is_refused_naming_it(tmp_path):
    cfg = _config(tmp_path)
    _write_data(cfg)
    part = min((cfg.paths.processed / "valid").glob("*.parquet"))
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    with pytest.raises(UserError, match=rf"{part} is not a readable parquet file .*run `python -m pipeline run etl`"):
        run(cfg)
    assert not cfg.paths.train.exists()


def test_an_empty_split_is_refused_naming_the_settings_that_give_it_rows(tmp_path):
    """An ETL output made with a fraction of 0 (the ETL stage alone takes one), then trained on."""
    from pipeline.stages.etl import run as run_etl

    cfg = _config(tmp_path, "data.rows=3000", "data.test_fraction=0")
    run_etl(cfg)
    with pytest.raises(UserError, match=r"the test split has no rows .*data.test_fraction"):
        run(cfg)
    assert Schema.load(cfg.paths.schema).rows["test"] == 0 and not cfg.paths.train.exists()


def test_the_compiled_dense_part_trains_like_eager(tmp_path):
    """train.compile=on compiles the dense part and the loss (the default on a GPU), max-autotune with kernels
    chosen by timing: same weights as eager."""
    states = {}
    for mode in ("off", "on", "max-autotune"):
        cfg = _config(tmp_path / mode, f"train.compile={mode}", "train.max_steps=6", "train.checkpoint_every=0")
        _write_data(cfg)
        _train(cfg)
        states[mode] = _final_state(cfg)
    _assert_same_state(states["on"], states["off"])
    _assert_same_state(states["max-autotune"], states["off"])


def test_an_epochs_short_last_batch_is_not_compiled_again(tmp_path):
    """1,500 rows in batches of 128: eleven full batches and one of 92. The short one runs eagerly, where a
    compiled step would compile the whole graph again for its shape (seconds on a GPU, for one step)."""
    from torch._dynamo import reset
    from torch._dynamo.utils import counters

    graphs = {}
    for name, steps in (("full batches only", "train.max_steps=11"), ("the whole epoch", "train.max_steps=0")):
        reset()
        counters.clear()
        cfg = _config(tmp_path / name.replace(" ", "-"), "train.compile=on", steps, "train.checkpoint_every=0")
        _write_data(cfg)
        _train(cfg)
        graphs[name] = counters["stats"]["unique_graphs"]
    assert graphs["the whole epoch"] == graphs["full batches only"] > 0


def test_ctrl_c_says_how_to_continue_and_that_continues_the_run(tmp_path, capsys):
    common = ["train.epochs=2", "train.checkpoint_every=5", "seed=3"]
    straight = _config(tmp_path / "straight", *common)
    _write_data(straight)
    run(straight)
    cfg = _config(tmp_path / "stopped", *common)
    _write_data(cfg)
    with pytest.raises(KeyboardInterrupt):
        _train(cfg, [CrashAfter(12, KeyboardInterrupt)])
    name = newest_run(cfg.paths.train).name
    lines = [line for line in capsys.readouterr().out.splitlines() if "interrupted" in line]
    assert lines == [(f"[train] interrupted at step 12: rerun the same command with train.resume=true "
                      f"train.run={name} to continue it from its checkpoint step-00000010.pt")]
    run(_config(tmp_path / "stopped", *common, "train.resume=true", f"train.run={name}"))
    assert f"[train] resuming from {cfg.paths.train / name / 'checkpoints' / 'step-00000010.pt'}" in capsys.readouterr().out
    _assert_same_state(_final_state(straight), _final_state(cfg))


def test_a_diverged_run_stops_with_an_error_naming_the_learning_rates_and_is_not_the_latest(tmp_path):
    """SGD at an lr far too high makes the loss nan within a few steps: the run stops at the next logged loss
    with one error naming the learning rates, where it went on to the end, scored nan and became train/latest."""
    good = _config(tmp_path, "train.max_steps=4", "train.log_every=2", "train.run=good")
    _write_data(good)
    run(good)
    cfg = _config(tmp_path, "train.max_steps=40", "train.log_every=2", "train.optimizer=sgd", "train.lr=1e12",
                  "train.warmup_steps=1", "train.run=diverged")
    with pytest.raises(UserError, match=r"training loss became (nan|inf) by step \d+ \(train.lr .*lower learning rates"):
        run(cfg)
    assert (cfg.paths.train / "latest").resolve().name == "good"
    assert not (cfg.paths.train / "diverged" / "result.json").exists()


def test_files_a_run_reads_that_were_cut_short_are_one_error_naming_each(tmp_path):
    """A truncated schema.json, model.json, model.pt or result.json was a traceback (JSONDecodeError, EOFError,
    the zip reader's RuntimeError)."""
    from pipeline.files import DamagedFileError
    from pipeline.stages.export import trained_record

    cfg = _config(tmp_path, "train.max_steps=3", "train.run=r")
    _write_data(cfg)
    run(cfg)
    folder = cfg.paths.train / "r"
    for path, read in ((folder / "model.pt", lambda: load_trained(folder)),
                       (folder / "model.json", lambda: load_trained(folder)),
                       (folder / "result.json", lambda: trained_record(folder)),
                       (cfg.paths.schema, lambda: run(_config(tmp_path, "train.max_steps=3", "train.run=s")))):
        whole = path.read_bytes()
        for cut in (whole[: len(whole) // 2], b""):
            path.write_bytes(cut)
            with pytest.raises(DamagedFileError, match=rf"^{path}( is not whole JSON| does not read as saved).*"
                                                       r"cut short or changed by hand; (train|run) "):
                read()
        path.write_bytes(whole)
    cfg.paths.oracle.parent.mkdir(parents=True, exist_ok=True)
    cfg.paths.oracle.write_text('{"test": {"auc": 0.8')
    with pytest.raises(DamagedFileError, match=rf"^{cfg.paths.oracle} is not whole JSON"):
        run(_config(tmp_path, "train.max_steps=3", "train.run=o"))
    assert not (cfg.paths.train / "o").exists()  # refused before training, not after it
    cfg.paths.oracle.unlink()
    cfg.paths.schema.write_text("[]")
    with pytest.raises(SchemaError, match="a schema is a JSON object, not list; rerun the ETL"):
        run(_config(tmp_path, "train.max_steps=3", "train.run=t"))


def test_bf16_autocast_and_cublaslt_mlps_asked_on_a_cpu_are_said_to_run_as_torch_layers_in_float32(tmp_path, capsys):
    cfg = _config(tmp_path, "train.max_steps=2", "train.amp=bf16", "train.mlp_backend=cublaslt")
    _write_data(cfg)
    run(cfg)
    out = capsys.readouterr().out
    assert "[train] train.amp=bf16: bf16 autocast runs on a GPU; on cpu the dense part computes in float32" in out
    assert "[train] train.mlp_backend=cublaslt: cuBLASLt runs the MLPs on a GPU; on cpu torch's layers run them" in out
