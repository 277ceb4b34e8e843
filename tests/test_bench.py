"""The benchmarks run on tiny shapes on the CPU and report every figure; the ids they draw are as described."""

import json

import numpy as np
import pytest

from pipeline.bench.train import draw_ids, hot_rows_share
from pipeline.stages.cli import main

TINY_TRAIN = ["--tables", "3", "--rows", "2000", "--dim", "4", "--batch", "128", "--steps", "2", "--rounds", "1",
              "--warmup", "1", "--bottom", "8", "--top", "8,1", "--threads", "1", "--device", "cpu"]


@pytest.mark.parametrize("exponent", [1.1, 1.0, 0.8])
def test_zipf_ids_are_skewed_within_range_and_spread_over_the_table(exponent):
    rows = 1000
    ids = draw_ids("zipf", rows, (200_000, 4), exponent, np.random.default_rng(0))
    assert ids.dtype == np.int64 and ids.min() >= 0 and ids.max() < rows
    for t in range(4):
        counts = np.sort(np.bincount(ids[:, t], minlength=rows))[::-1]
        top = counts[: rows // 100].sum() / counts.sum()  # the hottest 1% of rows
        assert top > 10 * 0.01
        assert top == pytest.approx(hot_rows_share("zipf", rows, exponent), abs=0.01)
        hottest = np.argsort(np.bincount(ids[:, t], minlength=rows))[::-1][:10]
        assert hottest.max() - hottest.min() > rows // 4  # not packed at the start of the table
    assert len({int(np.bincount(ids[:, t]).argmax()) for t in range(4)}) == 4  # each table its own hot row


def test_uniform_ids_are_not_skewed():
    rows = 1000
    ids = draw_ids("uniform", rows, (200_000, 2), 1.1, np.random.default_rng(0))
    assert ids.min() >= 0 and ids.max() < rows
    counts = np.sort(np.bincount(ids[:, 0], minlength=rows))[::-1]
    assert counts[: rows // 100].sum() / counts.sum() < 0.02
    assert hot_rows_share("uniform", rows, 1.1) == 0.01


@pytest.mark.parametrize("ids,optimizer,baseline", [("zipf", "adam", "SparseAdam"), ("uniform", "adagrad", "Adagrad"),
                                                    ("zipf", "sgd", "SGD")])
def test_bench_train_reports_rates_and_its_settings(tmp_path, capsys, ids, optimizer, baseline):
    out = tmp_path / "train.json"
    assert main(["bench", "train", *TINY_TRAIN, "--ids", ids, "--optimizer", optimizer, "--json", str(out),
                 f"workdir={tmp_path}"]) == 0
    result = json.loads(out.read_text())
    assert result["ours_samples_per_s"] > 0 and result["plain_pytorch_samples_per_s"] > 0
    assert result["ids"] == ids and result["optimizer"] == optimizer
    assert result["baseline_optimizer"].startswith(baseline)
    assert (result["zipf_exponent"] == 1.1) == (ids == "zipf")
    assert 0 < result["distinct_rows_per_batch"] <= 128
    printed = capsys.readouterr().out
    assert f"fused sparse {optimizer}" in printed and f"EmbeddingBag + {baseline}" in printed
    assert ("zipf, exponent 1.1" in printed) == (ids == "zipf")


def test_bench_train_refuses_a_zipf_exponent_that_is_not_positive(tmp_path, capsys):
    assert main(["bench", "train", *TINY_TRAIN, "--ids", "zipf", "--zipf-exponent", "0", f"workdir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --zipf-exponent: expected a number > 0, got 0.0"]
