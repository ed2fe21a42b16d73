"""End to end on CPU: the rft recipe through the real CLI, 2 CPU ranks under the real `accelerate
launch`: generation sharded over the ranks, the kept set gathered and written to the run folder,
TRL SFT with DDP on gloo, evaluation before and after, the model saved; then a second run trains on
the first one's set (`data_from`)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from conftest import check_step_phases, gpuscale, leftover_processes, run_json, wait_until
from gpuscale.control.store import Store
from gpuscale.data.models import load_model
from gpuscale.data.rewards import correctness
from gpuscale.data.tasks import load_examples
from gpuscale.recipes.shared.registry import get_recipe
from gpuscale.runs.generations import GENERATIONS_PER_STEP, read_generations

TINY_RFT = ["--recipe", "rft", "--set", "max_examples=16", "--set", "samples_per_question=4",
            "--set", "batch_size=4", "--set", "keep_per_question=2", "--set", "max_new_tokens=48",
            "--set", "max_length=96", "--set", "train_batch_size=2", "--set", "eval_examples=8",
            "--set", "learning_rate=1e-4"]


@pytest.mark.e2e
def test_two_cpu_ranks_generate_filter_train_and_evaluate_in_one_run(home):
    run = run_json("run", *TINY_RFT, "--gpus", "2", "--set", "max_steps=3", "--set", "include_gold=true")
    assert run["status"] == "succeeded", run["error"]
    command = run["command"]
    assert "--multi_gpu" in command and command[command.index("--num_processes") + 1] == "2"
    summary = run["summary"]
    missing = [figure for figure in get_recipe("rft").promised_figures if figure not in summary]
    assert not missing
    assert summary["world_size"] == 2 and summary["steps"] == 3
    assert summary["generated_samples"] == 16 * 4 and 0 <= summary["yield"] <= 1
    assert summary["samples_per_s"] == summary["generated_samples"] / summary["generation_seconds"]
    for when in ("before", "after"):
        assert 0 <= summary[f"accuracy_greedy_{when}"] <= 1 and 0 <= summary[f"accuracy_sampled_{when}"] <= 1
    # Where a step goes (data/step_phases.py): its generation calls' and its optimizer steps' phases, on each rank.
    check_step_phases(home, run, {"generate", "filter", "data", "forward_backward", "optimizer"}, ranks=2)

    # The kept set is in the run folder: every question's gold answer, and samples that are correct.
    run_dir = Path(run["run_dir"])
    rows = [json.loads(line) for line in (run_dir / "generated.jsonl").read_text().splitlines()]
    assert len(rows) == summary["kept_examples"]
    assert all(set(row) == {"question", "completion", "domain", "source"} for row in rows)
    gold = {example["question"]: example["answer"] for example in load_examples("tiny-math", "train", 16)}
    assert {row["question"] for row in rows if row["source"] == "gold"} == set(gold)  # both ranks' questions
    samples = [row for row in rows if row["source"] == "sample"]
    assert len(samples) == summary["kept_samples"]
    assert all(correctness(row["completion"], gold[row["question"]], mode="strict") for row in samples)
    for question in gold:
        mine = [row["completion"] for row in samples if row["question"] == question]
        assert len(mine) <= 2 and len(set(mine)) == len(mine)

    # What rank 0 generated (runs/generations.py): a few of its first call, all of its last (4 questions x 4).
    records = read_generations(run_dir)
    assert Counter(record["step"] for record in records) == {1: GENERATIONS_PER_STEP, 2: 16}
    for record in records:
        assert record["phase"] == "generate" and record["rewards"] == {"correctness": float(record["correct"])}
        assert record["correct"] is bool(correctness(record["completion"], gold[record["prompt"]], mode="strict"))

    # The monitor saw every phase, in order, on one rising step count.
    phases = Store(home).metrics(run["id"], "phase")
    rank0 = [m for m in phases if m["rank"] == 0]
    assert [m["value"] for m in rank0] == sorted(m["value"] for m in rank0)
    assert {m["value"] for m in rank0} == {0, 1, 2, 3}
    assert [m["step"] for m in rank0] == sorted(m["step"] for m in rank0)
    # One total from the start, generation and training counted (1 + 2 calls of 4 questions a rank +
    # 3 steps + 1), never changed: the progress never went back.
    assert {m["value"] for m in Store(home).metrics(run["id"], "total")} == {7}
    assert (run["progress"]["step"], run["progress"]["total"]) == (7, 7)

    # The trained model is in the run folder, loads like any model, and differs from the base.
    trained, tokenizer = load_model(summary["model_dir"])
    original, _ = load_model("tiny-math")
    assert tokenizer is not None
    assert any(not torch.equal(w, original.state_dict()[name]) for name, w in trained.state_dict().items())

    # A second run trains on the first run's set instead of generating.
    again = run_json("run", *TINY_RFT, "--gpus", "1", "--set", "max_steps=1", "--set", f"data_from={run['id']}",
                     "--set", "save_model=false")
    assert again["status"] == "succeeded", again["error"]
    assert again["summary"]["data_from"] == str(run_dir / "generated.jsonl")
    # The history keeps the id the user typed; the ranks were handed the run's folder (no rank opens
    # the history: launch.run_ids_as_folders).
    assert again["settings"]["data_from"] == str(run["id"])
    assert json.loads((Path(again["run_dir"]) / "settings.json").read_text())["data_from"] == str(run_dir)
    assert again["summary"]["yield"] == summary["yield"]
    assert not (Path(again["run_dir"]) / "generated.jsonl").exists()


def test_data_from_a_run_that_does_not_exist_is_refused_before_launch(home):
    result = gpuscale("run", "--recipe", "rft", "--set", "data_from=41")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].endswith("data_from: '41': no run 41 in the history")
    assert Store(home).list_runs() == []


@pytest.mark.e2e
def test_a_run_stopped_while_generating_keeps_its_partial_kept_set_for_data_from(home):
    """Stopped in the generation phase: the kept rows of the calls each rank finished are in
    results.jsonl, and a later run trains on them with data_from."""
    run_id = int(gpuscale("run", *TINY_RFT, "--gpus", "2", "--set", "max_examples=4000", "--set", "eval_examples=2",
                          "--set", "include_gold=true", "--detach").stdout)
    store = Store(home)

    def generated_calls() -> int:
        return sum(1 for m in store.metrics(run_id, "phase") if m["value"] == 1)

    wait_until(lambda: generated_calls() >= 6, 180, message="six generation calls")
    assert gpuscale("stop", str(run_id)).returncode == 0
    run = run_json("show", str(run_id))
    assert run["status"] == "stopped" and not leftover_processes(run["run_dir"])
    run_dir = Path(run["run_dir"])
    assert not (run_dir / "generated.jsonl").exists()  # the whole set was never gathered
    rows = [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]
    assert len(rows) >= 4  # at least the gold answers of the questions of the calls counted
    assert {row["source"] for row in rows} <= {"gold", "sample"}
    gold = {e["question"]: e["answer"] for e in load_examples("tiny-math", "train", 4000)}
    assert all(row["question"] in gold for row in rows)
    assert all(correctness(row["completion"], gold[row["question"]], mode="strict") for row in rows)

    # `gpuscale resume` trains on them (data_from its folder): no checkpoint needed, nothing generated again.
    resumed = gpuscale("resume", str(run_id), "--gpus", "1", "--set", "max_steps=1", "--json")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming run {run_id} from the answers it kept on 1 CPU rank(s)" in resumed.stderr
    reused = json.loads(resumed.stdout)
    assert reused["status"] == "succeeded", reused["error"]
    assert reused["parent_id"] == run_id and reused["settings"]["data_from"] == str(run_dir)
    assert reused["settings"]["resume_from"] is None
    summary = reused["summary"]
    assert summary["data_from"] == str(run_dir / "results.jsonl") and summary["steps"] == 1
    # Its figures say what it trained on: the kept answers, not the 4000 questions of the data set.
    assert summary["kept_examples"] == summary["train_examples"] == len(rows)
    assert summary["train_questions"] == len({row["question"] for row in rows})
    assert "generation_questions" not in summary and "generated_samples" not in summary
