"""Training on several nodes: README.md's torchrun command, run as two nodes of this machine (two
launchers meeting at a c10d rendezvous on 127.0.0.1, 2 gloo processes each), trains what
``run train --nproc 4`` trains on one node, into one run folder that only global rank 0 writes; every
command but the training is refused in the processes torchrun started."""

from __future__ import annotations

import json
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.loader.synthetic import criteo_schema, write_processed
from pipeline.stages.config import load_config
from pipeline.train.checkpoint import sharded_checkpoints

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ["device=cpu", "progress=off", "train.batch_size=128", "train.eval_batch_size=512", "train.epochs=1",
            "train.max_steps=6", "train.checkpoint_every=4", "train.embedding_dim=8", "train.bottom_mlp=[16,8]",
            "train.top_mlp=[16,1]", "train.log_every=3"]


def readme_command() -> list[str]:
    """The words of README.md's several-node command (the one line starting ``torchrun --nnodes``)."""
    text = (ROOT / "README.md").read_text().replace("\\\n", " ")
    lines = [line for line in text.splitlines() if line.startswith("torchrun --nnodes")]
    assert len(lines) == 1, "README.md shows one several-node torchrun command"
    return shlex.split(lines[0], comments=True)


def flag(words: list[str], name: str) -> str:
    return words[words.index(name) + 1]


def node_command(words: list[str], endpoint: str, workdir: Path) -> list[str]:
    """``words`` run by this Python (torchrun is ``python -m torch.distributed.run``), meeting at
    ``endpoint``, in ``workdir``, with the small training of :data:`SETTINGS`."""
    words = list(words)
    words[words.index("--rdzv-endpoint") + 1] = endpoint
    words = [f"workdir={workdir}" if w.startswith("workdir=") else w for w in words]
    return [sys.executable, "-m", "torch.distributed.run", *words[1:], *SETTINGS]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_nodes(commands: list[list[str]], timeout_s: float = 300) -> None:
    """Start every command at once (one launcher per node) and wait for all; fail with their output."""
    nodes = [subprocess.Popen(c, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in commands]
    try:
        outputs = [node.communicate(timeout=timeout_s)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()
    for node, output in zip(nodes, outputs):
        assert node.returncode == 0, f"{shlex.join(node.args)} failed:\n{output}"


def finished_run(train: Path, name: str) -> tuple[dict, dict[str, torch.Tensor], str]:
    """``result.json``, the weights of ``model.pt`` (those of the newest checkpoint, as one process holds
    them) and the newest checkpoint's name, of the run ``name`` under ``train``."""
    out = train / name
    weights = torch.load(out / "model.pt", map_location="cpu", weights_only=True)
    return json.loads((out / "result.json").read_text()), weights, sharded_checkpoints(out / "checkpoints")[-1].name


def test_two_nodes_train_what_four_processes_of_one_node_train(tmp_path):
    words = readme_command()
    assert flag(words, "--rdzv-backend") == "c10d"
    assert words[words.index("-m"):][:4] == ["-m", "pipeline", "run", "train"]
    nodes, per_node = int(flag(words, "--nnodes")), int(flag(words, "--nproc-per-node"))
    assert (nodes, per_node) == (2, 2)  # what two cores run in a test
    cfg = load_config(None, [f"workdir={tmp_path}"])
    schema = criteo_schema(size=0.0001, categorical=5, continuous=3, multihot={"M1": 3})
    write_processed(cfg.paths.processed, schema, {"train": 4096, "valid": 512, "test": 1024}, row_group_rows=512,
                    seed=3)
    train = cfg.paths.train

    run_nodes([[sys.executable, "-m", "pipeline", "run", "train", "--nproc", str(nodes * per_node),
                f"workdir={tmp_path}", *SETTINGS, "train.run=one-node"]])
    endpoint = f"127.0.0.1:{free_port()}"
    run_nodes([node_command(words, endpoint, tmp_path) for _ in range(nodes)])

    runs = sorted(p.name for p in train.iterdir() if p.is_dir() and not p.is_symlink())
    assert len(runs) == 2 and "one-node" in runs  # the ranks of both nodes wrote one run folder
    (several,) = set(runs) - {"one-node"}
    assert (train / "latest").resolve() == (train / several).resolve()
    one_result, one_weights, one_checkpoint = finished_run(train, "one-node")
    result, weights, checkpoint = finished_run(train, several)

    assert result["ranks"] == one_result["ranks"] == nodes * per_node
    assert result["steps"] == one_result["steps"] == 6 and checkpoint == one_checkpoint
    assert json.loads((train / several / "plan.json").read_text())["world_size"] == nodes * per_node
    assert weights.keys() == one_weights.keys()
    for key, value in one_weights.items():
        torch.testing.assert_close(weights[key], value, msg=lambda m, key=key: f"{key}: {m}")
    assert result["test"]["rows"] == 1024
    assert result["test"]["auc"] == pytest.approx(one_result["test"]["auc"], abs=1e-6)
    assert result["test"]["logloss"] == pytest.approx(one_result["test"]["logloss"], abs=1e-6)


@pytest.mark.parametrize("argv,what", [(["run", "etl"], "run etl"), (["run", "all"], "run all"), (["data"], "data")])
def test_under_torchrun_only_the_training_runs(tmp_path, monkeypatch, capsys, argv, what):
    from pipeline.stages.cli import main

    for name, value in {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)  # what torchrun gives the second process of a node
    assert main([*argv, f"workdir={tmp_path}", "device=cpu"]) == 2
    expected = (f"error: `{what}` under torchrun (4 processes): only `run train` runs on several processes; "
                f"run `python -m pipeline {what}` once without torchrun, then train under it")
    assert capsys.readouterr().err.strip().splitlines() == [expected]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("second", [2, -15], ids=["both refused", "the second stopped by torch"])
def test_ranks_that_refused_end_in_code_2_whether_or_not_torch_stopped_the_others_first(monkeypatch, capsys, tmp_path,
                                                                                        second):
    """Once one rank fails, torch stops the others with SIGTERM: a rank stopped before it refused was counted as a
    failure of its own, and the launch ended in code 1 instead of the refusal's 2, one run in a few."""
    import torch.distributed.run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from pipeline.distributed.launch import relaunch

    def failing(args):
        raise ChildFailedError("pipeline", {
            0: ProcessFailure(local_rank=0, pid=11, exitcode=2, error_file=str(tmp_path / "none")),
            1: ProcessFailure(local_rank=1, pid=12, exitcode=second, error_file=str(tmp_path / "none"))})

    monkeypatch.setattr(torch.distributed.run, "run", failing)
    assert relaunch(["run", "train"], 2) == 2
    failed = 2 if second == 2 else 1
    assert capsys.readouterr().out.strip() == (f"error: {failed} of 2 training processes failed; first: rank 0 exited "
                                               "with code 2 (its error is above)")


def test_a_refusal_under_nproc_ends_in_the_ranks_error_and_ctrl_c_in_no_traceback(tmp_path):
    """The last line was torch's placeholder ("To enable traceback see: ...") with exit code 1; Ctrl-C ended in a
    torch SignalException traceback with exit code 1."""
    import os
    import signal
    import time

    cfg = load_config(None, [f"workdir={tmp_path}", *SETTINGS])
    write_processed(cfg.paths.processed, criteo_schema(size=0.0001, categorical=5, continuous=3),
                    {"train": 4096, "valid": 512, "test": 512}, row_group_rows=512, seed=3)
    command = [sys.executable, "-m", "pipeline", "run", "train", "--nproc", "2", f"workdir={tmp_path}", *SETTINGS]
    refused = subprocess.run([*command, "train.resume=true", "train.run=nope"], cwd=ROOT, capture_output=True,
                             text=True, timeout=240, check=False)
    said = refused.stdout + refused.stderr
    assert refused.returncode == 2, said
    assert "error: train.resume=true, but there is no run train.run=nope" in said and "Traceback" not in said
    # both ranks refuse; which one torch saw fail first is a race, and so is whether the second refused before torch
    # stopped it (SIGTERM: not a failure of its own, and no reason to end in another code than 2)
    assert re.fullmatch(r"error: [12] of 2 training processes failed; first: rank [01] exited with code 2 "
                        r"\(its error is above\)", refused.stdout.strip().splitlines()[-1])
    long = subprocess.Popen([*command, "train.max_steps=100000", "train.epochs=1000", "train.run=long"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not (cfg.paths.train / "long" / "model.json").exists():
        time.sleep(0.2)
    time.sleep(2)
    os.killpg(long.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole group
    output = long.communicate(timeout=120)[0]
    assert long.returncode == 130, output
    assert "Traceback" not in output and "rerun the same command with train.resume=true train.run=long" in output
