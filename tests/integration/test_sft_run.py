"""End to end on CPU: the sft recipe through the real CLI, a real TRL SFTTrainer on the embedded model
under the real `accelerate launch` with 2 CPU ranks (DDP on gloo), a real supervisor and runs.db."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import check_step_phases, gpuscale, run_json, run_together, runs_at_once
from gpuscale.control.metrics_tail import Throughput
from gpuscale.control.store import Store
from gpuscale.data.models import load_model
from gpuscale.data.step_phases import OTHER, label
from gpuscale.data.tasks import load_examples
from gpuscale.recipes.shared.registry import get_recipe

pytestmark = pytest.mark.e2e  # every test here starts real runs

BENCH = Path(__file__).resolve().parents[2] / "bench"

TINY_SFT = ["--recipe", "sft", "--batch-size", "2", "--set", "max_examples=16", "--set", "max_steps=3",
            "--set", "max_length=64", "--set", "eval_examples=4", "--set", "max_new_tokens=48",
            "--set", "learning_rate=1e-4"]


def check_held_out_answers(run: dict) -> None:
    """Every held-out answer of both evaluations, gathered from both ranks, with the gold answer the data
    gave and the one read from the completion: `gpuscale generations ID` shows the final ones first."""
    from gpuscale.data.tasks import gold_answer

    problems = load_examples("tiny-math", run["summary"]["eval_split"], 4)
    shown = run_json("generations", str(run["id"]))
    assert [(record["step"], record["phase"]) for record in shown] == [(1, "held-out sampled after")] * 4 + [
        (1, "held-out greedy after")] * 4  # newest first
    assert sorted(record["gold"] for record in shown) == sorted([gold_answer(example) for example in problems] * 2)
    before = run_json("generations", str(run["id"]), "--step", "0")
    assert {record["phase"] for record in before} == {"held-out greedy before", "held-out sampled before"}
    greedy = [record["correct"] for record in shown if record["phase"] == "held-out greedy after"]
    assert run["summary"]["accuracy_greedy_after"] == sum(greedy) / 4


def test_two_cpu_ranks_fine_tune_under_accelerate_launch(home):
    # Scored on test-v1 by name (the test split before 2026-11-29), whose first 4 problems hold one
    # structurally new problem, whichever split `test` is.
    run = run_json("run", *TINY_SFT, "--gpus", "2", "--set", "save_model=true", "--set", "eval_split=test-v1")
    assert run["status"] == "succeeded", run["error"]
    command = run["command"]
    assert command[1:3] == ["-m", "accelerate.commands.launch"] and "--multi_gpu" in command
    assert command[command.index("--num_processes") + 1] == "2"

    summary = run["summary"]
    missing = [figure for figure in get_recipe("sft").promised_figures if figure not in summary]
    assert not missing
    assert summary["world_size"] == 2 and summary["steps"] == 3 and summary["eval_split"] == "test-v1"
    assert summary["train_loss"] > 0 and summary["tokens_per_s"] > 0
    # Beside the whole run's rate, its steady one: the median of steps 2 and 3 (no MFU on CPU: no card's peak).
    assert summary["tokens_per_s_steady"] > 0 and summary["mfu"] is None and summary["mfu_steady"] is None
    for kind in ("greedy", "sampled"):
        assert 0 <= summary[f"accuracy_{kind}_before"] <= 1 and 0 <= summary[f"accuracy_{kind}_after"] <= 1
        # tiny-math's structurally new subset, gathered from both ranks: one of the 4 test problems.
        assert summary[f"accuracy_{kind}_new_after"] in (0.0, 1.0)
    marked = [example["structurally_new"] for example in load_examples("tiny-math", "test-v1", 4)]
    assert summary["eval_examples_new"] == sum(marked) == 1
    check_held_out_answers(run)

    store = Store(home)
    # The ranks' own rows (rank -1 holds the supervisor's run-wide combination of each figure).
    losses = [m for m in store.metrics(run["id"], "loss") if m["rank"] >= 0]
    assert [m["step"] for m in losses] == [1, 2, 3] and {m["rank"] for m in losses} == {0}
    tokens = [m for m in store.metrics(run["id"], "tokens") if m["rank"] >= 0]
    assert {m["rank"] for m in tokens} == {0, 1}
    # Each rank counts its own batches' tokens (no longer an equal share of the global count, which
    # showed one figure for every rank), and the ranks' counts add up to the trainer's global count.
    by_rank = {rank: sum(m["value"] for m in tokens if m["rank"] == rank) for rank in (0, 1)}
    assert by_rank[0] != by_rank[1], by_rank
    assert sum(m["value"] for m in tokens) == summary["train_tokens"] > 0
    assert run["progress"]["tokens"] == summary["train_tokens"]
    # tokens/s as the front ends derive it from the stored rows.
    rows = store.metrics(run["id"])
    throughput = Throughput()
    throughput.add(rows)
    rates = throughput.progress(now=max(row["t"] for row in rows))
    assert rates["tokens_per_s"] > 0 and set(rates["tokens_per_s_by_rank"]) == {"0", "1"}
    # Where a step goes (data/step_phases.py): each rank's steps in phases, the named ones covering 95%
    # of a steady step.
    check_step_phases(home, run, {"data", "forward_backward", "wait", "optimizer", "log"}, ranks=2)
    shown = gpuscale("show", str(run["id"])).stdout.splitlines()
    # The split as one line, its largest phase first (forward+backward on a quiet machine; on a busy one
    # a rank's wait for the other can lead).
    largest = max((phase for phase in summary["step_phases"] if phase != OTHER), key=summary["step_phases"].get)
    step_line = [line for line in shown if line.startswith("step: ")][0]
    assert step_line.startswith(f"step: {label(largest)} ") and "forward+backward" in step_line, step_line

    # The trained model is in the run folder, loadable by name like any model, and it changed.
    trained, tokenizer = load_model(summary["model_dir"])
    original, _ = load_model("tiny-math")
    assert tokenizer is not None
    changed = [name for name, weight in trained.state_dict().items()
               if not torch.equal(weight, original.state_dict()[name])]
    assert changed


def test_a_slowed_rank_is_named_a_straggler_live_within_three_logged_steps_and_the_monitor_shows_it(tmp_path):
    """bench/phases_view.py (the monitor captured during a run) on 2 CPU ranks: GPUSCALE_SLOW_RANK
    (engines/step_phases.py's test aid) makes rank 1 sleep half a second at each training pass; the
    warnings the monitor and `gpuscale run`'s progress line show (app/views/collapse.py) name it while
    the run goes on, by the time the ranks have logged 3 steady steps; the other rank's step is as long,
    spent waiting at the gradient all-reduce, so it is not named; and the real app's monitor, captured
    while the run is live, shows the rows a rank and the advice."""
    from gpuscale.data.step_phases import LIVE_STEPS, WARM_UP_STEPS

    out = tmp_path / "monitor.json"
    # Steps enough that the run is still live when the app has drawn its monitor, and that a progress line
    # (`gpuscale run` prints one every 10 s off a terminal) comes after the naming (each step a second or more).
    done = subprocess.run([sys.executable, str(BENCH / "phases_view.py"), "--gpus", "2", "--model", "tiny-math",
                           "--slow-rank", "1:0.5", "--sizes", "120x40", "--set", "max_steps=16",
                           "--set", "max_examples=64", "--set", "batch_size=2", "--set", "max_length=64",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    figures = json.loads(out.read_text())["figures"]
    assert figures["status"] == "succeeded" and figures["other_ranks_named"] == []
    # Slowed from its first log on, so from its first steady step on.
    assert figures["named_at_step"] <= WARM_UP_STEPS + LIVE_STEPS
    named = next(seen for seen in figures["observations"] if seen["step"] == figures["named_at_step"])
    assert named["status"] == "running"  # named while the run goes on
    rows = named["rows"]  # the monitor's row a rank: the other's step as long, spent waiting for rank 1
    assert rows[1].startswith("  rank 0: ") and ", waited " in rows[1], rows
    assert rows[2].startswith("  rank 1: "), rows
    screen = "\n".join(figures["screens"]["monitor-120x40"])
    assert "where a step goes" in screen and "rank 1 is a straggler" in screen, screen
    assert (out.with_suffix("") / "monitor-120x40.svg").exists()
    progress_line = (out.with_suffix("") / "run.txt").read_text()
    assert "rank 1 is a straggler: it works" in progress_line and "rank 0 is a straggler" not in progress_line


# An optimizer step's rows are counted over all ranks: 1 rank takes the 4 rows of a step, 2 ranks 2 each.
FOUR_ROWS_A_STEP = ["--recipe", "sft", "--set", "rows_per_step=4", "--set", "max_examples=16", "--set", "max_steps=3",
                    "--set", "max_length=64", "--set", "eval_examples=0", "--set", "learning_rate=1e-3",
                    "--set", "lr_scheduler=constant", "--set", "checkpoint_every=0"]


def test_one_and_two_ranks_train_the_same_steps_to_the_same_weights(home):
    """rows_per_step is the step over all ranks: 2 ranks take the same rows a step as 1 (each half of
    them) and end at the same weights, up to fp32's summation order. Counted a rank (TRL's
    gradient_accumulation), the 2-rank run takes twice the rows a step and ends elsewhere."""
    one, two, per_rank = runs_at_once([*FOUR_ROWS_A_STEP, "--gpus", "1"], [*FOUR_ROWS_A_STEP, "--gpus", "2"],
                                      [*FOUR_ROWS_A_STEP, "--gpus", "2", "--set", "gradient_accumulation=1",
                                       "--batch-size", "4"])
    weights = {}
    for name, run in (("one", one), ("two", two), ("per_rank", per_rank)):
        assert run["status"] == "succeeded", run["error"]
        assert run["summary"]["steps"] == 3
        weights[name] = load_model(run["summary"]["model_dir"])[0].state_dict()
    assert (one["summary"]["rows_per_step"], two["summary"]["rows_per_step"]) == (4, 4)
    assert two["summary"]["gradient_accumulation"] * two["summary"]["batch_size"] == 2  # a rank's half
    assert per_rank["summary"]["rows_per_step"] == 8
    original = load_model("tiny-math")[0].state_dict()

    def largest_difference(a: dict, b: dict) -> float:
        return max((a[name] - b[name]).abs().max().item() for name in a)

    moved = largest_difference(weights["one"], original)
    assert moved > 1e-3
    # Measured: 2 ranks 3.4e-6 from 1 rank, a thousandth of the 3.0e-3 the weights moved (fp32's summation
    # order, under Adam's division by each gradient's own size); counted a rank, 6.0e-3.
    assert largest_difference(weights["two"], weights["one"]) < 1e-2 * moved
    assert largest_difference(weights["per_rank"], weights["one"]) > 0.5 * moved


VALIDATION_SFT = ["--recipe", "sft", "--gpus", "1", "--batch-size", "2", "--set", "max_examples=6",
                  "--set", "max_steps=1", "--set", "max_length=64", "--set", "eval_examples=2",
                  "--set", "max_new_tokens=8", "--set", "save_model=false", "--set", "eval_split=validation",
                  "--set", "report_to=tensorboard"]


@pytest.fixture(scope="module")
def one_rank_runs(module_home) -> dict[str, subprocess.CompletedProcess]:
    """The two 1-rank runs of the tests below, started together (each keeps one core busy): TINY_SFT
    with a fault injected where the final evaluation starts, and a run scored on validation problems
    that reports to TensorBoard."""
    final_eval_fault, validation = run_together([*TINY_SFT, "--gpus", "1"], VALIDATION_SFT,
                                                envs=[{"GPUSCALE_INJECT_FAULT": "0:final_eval:0"}, {}])
    return {"final_eval_fault": final_eval_fault, "validation": validation}


def test_a_failure_in_the_final_evaluation_keeps_the_saved_model_and_the_figures_before_it(one_rank_runs):
    """Save first, evaluate second: a fault injected where the final evaluation starts fails the run,
    and the trained model is already in the run folder, with the accuracy measured before training."""
    result = one_rank_runs["final_eval_fault"]
    assert result.returncode == 1
    run = run_json("show", str(json.loads(result.stdout)["id"]))
    assert run["status"] == "failed" and run["error"] == "rank 0: RuntimeError: injected fault on rank 0 at final_eval"
    summary = run["summary"]
    assert summary["partial"] is True and summary["steps"] == 3
    assert 0 <= summary["accuracy_greedy_before"] <= 1 and "accuracy_greedy_after" not in summary
    model_dir = Path(run["run_dir"]) / "model"
    assert summary["model_dir"] == str(model_dir) and (model_dir / "model.safetensors").is_file()
    assert AutoModelForCausalLM.from_pretrained(model_dir).num_parameters() > 0


def test_a_run_scored_on_validation_problems_says_so_in_its_summary(one_rank_runs):
    """eval_split=validation: the run scores the first eval_examples problems of tiny-math's validation
    split and trains on max_examples of the training split; the summary names the split, so its
    figures are never taken for test figures."""
    result = one_rank_runs["validation"]
    assert result.returncode == 0, result.stderr
    run = json.loads(result.stdout)
    assert run["status"] == "succeeded", run["error"]
    summary = run["summary"]
    assert summary["eval_split"] == "validation"
    assert summary["eval_examples"] == 2 and summary["train_examples"] == 6
    assert summary["accuracy_greedy_after"] is not None and summary["accuracy_sampled_after"] is not None
    assert run["settings"]["eval_split"] == "validation"


def test_report_to_tensorboard_writes_the_trainer_s_figures_into_the_run_folder(one_rank_runs):
    """report_to=tensorboard: transformers' integration (tensorboardX, of the test extra) writes its
    event file into RUN_DIR/tensorboard, with the loss and learning rate of every step."""
    run = json.loads(one_rank_runs["validation"].stdout)
    assert run["settings"]["report_to"] == "tensorboard"
    [events] = (Path(run["run_dir"]) / "tensorboard").glob("events.out.tfevents.*")
    written = events.read_bytes()
    assert b"train/loss" in written and b"train/learning_rate" in written  # the tags, stored as plain text
