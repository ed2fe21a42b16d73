"""eggroll end to end on CPU ranks: the real CLI, torchrun on gloo, the embedded model and tasks."""

from collections import Counter

import pytest

from conftest import check_step_phases, run_json, runs_at_once
from gpuscale.control.store import Store
from gpuscale.runs.generations import GENERATIONS_PER_STEP, read_generations

pytestmark = pytest.mark.e2e  # every test here starts real runs

SMALL = ["--set", "population=8", "--set", "prompts_per_step=4", "--set", "max_new_tokens=24",
         "--set", "steps=3", "--set", "eval_examples=8", "--set", "sigma=0.05", "--set", "lr=0.5",
         "--set", "fitness=correctness", "--batch-size", "16",  # the answers' rewards: equal in both methods
         "--set", "max_examples=64"]  # not the whole 200,000-problem split: generating it costs a rank ~6 s


def test_two_ranks_record_fitness_and_keep_identical_weights(home):
    run = run_json("run", "--recipe", "eggroll", "--gpus", "2", *SMALL)
    assert run["status"] == "succeeded", run["error"]
    summary = run["summary"]
    assert summary["world_size"] == 2 and summary["population"] == 8
    # Each rank evaluated its 4 members; the fitnesses were gathered and both applied the same update.
    assert summary["weights_identical_across_ranks"] is True
    # Rows of the ranks themselves (rank -1 holds the supervisor's run-wide combination).
    fitness = [row for row in Store(home).metrics(run["id"], "fitness_mean") if row["rank"] >= 0]
    assert sorted({(row["rank"], row["step"]) for row in fitness}) == [(r, s) for r in (0, 1) for s in (1, 2, 3)]
    by_step = {}
    for row in fitness:  # every rank logs the population's mean: the same number on both
        by_step.setdefault(row["step"], set()).add(round(row["value"], 9))
    assert all(len(values) == 1 for values in by_step.values())
    samples = [row for row in Store(home).metrics(run["id"], "samples") if row["rank"] >= 0]
    assert sum(row["value"] for row in samples) == 8 * 3  # members evaluated, over ranks and steps
    names = {row["name"] for row in Store(home).metrics(run["id"])}
    assert {"reward_arithmetic", "reward_comparison", "reward_counting"} & names  # the step's prompts' domains
    # Where a step goes (data/step_phases.py): its own phases (its PhaseClock's laps), on each rank.
    check_step_phases(home, run, {"noise", "load", "generate", "score", "gather", "update"}, ranks=2)
    # What rank 0's members answered (runs/generations.py): its first call of each step (its 4 members x 4
    # prompts), a few of the earlier steps, all of the last; each answer with its member's fitness.
    records = read_generations(run["run_dir"])
    assert Counter(record["step"] for record in records) == {1: GENERATIONS_PER_STEP, 2: GENERATIONS_PER_STEP, 3: 16}
    last = [record for record in records if record["step"] == 3]
    for member in range(4):
        answers = last[member * 4 : member * 4 + 4]
        assert len({record["fitness"] for record in answers}) == 1
        assert answers[0]["fitness"] == pytest.approx(sum(record["correct"] for record in answers) / 4)


@pytest.mark.parametrize("temperature", ["0", "1"])
def test_the_batched_population_and_the_naive_structure_make_the_same_run(home, temperature):
    """The answers of the low-rank terms equal those of the explicitly perturbed weights, so both
    methods see the same fitnesses and end with the same weights (fp32 on CPU): greedy, and sampled
    too, since with common random numbers every member draws with the step's numbers whether it
    answers alone (naive) or in the population's batch."""
    same = (*SMALL, "--set", f"temperature={temperature}", "--set", "eval_examples=0")  # the steps alone compared
    batched, naive = runs_at_once(["--recipe", "eggroll", "--gpus", "1", *same, "--set", "method=eggroll"],
                                  ["--recipe", "eggroll", "--gpus", "1", *same, "--set", "method=naive"])
    assert batched["status"] == naive["status"] == "succeeded"
    # eval_examples=0 means no evaluation, as in the other recipes: the runs trained, and their accuracy
    # figures are None (nothing measured), not a refusal.
    for run in (batched, naive):
        summary = run["summary"]
        assert summary.get("accuracy_greedy_before") is None and summary.get("accuracy_sampled_after") is None
        assert "accuracy_greedy_after" in summary  # the figure is there, empty: nothing was scored
        assert summary["steps"] == 3
    store = Store(home)
    series = [[row["value"] for row in store.metrics(run["id"], "fitness_mean") if row["rank"] == 0]
              for run in (batched, naive)]
    assert series[0] == series[1]
    assert batched["summary"]["weights_checksum"] == naive["summary"]["weights_checksum"]
    # ... after real updates: members' fitnesses differed in some step, so the weights moved.
    assert any(row["value"] > 0 for row in store.metrics(batched["id"], "fitness_std") if row["rank"] == 0)
