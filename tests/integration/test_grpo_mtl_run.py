"""End to end on CPU: grpo-mtl through the real CLI, TRL's GRPOTrainer with gpuscale's engine as its
rollout and PCGrad in its training step, under the real `accelerate launch` with 2 CPU ranks (DDP on
gloo, the domains' gradients all-reduced by hand), a real supervisor and runs.db."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest
import torch

from conftest import check_step_phases, gpuscale, leftover_processes, run_json
from gpuscale.control.store import Store
from gpuscale.data.models import load_model
from gpuscale.data.tiny_math import TINY_MATH_DOMAINS
from gpuscale.recipes.shared.registry import get_recipe
from gpuscale.runs.generations import GENERATIONS_PER_STEP, read_generations

pytestmark = pytest.mark.e2e  # every test here starts real runs

TINY_GRPO = ["--recipe", "grpo-mtl", "--gpus", "2", "--set", "mtl=pcgrad", "--set", "rollout.n=4",
             "--set", "data.train_batch_size=4", "--set", "ppo_micro_batch_size_per_gpu=4",
             "--set", "max_response_length=16", "--set", "max_steps=2", "--set", "eval_examples=6",
             "--set", "max_examples=16", "--set", "save_model=true"]


@pytest.fixture(scope="module")
def pcgrad_run(module_home) -> dict:
    """TINY_GRPO's run, once for the tests that read it: the 2-rank PCGrad run's own figures, and the synchronous
    side of the staleness-0 comparison."""
    return run_json("run", *TINY_GRPO)


def test_two_cpu_ranks_train_with_pcgrad_and_report_per_domain_figures(module_home, pcgrad_run):
    run = pcgrad_run
    assert run["status"] == "succeeded", run["error"]
    command = run["command"]
    assert command[1:3] == ["-m", "accelerate.commands.launch"] and "--multi_gpu" in command

    summary = run["summary"]
    missing = [figure for figure in get_recipe("grpo-mtl").promised_figures if figure not in summary]
    assert not missing
    assert summary["world_size"] == 2 and summary["steps"] == 2 and summary["mtl"] == "pcgrad"
    assert summary["generator"] == "engine" and summary["generation_seconds"] > 0
    assert summary["tokens_per_s"] > 0 and summary["training_seconds"] > 0
    assert set(summary["domains"]) == set(TINY_MATH_DOMAINS)
    # Per-domain figures: training reward (TRL's per-domain reward functions) and held-out accuracy.
    # (a domain drawn in none of the two steps has no training figure)
    trained = [d for d in summary["domains"] if f"train_accuracy_{d}_last" in summary]
    assert len(trained) >= 2 and all(0 <= summary[f"train_accuracy_{d}_last"] <= 1 for d in trained)
    evaluated = [d for d in TINY_MATH_DOMAINS if f"accuracy_greedy_{d}_before" in summary]
    assert len(evaluated) >= 2
    for domain in evaluated:
        for figure in ("greedy", "sampled"):
            for when in ("before", "after"):
                assert 0 <= summary[f"accuracy_{figure}_{domain}_{when}"] <= 1
    assert 0 <= summary["pcgrad_conflict_share_last"] <= 1

    store = Store(module_home)
    rewards = store.metrics(run["id"], "reward")
    # Written by rank 0 only (rank -1 rows are the supervisor's run-wide series).
    assert [m["step"] for m in rewards if m["rank"] >= 0] == [1, 2] and {m["rank"] for m in rewards} <= {0, -1}
    assert {m["rank"] for m in store.metrics(run["id"], "tokens")} == {0, 1}
    assert store.metrics(run["id"], "time_generation")
    check_policy_mismatch(store, run)
    check_generations(run)
    # Where a step goes (data/step_phases.py): the rollout's phases inside the trainer's, on each rank.
    check_step_phases(module_home, run, {"data", "generate", "reward", "forward_backward", "optimizer"}, ranks=2)

    # The trained model is in the run folder, loadable by name, and PCGrad's update changed it.
    trained, tokenizer = load_model(summary["model_dir"])
    original, _ = load_model("tiny-math")
    assert tokenizer is not None
    assert any(not torch.equal(weight, original.state_dict()[name]) for name, weight in trained.state_dict().items())


def check_generations(run: dict) -> None:
    """What the run generated (runs/generations.py), through TRL's completion log: a few of step 1, all of
    step 2 (4 prompts x 4 completions, both ranks' gathered), each with its domain, rewards, advantage
    and truncation; and `gpuscale generations` shows them, filtered."""
    records = read_generations(run["run_dir"])
    assert Counter(record["step"] for record in records) == {1: GENERATIONS_PER_STEP, 2: 16}
    for record in records:
        assert record["domain"] in TINY_MATH_DOMAINS and record["prompt"].strip()
        assert isinstance(record["completion"], str)
        assert set(record["rewards"]) == {"correctness", "format"}, record["rewards"]
        assert record["correct"] is (record["rewards"]["correctness"] == 1.0)
        assert isinstance(record["advantage"], float) and isinstance(record["truncated"], bool)
    assert any(record["truncated"] for record in records)  # 16 tokens: the untrained model runs on
    # `gpuscale generations` shows the final held-out answers first (6 problems greedy and sampled, after the
    # last step), the evaluation before training as step 0, and the training steps' generations between.
    shown = gpuscale("generations", str(run["id"]))
    assert shown.returncode == 0 and f"run {run['id']}: 12 generations of step 3 (steps kept: 0-3" in shown.stdout
    assert "step 3 · held-out sampled after · " in shown.stdout and " · gold " in shown.stdout
    trained = gpuscale("generations", str(run["id"]), "--step", "2")
    assert f"run {run['id']}: 16 generations of step 2 (steps kept: 0-3" in trained.stdout
    domain = records[0]["domain"]
    picked = run_json("generations", str(run["id"]), "--step", "1", "--domain", domain)
    assert picked and {(r["step"], r["domain"]) for r in picked} == {(1, domain)}
    wrong = gpuscale("generations", str(run["id"]), "--step", "9")
    assert wrong.returncode == 2 and f"step: 9: run {run['id']} kept generations of steps 0-3" in wrong.stderr


def check_policy_mismatch(store: Store, run: dict) -> None:
    """The engine samples from the weights the loss trains (fp32 on CPU, the same step): the trainer's
    log-probs of the sampled tokens are the sampler's, every step, both ranks' tokens counted; no warning."""
    from gpuscale.app.views.collapse import run_collapse_warnings

    for name, tolerance in (("sampling_sampling_logp_difference_mean", 1e-5),
                            ("sampling_sampling_logp_difference_max", 1e-4), ("sampling_sampler_kl", 1e-8)):
        logged = [(m["step"], m["value"]) for m in store.metrics(run["id"], name) if m["rank"] >= 0]
        assert [step for step, _ in logged] == [1, 2], name
        assert all(0 <= value < tolerance for _, value in logged), (name, logged)
    assert 0 <= run["summary"]["sampling_sampling_logp_difference_mean_last"] < 1e-5
    assert not any("mismatch" in warning for warning in run_collapse_warnings(store, run))


@pytest.fixture(scope="module")
def async_run(module_home) -> dict:
    """TINY_GRPO at rollout=async for 5 steps, with comparison's prompts weighted twice, once for the tests of
    each: the async rollout's overlap, and domain_weights' shares. The weights change which rows an epoch
    holds, not how many (max_examples stays 16, 4 a step): the steps that had nothing generated ahead are
    the same."""
    return run_json("run", *TINY_GRPO, "--set", "max_steps=5", "--set", "eval_examples=0", "--set", "rollout=async",
                    "--set", "domain_weights=comparison=2")


def test_domain_weights_give_a_domain_more_of_the_prompts_trained_on(async_run):
    """domain_weights=comparison=2 on 2 CPU ranks: the run trains, and its summary records each domain's share of
    the training prompts (the rows TRL's sampler draws), comparison's above its share of the data's own rows."""
    from gpuscale.recipes.grpo_mtl import Settings
    from gpuscale.recipes.grpo_mtl.data import domain_shares, training_and_eval_examples

    run = async_run
    assert run["status"] == "succeeded", run["error"]
    shares = {name: value for name, value in run["summary"].items() if name.startswith("train_share_")}
    assert set(shares) == {f"train_share_{domain}" for domain in TINY_MATH_DOMAINS}
    assert sum(shares.values()) == pytest.approx(1)
    unweighted, _ = training_and_eval_examples(Settings(max_examples=16, eval_examples=0))
    assert shares["train_share_comparison"] > domain_shares(unweighted)["train_share_comparison"]


def test_a_nan_reward_fails_the_run_within_a_few_steps_with_one_line(home):
    """Rank 0's reward functions return NaN from step 2 on (GPUSCALE_INJECT_FAULT's nan_reward): the run
    fails at that step, and its error is the guard's one line, naming the step, the reward and what to try.
    One rank: the guard is each rank's own reward call (engines/trl_bridge.py's FiniteReward); a rank's error
    ending its peers and naming it is test_runs.py's and test_hung_runs.py's."""
    arguments = [*TINY_GRPO, "--gpus", "1", "--set", "max_steps=6", "--set", "eval_examples=0", "--set", "mtl=none"]
    result = gpuscale("run", *arguments, "--json", env={"GPUSCALE_INJECT_FAULT": "0:nan_reward:2"})
    assert result.returncode == 1
    run = run_json("show", "1")
    assert run["status"] == "failed"
    assert re.fullmatch(r"rank 0: step 2: reward correctness_\w+ is nan \(the reward function returned it\); "
                        r"try checking the reward function on this step's completions", run["error"]), run["error"]
    assert run["summary"]["partial"] is True and run["summary"]["steps_done"] < 6
    assert not leftover_processes(run["run_dir"])


def test_too_few_prompts_left_under_max_prompt_length_fail_at_once_in_one_line(home):
    """recipe.check counts the examples before launch; which prompts fit max_prompt_length is known
    once the rank has the tokenizer. With fewer left than a step takes, TRL would end the run at once
    with 0 steps as if it had succeeded: the rank refuses instead, before any evaluation or step."""
    arguments = ["--recipe", "grpo-mtl", "--gpus", "1", "--set", "max_examples=16", "--set", "prompts_per_step=8",
                 "--set", "num_generations=2", "--set", "batch_size=4", "--set", "max_prompt_length=22",
                 "--set", "eval_examples=0"]
    result = gpuscale("run", *arguments, "--json")
    assert result.returncode == 1
    run = run_json("show", "1")
    assert run["status"] == "failed"
    found = re.fullmatch(r"rank 0: max_prompt_length: 22: (\d+) of 16 training prompts are longer, "
                         r"leaving (\d+), fewer than prompts_per_step \(8\); raise max_prompt_length or lower "
                         r"prompts_per_step", run["error"])
    assert found, run["error"]
    assert int(found.group(1)) + int(found.group(2)) == 16 and int(found.group(2)) < 8
    assert not Store(home).metrics(run["id"], "reward")  # no step was taken
    assert not leftover_processes(run["run_dir"])


def test_under_bf16_the_engine_samples_from_a_bf16_copy_within_the_mismatch_bound(home):
    """Precision bf16 (a GPU run's default; autocast over fp32 masters, on a CPU rank here): the engine
    decodes a bf16 copy of the policy, the rank log says so, and the trainer's log-probs of the sampled
    tokens differ from the sampler's, a little: above zero, below the warning's bound."""
    from gpuscale.app.views.collapse import MISMATCH_BOUND

    run = run_json("run", "--recipe", "grpo-mtl", "--gpus", "1", "--precision", "bf16", "--set", "rollout.n=4",
                   "--set", "data.train_batch_size=4", "--set", "max_response_length=16", "--set", "max_steps=2",
                   "--set", "eval_examples=0", "--set", "max_examples=8")
    assert run["status"] == "succeeded", run["error"]
    assert run["summary"]["dtype"] == "bfloat16"
    log = (Path(run["run_dir"]) / "logs" / "rank0.log").read_text()
    assert "speed: the engine decodes a torch.bfloat16 copy of the fp32 master weights" in log
    assert 0 < run["summary"]["sampling_sampling_logp_difference_mean_last"] < MISMATCH_BOUND


def test_async_rollout_at_staleness_0_trains_as_the_sync_rollout_does(module_home, pcgrad_run):
    """rollout=async with max_staleness=0 (2 CPU ranks, PCGrad): the background thread, the engine's own copy
    of the weights and TRL's importance-sampling correction, with nothing generated ahead. Each step samples
    what the synchronous run (TINY_GRPO's, the test above's) samples and its weights are 1 up to float noise:
    the same rewards, the same losses and gradient norms, the same trained model."""
    sync = pcgrad_run
    asynchronous = run_json("run", *TINY_GRPO, "--set", "rollout=async", "--set", "max_staleness=0")
    assert sync["status"] == asynchronous["status"] == "succeeded", (sync["error"], asynchronous["error"])
    assert (sync["summary"]["rollout"], asynchronous["summary"]["rollout"]) == ("sync", "async")
    store = Store(module_home)

    def series(run: dict, name: str) -> list[tuple[int, float]]:
        return [(m["step"], m["value"]) for m in store.metrics(run["id"], name) if m["rank"] == 0]

    assert series(asynchronous, "sampling_staleness") == [(1, 0.0), (2, 0.0)]
    assert series(sync, "reward") == series(asynchronous, "reward")  # the same completions
    for name in ("loss", "grad_norm"):
        ours, theirs = series(asynchronous, name), series(sync, name)
        assert [step for step, _ in ours] == [step for step, _ in theirs] == [1, 2], name
        assert all(value == pytest.approx(other, rel=1e-4, abs=1e-6)
                   for (_, value), (_, other) in zip(ours, theirs, strict=True)), (name, ours, theirs)
    trained, _ = load_model(asynchronous["summary"]["model_dir"])
    reference, _ = load_model(sync["summary"]["model_dir"])
    weights = reference.state_dict()
    assert all(torch.allclose(weight, weights[name], atol=1e-5) for name, weight in trained.state_dict().items())


def test_async_rollout_overlaps_a_step_and_records_its_staleness_and_clipped_share(module_home, async_run):
    """rollout=async at the default max_staleness (1), 2 CPU ranks, PCGrad: from the second step on, each
    step trains on completions generated during the step before, from the weights before it; the
    first step of the second epoch (16 prompts, 4 a step) has nothing generated ahead. The summary
    records the staleness and the share of importance weights TRL's cap clipped."""
    run = async_run
    assert run["status"] == "succeeded", run["error"]
    summary = run["summary"]
    assert (summary["rollout"], summary["max_staleness"], summary["steps"]) == ("async", 1, 5)
    store = Store(module_home)
    staleness = [(m["step"], m["value"]) for m in store.metrics(run["id"], "sampling_staleness") if m["rank"] == 0]
    assert staleness == [(1, 0.0), (2, 1.0), (3, 1.0), (4, 1.0), (5, 0.0)]
    assert summary["sampling_staleness_first"] == 0.5 and summary["sampling_staleness_last"] == 0.5  # 2 of 5 each
    for when in ("first", "last"):
        assert 0 <= summary[f"sampling_importance_sampling_clipped_share_{when}"] <= 1
    ratios = [m["value"] for m in store.metrics(run["id"], "sampling_importance_sampling_ratio_mean") if m["rank"] == 0]
    assert len(ratios) == 5 and all(0.5 < ratio < 1.5 for ratio in ratios)
    log = (Path(run["run_dir"]) / "logs" / "rank1.log").read_text()
    assert "speed: the engine decodes a torch.float32 copy of the fp32 master weights" in log
    assert not leftover_processes(run["run_dir"])
