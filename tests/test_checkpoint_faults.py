"""Resuming past damaged checkpoints: a truncated, empty, foreign or other-version newest checkpoint
(``.pt`` or a sharded folder) is reported in one line and the run resumes from the newest readable
one, ending with the weights of an uninterrupted run; stale ``*.tmp`` files of a killed save go."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.distributed.checkpoint import ShardedCheckpointError
from pipeline.distributed.world import World
from pipeline.schema import Schema
from pipeline.stages.config import load_config
from pipeline.stages.train import run
from pipeline.train.checkpoint import (
    CheckpointError,
    ShardedCheckpoints,
    checkpoints,
    load_checkpoint,
    save_checkpoint,
    sharded_checkpoints,
)
from pipeline.train.driver import train
from pipeline.train.runs import newest_run
from tests.test_train import Crash, CrashAfter, _final_state, _write_data

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["device=cpu", "train.batch_size=128", "train.eval_batch_size=512", "train.embedding_dim=8",
         "train.bottom_mlp=[16,8]", "train.top_mlp=[16,1]", "progress=off", "train.log_every=4",
         "train.warmup_steps=3", "train.threads=1", "seed=3"]
PLAIN = ["train.epochs=2", "train.checkpoint_every=5", "train.keep_checkpoints=3", "train.embedding_optimizer=adam"]


def _config(workdir, *overrides):
    return load_config(None, [f"workdir={workdir}", *SMALL, *overrides])


def _assert_same_state(a, b):
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=lambda m, key=key: f"{key}: {m}")


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "zero":
        path.write_bytes(b"")
    elif how == "garbage":
        path.write_bytes(b"not a checkpoint\n" * 50)
    elif how == "missing":
        path.unlink()
    elif how == "version":
        state = torch.load(path, weights_only=True)
        torch.save({**state, "version": 99}, path)
    elif how == "foreign":  # another model's checkpoint: a layer wider, one more
        state = torch.load(path, weights_only=True)
        model = dict(state["model"])
        name = next(k for k, v in model.items() if k.startswith("top.") and v.dim() == 2)
        model[name] = torch.zeros(model[name].shape[0] + 1, model[name].shape[1])
        model["cross.0.weight"] = torch.zeros(4, 4)
        torch.save({**state, "model": model}, path)
    else:
        raise ValueError(how)


def _tmp_files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*.tmp"))


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted plain run's final weights."""
    cfg = _config(tmp_path_factory.mktemp("straight"), *PLAIN)
    _write_data(cfg)
    run(cfg)
    return _final_state(cfg)


def _crashed_run(workdir: Path):
    """A run stopped after step 17: checkpoints at steps 5, 10, 15."""
    cfg = _config(workdir, *PLAIN)
    _write_data(cfg)
    with pytest.raises(Crash):
        train(cfg.train, cfg.paths.processed, cfg.paths.train, schema=Schema.load(cfg.paths.schema), seed=cfg.seed,
              callbacks=[CrashAfter(17)], progress=cfg.progress)
    folder = newest_run(cfg.paths.train) / "checkpoints"
    assert [p.name for p in checkpoints(folder)] == ["step-00000005.pt", "step-00000010.pt", "step-00000015.pt"]
    return cfg, folder


@pytest.mark.parametrize("how,reason", [("truncated", "truncated"), ("zero", "empty file"),
                                        ("garbage", "not a torch checkpoint"), ("version", "expected version 1, found 99"),
                                        ("foreign", "another model's weights (2 differ: cross.0.weight is not in this model")])
def test_resume_falls_back_past_a_damaged_newest_checkpoint(how, reason, straight, tmp_path, capsys):
    cfg, folder = _crashed_run(tmp_path)
    _damage(folder / "step-00000015.pt", how)
    (folder / "step-00000020.pt.tmp").write_bytes(b"a save killed half way")
    (folder.parent / "model.pt.tmp").write_bytes(b"a save killed half way")
    capsys.readouterr()
    run(_config(tmp_path, *PLAIN, "train.resume=true"))
    out = capsys.readouterr().out
    skipped = [line for line in out.splitlines() if "step-00000015.pt" in line]
    assert len(skipped) == 1 and reason in skipped[0] and "step-00000010.pt" in skipped[0], out
    assert f"[train] resuming from {folder / 'step-00000010.pt'}" in out
    _assert_same_state(straight, _final_state(cfg))
    assert _tmp_files(cfg.paths.train) == []


def test_resuming_a_finished_run_trains_nothing_and_says_so(tmp_path, capsys):
    cfg = _config(tmp_path, *PLAIN)
    _write_data(cfg)
    run(cfg)
    before = _final_state(cfg)
    capsys.readouterr()
    run(_config(tmp_path, *PLAIN, "train.resume=true"))
    out = capsys.readouterr().out
    assert "no step trained (the run had finished)" in out and "nan" not in out.lower(), out
    result = json.loads((newest_run(cfg.paths.train) / "result.json").read_text(),
                        parse_constant=lambda name: pytest.fail(f"result.json holds {name}"))
    assert result["samples_per_s"] is None and result["steps"] == 24
    _assert_same_state(before, _final_state(cfg))


def test_no_readable_checkpoint_starts_fresh_and_says_so(straight, tmp_path, capsys):
    cfg, folder = _crashed_run(tmp_path)
    for path, how in zip(checkpoints(folder), ["zero", "truncated", "garbage"]):
        _damage(path, how)
    capsys.readouterr()
    run(_config(tmp_path, *PLAIN, "train.resume=true"))
    out = capsys.readouterr().out
    assert sum("is unreadable" in line for line in out.splitlines()) == 3, out
    assert "no readable checkpoint" in out and "starting fresh" in out
    _assert_same_state(straight, _final_state(cfg))


def test_a_damaged_checkpoint_names_the_file_and_the_reason(tmp_path):
    path = save_checkpoint(tmp_path, {"step": 3, "model": {"w": torch.ones(4)}})
    for how, reason in [("zero", "empty file (0 bytes)"), ("truncated", "truncated"),
                        ("garbage", "not a torch checkpoint"), ("missing", "missing")]:
        save_checkpoint(tmp_path, {"step": 3, "model": {"w": torch.ones(4)}})
        _damage(path, how)
        with pytest.raises(CheckpointError) as err:
            load_checkpoint(path)
        message = str(err.value)
        assert str(path) in message and reason in message and "\n" not in message, message


def test_a_save_removes_stale_tmp_files(tmp_path):
    (tmp_path / "step-00000007.pt.tmp").write_bytes(b"half")
    save_checkpoint(tmp_path, {"step": 8, "model": {}})
    assert _tmp_files(tmp_path) == [] and [p.name for p in checkpoints(tmp_path)] == ["step-00000008.pt"]


def test_the_cli_reports_a_damaged_checkpoint_without_a_traceback(tmp_path):
    _, folder = _crashed_run(tmp_path)
    _damage(folder / "step-00000015.pt", "truncated")
    args = [f"workdir={tmp_path}", *SMALL, *PLAIN, "train.resume=true"]
    done = subprocess.run([sys.executable, "-m", "pipeline", "run", "train", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert f"[train] resuming from {folder / 'step-00000010.pt'}" in done.stdout


SHARDED = ["train.epochs=3", "train.max_steps=12", "train.checkpoint_every=5", "train.keep_checkpoints=3",
           "train.embedding_backend=torch", "train.eval_every=0"]


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    """A finished 2-rank run (checkpoints at steps 5, 10, 12) and its final weights."""
    from pipeline.distributed.launch import relaunch

    workdir = tmp_path_factory.mktemp("sharded")
    cfg = _config(workdir, *SHARDED)
    _write_data(cfg)
    assert relaunch(["run", "train", f"workdir={workdir}", *SMALL, *SHARDED], 2) == 0
    folder = cfg.paths.train / "latest" / "checkpoints"
    assert [p.name for p in sharded_checkpoints(folder)] == [f"step-{s:08d}.sharded" for s in (5, 10, 12)]
    return workdir, _final_state(cfg)


def _piece(folder: Path) -> Path:
    return max((folder / "embedding").rglob("rows-*.pt"))


@pytest.mark.parametrize("damage_12,damage_10", [
    ("no meta.json", "truncated piece"),
    ("zero dense.pt", "missing piece"),
    ("garbage rank file", "version"),
])
def test_sharded_resume_falls_back_past_damaged_folders(damage_12, damage_10, sharded_run, tmp_path, capfd):
    from pipeline.distributed.launch import relaunch

    source, final = sharded_run
    shutil.copytree(source, tmp_path, symlinks=True, dirs_exist_ok=True)
    cfg = _config(tmp_path, *SHARDED)
    folder = newest_run(cfg.paths.train) / "checkpoints"
    twelve, ten = folder / "step-00000012.sharded", folder / "step-00000010.sharded"
    actions = {
        "no meta.json": lambda f: (f / "meta.json").unlink(),
        "zero dense.pt": lambda f: _damage(f / "dense.pt", "zero"),
        "garbage rank file": lambda f: _damage(f / "rank-1.pt", "garbage"),
        "truncated piece": lambda f: _damage(_piece(f), "truncated"),
        "missing piece": lambda f: _damage(_piece(f), "missing"),
        "version": lambda f: (f / "meta.json").write_text((f / "meta.json").read_text().replace(
            '"version": 1', '"version": 7')),
    }
    actions[damage_12](twelve)
    actions[damage_10](ten)
    (twelve / "rank-0.pt.tmp").write_bytes(b"half")
    (folder / "step-00000015.sharded").mkdir()
    (folder / "step-00000015.sharded" / "dense.pt.tmp").write_bytes(b"half")
    for path in (twelve, ten):
        with pytest.raises(ShardedCheckpointError, match=f"sharded checkpoint {path}.* is unreadable: "):
            ShardedCheckpoints(folder, World(rank=0, size=2)).check(path)
    (folder.parent / "model.pt").unlink()
    capfd.readouterr()
    assert relaunch(["run", "train", f"workdir={tmp_path}", *SMALL, *SHARDED, "train.resume=true"], 2) == 0
    out = capfd.readouterr().out
    for name in ("step-00000012.sharded", "step-00000010.sharded"):
        lines = [line for line in out.splitlines() if line.startswith(f"[train] sharded checkpoint {folder / name}")]
        assert len(lines) == 1 and "is unreadable: " in lines[0], out
    assert f"[train] resuming from {folder / 'step-00000005.sharded'}" in out
    _assert_same_state(final, _final_state(cfg))
    assert _tmp_files(cfg.paths.train) == [] and not (folder / "step-00000015.sharded").exists()
