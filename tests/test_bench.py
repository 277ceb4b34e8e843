"""The benchmarks run on tiny shapes on the CPU and report every figure; the ids they draw are as described."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

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
    rounds = [line for line in printed.splitlines() if line.startswith("[bench train] round ")]
    assert len(rounds) == len(result["rounds"]["ours"]) and all("ours " in line and "plain_pytorch " in line
                                                                 for line in rounds)


def test_bench_train_compiles_our_dense_part_as_the_stage_does(tmp_path, capsys):
    out = tmp_path / "train.json"
    assert main(["bench", "train", *TINY_TRAIN, "--compile", "on", "--mlp-backend", "cublaslt", "--json", str(out),
                 f"workdir={tmp_path}"]) == 0
    result = json.loads(out.read_text())
    assert result["compiled"] and result["ours_samples_per_s"] > 0 and result["mlp_backend"] == "cublaslt"
    printed = capsys.readouterr().out
    assert "our dense part compiled True" in printed and "our MLPs through cublaslt" in printed


def test_bench_train_under_a_budget_takes_the_pinned_placements_of_distributed_sharding(tmp_path):
    out = tmp_path / "train.json"
    budget = ["bench", "train", *TINY_TRAIN, "--embedding-budget-mb", "0.05", "--json", str(out), f"workdir={tmp_path}"]
    assert main(budget) == 0
    assert json.loads(out.read_text())["tables_in_device_memory"]  # the planner keeps what fits
    assert main([*budget, "distributed.sharding={t_C1: host_cached, t_C2: host_cached, t_C3: host_cached}"]) == 0
    result = json.loads(out.read_text())
    assert result["tables_in_device_memory"] == [] and set(result["host_cached_tables"]) == {"t_C1", "t_C2", "t_C3"}


def test_bench_train_profiles_more_steps_of_each_model_after_the_timed_rounds(tmp_path, capsys):
    out = tmp_path / "train.json"
    assert main(["bench", "train", *TINY_TRAIN, "--embedding-budget-mb", "0.02", "--profile", "2", "--json", str(out),
                 f"workdir={tmp_path}"]) == 0
    result = json.loads(out.read_text())
    assert set(result["profile"]) == {"ours", "host_cached"}
    for name, figures in result["profile"].items():
        assert figures["steps"] == 2 and figures["wall_ms_per_step"] > 0
        text = (tmp_path / f"profile-{name}.txt").read_text()
        assert text.startswith(f"{name}: 2 steps") and "aten::" in text
    assert "profile of host_cached: 2 steps" in capsys.readouterr().out


def test_bench_train_times_dynamic_tables_on_the_same_ids_beside_the_static_ones(tmp_path, capsys):
    out = tmp_path / "train.json"
    assert main(["bench", "train", *TINY_TRAIN, "--ids", "zipf", "--dynamic", "--json", str(out), f"workdir={tmp_path}",
                 "train.admit_after=2"]) == 0
    result = json.loads(out.read_text())
    static, dynamic = result["ours_samples_per_s"], result["ours_dynamic_samples_per_s"]
    assert static > 0 and dynamic > 0 and len(result["rounds"]["ours_dynamic"]) == 1
    assert result["static_over_dynamic"] == pytest.approx(static / dynamic)
    tables = result["dynamic_tables"]
    assert (tables["capacity"], tables["admit_after"], tables["hashtable_backend"]) == (2048, 2, "torch")
    # Rows for the ids seen twice in the three steps (a warm-up, two timed); those seen once are counted.
    assert 0 < tables["ids"] < 3 * tables["distinct_ids_per_table"] and tables["candidates"] > 0
    assert tables["distinct_ids_per_table"] <= 2000 and tables["evictions"] == 0
    printed = capsys.readouterr().out
    assert "ours, dynamic tables (capacity 2,048):" in printed and "ratio static / dynamic tables:" in printed


@pytest.mark.gpu
def test_bench_train_places_the_ids_of_dynamic_tables_with_the_hash_table_kernels_on_the_gpu(tmp_path):
    out = tmp_path / "train.json"
    # One warm-up step and two timed ones (of the bench's rotating batches): ids seen once stay candidates.
    assert main(["bench", "train", "--tables", "3", "--rows", "20000", "--batch", "4096", "--steps", "2", "--rounds",
                 "1", "--warmup", "1", "--device", "cuda", "--ids", "zipf", "--dynamic", "--json", str(out),
                 f"workdir={tmp_path}", "train.admit_after=2"]) == 0
    result = json.loads(out.read_text())
    assert (result["backend"], result["compiled"], result["amp_bf16"]) == ("cuda", True, True)
    tables = result["dynamic_tables"]
    assert tables["hashtable_backend"] == "cuda" and tables["ids"] > 0 and tables["candidates"] > 0
    assert result["ours_dynamic_samples_per_s"] > 0 and result["static_over_dynamic"] > 0


def test_bench_train_times_static_tables_alone_unless_told(tmp_path):
    out = tmp_path / "train.json"
    assert main(["bench", "train", *TINY_TRAIN, "--json", str(out), f"workdir={tmp_path}"]) == 0
    result = json.loads(out.read_text())
    assert "ours_dynamic_samples_per_s" not in result and set(result["rounds"]) == {"ours", "plain_pytorch"}


def test_every_numeric_option_of_a_bench_refuses_a_value_out_of_its_range_as_one_line(tmp_path, capsys):
    """No bench option takes a plain int or float: each is typed with its range (``pipeline.bench.arguments``), so
    -1 (out of every option's range) ends the command before anything runs, exit status 2, with one line naming the
    option and where the options are listed; so does a value that is not a number."""
    import argparse
    import importlib

    from pipeline.bench.arguments import output_file
    from pipeline.stages.cli import BENCHES

    checked = 0
    for name, module in BENCHES.items():
        parser = argparse.ArgumentParser()
        importlib.import_module(module).add_arguments(parser)
        for action in parser._actions:
            assert action.type not in (int, float), f"bench {name} {action.option_strings}: a plain {action.type}"
            if action.type in (None, output_file) or not action.option_strings or action.choices:
                continue
            for value in ("-1", "many"):
                with pytest.raises(SystemExit) as stopped:
                    main(["bench", name, action.option_strings[0], value, f"workdir={tmp_path}"])
                assert stopped.value.code == 2
                err = capsys.readouterr().err.strip().splitlines()
                assert len(err) == 1 and err[0].startswith(f"error: argument {action.option_strings[0]}: expected ")
                assert f"`python -m pipeline bench {name} --help`" in err[0]
                checked += 1
    assert checked > 40 and not list(tmp_path.iterdir())


def test_bench_train_times_tables_placed_under_a_budget_against_all_in_device_memory(tmp_path, capsys):
    out = tmp_path / "train.json"
    # 3 tables of 2000 rows x 4 fp32 and a row of Adagrad state: 0.114 MiB, 3x the budget
    assert main(["bench", "train", *TINY_TRAIN, "--ids", "zipf", "--optimizer", "adagrad", "--rounds", "2",
                 "--embedding-budget-mb", "0.038", "--json", str(out), f"workdir={tmp_path}"]) == 0
    result = json.loads(out.read_text())
    assert result["ours_samples_per_s"] > 0 and result["host_cached_samples_per_s"] > 0
    assert result["host_cached_ratio"] == result["host_cached_samples_per_s"] / result["ours_samples_per_s"]
    assert len(result["rounds"]["ours"]) == len(result["rounds"]["host_cached"]) == 2
    assert result["tables_over_budget"] == pytest.approx(3.0, rel=0.01)
    cached = result["host_cached_tables"]
    assert sorted([*cached, *result["tables_in_device_memory"]]) == ["t_C1", "t_C2", "t_C3"]
    assert sorted(cached) == sorted(result["hit_rates"])
    assert all(c["cache_rows"] < c["rows"] == 2000 for c in cached.values())
    assert all(0 < rate < 1 for rate in result["hit_rates"].values())
    printed = capsys.readouterr().out
    assert f"{len(cached)} host-cached behind device caches" in printed
    assert "ratio placed / in device memory:" in printed and "cache hit rate over the timed steps" in printed


def test_the_timed_stretches_of_a_run_are_one_pass_of_the_pipeline_so_a_round_starts_prefetched():
    from pipeline.bench.train_models import PipelinedSteps, StepBatch
    from pipeline.modules.cached_collection import HostCachedCollection
    from pipeline.modules.configs import TableConfig
    from pipeline.sparse import KeyedJaggedTensor
    from tests.test_distributed_pipeline import Holding

    embedding = HostCachedCollection([TableConfig("t", 1024, 4, ["f"])], ["f"], {"t": 100}, backend="torch")
    ones = torch.ones(8, dtype=torch.int64)
    stream = [StepBatch(torch.zeros(8, 1), None, KeyedJaggedTensor(["f"], torch.arange(8) + 8 * i, ones), None,
                        torch.zeros(8)) for i in range(6)]
    trained = []

    def step(dense, sparse, label):
        embedding(sparse).sum().backward()
        trained.append(label)

    steps = PipelinedSteps(Holding(embedding), step, "cpu", stream, lambda b: b.kjt)
    steps(stream[:2])
    # the third batch's rows were prefetched during the first round (each batch's 8 rows are new)
    assert embedding.cache_stats()["t"].rows == 24
    steps(stream[2:5])
    assert [id(label) for label in trained] == [id(b.label) for b in stream[:5]]
    with pytest.raises(ValueError, match="not the next of the run's stream"):
        steps(stream[:1])


def test_the_model_placed_under_a_budget_starts_from_the_values_of_the_one_in_device_memory():
    import argparse

    from pipeline.bench.train import add_arguments
    from pipeline.bench.train_host_cached import _placed_under_budget
    from pipeline.bench.train_models import our_dlrm
    from pipeline.modules.models import ModelSizes

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--tables", "3", "--rows", "2000", "--dim", "4", "--batch", "128",
                              "--embedding-budget-mb", "0.038"])
    sizes = ModelSizes(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1])
    plain = our_dlrm(args, sizes, "cpu").state_dict()
    placed, _ = _placed_under_budget(args, sizes, torch.device("cpu"), {})
    assert placed.embedding.cache.names  # some tables host-cached
    placed = placed.state_dict()
    assert set(placed) == set(plain) and all(torch.equal(placed[k], plain[k]) for k in plain)


def test_bench_train_refuses_a_budget_that_every_table_fits(tmp_path, capsys):
    assert main(["bench", "train", *TINY_TRAIN, "--embedding-budget-mb", "100", f"workdir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [("error: --embedding-budget-mb 100: every table fits in it, so none is host-cached: give a budget "
                    "below what the tables take")]


def test_bench_train_refuses_dynamic_tables_under_a_budget(tmp_path, capsys):
    assert main(["bench", "train", *TINY_TRAIN, "--dynamic", "--embedding-budget-mb", "0.038",
                 f"workdir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [("error: --dynamic with --embedding-budget-mb: give one of them: the budget places static tables, "
                    "host-caching those that do not fit, and dynamic tables are not placed under it")]


SMALL_STAGE = ["train.batch_size=128", "train.eval_batch_size=512", "train.embedding_dim=8", "train.bottom_mlp=[16,8]",
               "train.top_mlp=[16,1]", "progress=off", "train.log_every=4", "train.threads=1"]


def _processed(workdir, rows=1500) -> None:
    """Processed data where the default settings look for it under ``workdir``."""
    from pipeline.loader.synthetic import criteo_schema, write_processed
    from pipeline.stages.config import load_config

    cfg = load_config(None, [f"workdir={workdir}"])
    schema = criteo_schema(size=0.0001, categorical=5, continuous=3, multihot={"M1": 3})
    write_processed(cfg.paths.processed, schema, {"train": rows, "valid": 300, "test": 300}, row_group_rows=500, seed=7)


def test_bench_e2e_reports_every_rate_and_where_the_stage_time_goes(tmp_path, capsys):
    _processed(tmp_path)
    out = tmp_path / "out"
    # 12 timed steps after 2: steps 3..14, across the end of the 12-batch epoch (its last batch 92 rows),
    # with an evaluation (steps 5, 10, 12) and a checkpoint (step 6) among them
    assert main(["bench", "e2e", "--device", "cpu", "--steps", "12", "--warmup", "2", "--optimizer", "adam",
                 "--dense-optimizer", "sgd", "--profile", "2", "--out", str(out), f"workdir={tmp_path}", *SMALL_STAGE,
                 "train.eval_every=5", "train.checkpoint_every=6"]) == 0
    r = json.loads((out / "e2e.json").read_text())
    assert r["steps"] == 12 and r["stage_samples"] == 11 * 128 + 92 and r["batch"] == 128
    assert r["embedding_optimizer"] == "adam" and r["dense_optimizer"] == "sgd" and r["model"] == "dlrm"
    assert r["mlp_backend"] == "torch"
    for key in ("stage_samples_per_s", "stage_without_evaluation_and_checkpoints_samples_per_s",
                "step_alone_samples_per_s", "loader_alone_samples_per_s"):
        assert r[key] > 0, key
    regions = r["regions_seconds"]
    assert {"batch wait", "step", "loss read", "log", "evaluation", "checkpoint"} <= set(regions)
    assert all(v >= 0 for v in regions.values())
    assert sum(regions.values()) == pytest.approx(r["stage_seconds"], rel=1e-6)
    assert sum(r["difference_seconds"].values()) == pytest.approx(r["stage_seconds"] - r["step_alone_seconds"],
                                                                  rel=1e-6, abs=1e-9)
    assert r["stage_samples_per_s"] == pytest.approx(r["stage_samples"] / r["stage_seconds"])
    assert r["host_syncs"] is None  # not counted on the CPU
    # the dense part's matrix products: DLRM's MLPs alone are 4-6 FLOPs per weight a sample (forward and backward)
    assert r["dense_gemm_flops_per_sample"] > 4 * r["dense_weights"]
    assert r["dense_gemm_tflops_at_step_alone"] == pytest.approx(
        r["dense_gemm_flops_per_sample"] * r["step_alone_samples_per_s"] / 1e12)
    assert r["reference_gemm_tflops"] is None
    assert (out / "trace.json").stat().st_size > 0 and "Self CPU" in (out / "profile.txt").read_text()
    # the two profiled steps, 15 and 16, hold step 15's evaluation, and say so
    assert set(r["profile_also"]) == {"evaluation"} and r["profile_also"]["evaluation"] > 0
    # the stage's own outputs, from its own code: the loss logged every 4 steps, up to where the bench stopped it
    run = Path(r["stage_run"])
    assert run.parent == out / "train"
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "loss" in x] == [4, 8, 12, 16]
    assert not (run / "model.pt").exists()
    printed = capsys.readouterr().out
    for text in ("(a) training stage", "(b) step alone", "(c) loader alone", "batch wait", "(a) - (b)", "MLPs through torch",
                 "the dense part's matrix products", "the profiled steps also hold the stage's evaluation"):
        assert text in printed


def test_bench_e2e_refuses_a_batch_larger_than_the_training_split(tmp_path, capsys):
    """It printed "batch 100000" while each step trained the split's 1,500 rows."""
    _processed(tmp_path)
    assert main(["bench", "e2e", "--device", "cpu", "--batch", "100000", f"workdir={tmp_path}", *SMALL_STAGE]) == 2
    assert "--batch 100000 is more than the " in capsys.readouterr().err


def test_bench_e2e_without_processed_data_says_which_stage_to_run(tmp_path, capsys):
    assert main(["bench", "e2e", "--device", "cpu", f"workdir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no processed data at ")
    assert "python -m pipeline run etl" in err[0]


@pytest.mark.gpu
def test_bench_e2e_on_the_gpu_counts_the_loss_reads_as_the_only_syncs_of_a_step(tmp_path):
    _processed(tmp_path, rows=40_000)
    out = tmp_path / "out"
    assert main(["bench", "e2e", "--device", "cuda", "--steps", "20", "--warmup", "5", "--out", str(out),
                 f"workdir={tmp_path}", *SMALL_STAGE, "train.checkpoint_every=0", "train.eval_every=0"]) == 0
    r = json.loads((out / "e2e.json").read_text())
    syncs = r["host_syncs"]
    assert syncs["steps"] == 4
    assert syncs["sites"], "the loss read every train.log_every steps is a sync"
    assert not [s for s in syncs["sites"] if "pipeline/modules" in s or "pipeline/kernels" in s], syncs["sites"]
    assert r["reference_gemm_tflops"] > 0 and r["dense_gemm_tflops_at_step_alone"] > 0
    assert sum(r["regions_seconds"].values()) == pytest.approx(r["stage_seconds"], rel=1e-6)


@pytest.mark.gpu
def test_bench_embedding_interaction_times_the_fused_kernels_and_torch(tmp_path, capsys):
    out = tmp_path / "interaction.json"
    assert main(["bench", "embedding", "--interaction", "--batch", "4096", "--reps", "3", "--json", str(out),
                 f"workdir={tmp_path}"]) == 0
    r = json.loads(out.read_text())
    assert (r["vectors"], r["dim"], r["pairs"]) == (27, 128, 351)
    assert [row["dtype"] for row in r["results"]] == ["bf16", "fp32"]
    for row in r["results"]:
        assert 0 < row["floor_forward_ms"] < row["floor_forward_backward_ms"]
        for key in ("fused_forward_ms", "fused_forward_backward_ms", "torch_forward_ms", "torch_forward_backward_ms"):
            assert row[key] > 0
    assert "speed-up" in capsys.readouterr().out


def test_bench_loader_reports_rates_cpu_time_and_the_gil_share(tmp_path, capsys):
    assert main(["bench", "loader", "--rows", "30000", "--batch-size", "1024", "--naive-rows", "2000", "--epochs", "1",
                 "--window-rows", "8192", "--device", "cpu", f"workdir={tmp_path}"]) == 0
    printed = capsys.readouterr().out
    assert "30,000 rows" in printed and "windows of 30,720 rows" in printed  # at most the rows, in batches
    lines = {line.split("  ")[0]: line.split() for line in printed.splitlines() if "x  " in line}
    for name in ("pyarrow read_table", "per-row Dataset + DataLoader", "Loader host side (read, check, pack)",
                 "Loader cpu, in order", "Loader cpu, shuffled", "Loader cpu, shuffled, no checks"):
        samples_per_s, cpu_ms = float(lines[name][-3].replace(",", "")), float(lines[name][-1])
        assert samples_per_s > 0 and cpu_ms > 0, name
    assert "Loader cpu, shuffled, beside a Python thread spinning:" in printed
    assert "waited for the GIL" in printed
    calls = [line for line in printed.splitlines() if line.startswith("Python calls per batch")]
    assert len(calls) == 1 and float(calls[0].split()[-1].replace(",", "")) > 0


def test_bench_hashtable_on_the_cpu_times_the_reference_at_each_dim_and_load(tmp_path, capsys):
    out = tmp_path / "hashtable.json"
    assert main(["bench", "hashtable", "--device", "cpu", "--capacity", "1024", "--batch", "256", "--dims", "8,12",
                 "--loads", "0.5,0.9", "--reps", "2", "--json", str(out), f"workdir={tmp_path}"]) == 0
    r = json.loads(out.read_text())
    assert (r["backend"], r["capacity"], r["batch"]) == ("torch", 1024, 256) and r["copy_gb_s"] > 0
    assert [(row["dim"], row["load"]) for row in r["results"]] == [(8, 0.5), (8, 0.9), (12, 0.5), (12, 0.9)]
    for row in r["results"]:
        assert row["measured_load"] == pytest.approx(row["load"], abs=0.01)
        assert row["find_keys_per_s"] > 0 and row["insert_or_assign_keys_per_s"] > 0
        assert row["find_bytes_per_key"] == 145 + 8 * row["dim"] and 0 < row["find_fraction_of_copy"] < 1
        assert "reference_find_keys_per_s" not in row
    assert "dim   12  load 0.90" in capsys.readouterr().out


def test_bench_hashtable_refuses_a_capacity_that_is_not_whole_buckets(tmp_path, capsys):
    assert main(["bench", "hashtable", "--device", "cpu", "--capacity", "1000", f"workdir={tmp_path}"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --capacity: expected a positive multiple of 128, got 1000"]


@pytest.mark.gpu
def test_bench_hashtable_on_the_gpu_times_the_kernels_and_the_reference(tmp_path):
    out = tmp_path / "hashtable.json"
    assert main(["bench", "hashtable", "--capacity", str(1 << 20), "--batch", str(1 << 16), "--dims", "64",
                 "--loads", "0.75", "--reps", "3", "--json", str(out), f"workdir={tmp_path}"]) == 0
    (row,) = json.loads(out.read_text())["results"]
    for key in ("find_keys_per_s", "insert_or_assign_keys_per_s", "reference_find_keys_per_s",
                "reference_insert_or_assign_keys_per_s"):
        assert row[key] > 0, key


def test_bench_embedding_sweeps_the_update_kernels_named_or_all_of_them():
    from pipeline.bench.embedding import update_kernels_to_sweep
    from pipeline.kernels.embedding.launcher import UPDATE_KERNELS

    assert update_kernels_to_sweep("") == []
    assert update_kernels_to_sweep("all") == list(UPDATE_KERNELS) and "position" in UPDATE_KERNELS
    assert update_kernels_to_sweep("segments_looped,position") == ["segments_looped", "position"]


def test_bench_embedding_refuses_an_unknown_update_kernel_before_it_looks_for_a_gpu(tmp_path, capsys):
    assert main(["bench", "embedding", "--sweep-update-kernels", "position,by_row", f"workdir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --sweep-update-kernels: expected names among position, ")
    assert err[0].endswith("(or all), got by_row")


@pytest.mark.gpu
def test_bench_embedding_times_every_update_kernel_against_the_byte_floor(tmp_path, capsys):
    from pipeline.kernels.embedding.launcher import UPDATE_KERNEL, UPDATE_KERNELS

    out = tmp_path / "embedding.json"
    assert main(["bench", "embedding", "--tables", "3", "--rows-min", "1000", "--rows-max", "100000", "--batch", "4096",
                 "--hots", "1,4", "--optimizer", "adagrad", "--ids", "zipf", "--no-baseline", "--reps", "2",
                 "--sweep-update-kernels", "all", "--json", str(out), f"workdir={tmp_path}"]) == 0
    r = json.loads(out.read_text())
    assert r["update_kernel"] == UPDATE_KERNEL
    for row in r["results"]:
        assert list(row["backward_update_ms_by_kernel"]) == list(UPDATE_KERNELS)
        assert all(ms > 0 for ms in row["backward_update_ms_by_kernel"].values())
        assert row["floor_ms"] > 0 and row["time_over_floor"] == pytest.approx(
            (row["forward_ms"] + row["backward_update_ms"]) / row["floor_ms"])
        for name, ms in row["backward_update_ms_by_kernel"].items():
            assert row["time_over_floor_by_kernel"][name] == pytest.approx((row["forward_ms"] + ms) / row["floor_ms"])
        assert list(row["step_ms_by_kernel"]) == list(UPDATE_KERNELS)
        for name, ms in row["step_ms_by_kernel"].items():
            assert ms > 0 and row["step_over_floor_by_kernel"][name] == pytest.approx(ms / row["floor_ms"])
        # the rows a batch touches, read and written back alone, each way of spreading them over warps timed
        assert row["random_rows"] == row["unique_rows"] and list(row["random_rows_ms_by_rows_per_warp"]) == ["1", "2", "4", "8"]
        assert row["random_rows_tb_s"] > 0 and all(ms > 0 for ms in row["random_rows_ms_by_rows_per_warp"].values())
        assert row["floor_ms_at_random_rows_rate"] > 0 and row["step_over_random_rows_floor"] == pytest.approx(
            row["step_ms"] / row["floor_ms_at_random_rows_rate"])
        # steps back to back: no bound against the step alone (at this size the host's launches outlast the
        # kernels, and five steps together ran 12% slower than one on an H100)
        assert row["step_back_to_back_ms"] > 0 and row["step_back_to_back_over_floor"] == pytest.approx(
            row["step_back_to_back_ms"] / row["floor_ms"])
    printed = capsys.readouterr().out
    assert "steps back to back, as training runs them" in printed
    assert "backward + update by update kernel" in printed and "step (forward, then backward + update) by" in printed


@pytest.mark.parametrize("ids", ["uniform", "zipf"])
def test_bench_embedding_draws_each_tables_ids_in_range_uniform_or_skewed(ids):
    import numpy as np

    from pipeline.bench.embedding import batch_of_ids

    rows, batch, hot = [5000, 40], 512, 3
    indices, offsets = batch_of_ids(torch, rows, batch, hot, seed=1, ids=ids, device="cpu")
    assert offsets.tolist() == list(range(0, 2 * batch * hot + 1, hot))
    first, second = indices[: batch * hot].numpy(), indices[batch * hot:].numpy()
    assert 0 <= first.min() and first.max() < 5000 and 0 <= second.min() and second.max() < 40
    top = np.sort(np.bincount(first, minlength=5000))[::-1][:50].sum() / first.size  # the hottest 1% of rows
    assert (top > 0.3) == (ids == "zipf")


def test_bench_serve_times_its_paths_in_turn_in_blocks():
    """The ensemble and the in-process model are timed in blocks of 10 calls taken in turn, not one path's
    requests all before the other's: a change of load on the machine falls on both alike."""
    from pipeline.bench.serve import _timed_in_turn

    calls = []
    timed = _timed_in_turn({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 25)
    assert calls[20:] == ["a"] * 10 + ["b"] * 10 + ["a"] * 10 + ["b"] * 10 + ["a"] * 5 + ["b"] * 5  # after the warm-up
    assert {name: t["requests"] for name, t in timed.items()} == {"a": 25, "b": 25}
    assert 0 <= timed["a"]["p50_ms"] <= timed["a"]["p99_ms"]


def test_bench_serve_reports_latency_steps_throughput_and_cache_hit_rates(tmp_path, capsys):
    from export.server import server_problem
    from pipeline.stages.config import load_config

    problem = server_problem(load_config(None, []).serve)
    if problem:
        pytest.fail(f"the serving bench needs a Triton server and the models' environment (make serve-env): {problem}")
    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "data.rows=3000", "--batches", "1,16", "--requests", "5", "--clients", "2",
                 "--seconds", "0.5", "--throughput-batch", "8", f"workdir={tmp_path / 'work'}",
                 "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    for batch in ("1", "16"):
        for path in ("ensemble", "in_process", "model_only"):
            assert 0 < r["latency"][batch][path]["p50_ms"] <= r["latency"][batch][path]["p99_ms"], (batch, path)
        steps = r["steps"][batch]  # one model, raw rows in: its execute within its compute within its time served
        assert 0 < steps["ensemble model"] <= steps["ensemble"] <= steps["ensemble (server side)"]
        assert steps["ensemble queue"] >= 0 and "preprocess" not in steps
        phases = r["phases"][batch]  # inside the model's execute: each phase of its batches, host time
        assert set(phases) == {"refresh", "inputs", "preprocess", "lookup", "dense", "outputs"} and min(phases.values()) > 0
        assert sum(phases.values()) <= 1.1 * steps["ensemble model"], (phases, steps)
    assert r["throughput"]["ensemble_rows_per_s"] > 0 and r["throughput"]["in_process_rows_per_s"] > 0
    assert r["served_cache"]["hits"] > 0
    exported = json.loads((tmp_path / "work" / "bench-serve" / "bench-serve-3000" / "export" / "export.json").read_text())
    assert r["command"].startswith("python -m pipeline bench serve --rows 3000 --batches 1,16 ")
    served = (r["served_cache"]["model"], r["served_cache"]["instances"])
    assert served == ("ensemble", exported["options"]["instances"])
    assert set(r["cache_offline"]) == {"rows", "lru@0.05", "lru@0.25", "lfu@0.05", "lfu@0.25"}
    assert all(0 <= v <= 1 for k, v in r["cache_offline"].items() if k != "rows")
    assert "ensemble / in-process p50" in capsys.readouterr().out


TINY_DISTRIBUTED = ["--tables", "3", "--rows", "500", "--dim", "4", "--mlp", "small", "--batch", "64", "--steps", "2",
                    "--rounds", "1", "--warmup", "1", "--device", "cpu"]


def test_bench_train_distributed_times_the_pipelined_step_and_the_plain_loop(tmp_path, capsys):
    out = tmp_path / "distributed.json"
    assert main(["bench", "train_distributed", *TINY_DISTRIBUTED, "--nproc", "1,2", "--loop", "pipelined,plain",
                 "--out", str(out), f"workdir={tmp_path}"]) == 0
    results = json.loads(out.read_text())["results"]
    assert list(results) == ["1", "2/fp32/pipelined", "2/fp32/plain"]
    assert [r["loop"] for r in results.values()] == ["plain", "pipelined", "plain"]
    for r in results.values():
        assert r["samples_per_s"] > 0 and r["profiled_step_ms"] > 0 and r["scaling_efficiency"] > 0
    for key in ("2/fp32/pipelined", "2/fp32/plain"):
        assert results[key]["comm_ms_per_step"] > 0 and results[key]["plan"]["world_size"] == 2
    # The pipelined step trains the weights the plain loop does: the same loss after the same steps.
    assert results["2/fp32/pipelined"]["loss"] == pytest.approx(results["2/fp32/plain"]["loss"], abs=1e-7)
    printed = capsys.readouterr().out
    assert "2/fp32/pipelined" in printed and "2/fp32/plain" in printed


def test_bench_train_distributed_times_the_pipelined_step_unless_told(tmp_path, capsys):
    from pipeline.stages.cli import build_parser

    assert build_parser().parse_args(["bench", "train_distributed"]).loop == ["pipelined"]
    for option, value, expected in (("--loop", "async", "pipelined | plain"), ("--comm", "fp16", "fp32 | bf16"),
                                    ("--nproc", "0", "an integer >= 1")):
        with pytest.raises(SystemExit) as stopped:
            main(["bench", "train_distributed", *TINY_DISTRIBUTED, option, value, f"workdir={tmp_path}"])
        err = capsys.readouterr().err.strip().splitlines()
        assert stopped.value.code == 2 and len(err) == 1
        assert err[0].startswith(f"error: argument {option}: expected {expected}"), err


def test_bench_data_times_every_criteo_and_table_reader_on_the_same_file(tmp_path, capsys):
    assert main(["bench", "data", "--rows", "20000", "--ingest-rows", "3000", "--baseline-rows", "2000",
                 f"workdir={tmp_path}", "device=cpu"]) == 0
    printed = capsys.readouterr().out
    for source in ("criteo", "table"):
        for reader in ("arrow", "vectorized, numpy"):
            assert f"{source} read + check + type ({reader})" in printed
    assert "vectorized, cupy" not in printed


def test_etl_profile_times_each_step_of_one_partition(tmp_path):
    """tools/etl_profile.py on pandas: every step it reports on either backend but the cuDF-only ones."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("etl_profile", Path(__file__).parent.parent / "tools/etl_profile.py")
    profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile)
    summary = profile.main(["--backend", "pandas", "--rows", "5000", "--repeats", "1", "--workdir", str(tmp_path),
                            "--json", str(tmp_path / "profile.json")])
    assert json.loads((tmp_path / "profile.json").read_text()) == summary
    steps = " | ".join(summary["ms"])
    for step in ("read", "fit (all statistics", "fit task: Categorify counts (26 cols)", "fit task: FillMissing median",
                 "fit task: Normalize moments", "transform Categorify (26 cols)", "transform MissingIndicator",
                 "Categorify: 64-bit keys", "Categorify: counts in one sort", "Categorify: codes by key",
                 "Categorify: codes by string", "continuous chain, column by column", "continuous chain, one matrix",
                 "write (parquet, one file)", "write (parquet, to memory)"):
        assert step in steps, step
    assert all(ms >= 0 for ms in summary["ms"].values())
    assert summary["notes"]["write (parquet, to memory)"].endswith("MB")


def test_etl_variants_measures_each_variant_in_a_process_of_its_own(tmp_path):
    """tools/etl_variants.py on pandas: a setting and an environment variable reach their variant's run (its cluster
    and its output), a bad setting fails its variant alone."""
    import importlib.util

    import pyarrow.parquet as pq

    spec = importlib.util.spec_from_file_location("etl_variants", Path(__file__).parent.parent / "tools/etl_variants.py")
    variants = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(variants)
    results = variants.main(["--backend", "pandas", "--rows", "20000", "--repeats", "1", "--workers", "1",
                             "--workdir", str(tmp_path), "--json", str(tmp_path / "v.json"),
                             "--report", str(tmp_path / "reports"), "as is:",
                             "groups:etl.row_group_rows=4096 DASK_DISTRIBUTED__SCHEDULER__WORK_STEALING=False",
                             "bad:etl.nope=1"])
    assert json.loads((tmp_path / "v.json").read_text()) == results
    plain, groups, bad = results
    assert plain["rows"] == groups["rows"] == 20_000 and plain["where"] == "ours, pandas on LocalCluster(1 workers)"
    assert groups["settings"] == ["etl.row_group_rows=4096"]
    assert groups["environment"] == {"DASK_DISTRIBUTED__SCHEDULER__WORK_STEALING": "False"}
    assert len(plain["fit_each_s"]) == 1 and plain["fit_s"] > 0 and plain["transform_rows_s"] > 0
    out = sorted((tmp_path / "out").glob("part-*.parquet"))
    assert out and pq.ParquetFile(out[0]).metadata.row_group(0).num_rows == 4096, "the last variant's row groups"
    assert bad["failed"].startswith("pipeline.stages.config.ConfigError: unknown setting etl.nope")
    for number in (1, 2):  # each measured variant's report: where its fit and its transform spent their time
        report = json.loads((tmp_path / "reports" / f"{number}.json").read_text())
        assert set(report) == {"pandas-fit", "pandas-transform"} and report["pandas-fit"]["tasks"]


def test_etl_gpu_trace_records_each_worker_and_the_client(tmp_path):
    """tools/etl_gpu_trace.py on pandas: the mechanics (each worker's recording started and stopped, its trace kept,
    the client's profile) without a GPU figure."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("etl_gpu_trace", Path(__file__).parent.parent / "tools/etl_gpu_trace.py")
    trace = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trace)
    results = trace.main(["--backend", "pandas", "--rows", "20000", "--workdir", str(tmp_path),
                          "--out", str(tmp_path / "trace")])
    assert [phase["phase"] for phase in results] == ["fit", "transform+write"]
    assert all(len(phase["workers"]) == 2 and phase["wall_s"] > 0 for phase in results)
    assert results[0]["client"] and all(seconds >= 0 for _, seconds in results[0]["client"])
    inside = dict(results[1]["client_inside"])
    assert any(line.endswith(" transform_split") for line in inside)  # the stage's own steps, with what they call
    assert 0 < results[1]["client_s"] <= results[1]["wall_s"] + 1
    assert len(list((tmp_path / "trace").glob("trace-transform-*.json"))) == 2
    assert json.loads((tmp_path / "trace" / "trace-summary.json").read_text()) == json.loads(json.dumps(results))
    assert trace._union([(5, 6), (0, 2), (1, 3), (1.5, 2.5)]) == 4  # overlapping work counted once


def test_dense_profile_times_a_dense_part_and_counts_its_matrix_products(tmp_path):
    """tools/dense_profile.py on the CPU: DCNv2 of the small preset (cross layers of rank 128), its FLOPs a sample
    those of its layers' matrix products (forward, and backward but for the dense input's own gradient)."""
    import importlib.util

    import torch

    from pipeline.loader.synthetic import criteo_schema
    from pipeline.modules.models import ModelSizes, build_model

    tool = Path(__file__).parent.parent / "tools/dense_profile.py"
    spec = importlib.util.spec_from_file_location("dense_profile", tool)
    profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile)
    result = profile.main(["--model", "dcnv2", "--preset", "small", "--batch", "256", "--device", "cpu",
                           "--steps", "2", "--warmup", "1", "--compile", "off", "--profile", "1",
                           "--json", str(tmp_path / "dense.json")])
    assert json.loads((tmp_path / "dense.json").read_text())["step_ms"] == result["step_ms"] > 0
    model = build_model("dcnv2", criteo_schema(size=0.001), ModelSizes.preset("small"), backend="torch")
    layers = [(m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    width = layers[1][1] + 26 * 32
    assert len(layers) == 2 + 3 * 2 + 3 and layers[2:4] == [(width, 128), (128, width)]  # bottom, cross, top
    forward = sum(2 * a * b for a, b in layers)
    assert result["gemm_flops_per_sample"] == 3 * forward - 2 * layers[0][0] * layers[0][1]
    assert result["kinds"]["matmul"]["ms_per_step"] > 0 and "aten::mm" in dict(result["kinds"]["matmul"]["largest"])


def test_stream_busy_time_counts_overlapping_kernels_once():
    from pipeline.bench.train_profile import _union_us

    assert _union_us([(5, 6), (0, 2), (1, 3)]) == 4 and _union_us([(0, 10), (2, 3)]) == 10 and _union_us([]) == 0


def test_criteo_scale_runs_tsv_to_processed_timing_each_stage_and_compares_a_sample(tmp_path, capsys):
    """tools/criteo_scale.py on the CPU: the TSV written by several processes holds every row once, the data and ETL
    stages run on it, each timed with its memory peaks, and a sample through both sides compares equal."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("criteo_scale",
                                                  Path(__file__).parent.parent / "tools/criteo_scale.py")
    scale = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scale)
    rows = 150_000  # three generator blocks of 65,536, the last short, over two files
    assert scale.main(["--rows", str(rows), "--device", "cpu", "--workdir", str(tmp_path), "--parts", "2",
                       "--sample-rows", "20000", "--json", str(tmp_path / "scale.json")]) == 0
    r = json.loads((tmp_path / "scale.json").read_text())
    lines = [line for p in sorted((tmp_path / "tsv").glob("*.tsv")) for line in p.read_text().splitlines()]
    assert len(lines) == rows and len(set(lines)) > rows * 0.99 and all(line.count("\t") == 39 for line in lines[:100])
    assert list(r["stages"]) == ["tsv", "data", "etl"]
    for stage in r["stages"].values():
        assert stage["seconds"] > 0 and stage["rows_per_s"] > 0 and "host_peak_gib" in stage
    whole = r["raw_tsv_to_processed"]
    assert whole["seconds"] == pytest.approx(r["stages"]["data"]["seconds"] + r["stages"]["etl"]["seconds"])
    assert whole["criteo_1tb_hours"] == pytest.approx(scale.CRITEO_1TB_ROWS / whole["rows_per_s"] / 3600)
    assert r["sample"]["equal"] and 0 < r["sample"]["rows"] < 20_000
    assert "raw TSV to processed parquet" in capsys.readouterr().out


def test_bench_etl_sides_write_the_same_table_with_the_default_frequency_threshold(tmp_path, capsys):
    """The plain pandas side leaves out values seen fewer than etl.freq_threshold times, as the workflow does (it
    kept them, and the bench stopped on the first categorical column)."""
    out = tmp_path / "etl.json"
    assert main(["bench", "etl", "--rows", "20000", "--cluster", "threads", "--json", str(out), f"workdir={tmp_path}",
                 "device=cpu"]) == 0
    said = capsys.readouterr().out
    assert "every side wrote the same table" in said
    summary = json.loads(out.read_text())
    (ours, ours_times), (plain, plain_times) = summary["results"].items()
    speedup = summary["speedup"][plain]
    for phase in ("fit", "transform"):  # reported to two decimals: 1% of a ratio under 0.5 is less than their step
        assert speedup[phase] == round(plain_times[phase] / ours_times[phase], 2)
    assert f"{ours}: {speedup['fit']:.2f}x the fit and {speedup['transform']:.2f}x the transform+write of {plain}" in said


def test_bench_etl_takes_workers_0_for_one_per_core():
    """Its help said so, and the GPU checks pass it; the option refused it."""
    from pipeline.stages.cli import build_parser

    assert build_parser().parse_args(["bench", "etl", "--workers", "0"]).workers == 0


def test_bench_etl_reports_the_lines_the_workers_spent_their_time_in(tmp_path):
    """Where a side's time goes inside its tasks (a GPU worker's host time had no name: the task stream gives one
    figure a task)."""
    import json

    report = tmp_path / "report.json"
    assert main(["bench", "etl", "--rows", "20000", "--workers", "1", "--no-baseline", "--report", str(report),
                 f"workdir={tmp_path}", "device=cpu", "progress=off"]) == 0
    fit = json.loads(report.read_text())["pandas-fit"]
    lines = fit["worker_lines"]
    assert lines and all(0 < line["self"] <= line["total"] <= 1 for line in lines)
    assert any("pipeline/etl/" in line["line"] for line in lines)


def test_bench_etl_reports_each_run_and_starts_each_on_an_idle_scheduler(tmp_path, capsys, monkeypatch):
    """The best of the repeats is reported, each repeat's times beside it (a fit many times faster than the others is
    then seen); a repeat starts once the scheduler holds no task of the one before, so none can take its results.
    Each repeat's transform+write starts without the last one's output (its removal was timed as part of it)."""
    import time

    from distributed import Client, LocalCluster

    from pipeline.bench.etl import _wait_for_idle_scheduler
    from pipeline.etl import output

    found = []
    transform_split = output.transform_split

    def noting_what_is_there(workflow, files, folder, *args, **kwargs):
        found.append(sorted(p.name for p in Path(folder).glob("*")))
        return transform_split(workflow, files, folder, *args, **kwargs)

    monkeypatch.setattr(output, "transform_split", noting_what_is_there)
    out = tmp_path / "etl.json"
    assert main(["bench", "etl", "--rows", "20000", "--workers", "1", "--repeats", "2", "--no-baseline", "--json",
                 str(out), f"workdir={tmp_path}", "device=cpu", "progress=off"]) == 0
    (side,) = json.loads(out.read_text())["results"].values()
    assert len(side["fit_each_s"]) == len(side["transform_each_s"]) == 2
    assert side["fit"] == pytest.approx(min(side["fit_each_s"]), abs=1e-3)
    assert "each run: fit" in capsys.readouterr().out
    assert found == [[], []]
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        held = client.submit(sum, [1, 2])
        assert held.result() == 3
        t = time.monotonic()
        assert _wait_for_idle_scheduler(timeout_s=0.5) == 1, "a held result is a task the scheduler still holds"
        assert time.monotonic() - t >= 0.5
        del held
        t = time.monotonic()
        assert _wait_for_idle_scheduler(timeout_s=10) == 0
        assert time.monotonic() - t < 5


def test_bench_quality_leaves_latest_on_the_first_model_asked_for(tmp_path, capsys):
    """The logistic baseline trains last, so `train/latest` (what `run export` exports) was left on it."""
    settings = [f"workdir={tmp_path}", "device=cpu", "data.rows=3000", "train.epochs=1", "progress=off",
                "etl.cluster=threads"]
    assert main(["bench", "quality", "--models", "dlrm", *settings]) == 0
    latest = tmp_path / "synthetic" / "train" / "latest"
    assert json.loads((latest / "result.json").read_text())["model"] == "dlrm"
    out = capsys.readouterr().out
    assert f"{latest} -> {latest.resolve().name} (dlrm)" in out
    assert "The test split's AUC has a standard error of about 0.0" in out and "positive): differences" in out
    assert main(["bench", "quality", "--models", "dlrm", *settings, "train.run=mine"]) == 2
    assert "train.run=mine: bench quality trains a run for each model" in capsys.readouterr().err


def test_a_benchs_rows_come_from_rows_or_data_rows_and_both_must_agree():
    """`bench etl data.rows=3000` and `bench serve data.rows=3000` ran on their own defaults (2M, 50k) without a word."""
    from pipeline.bench.arguments import bench_rows
    from pipeline.data.config import DataConfig
    from pipeline.errors import UserError

    assert bench_rows(None, DataConfig(), 2_000_000) == 2_000_000
    assert bench_rows(None, DataConfig(rows=3000), 2_000_000) == 3000
    assert bench_rows(5000, DataConfig(), 2_000_000) == 5000 == bench_rows(5000, DataConfig(rows=5000), 10)
    with pytest.raises(UserError, match="--rows 5000 and data.rows=3000 disagree"):
        bench_rows(5000, DataConfig(rows=3000), 10)


def test_bench_etl_leaves_the_users_dataset_of_that_name_as_it_is(tmp_path, capsys):
    """With data.name naming the user's dataset, the bench read it again into that name with every row in train:
    its valid and test splits were emptied, and the next training scored NaN against the oracle."""
    from pipeline.stages import data as data_stage
    from pipeline.stages.config import load_config

    mine = load_config(None, [f"workdir={tmp_path}", "data.rows=3000", "data.name=mine", "progress=off"])
    data_stage.run(mine)
    before = (mine.paths.raw / "meta.json").read_text()
    assert main(["bench", "etl", "--rows", "2000", "--no-baseline", "--cluster", "threads", "--workers", "1",
                 f"workdir={tmp_path}", "data.name=mine", "device=cpu"]) == 0
    assert (mine.paths.raw / "meta.json").read_text() == before
    assert (tmp_path / "bench-etl-2000" / "raw" / "meta.json").is_file()


def test_a_benchs_output_file_that_is_a_folder_is_refused_before_the_run(tmp_path, capsys):
    """The error came after the whole measurement, naming a `.tmp` file that does not exist or advising to remove the
    user's folder."""
    for bench, option in (("train", "--json"), ("train_distributed", "--out"), ("etl", "--report")):
        with pytest.raises(SystemExit) as stopped:
            main(["bench", bench, option, str(tmp_path), f"workdir={tmp_path / 'w'}"])
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and f"is a folder: name a file, e.g. {tmp_path / 'bench.json'}" in err, err
    assert not (tmp_path / "w").exists()


def test_bench_etl_report_over_a_file_that_is_no_report_replaces_it(tmp_path, capsys):
    report = tmp_path / "report.json"
    report.write_text("{broken")
    assert main(["bench", "etl", "--rows", "2000", "--workers", "1", "--no-baseline", "--report", str(report),
                 f"workdir={tmp_path}", "device=cpu", "progress=off"]) == 0
    assert "holds no report of this bench: it is replaced" in capsys.readouterr().out
    assert {"pandas-fit", "pandas-transform"} <= set(json.loads(report.read_text()))


@pytest.mark.parametrize("setting", ["etl.missing_indicator=false", "etl.hash_buckets={C1: 100}",
                                     "etl.hash_ids={C1: 1024}"])
def test_bench_etl_refuses_work_its_baseline_does_not_do_before_any(tmp_path, capsys, setting):
    """The baseline wrote the default workflow: after the timing, a KeyError or "disagree on column" traceback."""
    assert main(["bench", "etl", "--rows", "2000", setting, f"workdir={tmp_path}", "device=cpu"]) == 2
    assert "add --no-baseline to time the workflow alone" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_bench_train_options_a_model_cannot_take_are_refused_before_it_is_built(tmp_path, capsys):
    """`--top 512,256` failed after the models were built (a target of another size); `--backend cuda` on a CPU and
    `--bottom abc` were tracebacks."""
    for option, value, expected in (("--top", "4,2", "argument --top: expected widths ending in 1"),
                                    ("--bottom", "abc", "argument --bottom: expected an integer >= 1"),
                                    ("--backend", "foo", "argument --backend: invalid choice: 'foo'")):
        with pytest.raises(SystemExit) as stopped:
            main(["bench", "train", *TINY_TRAIN, option, value, f"workdir={tmp_path}"])
        assert stopped.value.code == 2 and expected in capsys.readouterr().err
    assert main(["bench", "train", *TINY_TRAIN, "--backend", "cuda", f"workdir={tmp_path}"]) == 2
    assert "error: --backend cuda: embedding backend 'cuda' cannot run on cpu" in capsys.readouterr().err


def test_bench_data_asked_for_cuda_on_a_cpu_refuses(tmp_path, capsys):
    """It measured the CPU readers and said nothing of the device asked for."""
    assert main(["bench", "data", "--rows", "100", "--ingest-rows", "10", "--device", "cuda", f"workdir={tmp_path}"]) == 2
    assert "--device cuda was asked for" in capsys.readouterr().err


def test_bench_loader_refuses_a_split_another_bench_loader_is_using(tmp_path, capsys):
    """Two benches of one split at once: one rewrote the files under the other's reads ("not a readable parquet")."""
    from pipeline.files import FileLock

    held = FileLock(tmp_path / "bench" / "loader-3000-lz4.lock", "taken")
    assert main(["bench", "loader", "--rows", "3000", "--naive-rows", "100", "--epochs", "1",
                 f"workdir={tmp_path}", "device=cpu"]) == 2
    assert "another bench loader reads or writes" in capsys.readouterr().err
    held.release()
    assert main(["bench", "loader", "--rows", "3000", "--naive-rows", "100", "--epochs", "1",
                 f"workdir={tmp_path}", "device=cpu"]) == 0
