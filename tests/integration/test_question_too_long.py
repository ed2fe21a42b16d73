"""One question of 10 MB among good rows: every recipe that reads questions holds it to one rule,
decided before launch (data/question_length.py). too_long=refuse (the default): refused in one line
naming file, line, length and the model's context, nothing recorded or started. too_long=skip: left
out by the ranks before anything is allocated for it, and counted in the run's summary.

Before, rft's rank grew to 23.7 GB until the OOM killer took it, power-sampling asked for 100 TB,
sft cut the line and grpo-mtl dropped it on its own terms."""

from __future__ import annotations

import json
import time

import pytest

from conftest import gpuscale, run_json
from gpuscale.control.launch import questions_left_out
from gpuscale.data.tasks import load_examples
from gpuscale.recipes.shared.registry import get_recipe
from gpuscale.runs.settings import resolve_settings
from gsm8k_shaped import gsm8k_rows, write_jsonl

LONG_LINE = 3  # early, so that a run of the first few rows would take it
LONG_QUESTION = "What is " + "1 + " * 2_500_000 + "1?"  # 10,000,010 characters


@pytest.fixture(scope="module")
def bigline(tmp_path_factory):
    """64 good tiny-math rows and, at line 3, one question of 10 MB."""
    rows = [{"question": r["question"], "answer": r["answer"]} for r in load_examples("tiny-math", "train", 64)]
    rows.insert(LONG_LINE - 1, {"question": LONG_QUESTION, "answer": "#### 2500001"})
    path = tmp_path_factory.mktemp("data") / "bigline.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize("recipe", ["power-sampling", "rft", "sft", "grpo-mtl", "eggroll"])
def test_every_recipe_refuses_it_before_launch(home, bigline, recipe):
    started = time.monotonic()
    result = gpuscale("run", "--recipe", recipe, "--gpus", "2", "--dataset", str(bigline))
    elapsed = time.monotonic() - started
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"gpuscale: error: dataset: {bigline}, line {LONG_LINE}: the question is too long for the model: "
        f"10,000,010 characters, {result.stderr.split(' characters, ')[1].split(' ')[0]} or more tokens as a "
        "prompt, and tiny-math's context is 256 tokens (the prompt and its answer must fit); remove the line, or "
        "set too_long=skip to leave such questions out"]
    assert run_json("runs") == []  # nothing recorded, no rank started
    assert elapsed < 60, f"the check took {elapsed:.1f} s"  # a CLI start-up and a prefix measured: seconds


def test_a_gsm8k_sized_file_says_how_far_its_check_got(home, tmp_path):
    """7,000 GSM8K-shaped questions that fit and, last, one that does not: the check before launch
    measures them in batches, writes progress lines on stderr while it works (at once here: the
    threshold lowered, so that no test waits on a slow machine), and refuses the last line."""
    rows = gsm8k_rows(7_000, most_sentences=2)  # prompts of at most 179 of tiny-math's 256 tokens
    path = write_jsonl(tmp_path / "train.jsonl", [*rows, {"question": "x" * 1_000, "answer": "#### 1"}])
    result = gpuscale("run", "--recipe", "sft", "--gpus", "1", "--dataset", str(path),
                      env={"GPUSCALE_PROGRESS_AFTER_S": "0"})
    assert result.returncode == 2, result.stderr
    *progress, refusal = result.stderr.strip().splitlines()
    assert refusal.startswith(f"gpuscale: error: dataset: {path}, line 7001: the question is too long for the model: "
                              "1,000 characters, ")
    assert progress and all(line.startswith(f"checking {path}: question lengths for tiny-math's context of 256 "
                                            "tokens: ") for line in progress), progress
    assert run_json("runs") == []


def results_questions(run: dict) -> list[str]:
    with open(f"{run['run_dir']}/results.jsonl") as rows:
        return [json.loads(row)["question"] for row in rows]


@pytest.mark.e2e
def test_power_sampling_skips_it_and_counts_it(home, bigline):
    """One rank (rft's test below takes two): the front end counts what is left out, each rank leaves it out by
    the same rule."""
    result = gpuscale("run", "--recipe", "power-sampling", "--gpus", "1", "--dataset", str(bigline), "--set",
                      "too_long=skip", "--set", "max_examples=4", "--set", "max_new_tokens=4", "--set", "blocks=1",
                      "--set", "mcmc_steps=1", "--json")
    assert result.returncode == 0, result.stderr
    run = json.loads(result.stdout)
    assert f"1 question(s) longer than the model's context left out (too_long=skip), the first at {bigline}, " \
           f"line {LONG_LINE}" in result.stderr
    assert run["status"] == "succeeded"
    assert run["summary"]["questions_too_long"] == 1 and run["summary"]["problems"] == 4
    assert LONG_QUESTION not in results_questions(run) and len(results_questions(run)) == 4


@pytest.mark.e2e
def test_rft_skips_it_on_two_ranks_and_counts_it(home, bigline):
    """A 2-rank rft run with too_long=skip, tiny: the generation phase never sees the question."""
    result = gpuscale("run", "--recipe", "rft", "--gpus", "2", "--dataset", str(bigline), "--set", "eval_examples=0",
                      "--set", "too_long=skip", "--set", "max_examples=4", "--set", "samples_per_question=2",
                      "--set", "max_new_tokens=8", "--set", "max_steps=1", "--set", "save_model=false",
                      "--set", "include_gold=true", "--json")
    assert result.returncode == 0, result.stderr
    run = json.loads(result.stdout)
    assert run["status"] == "succeeded" and run["summary"]["questions_too_long"] == 1
    assert run["summary"]["train_questions"] == 4
    with open(run["summary"]["generated_set"]) as rows:
        assert all(json.loads(row)["question"] != LONG_QUESTION for row in rows)


@pytest.mark.parametrize("recipe, settings", [
    ("sft", {"eval_examples": 4, "max_examples": 8}),
    ("grpo-mtl", {"eval_examples": 4, "max_examples": 16, "prompts_per_step": 4}),
    ("eggroll", {"eval_examples": 4, "max_examples": 16, "prompts_per_step": 4}),
])
def test_the_training_recipes_data_leaves_it_out_before_launch_and_in_the_ranks(bigline, recipe, settings):
    """What the front end checks and counts, and the rows a rank of each of these recipes loads
    (their own loaders, as their trainers call them), with too_long=skip."""
    chosen = get_recipe(recipe)
    skip = resolve_settings(chosen.settings_cls, overrides={"dataset": str(bigline), "too_long": "skip", **settings})
    chosen.check(skip)
    assert questions_left_out(chosen, skip) == {"questions_too_long": 1,
                                                "questions_too_long_first": f"{bigline}, line {LONG_LINE}"}
    if recipe == "grpo-mtl":
        from gpuscale.recipes.grpo_mtl.data import training_and_eval_examples
    else:
        from gpuscale.recipes.shared.training_data import training_and_eval_examples
    train, held_out = training_and_eval_examples(skip)
    assert len(held_out) == 4 and len(train) == settings["max_examples"]
    assert LONG_QUESTION not in {row["question"] for row in train + held_out}
