import pytest

from pipeline.stages.cli import main
from pipeline.stages.config import ConfigError, load_config


def test_defaults_then_yaml_then_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("data:\n  rows: 1234\n  size: 0.5\ntrain:\n  epochs: 3\n")
    cfg = load_config(f, ["data.rows=99", "seed=7"])
    assert (cfg.data.rows, cfg.data.size, cfg.train.epochs, cfg.seed) == (99, 0.5, 3, 7)
    assert str(cfg.paths.schema).endswith("synthetic/processed/schema.json")


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.nope=1", "unknown setting data.nope"),
        ("data.rows=many", "data.rows: expected int"),
        ("data.source=ftp", "expected synthetic, criteo or table"),
        ("device=tpu", "expected cpu, cuda or auto"),
        ("data", "expected key=value"),
    ],
)
def test_bad_settings_say_what_is_wrong(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_cli_settings_and_errors(capsys):
    assert main(["settings"]) == 0
    assert "data.rows" in capsys.readouterr().out
    assert main(["config", "show", "data.rows=oops"]) == 2
    assert "expected int" in capsys.readouterr().err


def test_device_cuda_without_gpu_is_a_clear_error(capsys):
    from pipeline.device import gpu_problem

    if gpu_problem() is None:
        pytest.skip("a GPU is usable here; this test is for machines without one")
    assert main(["run", "etl", "--device", "cuda", "data.rows=1000"]) == 2
    assert "--device cuda was asked for" in capsys.readouterr().err


def test_nproc_is_for_training_only(capsys):
    with pytest.raises(SystemExit):
        main(["run", "etl", "--nproc", "2"])
    assert "applies to `run train` only" in capsys.readouterr().err


def test_a_refused_value_names_its_setting_once(capsys):
    assert main(["config", "show", "train.lr=-1"]) == 2
    assert capsys.readouterr().err == "error: train.lr: expected a finite number >= 0, got -1.0\n"
    assert main(["config", "show", "data.rows=0"]) == 2
    assert capsys.readouterr().err == "error: data.rows: expected an integer >= 1, got 0\n"


def test_lists_and_mappings_from_the_command_line():
    cfg = load_config(None, ["train.bottom_mlp=64,32", "train.top_mlp=[128, 1]", "etl.hash_buckets={C3: 100000}",
                             "etl.hash_buckets.C4=7", "data.categorical="])
    assert (cfg.train.bottom_mlp, cfg.train.top_mlp) == ([64, 32], [128, 1])
    assert cfg.etl.hash_buckets == {"C3": 100000, "C4": 7} and cfg.data.categorical == []


def test_every_command_help_says_what_it_does_and_gives_examples_that_parse(tmp_path, capsys):
    import shlex

    from pipeline.stages.cli import EXAMPLES, _config_from, build_parser

    parser = build_parser()
    for command in ("data", "run", "bench", "config", "settings"):
        with pytest.raises(SystemExit):
            parser.parse_args([command, "--help"])
        text = capsys.readouterr().out
        assert "examples:" in text and f"python -m pipeline {command}" in text, text
        description = text.split("\n\n")[1]
        assert not description.startswith(("positional", "options")), text
    (tmp_path / "my.yaml").write_text("train:\n  epochs: 2\n")
    for command, lines in EXAMPLES.items():
        for line in lines:
            for part in line.split("#")[0].split("&&"):
                words = shlex.split(part.split("|")[0].split(">")[0].replace("my.yaml", str(tmp_path / "my.yaml")))
                assert words[:3] == ["python", "-m", "pipeline"], line
                args, extra = parser.parse_known_args(words[3:])
                assert all("=" in word and not word.startswith("-") for word in extra), line
                if args.command != "settings":
                    args.overrides = list(args.overrides or []) + extra
                    _config_from(args)


def test_a_workdir_under_the_home_folder_is_expanded(monkeypatch, tmp_path):
    """``workdir: ~/pipe`` in a YAML file (no shell expands it) made a folder named ``~`` in the current one."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text("workdir: ~/pipe\n")
    assert load_config(tmp_path / "c.yaml", []).paths.root == tmp_path / "pipe" / "synthetic"
