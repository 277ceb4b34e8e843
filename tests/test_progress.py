"""The ``progress`` setting: bars on a terminal, bounded plain lines in a log, nothing when off, in every stage."""

from __future__ import annotations

import re
import time
from collections import Counter

import pytest

from pipeline.loader.synthetic import criteo_schema, write_processed
from pipeline.progress import Progress, progress_mode
from pipeline.stages import data, train
from pipeline.stages.config import ConfigError, load_config

TINY = ["device=cpu", "data.rows=4000", "data.chunk_rows=1000", "etl.cluster=threads", "train.batch_size=128",
        "train.eval_batch_size=512", "train.embedding_dim=8", "train.bottom_mlp=[16,8]", "train.top_mlp=[16,1]",
        "train.max_steps=12", "train.log_every=4", "train.threads=1"]
# A plain progress line: "[desc] unit 12/40 (30%) 3.1k unit/s, ..."
PLAIN = re.compile(r"^\[(?P<desc>[^\]]+)\] (?P<unit>\w+) [\d.]+[kMG]?(/[\d.]+[kMG]? \(\d+%\))? [\d.]+[kMG]? (?P=unit)/s")


def _config(workdir, *overrides):
    return load_config(None, [f"workdir={workdir}", *TINY, *overrides])


def _progress_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if PLAIN.match(line)]


def test_a_log_gets_a_bounded_number_of_plain_lines_from_every_stage(tmp_path, capsys):
    start = time.monotonic()
    train.run(_config(tmp_path))  # data -> ETL -> train, stdout and stderr not a terminal
    elapsed = time.monotonic() - start
    out, err = capsys.readouterr()
    assert "\r" not in out + err
    lines = _progress_lines(out)
    assert not _progress_lines(err)
    per_bar = Counter(PLAIN.match(line)["desc"] for line in lines)
    assert {"synthetic data", "fit statistics", "transform train", "transform test", "train"} <= set(per_bar)
    # at most a line per 5 s per bar and a last one ("fit statistics" is two computes)
    assert max(per_bar.values()) <= 2 * (1 + int(elapsed / 5))
    last = [line for line in lines if line.startswith("[train] ")][-1]
    assert re.match(r"\[train\] step 12/12 \(100%\) [\d.]+[k]? step/s, in [\d.]+s, loss=\d\.\d{4}, lr=[\d.e-]+, "
                    r"samples/s=[\d,]+$", last), last


def test_off_prints_no_progress(tmp_path, capsys):
    train.run(_config(tmp_path, "progress=off"))
    out, err = capsys.readouterr()
    assert "\r" not in out + err
    assert not _progress_lines(out + err)
    assert "[etl] wrote" in out and "[train] test AUC" in out  # the stages' own lines stay


def test_bar_draws_bars_in_data_and_training(tmp_path, capsys):
    cfg = _config(tmp_path, "progress=bar")
    data.run(cfg)
    schema = criteo_schema(size=0.0001, categorical=5, continuous=3)
    write_processed(cfg.paths.processed, schema, {"train": 1536, "valid": 300, "test": 300}, row_group_rows=512, seed=7)
    train.run(cfg)
    out, err = capsys.readouterr()
    assert not _progress_lines(out)
    bars = err.split("\r")
    assert any(b.startswith("synthetic data: 100%") and "6/6" in b for b in bars)
    final = [b for b in bars if b.startswith("train: 100%")]
    assert final and "12/12" in final[-1] and "loss=" in final[-1] and "lr=" in final[-1], final
    assert "samples/s=" in final[-1]


def test_plain_lines_come_at_most_once_per_interval_and_once_at_the_end(capsys):
    start = time.monotonic()
    with Progress("work", total=60, unit="item", mode="plain", every_s=0.05) as bar:
        for _ in range(60):
            time.sleep(0.005)
            bar.update(1)
    elapsed = time.monotonic() - start
    lines = capsys.readouterr().out.splitlines()
    assert all(PLAIN.match(line) for line in lines)
    assert 2 <= len(lines) <= elapsed / 0.05 + 2
    assert "eta " in lines[0] and lines[-1].startswith("[work] item 60/60 (100%) ") and ", in " in lines[-1]


def test_a_slow_first_unit_does_not_stretch_the_time_left(capsys):
    """The first step of training holds its compilation (a minute on a fresh GPU machine, then 76 steps a second):
    the line after it said "eta 7h30m" for a run that took 72 s. The time left now goes by the units since the
    first, and the first's line says how long it took."""
    with Progress("work", total=30, unit="item", mode="plain", every_s=0.0) as bar:
        time.sleep(0.4)
        for _ in range(30):
            bar.update(1)
            time.sleep(0.002)
    lines = capsys.readouterr().out.splitlines()
    assert re.match(r"\[work\] item 1/30 \(3%\) [\d.]+ item/s, the first item in 0\.4s$", lines[0]), lines[0]
    left = [float(m[1]) for line in lines[1:-1] if (m := re.search(r", eta ([\d.]+)s$", line))]
    assert len(left) == 28 and max(left) < 1.0, lines  # at the second item: about 0.06 s, and 5.6 s going by the first too


def test_the_last_count_is_printed_once_even_when_its_interval_is_due(capsys):
    with Progress("work", total=3, unit="item", mode="plain", every_s=0.0) as bar:
        for _ in range(3):
            bar.update(1)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" item/s")[0].rsplit(" ", 1)[0] for line in lines] == [
        "[work] item 1/3 (33%)", "[work] item 2/3 (67%)", "[work] item 3/3 (100%)"], lines
    assert ", in " in lines[-1]


def test_modes():
    assert progress_mode(False) == progress_mode("off") == "off"
    assert progress_mode("plain") == "plain" and progress_mode("bar") == "bar"
    assert progress_mode(True) in ("bar", "plain")
    with pytest.raises(ValueError, match="progress: expected one of auto, bar, plain, off, got 'loud'"):
        progress_mode("loud")
    with pytest.raises(ConfigError, match="progress: expected one of auto, bar, plain, off, got 'false'"):
        load_config(None, ["progress=false"])
    with pytest.raises(ConfigError, match="unknown setting train.progress"):
        load_config(None, ["train.progress=false"])
