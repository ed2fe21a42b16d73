"""The bench scripts end to end on CPU at tiny sizes: real `gpuscale run`s (CLI, supervisor, ranks as CPU
processes, runs.db), the script's JSON checked against the runs it made. Speeds on CPU mean nothing;
what is checked is that every run happens with the settings the script promises and that its figures
and ratios are computed from them."""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import sqlite3
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
from bench_loader import load_bench

from conftest import slow
from gpuscale.control.store import Store

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ("date", "commit", "tracked_files_match_commit", "command", "card", "versions", "defaults_fingerprints",
          "test_split", "settings", "figures")  # bench/record.py's


def bench(script: str, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    """The script's run; `check=False` where its exit code is a verdict that CPU speeds cannot meet.

    One OpenMP thread, as the `home` fixture gives every run: a script that trains in its own process
    (train_speed.py's stock SFT variants) spun two threads at barriers on a busy 2-core machine, 93 s
    instead of 28 s."""
    done = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == (0 if check else done.returncode), done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.mark.e2e
def test_grpo_mtl_bench_times_every_generator_on_one_rank(home, tmp_path):
    """bench/grpo_mtl.py on one CPU rank: each generator's run and the ratios against the engine's. Its
    multi-GPU engine run is grpo_mtl.measure's weak-scaling run at 2 ranks, which grpo_async.py's test
    starts (as sync_2gpu, the same call with rollout=sync spelt out); the scaling ratios are checked on
    made-up runs (test_grpo_mtl_bench_scales_the_many_gpu_engine_run_against_the_one_gpu_one): a third
    2-rank run here would only repeat that one."""
    out = tmp_path / "grpo.json"
    prompts, generations = 2, 2
    done = bench("grpo_mtl.py", "--model", "tiny-math", "--gpus", "1", "--prompts-per-step", str(prompts),
                 "--generations", str(generations), "--max-completion-length", "6", "--batch-size", "2",
                 "--steps", "2", "--precision", "auto", "--home", str(home), "--out", str(out))
    record = json.loads(out.read_text())
    assert set(record) == set(SCHEMA) and record["settings"]["gpus"] == 1
    results = record["figures"]
    runs = results["runs"]
    assert set(runs) == {"transformers_1gpu", "continuous_1gpu", "engine_1gpu"}
    store = Store(home, read_only=True)  # the runs are over; reading takes no write lock
    for name, run in runs.items():
        generator = name.split("_")[0]
        stored = store.get_run(run["run"])
        assert stored["status"] == "succeeded" and stored["summary"]["generator"] == generator
        assert stored["summary"]["world_size"] == 1 and run["steps"] == 2
        assert f"prompts_per_step={prompts}" in run["command"]
        assert run["completions_per_step"] == prompts * generations
        # A median step lies within the training time, and its generation part within the step.
        assert 0 < run["generation_seconds_per_step"] < run["step_seconds"] <= run["train_seconds"]
        assert run["completions_per_s"] == pytest.approx(run["completions_per_step"] / run["step_seconds"])
        assert run["tokens_per_s_steady"] > 0 and run["mfu"] is None  # CPU: no peak to compare with
    ratios = results["ratios"]
    engine, transformers = runs["engine_1gpu"], runs["transformers_1gpu"]
    assert ratios["step_transformers_over_engine"] == pytest.approx(
        transformers["step_seconds"] / engine["step_seconds"])
    assert ratios["generation_transformers_over_engine"] == pytest.approx(
        transformers["generation_seconds_per_step"] / engine["generation_seconds_per_step"])
    assert ratios["step_continuous_over_engine"] == pytest.approx(
        runs["continuous_1gpu"]["step_seconds"] / engine["step_seconds"])
    assert ratios["engine_gpus"] is None and ratios["engine_scaling"] is None  # --gpus 1: no many-GPU run
    assert "step_transformers_over_engine" in done.stdout and "engine_1gpu" in done.stdout


def test_grpo_mtl_bench_scales_the_many_gpu_engine_run_against_the_one_gpu_one():
    """grpo_mtl.py's ratios on made-up runs: the N-GPU engine's completions/s (and steady tokens/s) over the
    one-GPU engine's, the efficiency that over N; the generators' ratios against the one-GPU engine."""
    ratios = load_bench("grpo_mtl.py").ratios
    runs = {"engine_1gpu": {"completions_per_s": 10.0, "tokens_per_s_steady": 100.0, "step_seconds": 0.5,
                            "generation_seconds_per_step": 0.2},
            "transformers_1gpu": {"step_seconds": 2.0, "generation_seconds_per_step": 1.6},
            "continuous_1gpu": {"step_seconds": 1.0},
            "engine_2gpu": {"completions_per_s": 18.0, "tokens_per_s_steady": 190.0}}
    assert ratios(runs, 2) == pytest.approx({
        "step_transformers_over_engine": 4.0, "generation_transformers_over_engine": 8.0,
        "step_continuous_over_engine": 2.0, "engine_gpus": 2, "engine_scaling": 1.8,
        "engine_scaling_tokens": 1.9, "scaling_efficiency": 0.9})
    one_gpu = ratios(runs, 1)  # --gpus 1: the 2-GPU run is not its many-GPU run
    assert (one_gpu["engine_gpus"], one_gpu["engine_scaling"], one_gpu["scaling_efficiency"]) == (None, None, None)


TINY_SFT_SPEED = ["--model", "tiny-math", "--rows", "64", "--row-tokens", "16", "--pack-length", "64",
                  "--stock-batches", "4,8", "--steps", "5", "--warm-up", "1"]


GRPO_STOCK_VARIANTS = ["generate", "static", "static+compile", "continuous"]
TINY_GRPO_SPEED = ["--grpo-prompts", "2", "--grpo-generations", "2", "--grpo-completion-tokens", "4",
                   "--grpo-stock-micro", "2,4", "--grpo-steps", "5", "--grpo-warm-up", "1",
                   "--grpo-stock-variants", ",".join(GRPO_STOCK_VARIANTS)]


@pytest.fixture(scope="module")
def train_speed_record(module_home, tmp_path_factory) -> dict:
    """bench/train_speed.py's sft and grpo comparisons in one call, for the tests of each: the script's
    start (torch, transformers and TRL imported) once instead of twice. The grpo side's gpuscale run is
    recorded in module_home."""
    out = tmp_path_factory.mktemp("train-speed") / "train-speed.json"
    bench("train_speed.py", *TINY_SFT_SPEED, "--repeats", "2", *TINY_GRPO_SPEED, "--only", "stock,gpuscale,grpo",
          "--out", str(out))
    return json.loads(out.read_text())


@pytest.mark.e2e
def test_train_speed_bench_sweeps_every_stock_sft_variant_and_compares_gpuscale_with_the_best_on_cpu(
        train_speed_record):
    """bench/train_speed.py's sft comparison on CPU, every stock SFTTrainer variant by default: those the CPU
    cannot run skipped with their reason, flash attention's refused with its exception, the rest swept over
    their batches; real tokens counted as TRL counts them; gpuscale at the best's rows a step, each side run
    --repeats times, the ratio of the medians."""
    record = train_speed_record
    figures = record["figures"]
    speed = load_bench("train_speed.py")
    variants = figures["stock_variants"]
    assert list(variants) == list(speed.STOCK_SFT)
    for name, options in speed.STOCK_SFT.items():
        needs_cuda = options.get("use_liger_kernel") or options.get("attention") == "flex_attention"
        if needs_cuda:
            assert variants[name]["not_run"] == speed.cpu_skip(name) and speed.cpu_skip(name)
        elif options.get("attention") == "flash_attention_2":
            assert variants[name]["not_run"].startswith("ImportError: FlashAttention2")
        else:
            assert variants[name]["tokens_per_s"] > 0
    ran = [row for row in figures["rows"] if row["side"] == "stock" and "tokens_per_s" in row]
    swept = [row for row in ran if "repeat" not in row]
    for row in ran:
        # The stock side pads nothing TRL would count: its count and ours agree, padded or padding-free.
        assert row["tokens_per_step"] == row["trl_tokens_per_step"] > 0 and row["timed_steps"] == 5
        assert row["gradient_checkpointing"] == (row["variant"] == "trl-defaults")
    packed = [row for row in swept if row["variant"] == "packing"]
    assert [row["batch"] for row in packed] == [1, 2][: len(packed)]  # 4 and 8 rows of 16 tokens in 64
    mean_row = record["settings"]["mean_row_tokens"]
    assert all(row["rows_per_step"] == pytest.approx(row["tokens_per_step"] / mean_row) for row in packed)
    best = figures["stock_best"]
    assert best["tokens_per_s"] == max(row["tokens_per_s"] for row in swept)
    stock, mine = figures["stock_runs"], figures["gpuscale_runs"]
    assert stock[0] == best and stock[1]["repeat"] == 2 and [row["repeat"] for row in mine] == [1, 2]
    assert {(row["variant"], row["batch"]) for row in stock} == {(best["variant"], best["batch"])}
    step_rows = max(8, round(best["rows_per_step"] / 8) * 8)  # to a multiple of 8: 8 x gradient_accumulation
    assert {row["step_rows"] for row in mine} == {figures["step_rows"]} == {step_rows}
    for side, runs in (("stock", stock), ("gpuscale", mine)):
        rates = [row["tokens_per_s"] for row in runs]
        assert figures[f"{side}_tokens_per_s"] == pytest.approx(statistics.median(rates))
        assert figures[f"{side}_spread"] == pytest.approx((max(rates) - min(rates)) / statistics.median(rates))
    assert figures["ratio_over_stock_best"] == pytest.approx(figures["gpuscale_tokens_per_s"] /
                                                             figures["stock_tokens_per_s"])
    # gpuscale pads its padding-free micro-batches to a multiple of 16: TRL counts those tokens, we do not.
    assert all(0 < row["tokens_per_step"] <= row["trl_tokens_per_step"] for row in mine)


@pytest.mark.e2e
def test_grpo_async_bench_runs_sync_async_and_placed_side_by_side_on_two_ranks(home, tmp_path):
    """bench/grpo_async.py on 2 CPU ranks: a rollout=sync and a rollout=async run of the same shape and a
    placed one (1 rank generates, 1 trains), whole-run completions/s, async's staleness and clipped share,
    the ratios computed from the runs. Two ranks only: the count where all three modes run; the one-rank
    sync run is grpo_mtl.py's test's engine_1gpu (the same grpo_mtl.measure call), rollout=async's
    background thread is run by test_grpo_mtl_run.py, and the weak-scaling ratios against one GPU are
    checked on made-up runs (test_grpo_async_bench_scales_each_mode_against_its_one_gpu_run)."""
    out = tmp_path / "async.json"
    prompts, generations, steps, gpus = 2, 2, 3, 2
    bench("grpo_async.py", "--model", "tiny-math", "--gpus", str(gpus), "--prompts-per-step", str(prompts),
          "--generations", str(generations), "--max-completion-length", "6", "--batch-size", "2",
          "--steps", str(steps), "--precision", "auto", "--home", str(home), "--out", str(out))
    record = json.loads(out.read_text())
    assert set(record) == set(SCHEMA) and record["settings"]["max_staleness"] == 1
    runs, ratios = record["figures"]["runs"], record["figures"]["ratios"]
    assert set(runs) == {"sync_2gpu", "async_2gpu", "placed_2gpu"}
    store = Store(home, read_only=True)
    for name, run in runs.items():
        mode = name.split("_")[0]
        summary = store.get_run(run["run"])["summary"]
        rollout, generators = ("async", 1) if mode == "placed" else (mode, 0)
        # A placed run's world is its training ranks; the step's prompts are the same over the same ranks.
        assert (summary["rollout"], summary["world_size"], summary["steps"]) == (rollout, gpus - generators, steps)
        assert f"--set rollout={rollout}" in run["command"] and f"prompts_per_step={prompts * gpus}" in run["command"]
        assert ("--set generation_gpus=1" in run["command"]) == (mode == "placed")
        assert run["completions_per_s_run"] == pytest.approx(
            prompts * gpus * generations * steps / summary["train_seconds"])
        if rollout == "async":  # steps 2 and 3 were generated during the step before
            assert run["sampling_staleness_last"] == 1.0
            assert 0 <= run["sampling_importance_sampling_clipped_share_last"] <= 1
        else:
            assert "sampling_staleness_last" not in run
    for mode in ("async", "placed"):
        assert ratios[f"{mode}_over_sync_2gpu"] == pytest.approx(
            runs[f"{mode}_2gpu"]["completions_per_s_run"] / runs["sync_2gpu"]["completions_per_s_run"])
    assert not any("scaling_efficiency" in name for name in ratios)  # no one-GPU run to scale against


def test_grpo_async_bench_scales_each_mode_against_its_one_gpu_run():
    """grpo_async.py's ratios on made-up runs at 1 and 2 GPUs: async and placed over sync at each count
    where they ran (placement cannot split one GPU), each mode's weak-scaling efficiency against its own
    one-GPU run, placed's against the one-GPU sync run (a user's run without placement)."""
    ratios = load_bench("grpo_async.py").ratios

    def run(per_run: float, steady: float) -> dict:
        return {"completions_per_s_run": per_run, "completions_per_s": steady}

    runs = {"sync_1gpu": run(10.0, 20.0), "async_1gpu": run(15.0, 25.0),
            "sync_2gpu": run(16.0, 36.0), "async_2gpu": run(27.0, 45.0), "placed_2gpu": run(24.0, 40.0)}
    assert ratios(runs, [1, 2]) == pytest.approx({
        "async_over_sync_1gpu": 1.5, "async_over_sync_steady_1gpu": 1.25,
        "async_over_sync_2gpu": 27 / 16, "async_over_sync_steady_2gpu": 1.25,
        "placed_over_sync_2gpu": 1.5, "placed_over_sync_steady_2gpu": 40 / 36,
        "sync_scaling_efficiency_2gpu": 0.8, "async_scaling_efficiency_2gpu": 0.9,
        "placed_scaling_efficiency_2gpu": 1.2})


def test_grpo_async_bench_gives_every_mode_the_lora_rank_asked_for_and_only_its_own_rollout_settings():
    """grpo_async.py --lora-rank R: every mode's run trains LoRA adapters of rank R (the LoRA step beside the full
    fine-tune's is the same call with and without it); without it, none does."""
    bench = load_bench("grpo_async.py")
    args = SimpleNamespace(max_staleness=1, generation_gpus=1, old_logprobs="loss", compile=False, lora_rank=16)
    assert bench.mode_settings(args, "sync") == {"rollout": "sync", "lora_rank": 16}
    assert bench.mode_settings(args, "async") == {"rollout": "async", "max_staleness": 1, "lora_rank": 16}
    assert bench.mode_settings(args, "placed") == {"rollout": "async", "max_staleness": 1, "generation_gpus": 1,
                                                   "lora_rank": 16}
    args.lora_rank = 0
    assert "lora_rank" not in bench.mode_settings(args, "sync")


@pytest.mark.e2e
def test_train_speed_bench_times_stock_grpo_generation_paths_against_a_grpo_mtl_run_on_cpu(train_speed_record):
    """bench/train_speed.py's grpo comparison on CPU with the uncompiled paths: the first variant at each
    micro-batch, the others at the one with the shortest training part; TRL's static cache refusing compile
    recorded; the fastest step the stock figure, each ratio against it."""
    variants = GRPO_STOCK_VARIANTS
    grpo = train_speed_record["figures"]["grpo"]
    stock = grpo["stock"]
    assert [(row["variant"], row["micro_batch"]) for row in stock[:2]] == [("generate", 2), ("generate", 4)]
    micro = min(stock[:2], key=lambda row: row["training_seconds_per_step"])["micro_batch"]
    assert grpo["stock_micro_batch"] == micro
    assert [(row["variant"], row["micro_batch"]) for row in stock[2:]] == [(name, micro) for name in variants[1:]]
    assert list(grpo["stock_not_run"]) == ["static+compile"]
    assert grpo["stock_not_run"]["static+compile"].startswith("TypeError") and "disable_compile" in grpo[
        "stock_not_run"]["static+compile"]
    ran = [row for row in stock if "step_seconds_median" in row]
    assert len(ran) == 4 and not any(row["gradient_checkpointing"] for row in ran)
    for row in ran:
        assert row["timed_steps"] == 5 and 0 < row["generation_seconds_per_step"] < row["step_seconds_median"]
    best, mine = grpo["stock_best"], grpo["gpuscale"]
    assert best == min(ran, key=lambda row: row["step_seconds_median"])
    assert grpo["step_stock_over_gpuscale"] == pytest.approx(best["step_seconds_median"] / mine["step_seconds_median"])
    for part in ("generation", "training"):
        assert grpo[f"{part}_stock_over_gpuscale"] == pytest.approx(
            best[f"{part}_seconds_per_step"] / mine[f"{part}_seconds_per_step"])
    assert "--set prompts_per_step=2" in mine["command"] and "--set max_steps=6" in mine["command"]


TINY_SCALING = ["--probe-batch", "4", "--probe-steps", "6", "--sft-batch", "2", "--train-steps", "3"]


@pytest.mark.e2e
def test_scaling_bench_weak_scales_a_serving_and_a_training_recipe_on_cpu_ranks(home, tmp_path):
    out = tmp_path / "scaling.json"
    done = bench("scaling.py", "--cpu", "--gpu-counts", "1,2", "--recipes", "probe,sft", "--models", "tiny-math",
                 *TINY_SCALING, "--set", "seed=3", "--out", str(out))
    record = json.loads(out.read_text())
    assert set(record) == set(SCHEMA) and record["card"] == "cpu" and record["date"]
    assert record["command"].startswith("python bench/scaling.py --cpu ")
    results = record["figures"]
    assert results["gpus_available"] == 0 and results["device_name"] == "cpu"
    rows = {(row["recipe"], row["mode"], row["gpus"]): row for row in results["rows"]}
    # The probe's ranks share no work: weak scaling only.
    assert set(rows) == {("probe", "weak", 1), ("probe", "weak", 2)} | {
        ("sft", mode, gpus) for mode in ("weak", "strong") for gpus in (1, 2)}
    store = Store(home, read_only=True)
    for (recipe, _mode, gpus), row in rows.items():
        summary = store.get_run(row["run"])["summary"]
        assert summary["world_size"] == gpus and row["model"] == "tiny-math" and row["wall_s"] > 0
        assert store.get_run(row["run"])["settings"]["seed"] == 3 and row["command"].endswith(" --set seed=3")
        assert row["command"].startswith(f"gpuscale run --recipe {recipe} --gpus {gpus} --model tiny-math")
        assert row["total"] > 0 and row["per_gpu"] == pytest.approx(row["total"] / gpus)
        assert row["comm_share"] is None  # neither times its collectives: "not measured"
        # CPU: the RSS of each rank the sampler caught alive (a short rank can end between samples).
        assert len(row["run_mem_mb_per_gpu"]) <= gpus and all(mb > 0 for mb in row["run_mem_mb_per_gpu"])
    # Strong scaling's 2-GPU point is the weak one's run; its 1-GPU run does the work of two.
    assert rows[("sft", "strong", 2)]["run"] == rows[("sft", "weak", 2)]["run"]
    assert rows[("sft", "strong", 1)]["run"] != rows[("sft", "weak", 1)]["run"]
    for recipe, mode in (("probe", "weak"), ("sft", "weak"), ("sft", "strong")):
        one, two = rows[(recipe, mode, 1)], rows[(recipe, mode, 2)]
        assert one["efficiency"] == pytest.approx(1.0)
        assert two["efficiency"] == pytest.approx(two["total"] / (2 * one["total"]))
    for gpus in (1, 2):  # the engine's throughput of every rank, summed; the decode loop's beside it
        row = rows[("probe", "weak", gpus)]
        summary = store.get_run(row["run"])["summary"]
        assert row["figure"] == "throughput_tokens_per_s" and row["decode_loop_tokens_per_s"] == summary["tokens_per_s"]
        assert row["total"] == pytest.approx(sum(summary[f"throughput_tokens_per_s_rank_{r}"] for r in range(gpus)))
        assert "--set steps=6 " in row["command"]
    # Weak scaling: every rank trains on the same sequences per step at both counts; strong: one rank
    # accumulates two micro-batches, so a step holds the 2-GPU run's sequences.
    assert "--set max_examples=6" in rows[("sft", "weak", 1)]["command"]
    assert "--set max_examples=12" in rows[("sft", "weak", 2)]["command"]
    strong = rows[("sft", "strong", 1)]["command"]
    assert "--set max_examples=12" in strong and "--set gradient_accumulation=2" in strong
    one, two = rows[("sft", "weak", 1)], rows[("sft", "weak", 2)]
    assert one["figure"] == "tokens_per_s_steady" and one["step_overhead"] is None
    for row in (one, two, rows[("sft", "strong", 1)]):
        summary = store.get_run(row["run"])["summary"]
        assert summary["steps"] == 3 and 0 < row["step_seconds"] <= summary["train_seconds"]
        assert row["total"] == pytest.approx(summary["train_tokens"] / 3 / row["step_seconds"])
    assert two["step_overhead"] == pytest.approx((two["step_seconds"] - one["step_seconds"]) / two["step_seconds"])
    assert results["targets"] == []  # the targets are at random-qwen2.5-0.5b
    assert "tokens_per_s_steady" in done.stdout and "not measured" in done.stdout  # the table
    assert "none: no random-qwen2.5-0.5b row above 1 GPU" in done.stdout


@pytest.mark.e2e
def test_scaling_bench_gives_every_rank_of_rfts_sft_its_own_rows_at_every_count(home, tmp_path):
    out = tmp_path / "scaling.json"
    questions, steps = 12, 3
    bench("scaling.py", "--cpu", "--gpu-counts", "1,2", "--recipes", "rft", "--modes", "weak", "--models",
          "tiny-math", "--rft-questions-per-gpu", str(questions), "--rft-questions-per-call", "6", "--rft-samples",
          "2", "--max-new-tokens", "8", "--train-steps", str(steps), "--out", str(out))
    rows = {row["gpus"]: row for row in json.loads(out.read_text())["figures"]["rows"] if row["phase"] == "sft"}
    store = Store(home, read_only=True)
    tokens_a_rank_a_step = {}
    for gpus, row in rows.items():
        summary = store.get_run(row["run"])["summary"]
        assert f"--set train_batch_size={questions // steps} " in row["command"]
        # One epoch holds every step's micro-batches on every rank: none is filled with repeated rows
        # (a micro-batch larger than a rank's rows made 2-rank steps twice a 1-rank step's rows).
        assert summary["train_examples"] >= questions // steps * gpus * steps
        tokens_a_rank_a_step[gpus] = summary["train_tokens"] / summary["steps"] / gpus
    assert tokens_a_rank_a_step[2] == pytest.approx(tokens_a_rank_a_step[1], rel=0.3)


@pytest.mark.e2e
def test_profile_step_profiles_the_same_optimizer_step_on_every_rank(home, tmp_path):
    out = tmp_path / "sft-2ranks"
    bench("profile_step.py", "--out", str(out), "--step", "2", "--trace", "--", "--recipe", "sft", "--gpus", "2",
          "--model", "tiny-math", "--batch-size", "4", "--set", "max_steps=3", "--set", "eval_examples=0",
          "--set", "save_model=false", "--set", "max_examples=24")
    for rank in (0, 1):
        text = Path(f"{out}.rank{rank}.txt").read_text()
        assert text.startswith(f"rank {rank}, optimizer step 2: wall ")
        # The step's forward and backward, and the gradients' all-reduce between the two ranks (gloo).
        assert "aten::mm" in text and "MmBackward0" in text and "gloo:all_reduce" in text
        with gzip.open(f"{out}.rank{rank}.trace.json.gz") as timeline:
            assert json.load(timeline)["traceEvents"]
    assert not list(tmp_path.glob("*.trace.json"))  # only the gzipped timelines stay


def test_scaling_rows_of_several_invocations_merge_and_scale_against_the_one_gpu_row():
    scaling = load_bench("scaling.py")
    earlier = [{"recipe": "sft", "model": "m", "gpus": 1, "total": 100.0, "step_seconds": 1.0},
               {"recipe": "sft", "model": "m", "gpus": 2, "total": 1.0, "step_seconds": 9.0}]
    new = [{"recipe": "sft", "model": "m", "gpus": 2, "total": 180.0, "step_seconds": 1.25},
           {"recipe": "probe", "model": "m", "gpus": 2, "total": 50.0}]
    rows = scaling.merged(earlier, new)
    scaling.add_scaling(rows)
    by_key = {(row["recipe"], row["gpus"]): row for row in rows}
    assert len(rows) == 3 and by_key[("sft", 2)]["total"] == 180.0  # the new row replaced the earlier one
    assert by_key[("sft", 2)]["efficiency"] == pytest.approx(0.9)
    assert by_key[("sft", 2)]["step_overhead"] == pytest.approx(0.2)
    assert by_key[("sft", 2)]["comm_share"] is None  # sft reports no collective time: not measured
    assert by_key[("sft", 1)]["step_overhead"] is None
    assert by_key[("probe", 2)]["efficiency"] is None  # no 1-GPU row to scale against


def test_an_appended_sweep_runs_only_the_points_not_measured_without_error(monkeypatch):
    scaling = load_bench("scaling.py")
    opts = scaling.parse_options(["--gpu-counts", "1,2", "--recipes", "sft,rft", "--models", "tiny-math",
                                  "--out", "unused.json", "--append"])
    base = {"model": "tiny-math", "figure": "f", "total": 1.0, "per_gpu": 1.0, "run_mem_mb_per_gpu": [],
            "memory_spread": None}
    earlier = [{**base, "recipe": "sft", "phase": None, "gpus": 1, "share": 1, "mode": "weak", "run": 7},
               {**base, "recipe": "sft", "phase": None, "gpus": 2, "share": 1, "mode": "weak", "error": "oom"},
               *({**base, "recipe": "rft", "phase": phase, "gpus": 2, "share": 1, "mode": mode, "run": 8}
                 for phase in ("generation", "sft") for mode in ("weak", "strong"))]
    ran = []

    def measure(recipe, model, gpus, share, opts, env, devices=()):
        ran.append((recipe, gpus, share))
        return [{**base, "recipe": recipe, "phase": phase, "gpus": gpus, "share": share, "run": len(ran)}
                for phase in scaling.RECIPES[recipe].phases]

    monkeypatch.setattr(scaling, "measure", measure)
    rows, _ = scaling.sweep(opts, [1, 2], {}, earlier=earlier)
    # sft: its 1-GPU weak point was measured; its 2-GPU one failed (run again); the strong 1-GPU one is new.
    # rft: both phases of its 2-GPU run were measured (weak and strong share it); its 1-GPU points are new.
    assert sorted(ran) == [("rft", 1, 1), ("rft", 1, 2), ("sft", 1, 2), ("sft", 2, 1)]
    weak_sft_one = next(r for r in rows if (r["recipe"], r["mode"], r["gpus"]) == ("sft", "weak", 1))
    assert weak_sft_one["run"] == 7
    assert {(r["phase"], r["mode"]) for r in rows if r["recipe"] == "rft" and r["gpus"] == 2} == {
        (phase, mode) for phase in ("generation", "sft") for mode in ("weak", "strong")}


def side_by_side_sweep(monkeypatch, slowed_beside: float = 1.0):
    """A side-by-side sweep of 3 recipes over 1, 2 and 4 GPUs with made-up runs, each run's figure
    `slowed_beside` when it ran on named GPUs beside others: (rows, check, runs, rows after each round)."""
    scaling = load_bench("scaling.py")
    opts = scaling.parse_options(["--gpu-counts", "1,2,4", "--recipes", "sft,rft,grpo-mtl", "--side-by-side"])
    ran, seen = [], []

    def measure(recipe, model, gpus, share, opts, env, devices=()):
        ran.append((recipe, gpus, share, devices))
        total = slowed_beside if devices and gpus == 1 else 1.0
        return [{"recipe": recipe, "model": model, "phase": phase, "gpus": gpus, "share": share, "figure": "f",
                 "total": total, "per_gpu": total, "run_mem_mb_per_gpu": [], "memory_spread": None}
                for phase in scaling.RECIPES[recipe].phases]

    monkeypatch.setattr(scaling, "measure", measure)
    rows, check = scaling.sweep(opts, [1, 2, 4], {}, devices=[4, 5, 6, 7],
                                after_each=lambda rows, check: seen.append(len(ran)))
    return scaling, opts, rows, check, ran, seen


def test_a_side_by_side_sweep_runs_each_counts_points_at_once_on_disjoint_gpus(monkeypatch):
    scaling, opts, rows, check, ran, seen = side_by_side_sweep(monkeypatch)
    # 3 recipes x (weak 1, 2, 4; strong 1, 2; strong 4 is weak 4's run): the check's point (sft weak, 1 GPU)
    # alone first, then the other five 1-GPU points in a round of four (the check's point again among them)
    # and one of two, six 2-GPU points in three rounds of two, three 4-GPU points alone.
    assert seen == [1, 5, 7, 9, 11, 13, 14, 15, 16]
    assert ran[0] == ("sft", 1, 1, ())
    assert check.point == ("sft", "random-qwen2.5-0.5b", 1, 1) and check.ratio == 1.0 and check.passed
    assert check.record()["passed"] is True
    assert sorted(devices for _, gpus, _, devices in ran[1:] if gpus == 1) == [(4,), (4,), (5,), (5,), (6,), (7,)]
    assert {devices for _, gpus, _, devices in ran if gpus == 2} == {(4, 5), (6, 7)}
    assert {devices for _, gpus, _, devices in ran if gpus == 4} == {(4, 5, 6, 7)}
    beside = {(r["recipe"], r["mode"], r["gpus"]): r["beside"] for r in rows if r.get("phase") != "sft"}
    assert beside[("sft", "weak", 1)] == 0  # its row is the run alone
    assert beside[("sft", "strong", 1)] == 3 and beside[("sft", "weak", 4)] == 0 and beside[("sft", "strong", 2)] == 1
    # Without devices every point runs alone on the first GPUs, and nothing is checked.
    ran.clear()
    rows, check = scaling.sweep(opts, [1, 2, 4], {})
    assert len(ran) == 15 and {devices for *_, devices in ran} == {()} and check.record() is None
    with pytest.raises(SystemExit):
        scaling.parse_options(["--cpu", "--side-by-side"])


def test_a_side_by_side_sweep_that_slows_its_runs_drops_the_round_and_goes_on_one_run_at_a_time(monkeypatch):
    scaling, opts, rows, check, ran, seen = side_by_side_sweep(monkeypatch, slowed_beside=0.6)
    assert check.ratio == pytest.approx(0.6) and not check.passed and check.record()["passed"] is False
    # The check's point alone, the first round of four (dropped), then all 14 other points alone.
    assert len(ran) == 1 + 4 + 14 and all(devices == () for *_, devices in ran[5:])
    assert all(row["beside"] == 0 and row["total"] == 1.0 for row in rows)


def scaling_row(recipe: str, mode: str, gpus: int, total: float | None, phase: str | None = None,
                model: str = "random-qwen2.5-0.5b", **more) -> dict:
    return {"recipe": recipe, "phase": phase, "model": model, "mode": mode, "gpus": gpus, "figure": "members_per_s",
            "total": total, "per_gpu": total / gpus if total else None, "run_mem_mb_per_gpu": [],
            "memory_spread": None, **more}


def test_scaling_efficiency_per_mode_and_the_issue_targets_met_or_not_on_made_up_rows(capsys):
    scaling = load_bench("scaling.py")
    rows = [scaling_row("eggroll", "weak", 1, 100.0, step_seconds=1.0, comm_share=0.01),
            scaling_row("eggroll", "weak", 2, 190.0, step_seconds=1.05, comm_share=0.04),
            scaling_row("eggroll", "weak", 4, 372.0, step_seconds=1.08, comm_share=0.07),
            scaling_row("eggroll", "strong", 1, 110.0), scaling_row("eggroll", "strong", 2, 200.0),
            scaling_row("eggroll", "strong", 4, 372.0),
            scaling_row("rft", "strong", 1, 50.0, phase="generation"),
            scaling_row("rft", "strong", 4, 180.0, phase="generation"),
            scaling_row("rft", "strong", 1, 1000.0, phase="sft"),
            scaling_row("rft", "strong", 4, 1000.0, phase="sft"),  # no strong target for rft's SFT
            scaling_row("sft", "weak", 1, 10.0), scaling_row("sft", "weak", 4, None, error="run 9 failed"),
            scaling_row("sft", "weak", 1, 10.0, model="tiny-math"),  # targets are at 0.5B only
            scaling_row("sft", "weak", 4, 1.0, model="tiny-math")]
    scaling.add_scaling(rows)
    by_key = {(scaling.bench_name(r), r["model"][:4], r["mode"], r["gpus"]): r for r in rows}
    # Each mode against its own 1-GPU row.
    assert by_key[("eggroll", "rand", "weak", 4)]["efficiency"] == pytest.approx(372 / 400)
    assert by_key[("eggroll", "rand", "strong", 4)]["efficiency"] == pytest.approx(372 / 440)
    assert by_key[("rft generation", "rand", "strong", 4)]["efficiency"] == pytest.approx(0.9)
    assert by_key[("eggroll", "rand", "weak", 4)]["comm_share"] == 0.07  # as the run reported it
    assert by_key[("eggroll", "rand", "weak", 4)]["step_overhead"] == pytest.approx(0.08 / 1.08)
    assert by_key[("eggroll", "rand", "strong", 4)]["step_overhead"] is None  # only weak has the same step work
    verdicts = {(v["bench"], v["mode"]): v for v in scaling.targets(rows)}
    assert set(verdicts) == {("eggroll", "weak"), ("eggroll", "strong"), ("rft generation", "strong"),
                             ("sft", "weak")}
    assert verdicts[("eggroll", "weak")] == {
        "bench": "eggroll", "model": "random-qwen2.5-0.5b", "mode": "weak", "target": 0.9, "gpus": [2, 4],
        "worst_efficiency": pytest.approx(0.93), "worst_at_gpus": 4, "met": True}
    assert verdicts[("eggroll", "strong")]["met"] is False and verdicts[("eggroll", "strong")]["target"] == 0.85
    assert verdicts[("eggroll", "strong")]["worst_efficiency"] == pytest.approx(372 / 440)
    assert verdicts[("rft generation", "strong")]["met"] is True
    assert verdicts[("sft", "weak")]["met"] is None  # its 4-GPU run failed: not measured, not "met"
    scaling.print_table(rows, list(verdicts.values()))
    table = capsys.readouterr().out.splitlines()
    assert any("weak" in line and "eggroll" in line and "lowest 0.930 at 4 GPUs" in line and line.endswith(" met")
               for line in table)
    assert any("strong" in line and "eggroll" in line and line.endswith("not met") for line in table)
    assert any(line.split()[:2] == ["weak", "sft"] and line.endswith("not measured") for line in table)
    assert any(line.startswith("sft ") and "not measured" in line for line in table)  # its comm share


def test_scaling_strong_shares_split_the_largest_counts_work_and_refuse_uneven_counts(capsys):
    scaling = load_bench("scaling.py")
    assert scaling.strong_shares([1, 2, 4]) == {1: 4, 2: 2, 4: 1}
    assert scaling.strong_shares([1, 2, 4, 8]) == {1: 8, 2: 4, 4: 2, 8: 1}
    assert scaling.parse_options(["--gpu-counts", "1,3", "--modes", "weak"]).gpu_counts == [1, 3]
    with pytest.raises(SystemExit) as refused:
        scaling.parse_options(["--gpu-counts", "1,3,4"])
    assert refused.value.code == 2
    assert "--gpu-counts: 1,3,4: strong scaling splits the work of 4 GPUs evenly, and [3] do not divide 4" in \
        capsys.readouterr().err
    # rft's one run gives two benches: its generation's steady samples/s and its SFT's steady tokens/s.
    store = type("LoggedSteps", (), {"metrics": lambda self, run, name: [
        {"rank": 0, "value": ms} for ms in (900.0, 200.0, 220.0, 240.0)] + [{"rank": 1, "value": 5000.0}]})()
    parts = scaling.rft_figures({"samples_per_s": 40.0, "samples_per_s_steady": 70.0, "steps": 4,
                                 "train_tokens": 8000}, store, 1)
    assert [(p["phase"], p["figure"], p["total"]) for p in parts] == [
        ("generation", "samples_per_s_steady", 70.0), ("sft", "tokens_per_s_steady", pytest.approx(2000 / 0.22))]
    assert parts[0]["samples_per_s"] == 40.0
    # eggroll's gather phase is communication only where its scoring was timed apart (every run since the
    # teacher-forced fitness lapped its scoring; the recipe contract test holds a real run to it).
    correctness = {"members_per_s": 64.0, "step_seconds_median": 2.0, "load_seconds_median": 0.1,
                   "generate_seconds_median": 1.5, "score_seconds_median": 0.2, "gather_seconds_median": 0.1}
    assert scaling.eggroll_figures(correctness, store, 1)[0]["comm_share"] == pytest.approx(0.05)
    gold_logprob = {"members_per_s": 64.0, "step_seconds_median": 2.0, "load_seconds_median": 0.1,
                    "score_seconds_median": 1.8, "gather_seconds_median": 0.05}
    assert scaling.eggroll_figures(gold_logprob, store, 1)[0]["comm_share"] == pytest.approx(0.025)
    before_the_lap = {"members_per_s": 64.0, "step_seconds_median": 2.0, "gather_seconds_median": 1.9}
    assert scaling.eggroll_figures(before_the_lap, store, 1)[0]["comm_share"] is None


def test_curve_averages_each_metric_over_windows_of_steps_and_ranks():
    curve = load_bench("curve.py")
    records = [{"step": 0, "name": "reward", "value": 9.0},  # before training: not a step
               {"step": 1, "name": "reward", "value": 0.2}, {"step": 1, "name": "reward", "value": 0.4},  # two ranks
               {"step": 2, "name": "reward", "value": 0.6}, {"step": 3, "name": "reward", "value": 1.0},
               {"step": 3, "name": "loss", "value": 5.0}]
    assert curve.chosen(["rew*"], {"reward", "loss"}) == ["reward"]
    assert curve.windows(records, ["reward"], window=2) == [(2, {"reward": pytest.approx(0.4)}), (3, {"reward": 1.0})]


def test_write_result_writes_every_schema_key_without_importing_torch(tmp_path):
    """bench/record.py in a fresh interpreter: every key of the schema, the default path
    results/<recipe>/<name>-<date>-<card>.json, no overwriting, and torch left unimported."""
    script = f"""
import json, sys
sys.path.insert(0, {str(ROOT / "bench")!r})
import record
record.RESULTS = __import__("pathlib").Path({str(tmp_path)!r})
first = record.write_result("sft", "speed", {{"batch": 8}}, {{"tokens_per_s": 1.5}}, card="cpu")
again = record.write_result("sft", "speed", {{"batch": 8}}, {{"tokens_per_s": 1.6}}, card="cpu")
out = record.write_result("sft", "speed", {{}}, {{}}, command="python bench/x.py --y 'a b'",
                          out={str(tmp_path / "o.json")!r})
import os
os.environ["GPUSCALE_TREE_COMMIT"] = "f" * 40  # as on the GPU machine, whose copy's .git is older than its files
given = record.write_result("sft", "given", {{}}, {{}}, card="cpu")
print(json.dumps([str(first), str(again), str(out), "torch" in sys.modules, str(given)]))
"""
    done = subprocess.run([sys.executable, "-c", script, "--flag", "two words"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    first, again, out, torch_imported, given = json.loads(done.stdout.strip().splitlines()[-1])
    assert not torch_imported
    data = json.loads(Path(first).read_text())
    assert tuple(data) == SCHEMA
    date = data["date"][:10]
    assert Path(first) == tmp_path / "sft" / f"speed-{date}-cpu.json" and data["date"][10] == "T"
    assert Path(again) == tmp_path / "sft" / f"speed-{date}-cpu-run2.json"  # the first one is kept
    assert data["card"] == "cpu" and data["settings"] == {"batch": 8} and data["figures"] == {"tokens_per_s": 1.5}
    assert data["commit"] is None or len(data["commit"]) == 40
    assert data["tracked_files_match_commit"] in (True, False, None)
    assert data["command"] == "python -c --flag 'two words'"
    assert data["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert set(data["versions"]) <= {"python", "torch", "transformers", "trl", "accelerate", "peft", "liger-kernel"}
    assert json.loads(Path(out).read_text())["command"] == "python bench/x.py --y 'a b'"
    from gpuscale.recipes.shared.defaults_fingerprint import defaults_fingerprints
    assert data["defaults_fingerprints"] == defaults_fingerprints()
    assert set(data["defaults_fingerprints"]) == {"eggroll", "grpo-mtl", "power-sampling", "probe", "rft", "sft"}
    assert data["test_split"] == "test-v2"
    given = json.loads(Path(given).read_text())
    assert (given["commit"], given["tracked_files_match_commit"]) == ("f" * 40, None)


def test_card_labels_name_the_card_and_count():
    record = load_bench("record.py")
    assert record.card_label("cpu") == "cpu"
    assert record.card_label({"names": ["NVIDIA H200"], "count": 1}) == "h200"
    assert record.card_label({"names": ["NVIDIA H100 80GB HBM3"] * 2, "count": 2}) == "h100x2"
    assert record.one_card("cpu (x86_64, 2 threads)") == "cpu"


@pytest.mark.e2e
def test_resume_kill_bench_kills_the_supervisor_and_resumes_to_the_end_on_cpu(home, tmp_path):
    """bench/resume_kill.py at its docstring's CPU sizes, a little smaller and on one rank (whose supervisor
    starts it without a launcher; test_runs.py's killed supervisor takes a launcher and two ranks with it): the
    supervisor's SIGKILL leaves no process behind, the store says lost, the resume runs from the checkpoint to
    max_steps."""
    out = tmp_path / "resume-kill.json"
    bench("resume_kill.py", "--gpus", "1", "--checkpoint-every", "2", "--set", "max_steps=4",
          "--set", "eval_examples=2", "--set", "max_examples=8", "--set", "prompts_per_step=4",
          "--set", "num_generations=4", "--set", "batch_size=4", "--set", "max_completion_length=8",
          "--home", str(home), "--out", str(out))
    record = json.loads(out.read_text())
    assert set(record) == set(SCHEMA) and record["card"] == "cpu"
    f = record["figures"]
    assert f["parent_status"] == "lost" and f["child_status"] == "succeeded" and f["child_parent_id"] == f["parent_id"]
    assert f["processes_left_after_kill"] == [] and f["processes_left_after_reconcile"] == []
    assert f["run_processes_at_kill"] >= 1  # the rank was alive when it was killed
    assert f["resumed_from_step"] >= f["first_checkpoint_step"] == 2
    assert f["child_first_logged_step"] == f["resumed_from_step"] + 1
    assert f["child_final_step"] == f["child_last_logged_step"] == f["max_steps"] == 4
    assert f["child_model_saved"] and 0 <= f["child_accuracy_greedy_after"] <= 1
    store = Store(home, read_only=True)
    assert store.get_run(f["parent_id"])["status"] == "lost"
    assert store.get_run(f["child_id"])["parent_id"] == f["parent_id"]


def test_the_gpu_pool_serves_cases_in_the_order_they_asked():
    """bench/faults.py's GpuPool (bench/gpu_counts.py's too): a two-GPU case that asked first is not kept
    waiting by a one-GPU case that asked after it and finds a GPU free."""
    pool = load_bench("faults.py").GpuPool([0, 1])
    first = pool.take(1)
    with ThreadPoolExecutor(max_workers=2) as workers:
        both = workers.submit(pool.take, 2)
        wait_until(lambda: pool.asked == 2)  # the two-GPU case holds its ticket
        one = workers.submit(pool.take, 1)
        wait_until(lambda: pool.asked == 3)  # the one-GPU case asked, after it
        assert not one.done() and not both.done()  # GPU 1 is free, but the two-GPU case asked first
        pool.give_back(first)
        assert both.result(timeout=10) == [0, 1]
        assert not one.done()
        pool.give_back([0, 1])
        assert one.result(timeout=10) == [0]


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)

@pytest.mark.e2e
def test_faults_bench_kills_a_rank_and_times_the_others_end_on_cpu(home, tmp_path):
    """bench/faults.py's kill case at its docstring's CPU sizes: rank 1 of a 2-rank sft run killed once
    both ranks are past step 2; the JSON's times and verdict agree with the history's run. The case is
    kept in --partial as it ends, and --from-partial makes a result of two calls' cases without a run."""
    out, partial = tmp_path / "faults.json", tmp_path / "faults.partial.jsonl"
    settings = ["batch_size=2", "max_examples=64", "eval_examples=2", "sft:max_length=64", "sft:max_new_tokens=8",
                "grpo-mtl:num_generations=2"]
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "faults.py"), "--cases", "sft-kill", "--gpus", "2",
                           "--model", "tiny-math", "--at-step", "2", *(f"--set={one}" for one in settings),
                           "--home", str(tmp_path / "homes"), "--json", str(out), "--partial", str(partial)],
                          capture_output=True, text=True, timeout=slow(300), cwd=ROOT)
    record = json.loads(out.read_text())
    assert set(record) == set(SCHEMA) and record["card"] == "cpu", done.stdout[-3000:] + done.stderr[-3000:]
    [case] = record["figures"]["cases"]
    assert case["case"] == "sft-kill" and case["gpus"] == "2" and case["rank"] == 1
    assert "num_generations=2" not in case["run_arguments"]  # another recipe's setting stays with it
    assert min(case["steps_at_fault"].values()) > 2 and case["fault_step"] == case["steps_at_fault"]["1"]
    assert case["others_gone_s"] < slow(10) and case["others_gone_s"] <= case["all_processes_gone_s"]
    assert case["processes_left"] == [] and case["other_ranks"] == 1
    assert case["error"] == "rank 1: killed by SIGKILL with no error of its own" and case["status"] == "failed"
    assert case["passed"] == (case["others_gone_s"] <= case["limit_s"] == 10)
    assert done.returncode == (0 if case["passed"] else 1)
    assert f"sft-kill (2): {'PASS' if case['passed'] else 'FAIL'}: rank 1 SIGKILL at step" in done.stdout
    run = Store(Path(case["home"]), read_only=True).get_run(case["run"])
    assert (run["status"], run["error"], run["run_dir"]) == (case["status"], case["error"], case["run_dir"])
    assert run["settings"]["max_steps"] == 1000 and run["settings"]["hang_timeout"] == 30
    assert [json.loads(line) for line in partial.read_text().splitlines()] == [{**case, "card": "cpu"}]
    merged = tmp_path / "merged.json"
    again = subprocess.run([sys.executable, str(ROOT / "bench" / "faults.py"), "--from-partial", str(partial),
                            str(partial), "--json", str(merged)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert again.returncode == done.returncode and json.loads(merged.read_text())["figures"]["cases"] == [case, case]


def selection_rows(label: str, seeds_figures: list[tuple[str, float, float, float, float]]) -> list[dict]:
    """Rows as select_settings makes them: (status, greedy before, greedy after, T=1 before, T=1 after) a seed."""
    return [{"label": label, "seed": seed, "status": status, "wall_s": 1.0, "accuracy": None,
             "accuracy_greedy_before": gb, "accuracy_greedy_after": ga,
             "accuracy_sampled_before": sb, "accuracy_sampled_after": sa}
            for seed, (status, gb, ga, sb, sa) in enumerate(seeds_figures)]


def test_select_settings_chooses_by_its_rule_on_the_seeds_means():
    select = load_bench("select_settings.py")
    candidates = select.parse_candidates("lr=0.3, sigma=0.01;lr=0.1;lr=0.05;lr=0.02")
    assert candidates[0] == ("lr=0.3,sigma=0.01", {"lr": "0.3", "sigma": "0.01"})
    ok = "succeeded"
    rows = (selection_rows("lr=0.3,sigma=0.01", [(ok, 0.5, 0.4, 0.3, 0.9), (ok, 0.5, 0.5, 0.3, 0.9)])  # greedy drops
            + selection_rows("lr=0.1", [(ok, 0.5, 0.5, 0.3, 0.6), (ok, 0.5, 0.6, 0.3, 0.6)])
            + selection_rows("lr=0.05", [(ok, 0.5, 0.7, 0.3, 0.6), (ok, 0.5, 0.7, 0.3, 0.6)])  # same T=1, greedy higher
            + selection_rows("lr=0.02", [(ok, 0.5, 0.9, 0.3, 0.95), ("failed", None, None, None, None)]))
    table = select.candidate_table(candidates, rows, [0, 1])
    assert [entry["seeds_ok"] for entry in table] == [[0, 1], [0, 1], [0, 1], [0]]
    assert table[1]["statistics"]["accuracy_sampled_after"]["mean"] == pytest.approx(0.6)
    assert table[1]["statistics"]["gain_greedy"]["mean"] == pytest.approx(0.05)
    assert select.choose(table) == "lr=0.05"
    assert select.choose(table[:1]) is None  # the best T=1, but greedy fell: nothing chosen
    # select.over_first: T=1 against the first candidate in points, and in standard errors of the difference of
    # the seeds' means. lr=0.3's T=1 is 0.9 in both seeds (sd 0), lr=0.1's 0.6 (sd 0): -30 points, no spread to
    # measure it by; lr=0.02 had one seed. With a spread, lr=0.1's seeds 0.6 and 0.7 (mean 0.65, sd 0.0707, n 2)
    # are 25 points under 0.9, and the difference's standard error is 0.0707 over the root of 2, 0.05: -5.0.
    assert select.over_first(table) == {"lr=0.1": {"t1_points": -30.0, "standard_errors": None},
                                        "lr=0.05": {"t1_points": -30.0, "standard_errors": None},
                                        "lr=0.02": {"t1_points": 5.0, "standard_errors": None}}
    spread = [dict(row, accuracy_sampled_after=0.7) if row["label"] == "lr=0.1" and row["seed"] == 1 else row
              for row in rows]
    assert select.over_first(select.candidate_table(candidates, spread, [0, 1]))["lr=0.1"] == {
        "t1_points": -25.0, "standard_errors": -5.0}
    # lr=0.05 again, but its greedy accuracy fell in one domain (and rose overall): lr=0.1 is chosen.
    for row in rows:
        if row["label"] == "lr=0.05":
            row["domains"] = {"accuracy_greedy_counting_before": 0.6, "accuracy_greedy_counting_after": 0.5}
    table = select.candidate_table(candidates, rows, [0, 1])
    assert table[2]["statistics"]["gain_greedy_counting"]["mean"] == pytest.approx(-0.1)
    assert select.choose(table) == "lr=0.1"
    # Floors: lr=0.1 has the best T=1 but gains only 5 points in counting (and +10 in the structurally new
    # subset, which is no domain); lr=0.02 reaches +8 overall and +2 in every domain: with the floors it wins.
    for row in rows:
        if row["label"] == "lr=0.02":
            row["status"], row["accuracy_greedy_before"], row["accuracy_greedy_after"] = ok, 0.5, 0.6
            row["accuracy_sampled_before"], row["accuracy_sampled_after"] = 0.3, 0.55
        row["domains"] = {"accuracy_greedy_counting_before": 0.5,
                          "accuracy_greedy_counting_after": {"lr=0.1": 0.55, "lr=0.02": 0.52}.get(row["label"], 0.4),
                          "accuracy_greedy_new_before": 0.4, "accuracy_greedy_new_after": 0.4 + 0.2 * row["seed"]}
    table = select.candidate_table(candidates, rows, [0, 1])
    assert select.choose(table) == "lr=0.1"  # no floors: T=1 alone
    assert select.choose(table, (5, None)) == "lr=0.1"  # both reach +5 overall: T=1 again
    assert select.choose(table, (8, 2)) == "lr=0.02"
    assert select.choose(table, (8, 6)) == "lr=0.1"  # none reaches the floors: as without them
    assert select.parse_floors(None, "grpo-mtl") == (5, 2) and select.parse_floors("none", "sft") is None
    assert select.parse_floors("7", "sft") == (7.0, None)
    with pytest.raises(SystemExit, match="--floors: 'x,1,2'"):
        select.parse_floors("x,1,2", "sft")
    # A run not scored on validation counts as failed, whatever its status.
    run = {"label": "lr=0.1", "seed": 0, "wall_s": 1.0,
           "run": {"id": 1, "status": "succeeded", "summary": {"eval_split": "test"}}}
    assert select.row_of(run)["status"] == "not-validation"


def test_select_settings_scores_the_whole_validation_split_where_the_data_has_one_of_its_own():
    from gpuscale.data.tiny_math import TINY_MATH_SIZES

    select = load_bench("select_settings.py")
    whole = str(TINY_MATH_SIZES["validation"])
    assert select.whole_validation({"lr": "0.1"}, "tiny-math") == {"lr": "0.1", "eval_examples": whole}
    assert select.whole_validation({"dataset": "tiny-math-conflict"}, "gsm8k")["eval_examples"] == whole
    assert select.whole_validation({"dataset": "tiny-math:comparison"}, "gsm8k")["eval_examples"] == whole
    assert select.whole_validation({"eval_examples": "8"}, "tiny-math") == {"eval_examples": "8"}  # given: kept
    # gsm8k's validation is carved from its training data: a larger one would train on less.
    assert select.whole_validation({"dataset": "gsm8k"}, "tiny-math") == {"dataset": "gsm8k"}


def test_split_composition_reads_each_problems_sub_kind_and_bounds_a_gains_spread_from_the_problems_drawn():
    from gpuscale.data.tiny_math import tiny_math_examples

    composition = load_bench("split_composition.py")
    # Arithmetic's kind read from the words agrees with the expression the generator kept.
    forms = {"add": r"\d+ \+ \d+", "subtract": r"\d+ - \d+", "temperature drop": r"\d+ - \d+",
             "multiply": r"\d+ \* \d+", "add-then-subtract": r"\(\d+ \+ \d+\) - \d+",
             "multiply-then-add": r"\(\d+ \* \d+\) \+ \d+"}
    examples = tiny_math_examples("validation", 400)
    kinds = {example["question"]: composition.kind_of(example) for example in examples}
    for example in examples:
        if example["domain"] == "arithmetic":
            assert re.fullmatch(forms[kinds[example["question"]]], example["expression"]), example
    assert {"add", "subtract", "multiply", "add-then-subtract", "multiply-then-add"} <= set(kinds.values())
    assert {"range of 3", "range of 4", "middle of 3", "list of 4-6", "list of 7-10"} <= set(kinds.values())
    assert "middle of 4" not in kinds.values()  # the generator asks for a middle of three amounts only
    # +10 points on 100 problems: none broken (0.1 - 0.01) / 100, or fixed and broken independently of the base.
    spread = composition.gain_spread(100, 0.5, 0.6)
    assert spread["least churn"] == pytest.approx(0.03) and spread["independent"] == pytest.approx(0.07)


def answer_rows(correct_by_problem: list[list[bool]]) -> list[dict]:
    """Result rows as power sampling stores them: one an answer, its problem's index and question."""
    return [{"index": index, "question": f"question {index}", "correct": correct}
            for index, answers in enumerate(correct_by_problem) for correct in answers]


def test_power_vs_greedy_pairs_problem_by_problem_and_spreads_over_the_seeds():
    pvg = load_bench("power_vs_greedy.py")
    greedy = answer_rows([[True], [False], [True], [False]])
    power = answer_rows([[True, False], [True, True], [False, False], [False, True]])
    # Differences -0.5, +1, -1, +0.5: mean 0, sample sd sqrt(2.5 / 3).
    found = pvg.paired(greedy, power, [100])
    sd = math.sqrt(2.5 / 3)
    assert found["problems"] == 4 and found["power_minus_greedy"] == 0.0
    assert found["standard_error"] == pytest.approx(sd / 2)
    assert found["standard_error_at"] == {"100": pytest.approx(sd / 10)}
    with pytest.raises(SystemExit, match="same problems"):  # another question at an index: nothing to pair
        pvg.paired(greedy, [{**row, "question": "other"} if row["index"] == 0 else row for row in power], [])
    # Per alpha: the paired runs only (not greedy, not a failed run), mean and sample sd over their seeds.
    rows = [{"alpha": None, "seed": 0, "accuracy": 0.5},
            {"alpha": 4.0, "seed": 0, "accuracy": 0.5, "power_minus_greedy": 0.0},
            {"alpha": 4.0, "seed": 1, "accuracy": 0.6, "power_minus_greedy": 0.1},
            {"alpha": 4.0, "seed": 2, "accuracy": None},
            {"alpha": 16.0, "seed": 0, "accuracy": 0.7, "power_minus_greedy": 0.2}]
    alphas = pvg.by_alpha(rows)
    assert list(alphas) == ["4.0", "16.0"] and alphas["4.0"]["seeds"] == [0, 1]
    assert alphas["4.0"]["accuracy_mean"] == pytest.approx(0.55)
    assert alphas["4.0"]["power_minus_greedy_sd"] == pytest.approx(statistics.stdev([0.0, 0.1]))
    assert alphas["16.0"]["accuracy_sd"] is None  # one seed: no spread
    # A power run is paired only with a greedy run of the same settings but for what the pairing varies.
    greedy_run = {"settings": {"method": "greedy", "chains": 1, "precision": "auto", "batch_size": 8}}
    power_run = {"settings": {"method": "power", "chains": 4, "precision": "bf16", "batch_size": 2}}
    assert pvg.settings_differences(greedy_run, power_run) == ["precision (auto, bf16)"]
    assert pvg.same_value(4.0, "4") and pvg.same_value([0, 1], "0,1") and pvg.same_value(False, "false")
    assert not pvg.same_value("auto", "bf16")
    assert "not a choice" in pvg.reading_of("test") and "not a choice" in pvg.reading_of("test-v1")
    assert "not a choice" not in pvg.reading_of("validation")


@pytest.mark.e2e
def test_power_vs_greedy_pairs_each_power_run_with_the_greedy_run_on_cpu(home, tmp_path):
    out = tmp_path / "paired.json"
    sizes = ["--problems", "8", "--chains", "2", "--alphas", "4", "--seeds", "0", "--set", "mcmc_steps=2"]
    bench("power_vs_greedy.py", *sizes, "--gpus", "1", "--home", str(home), "--json", str(out))
    record = json.loads(out.read_text())
    assert set(record) == set(SCHEMA) and record["settings"]["split"] == "validation"
    assert "not a choice" not in record["settings"]["reading"]
    figures = record["figures"]
    greedy, power = figures["runs"]
    assert figures["greedy"] == greedy and greedy["method"] == "greedy" and power["greedy_run"] == greedy["run"]
    store = Store(home, read_only=True)
    for row, method, chains in ((greedy, "greedy", 1), (power, "power", 2)):
        stored = store.get_run(row["run"])
        assert stored["status"] == "succeeded" and stored["summary"]["accuracy"] == row["accuracy"]
        assert (stored["settings"]["method"], stored["settings"]["chains"]) == (method, chains)
        assert stored["settings"]["split"] == "validation" and stored["settings"]["max_examples"] == 8
        assert stored["settings"]["mcmc_steps"] == 2 and stored["settings"]["seed"] == 0
    assert store.get_run(power["run"])["settings"]["alpha"] == 4.0
    # The pairing, from the runs' stored answers: per problem power's share correct minus greedy's 0/1.
    greedy_right = {row["index"]: row["correct"] for row in store.results(greedy["run"])}
    power_rows = store.results(power["run"])
    differences = [statistics.mean(row["correct"] for row in power_rows if row["index"] == index) - right
                   for index, right in sorted(greedy_right.items())]
    assert power["problems"] == len(differences) == 8
    assert power["power_minus_greedy"] == pytest.approx(power["accuracy"] - greedy["accuracy"], abs=1e-12)
    sd = statistics.stdev(differences)
    assert power["standard_error"] == pytest.approx(sd / math.sqrt(8))
    assert power["standard_error_at"] == {n: pytest.approx(sd / math.sqrt(int(n))) for n in ("128", "500", "2000")}
    assert figures["by_alpha"] == {"4.0": {"seeds": [0], "accuracy_mean": power["accuracy"], "accuracy_sd": None,
                                           "power_minus_greedy_mean": power["power_minus_greedy"],
                                           "power_minus_greedy_sd": None}}
    # The same rows paired again from the home alone (a comparison cut by a time limit is reported so).
    again = tmp_path / "again.json"
    bench("power_vs_greedy.py", *sizes, "--from-home", str(home), "--json", str(again))
    assert json.loads(again.read_text())["figures"]["runs"] == figures["runs"]


@pytest.mark.e2e
def test_select_settings_runs_every_candidate_and_seed_on_validation(home, tmp_path):
    out = tmp_path / "selection.json"
    done = bench("select_settings.py", "--recipe", "eggroll", "--candidates", "lr=0.3;lr=0.1", "--seeds", "0",
                 "--jobs", "2", "--set", "population=4", "--set", "prompts_per_step=2", "--set", "max_new_tokens=8",
                 "--set", "steps=1", "--set", "eval_examples=2", "--set", "eval_every=0", "--set", "batch_size=8",
                 "--set", "max_examples=16", "--home", str(home), "--out", str(out))
    assert "chosen: " in done.stdout
    record = json.loads(out.read_text())
    assert set(record) == set(SCHEMA) and record["settings"]["eval_split"] == "validation"
    assert record["settings"]["card_sharing"] == "time-slicing"  # no card here to share through MPS
    figures = record["figures"]
    assert [entry["candidate"] for entry in figures["candidates"]] == ["lr=0.3", "lr=0.1"]
    store = Store(home, read_only=True)
    for row in figures["runs"]:
        stored = store.get_run(row["run_id"])
        assert stored["status"] == "succeeded" and stored["summary"]["eval_split"] == "validation"
        assert stored["settings"]["eval_split"] == "validation" and stored["settings"]["save_model"] is False
        assert stored["settings"]["lr"] == float(row["label"].removeprefix("lr="))
    # The same table from the history alone (a selection cut by a time limit is reported this way); a
    # candidate with no run there is listed with no seed.
    rebuilt = tmp_path / "rebuilt.json"
    again = bench("select_settings.py", "--recipe", "eggroll", "--candidates", "lr=0.3;lr=0.1;lr=0.05", "--seeds", "0",
                  "--gpus", "1", "--from-home", str(home), "--out", str(rebuilt))
    assert f"chosen: {figures['chosen']}" in again.stdout
    table = json.loads(rebuilt.read_text())["figures"]["candidates"]

    def learning(entry: dict) -> dict:  # the wall time is the history's (start to end), not the launcher's
        return {**entry, "statistics": {k: v for k, v in entry["statistics"].items() if k != "wall_s"}}

    assert [learning(entry) for entry in table[:2]] == [learning(entry) for entry in figures["candidates"]]
    assert table[2]["seeds_ok"] == []


def acceptance_row(label: str, seed: int, greedy: tuple, sampled: tuple, domains: dict | None = None,
                   nan_free: bool = True, accuracy: float | None = None, temperature: float | None = None,
                   saved_model: dict | None = None, **measured) -> dict:
    """One row as bench/acceptance.py writes it to its --partial file; greedy and sampled: (before, after);
    `measured`: its energy figures and gpu_busy_s (a row of a file written before them has none)."""
    return {"label": label, "seed": seed, "run_id": seed + 1, "status": "succeeded", "error": None, "wall_s": 60.0,
            "peak_mem_mb": {"gpu0": 1000.0}, "accuracy_greedy_before": greedy[0], "accuracy_greedy_after": greedy[1],
            "accuracy_sampled_before": sampled[0], "accuracy_sampled_after": sampled[1], "domains": domains or {},
            "accuracy": accuracy, "temperature": temperature, "pass_at_k": None, "nan_free": nan_free,
            "saved_model": saved_model, **measured}


def test_acceptance_reports_a_check_run_in_parts_with_its_targets_per_domain(tmp_path):
    """Two --partial files (a check run in two calls) make one table, a later file's row replacing an
    earlier one of the same run; a greedy target is met only if every domain's mean gain clears it,
    no seed fell below the base in any domain and the figures of every seed were finite; the
    sharpening control and power sampling's rivals come from their rows too."""
    comparison_greedy_gains = [0.01, -0.02, -0.02]  # mean -1 point: greedy lower in one domain
    comparison_after = [0.6 + gain for gain in comparison_greedy_gains]
    pcgrad = [acceptance_row("grpo-mtl pcgrad", seed, (0.50, 0.55), (0.30, 0.40), {
        "accuracy_greedy_arithmetic_before": 0.4, "accuracy_greedy_arithmetic_after": 0.42,
        "accuracy_sampled_arithmetic_before": 0.2, "accuracy_sampled_arithmetic_after": 0.3,
        "accuracy_greedy_comparison_before": 0.6, "accuracy_greedy_comparison_after": comparison_after[seed],
        "accuracy_sampled_comparison_before": 0.4, "accuracy_sampled_comparison_after": 0.5,
    }) for seed in range(3)]
    plain = {"plain_accuracy": 0.57, "problems": 100, "run_accuracy": 0.58, "run_problems": 500,
             "tolerance": 0.152, "agrees": True}
    rest = [acceptance_row("rft", seed, (0.50, 0.58), (0.30, 0.39), energy_j=123_456.0 + seed,
                           energy_j_per_correct_answer=987.6, saved_model=plain,
                           gpu_busy_s={"gpu0": 20.0, "gpu1": 21.5 + seed}) for seed in range(2)]
    rest.append(acceptance_row("rft", 2, (0.50, 0.58), (0.30, 0.39), energy_unavailable="no NVML GPU (CPU run)"))
    rest += [acceptance_row("eggroll", seed, (0.50, 0.60), (0.30, 0.50), nan_free=seed != 1) for seed in range(2)]
    # A run that shared its GPU with others (control/telemetry.py's shared_gpu_figures): no J per correct answer.
    rest.append(acceptance_row("eggroll", 2, (0.50, 0.60), (0.30, 0.50), energy_j=20_300.0,
                               energy_shared="GPU 0 shared with runs 12, 13: NVML counts the whole GPU"))
    rest += [acceptance_row(label, seed, (None, None), (None, None), accuracy=accuracy) for seed in range(3)
             for label, accuracy in (("power-sampling", 0.6), ("power-sampling greedy", 0.58),
                                     ("power-sampling low-temperature", 0.55), ("power-sampling temperature-1", 0.4))]
    rest += [acceptance_row(f"sharpening validation T={t}", 0, (None, None), (None, None), accuracy=accuracy,
                            temperature=t) for t, accuracy in ((0.5, 0.5), (1.0, 0.4))]
    rest += [acceptance_row("sharpening control", seed, (None, None), (None, None), accuracy=0.33, temperature=0.5)
             for seed in range(3)]
    # Seed 0 of rft measured first at an older default: the later file's row replaces it.
    older = [acceptance_row("rft", 0, (0.50, 0.51), (0.30, 0.31))]
    first, second, out = tmp_path / "pcgrad.jsonl", tmp_path / "rest.jsonl", tmp_path / "acceptance.json"
    first.write_text("".join(json.dumps(row) + "\n" for row in older + pcgrad))
    second.write_text("".join(json.dumps(row) + "\n" for row in rest))
    # The GPU-marked tests' output of the two calls: this script's line in one, pytest's own in the other.
    beside, alone = tmp_path / "call1.log", tmp_path / "tests.log"
    beside.write_text("GPU-marked tests (gpu and not alone): exit 0: 8 passed, 2 deselected in 460.73s\n")
    alone.write_text("F.s\nFAILED tests/gpu/test_x.py::test_y - assert 1 == 0\n"
                     "===== 1 failed, 1 passed, 1 skipped, 3 warnings in 30.50s (0:00:30) =====\n")
    done = bench("acceptance.py", "--gpus", "2", "--from-partial", str(first), str(second), "--out", str(out),
                 "--gpu-tests-log", str(beside), str(alone))
    figures = json.loads(out.read_text())["figures"]
    assert [(found["summaries"], found["failures"], found["passed"]) for found in figures["gpu_tests"]] == [
        (["8 passed, 2 deselected in 460.73s"], [], True),
        (["1 failed, 1 passed, 1 skipped, 3 warnings in 30.50s"],
         ["FAILED tests/gpu/test_x.py::test_y - assert 1 == 0"], False)]
    assert len(figures["runs"]) == 26
    comparison = figures["seed_statistics"]["grpo-mtl pcgrad"]["gain_greedy_comparison"]
    assert comparison["mean"] == pytest.approx(statistics.fmean(comparison_greedy_gains))
    assert comparison["sd"] == pytest.approx(statistics.stdev(comparison_greedy_gains)) and comparison["n"] == 3
    targets = figures["targets"]
    pcgrad_greedy = targets["grpo-mtl pcgrad"]["greedy"]
    assert pcgrad_greedy["points"] == {"gain_greedy": 5.0, "gain_greedy_arithmetic": 2.0,
                                       "gain_greedy_comparison": -1.0}
    assert [(found["seed"], found["domain"]) for found in pcgrad_greedy["below_base"]] == [
        (1, "comparison"), (2, "comparison")]
    assert not pcgrad_greedy["met"] and not targets["grpo-mtl pcgrad"]["met"]
    assert targets["rft"]["greedy"]["points"] == {"gain_greedy": 8.0} and targets["rft"]["greedy"]["met"]
    assert targets["rft"]["over_sharpening_control"]["points"]["over_control"] == 6.0 and targets["rft"]["met"]
    assert targets["eggroll"]["greedy"]["points"] == {"gain_greedy": 10.0}
    assert not targets["eggroll"]["met"]  # seed 1 logged a non-finite figure
    assert figures["sharpening_control"]["temperature"] == 0.5
    power = targets["power-sampling"]
    assert (power["points"]["over_greedy"], power["points"]["over_low_temperature"]) == (2.0, 5.0) and power["met"]
    assert "grpo-mtl pcgrad greedy: NOT MET" in done.stdout and "rft greedy: MET" in done.stdout
    assert "seed 1 comparison 60.0 → 58.0" in done.stdout
    # The seconds its GPUs ran the run's own kernels (summed over them), the energy columns (kJ, J per correct
    # answer), and why a run has none.
    table = done.stdout.splitlines()
    assert "wall s  GPU s" in table[0] and "energy kJ J/correct" in table[0]
    assert [line.split()[4] for line in table if line.startswith("rft ")] == ["41.5", "42.5", "—"]
    assert [line.split()[6:8] for line in table if line.startswith("rft ")] == [
        ["123.5", "987.6"], ["123.5", "987.6"], ["—*", "—"]]
    assert "    * energy not measured: no NVML GPU (CPU run)" in table
    assert [line.split()[6:8] for line in table if line.startswith("eggroll ")] == [
        ["—", "—"], ["—", "—"], ["20.3†", "—"]]
    assert "    † energy shared: GPU 0 shared with runs 12, 13: NVML counts the whole GPU" in table
    # The saved model scored with plain transformers, and whether it agrees with the run's figure.
    assert [line.endswith("57.0% on 100: agrees (±15.2)") for line in table if line.startswith("rft ")] == [
        True, True, False]


# Run in one fresh interpreter: each script in turn as `python bench/SCRIPT --help` runs it (its folder first on
# sys.path, run as __main__, its sibling scripts imported afresh), its exit code and its output kept. A process a
# script took 20 s on one core: seven of them import torch at their top, each about 3 s, to print their help.
HELPS_OF = r"""
import contextlib, io, json, os, runpy, sys, traceback

bench, scripts = sys.argv[1], json.loads(sys.argv[2])
path, modules = sys.path[1:], set(sys.modules)
helps = {}
for script in scripts:
    sys.path[:] = [bench, *path]
    sys.argv = [os.path.join(bench, script), "--help"]
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        try:
            runpy.run_path(sys.argv[0], run_name="__main__")
            code = 0
        except SystemExit as end:
            code = end.code or 0
        except BaseException:
            code = traceback.format_exc()
    helps[script] = [code, shown.getvalue()]
    for name in set(sys.modules) - modules:  # the scripts it imported (record.py...) load again for the next
        if os.path.dirname(getattr(sys.modules[name], "__file__", None) or "") == bench:
            del sys.modules[name]
json.dump(helps, sys.stdout)
"""


def test_every_bench_script_help_names_its_baseline():
    """`--help` of every bench script (record.py, benchruns.py and svg_text.py are helpers, readme_figures.py checks
    README's figures and measures nothing) names the baseline it runs and how it is put at its best, or says
    it has none; it starts no run, so it works on CPU."""
    scripts = sorted(path.name for path in (ROOT / "bench").glob("*.py")
                     if path.name not in ("record.py", "benchruns.py", "svg_text.py", "readme_figures.py"))
    assert "generate_kwargs.py" in scripts and "train_speed.py" in scripts
    done = subprocess.run([sys.executable, "-c", HELPS_OF, str(ROOT / "bench"), json.dumps(scripts)],
                          capture_output=True, text=True, timeout=slow(120), cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    helps = json.loads(done.stdout)
    assert list(helps) == scripts
    for script, (code, text) in helps.items():
        assert code == 0, f"{script}: {code}"
        assert "baseline" in text.lower(), f"{script}: {text}"


def test_the_node_check_runs_the_probes_own_measures_outside_a_rank_on_cpu():
    import torch

    node_check = load_bench("node_check.py")
    figures = node_check.probe_code_figures(torch.device("cpu"))
    assert set(figures) == {"copy_gb_per_s", "matmul_tflops"} and all(value > 0 for value in figures.values())


@pytest.mark.e2e
def test_the_node_checks_decode_figures_are_set_beside_bench_generations_at_the_same_shape_on_cpu(home, tmp_path):
    out = tmp_path / "decode.json"
    done = bench("node_check.py", "--decode-agreement", "--cpu", "--model", "random-tiny", "--precision", "fp32",
                 "--batch-size", "2", "--steps", "5", "--prompt-tokens", "8", "--out", str(out))
    record = json.loads(out.read_text())
    assert set(record) == set(SCHEMA) and record["card"] == "cpu"
    figures = record["figures"]
    run = Store(home, read_only=True).list_runs()[0]
    assert run["summary"] == figures["probe_run"] and figures["gpus"] == 1
    assert run["settings"]["steps"] == 5 and run["settings"]["prompt_tokens"] == 8
    assert "probe time: " in figures["probe_laps_rank_0"] and "warm-up b=1" in figures["probe_laps_rank_0"]
    rows = figures["rows"]
    assert [(row["gpu"], row["figure"], row["batch"]) for row in rows] == [
        ("cpu 0", "latency_tokens_per_s", 1), ("cpu 0", "throughput_tokens_per_s", 2)]
    summary = run["summary"]
    for row in rows:  # the probe's figure as its summary has it, bench/generation.py's from its ms a step
        assert row["probe_tokens_per_s"] == summary[f"{row['figure']}_rank_0"]
        assert row["bench_tokens_per_s"] == pytest.approx(row["batch"] / row["bench_ms_per_step"] * 1e3)
        assert row["ratio"] == pytest.approx(row["probe_tokens_per_s"] / row["bench_tokens_per_s"])
        assert row["within_5_percent"] == (abs(row["ratio"] - 1) <= 0.05)
        # On a CPU both run the engine's plain path (uncompiled, no CUDA graphs), as the summary says.
        assert row["bench_path"] == "uncompiled step, fused weights" and summary["node_check_decode"].startswith(
            row["bench_path"] + "; a decode step = (a call of 5 new tokens - a call of 1) / 4, medians of 2 calls")
    assert rows[0]["probe_floor_share"] == summary["decode_batch1_floor_share_rank_0"]
    assert 0 < rows[0]["bench_floor_share"] and "probe_floor_share" not in rows[1]
    assert figures["all_within_5_percent"] == all(row["within_5_percent"] for row in rows)
    assert "cpu 0 batch 1: probe " in done.stdout and "node check:" in done.stdout


def test_row_terms_bench_times_the_engines_way_beside_the_batched_one_on_cpu(tmp_path):
    out = tmp_path / "row-terms.json"
    load_bench("row_terms.py").main(["--device", "cpu", "--groups", "4", "--rows", "8", "--repeats", "1", "--calls",
                                     "1", "--skip-compiled", "--out", str(out)])
    figures = json.loads(out.read_text())["figures"]
    assert len(figures["shapes"]) == 5
    for shape in figures["shapes"]:
        assert set(shape["us"]) == {"engine", "bmm", "bmm_outer", "bmm_blockdiag", "bmm_rank8", "broadcast"}
        assert not shape["errors"] and all(error < 1e-4 for error in shape["max_error"].values())
    # Each projection with its terms, separately and as one stacked GEMM: the same output (fp32 on CPU,
    # sums of up to 4,868 products: rounding only).
    assert len(figures["with_projection"]) == 5
    for shape in figures["with_projection"]:
        assert set(shape["us"]) == {"projection_then_terms", "stacked"}
        assert all(error < 1e-3 for error in shape["max_error"].values())


def test_eggroll_share_times_plain_inference_and_each_way_of_adding_the_terms_on_cpu(tmp_path):
    out = tmp_path / "share.json"
    load_bench("eggroll.py").main(["--share-only", "--device", "cpu", "--model", "tiny-math", "--population", "4",
                                   "--prompts", "2", "--max-new-tokens", "3", "--repeats", "1", "--out", str(out)])
    record = json.loads(out.read_text())
    assert set(record) == set(SCHEMA) and record["settings"]["paths"] == ["hooks", "fused"]
    share = record["figures"]["share"]
    assert (share["rows"], share["tokens"], share["mirrored_pairs"]) == (8, 24, True)  # the recipe's pairs
    # Each path against plain inference set its way: fuse_row_terms prefills through the fused wiring
    # with or without terms.
    for path, in_projections, side in (("hooks", False, "plain"), ("fused", True, "plain_fused")):
        timing, plain = share[path], share[side]
        assert timing["fused_decode"] and timing["terms_in_projections"] == in_projections
        assert timing["fused_prefill"] == plain["fused_prefill"] == in_projections
        assert timing["plain_side"] == side and timing["compile_fallbacks"] == plain["compile_fallbacks"] == []
        assert timing["decode_seconds"] == pytest.approx(timing["seconds"] - timing["one_token_seconds"])
        assert timing["share"] == pytest.approx(plain["seconds"] / timing["seconds"])
        assert timing["decode_share"] == pytest.approx(plain["decode_seconds"] / timing["decode_seconds"])
        assert timing["one_token_share"] == pytest.approx(plain["one_token_seconds"] / timing["one_token_seconds"])
        assert timing["decode_tokens_per_s"] == pytest.approx(8 * 2 / timing["decode_seconds"])


def test_acceptance_rows_from_a_cut_checks_history_are_the_rows_the_check_writes(home, tmp_path):
    """A check cut by a time limit after its runs ended: `--rows-from-home` makes their rows from the
    history (the newest run of each job and seed: here the job ran twice), and a job with no run gives none."""
    label = "acceptance-power-sampling-greedy-seed0"
    for _ in range(2):
        done = subprocess.run([sys.executable, "-m", "gpuscale.app.cli", "run", "--recipe", "power-sampling",
                               "--json", "--label", label, "--gpus", "1", "--set", "method=greedy", "--set",
                               "max_examples=4", "--set", "max_new_tokens=8", "--set", "seed=0"],
                              capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert done.returncode == 0, done.stderr[-2000:]
    run = json.loads(done.stdout)
    partial = tmp_path / "rows.jsonl"
    bench("acceptance.py", "--rows-from-home", str(home), "--seeds", "0,1", "--only", "power-sampling greedy",
          "sft", "--partial", str(partial))
    rows = [json.loads(line) for line in partial.read_text().splitlines()]
    assert [(row["label"], row["seed"], row["run_id"], row["status"]) for row in rows] == [
        ("power-sampling greedy", 0, run["id"], "succeeded")]
    assert rows[0]["accuracy"] == run["summary"]["accuracy"] and rows[0]["nan_free"] is True


def test_heartbeat_cost_compares_the_sides_medians_within_their_spread():
    """bench/heartbeat_cost.py's verdict on given runs: each side's median and spread, on / off against the
    larger spread, a run whose beats were not as set voiding it; and the one call both sides run."""
    cost = load_bench("heartbeat_cost.py")

    def runs(on: list[float], off: list[float], off_beats: int = 0) -> list[dict]:
        """Runs on, off, on, off... of these step times; those with heartbeats on wrote 7 beat lines."""
        pairs = zip([{"heartbeats": True, "step_seconds": seconds, "beat_lines": 7} for seconds in on],
                    [{"heartbeats": False, "step_seconds": seconds, "beat_lines": off_beats} for seconds in off])
        return [run for pair in pairs for run in pair]

    alike = cost.compare(runs([0.100, 0.104, 0.098], [0.101, 0.099, 0.103]))
    assert alike["on"]["median_s"] == 0.100 and alike["off"]["median_s"] == 0.101
    assert alike["on"]["spread"] == pytest.approx(0.006 / 0.100) and alike["noise"] == pytest.approx(0.06)
    assert alike["on_over_off"] == pytest.approx(0.100 / 0.101) and alike["within_noise"] and alike["beats_as_set"]
    assert cost.verdict_line("sft", alike) == (
        "sft: heartbeats on 100.0 ms, off 101.0 ms a step (median of 3 runs each); on/off 0.990, noise ±6.0% "
        "(spread on 6.0%, off 4.0%): cost within noise")
    slower = cost.compare(runs([0.120, 0.121, 0.119], [0.100, 0.101, 0.099]))
    assert slower["within_noise"] is False and cost.verdict_line("sft", slower).endswith(": cost NOT within noise")
    faster = cost.compare(runs([0.080, 0.081, 0.079], [0.100, 0.101, 0.099]))  # one-sided: not a cost
    assert faster["within_noise"] and faster["on_faster_beyond_noise"]
    assert cost.verdict_line("sft", faster).endswith(
        ": cost within noise (on faster than off beyond the noise: the runs vary more than their spread shows)")
    leaked = cost.compare(runs([0.100, 0.100], [0.100, 0.100], off_beats=1))
    assert not leaked["beats_as_set"] and ": VOID: " in cost.verdict_line("sft", leaked)
    single = cost.compare(runs([0.100], [0.105]))
    assert single["noise"] is None and single["within_noise"] is None
    assert cost.verdict_line("sft", single).endswith("noise one run a side: noise not measured")
    opts = cost.parse_options(["--model", "tiny-math", "--set", "sft:max_steps=6", "--set", "batch_size=2",
                               "--set", "grpo-mtl:num_generations=2"])
    assert opts.recipes == ["sft", "grpo-mtl"] and (opts.repeats, opts.warmups) == (3, 1)
    assert cost.run_arguments("sft", opts) == [
        "--recipe", "sft", "--gpus", "1", "--model", "tiny-math", "--set", "max_steps=6", "--set", "eval_examples=0",
        "--set", "save_model=false", "--set", "checkpoint_every=off", "--set", "batch_size=2"]
    assert "num_generations=2" in cost.run_arguments("grpo-mtl", opts)
    assert cost.result_name(["grpo-mtl", "sft"]) == "heartbeat-cost"
    assert cost.result_name(["sft"]) == "heartbeat-cost-sft"


@pytest.mark.e2e
def test_heartbeat_cost_bench_runs_the_same_call_with_heartbeats_on_and_off_on_cpu(home, tmp_path):
    """bench/heartbeat_cost.py at its docstring's CPU sizes (one run a side): the same settings on both
    sides, beats written by one side only, each run's step time the one its rank logged to the Store."""
    out = tmp_path / "heartbeat-cost.json"
    done = bench("heartbeat_cost.py", "--recipes", "sft", "--model", "tiny-math", "--repeats", "1", "--warmups", "0",
                 "--set", "sft:max_steps=6", "--set", "batch_size=2", "--set", "max_examples=64",
                 "--set", "sft:max_length=64", "--home", str(home), "--out", str(out))
    record = json.loads(out.read_text())
    assert set(record) == set(SCHEMA) and record["card"] == "cpu"
    sft = record["figures"]["recipes"]["sft"]
    assert sft["warmups"] == []
    on, off = sft["runs"]
    assert (on["order"], on["heartbeats"], off["order"], off["heartbeats"]) == (1, True, 2, False)
    assert on["beat_lines"] > 0 and off["beat_lines"] == 0 and sft["beats_as_set"]
    store = Store(home, read_only=True)
    stored = {run["run"]: store.get_run(run["run"]) for run in (on, off)}
    settings = [run["settings"] for run in stored.values()]
    assert settings[0] == settings[1] and settings[0]["max_steps"] == 6 and settings[0]["eval_examples"] == 0
    for run in (on, off):
        assert stored[run["run"]]["status"] == "succeeded" and run["steps"] == 6
        logged = [m["value"] / 1000 for m in store.metrics(run["run"], "step_time_ms") if m["rank"] == 0]
        assert len(logged) == 6 and run["step_seconds"] == pytest.approx(statistics.median(logged[1:]))
    assert sft["on_over_off"] == pytest.approx(on["step_seconds"] / off["step_seconds"])
    assert sft["within_noise"] is None and record["figures"]["passed"]
    assert "sft run 2/2: heartbeats off: steady step " in done.stdout
    assert done.stdout.splitlines()[-2].endswith("noise one run a side: noise not measured")


def test_step_phases_bench_cuts_the_profiler_timeline_where_the_device_work_before_each_mark_ends():
    """bench/step_phases.py's profiler split on a made-up GPU timeline: a cut is the later of its
    annotation and the end of the kernels, copies and memsets launched before it (as a CUDA event
    recorded there completes); work launched after a mark does not move it."""
    phases = load_bench("step_phases.py")

    def annotation(ts, name):
        return {"ph": "X", "cat": "user_annotation", "name": "gpuscale.phase/" + name, "ts": ts, "dur": 0}

    def launched(ts, correlation, start, dur, cat="kernel"):
        return [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1,
                 "args": {"correlation": correlation}},
                {"ph": "X", "cat": cat, "name": "k", "ts": start, "dur": dur, "args": {"correlation": correlation}}]

    trace = {"traceEvents": [annotation(0, "data"), annotation(100, "forward_backward"),
                             *launched(150, 1, 160, 500), *launched(200, 2, 660, 40, cat="gpu_memcpy"),
                             annotation(300, "optimizer"),  # the GPU is busy until 700: the cut is there
                             *launched(320, 3, 710, 50), annotation(400, "log"),  # cut at 760
                             annotation(900, "data"),  # idle GPU: the cut is the annotation
                             {**annotation(350, "optimizer"), "cat": "gpu_user_annotation", "dur": 300}]}  # no mark
    split = phases.profiler_split(trace)
    assert split == pytest.approx({"data": 100e-6, "forward_backward": 600e-6, "optimizer": 60e-6, "log": 140e-6})
    ours = {"data": 100e-6, "forward_backward": 200e-6, "optimizer": 100e-6, "log": 500e-6}  # the CPU's view
    worst = phases.agreement(ours, split)
    assert worst["worst_phase"] == "forward_backward" and worst["largest_difference"] == pytest.approx(400 / 900)
    assert phases.logged_step_seconds([{"t": 0.0, "step": 0, "total": 3}, {"t": 1.0, "step": 1, "loss": 1},
                                       {"t": 3.0, "step": 2, "loss": 1}, {"t": 3.5, "step": 1, "phase_seconds_x": 1},
                                       {"t": 4.0, "step": 3, "loss": 1}, {"t": 5.0, "step": 4, "loss": 1}]) == 1.0


@pytest.mark.e2e
def test_step_phases_bench_times_the_same_runs_with_the_timing_on_and_off_and_profiles_a_window_on_cpu(home, tmp_path):
    """bench/step_phases.py at its docstring's CPU sizes: the sides differ only in the timing (phase
    figures logged by the runs with it on alone), coverage read from the runs, the profiled window's
    split beside the profiler's for the same steps."""
    out = tmp_path / "step-phases.json"
    bench("step_phases.py", "--recipes", "sft", "--model", "tiny-math", "--repeats", "1", "--warmups", "0",
          "--profile-after", "1", "--profile-steps", "2", "--set", "sft:max_steps=6", "--set", "batch_size=2",
          "--set", "max_examples=64", "--set", "sft:max_length=64", "--home", str(home), "--out", str(out),
          check=False)
    record = json.loads(out.read_text())
    assert set(record) == set(SCHEMA) and record["card"] == "cpu"
    sft = record["figures"]["recipes"]["sft"]
    on, off = sft["runs"]
    assert (on["timing"], off["timing"]) == (True, False) and on["phase_lines"] == 6 and off["phase_lines"] == 0
    assert sft["timing_as_set"] and sft["on_over_off"] == pytest.approx(on["step_seconds"] / off["step_seconds"])
    store = Store(home, read_only=True)
    losses = store.metrics(on["run"], "loss")
    intervals = [b["t"] - a["t"] for a, b in zip(losses, losses[1:])]
    assert min(intervals[1:]) <= on["step_seconds"] <= max(intervals[1:])  # a steady interval between logged steps
    assert sft["coverage"] >= 0.95 and sft["coverage_least_rank"] >= 0.95
    profiler = sft["profiler"]
    assert profiler["steps"] == [2, 3] and store.get_run(profiler["run"])["status"] == "succeeded"
    [rank] = profiler["by_rank"].values()
    assert set(rank["ours"]) == set(rank["profiler"]) >= {"data", "forward_backward", "optimizer"}
    assert rank["largest_difference"] < 0.10  # on CPU both cut at the marks: only the plumbing is checked


def test_card_time_sums_each_run_s_share_of_the_card_from_pmon(tmp_path):
    """bench/card_time.py: pmon's lines (SM % of a second, per process) summed per run, the run found by its
    rank's pid in the history, every other process counted apart; the pids it wrote serve again."""
    pmon = tmp_path / "pmon.txt"
    pmon.write_text("# gpu pid type sm mem enc dec jpg ofa fb ccpm command\n# Idx # C/G % % % % % % MB MB name\n"
                    "    0   101   C   50   10   -   -   -   -   900   0   python\n"
                    "    0   102   C   30    5   -   -   -   -   900   0   python\n"
                    "    0   999   C   20    5   -   -   -   -   900   0   python\n"
                    "    0     -   -    -    -   -   -   -   -     -   -   -\n"
                    "    0   101   C   70   10   -   -   -   -   900   0   python\n")
    with sqlite3.connect(tmp_path / "runs.db") as db:
        db.execute("CREATE TABLE runs (id INTEGER, launcher_pid INTEGER)")
        db.executemany("INSERT INTO runs VALUES (?, ?)", [(1, 101), (2, 102)])
    partial = tmp_path / "rows.jsonl"
    partial.write_text("".join(json.dumps({"run_id": run, "label": label, "seed": 0, "status": "succeeded"}) + "\n"
                               for run, label in ((1, "eggroll"), (2, "sft"))))
    out = tmp_path / "card.json"
    bench("card_time.py", "--pmon", str(pmon), "--history", str(tmp_path / "runs.db"), "--partial", str(partial),
          "--out", str(out))
    result = json.loads(out.read_text())
    assert result["by_job"] == {"eggroll": 1.2, "sft": 0.3} and result["other_card_s"] == 0.2
    assert result["total_card_s"] == 1.7
    pids = tmp_path / "pids.json"
    pids.write_text(json.dumps(result["launcher_pids"]))
    again = bench("card_time.py", "--pmon", str(pmon), "--pids", str(pids), "--partial", str(partial))
    assert "     1.7 s  in all" in again.stdout and "     1.2 s  eggroll" in again.stdout
