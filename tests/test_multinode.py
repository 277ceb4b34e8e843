"""Training on several nodes: every command but the training is refused in the processes torchrun started."""

from __future__ import annotations

import pytest


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
