"""bench/acceptance.py's verdicts on made-up rows (no run): the greedy targets and their per-seed rule,
the sharpening control, power sampling against its rivals, the saved-model check's agreement rule;
the saved-model check's plain-transformers scoring on the embedded model; and how runs share a card (MPS, through
a stand-in for its control daemon)."""

from __future__ import annotations

import os
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest
from bench_loader import load_bench

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def acceptance():
    return load_bench("acceptance.py")


def row(label: str, seed: int, greedy=(None, None), sampled=(None, None), domains: dict | None = None,
        accuracy: float | None = None, temperature: float | None = None, status: str = "succeeded",
        pass_at_k: dict | None = None) -> dict:
    """A row as acceptance.py's row_of writes it; greedy and sampled: (before, after)."""
    return {"label": label, "seed": seed, "status": status, "error": None, "wall_s": 1.0, "peak_mem_mb": None,
            "accuracy_greedy_before": greedy[0], "accuracy_greedy_after": greedy[1],
            "accuracy_sampled_before": sampled[0], "accuracy_sampled_after": sampled[1], "domains": domains or {},
            "accuracy": accuracy, "temperature": temperature, "pass_at_k": pass_at_k, "nan_free": True,
            "saved_model": None}


def domains_of(**greedy: tuple) -> dict:
    """Per-domain greedy figures: domain=(before, after)."""
    return {f"accuracy_greedy_{domain}_{when}": value for domain, pair in greedy.items()
            for when, value in zip(("before", "after"), pair)}


def control_rows(acceptance, accuracy: float, seeds=range(3)) -> list[dict]:
    return [row(acceptance.CONTROL, seed, accuracy=accuracy, temperature=0.5) for seed in seeds]


def verdicts(acceptance, rows):
    return acceptance.verdicts_of(rows, acceptance.seed_statistics(rows))


def test_a_run_that_only_sharpens_fails_both_verdicts(acceptance):
    """T=1 up by 10 points with greedy unchanged (what a temperature change alone does) met
    sft's old T=1 target; now its greedy gain is 0 against +8, and its T=1 accuracy lies no higher than
    the base sharpened without training."""
    rows = [row("sft", seed, greedy=(0.57, 0.57), sampled=(0.38, 0.48)) for seed in range(3)]
    found, _ = verdicts(acceptance, rows + control_rows(acceptance, 0.47))
    sft = found["sft"]
    assert sft["greedy"]["points"] == {"gain_greedy": 0.0} and not sft["greedy"]["met"]
    assert sft["over_sharpening_control"]["points"] == {"over_control": 1.0,
                                                        "per_seed": {"0": 1.0, "1": 1.0, "2": 1.0}}
    assert not sft["over_sharpening_control"]["met"] and not sft["met"]
    # The same run with a real greedy gain, well over the control: both met.
    learned = [row("sft", seed, greedy=(0.57, 0.66), sampled=(0.38, 0.55)) for seed in range(3)]
    found, _ = verdicts(acceptance, learned + control_rows(acceptance, 0.47))
    assert found["sft"]["greedy"]["met"] and found["sft"]["over_sharpening_control"]["met"] and found["sft"]["met"]


def test_the_mean_is_not_enough_when_one_seed_falls_below_the_base_in_one_domain(acceptance, capsys):
    def grpo_rows(arithmetic_after_seed_1: float) -> list[dict]:
        return [row("grpo-mtl", seed, greedy=(0.50, 0.57), sampled=(0.3, 0.5), domains=domains_of(
            arithmetic=(0.40, arithmetic_after_seed_1 if seed == 1 else 0.50), comparison=(0.60, 0.65)))
            for seed in range(3)] + control_rows(acceptance, 0.40)

    found, control = verdicts(acceptance, grpo_rows(0.39))
    greedy = found["grpo-mtl"]["greedy"]
    # Mean arithmetic gain (10 - 1 + 10) / 3 = +6.3, over the +2 floor; overall +7 over +5 ...
    assert greedy["points"] == {"gain_greedy": 7.0, "gain_greedy_arithmetic": 6.3, "gain_greedy_comparison": 5.0}
    assert greedy["floors"] == {"gain_greedy": 5, "gain_greedy_arithmetic": 2, "gain_greedy_comparison": 2}
    # ... but seed 1 lost a point in arithmetic: not met, and the verdict line says where.
    assert greedy["below_base"] == [{"seed": 1, "domain": "arithmetic", "before": 0.40, "after": 0.39}]
    assert not greedy["met"]
    acceptance.print_targets(found, control)
    assert "grpo-mtl greedy: NOT MET: gain_greedy +7.0 (floor +5)" in capsys.readouterr().out.replace("\n", " ")
    acceptance.print_targets(found, control)
    assert "below the base: seed 1 arithmetic 40.0 → 39.0" in capsys.readouterr().out
    assert verdicts(acceptance, grpo_rows(0.40))[0]["grpo-mtl"]["greedy"]["met"]  # equal to the base is not below


def test_a_check_without_the_control_says_so_instead_of_a_control_that_failed(acceptance, capsys):
    """`--only grpo-mtl` runs no control: its T=1 line says the control was not run, where a control whose
    validation runs all failed says that they failed."""
    trained = [row("grpo-mtl", seed, greedy=(0.50, 0.57), sampled=(0.3, 0.5)) for seed in range(3)]
    acceptance.print_targets(*verdicts(acceptance, trained))
    alone = capsys.readouterr().out
    assert "grpo-mtl T=1 over the sharpening control: not run (the control was not among --only's jobs)" in alone
    assert "no validation run succeeded" not in alone
    failed = [row(f"{acceptance.VALIDATION_PREFIX}0.5", 0, status="failed", temperature=0.5)]
    acceptance.print_targets(*verdicts(acceptance, trained + failed))
    beside = capsys.readouterr().out
    assert "not run" not in beside and "no validation run succeeded" in beside


def test_a_failed_or_missing_seed_fails_the_greedy_target(acceptance):
    rows = [row("eggroll", seed, greedy=(0.5, 0.6), sampled=(0.3, 0.4)) for seed in range(3)]
    assert verdicts(acceptance, rows)[0]["eggroll"]["greedy"]["met"]
    rows[2] = row("eggroll", 2, status="failed")
    greedy = verdicts(acceptance, rows)[0]["eggroll"]["greedy"]
    assert greedy["points"] == {"gain_greedy": 10.0} and greedy["seeds_without_greedy_figures"] == [2]
    assert not greedy["met"]


def test_the_sharpening_control_takes_the_best_validation_temperature_and_gains_are_measured_over_it(acceptance):
    grid = [row(f"{acceptance.VALIDATION_PREFIX}{t}", 0, accuracy=a, temperature=t)
            for t, a in ((0.3, 0.50), (0.5, 0.56), (0.6, 0.56), (0.8, 0.52), (1.0, 0.40))]
    grid.append(row(f"{acceptance.VALIDATION_PREFIX}0.4", 0, accuracy=0.9, temperature=0.4, status="failed"))
    assert acceptance.choose_temperature(grid) == (0.6, {0.3: 0.50, 0.5: 0.56, 0.6: 0.56, 0.8: 0.52, 1.0: 0.40})
    tested = [row(acceptance.CONTROL, seed, accuracy=accuracy, temperature=0.6)
              for seed, accuracy in enumerate((0.45, 0.47, 0.43))]
    rft = [row("rft", seed, greedy=(0.57, 0.66), sampled=(0.38, sampled))
           for seed, sampled in enumerate((0.55, 0.50, 0.49))]
    found, control = verdicts(acceptance, grid + tested + rft)
    assert control["temperature"] == 0.6 and control["test_accuracy"] == {"0": 0.45, "1": 0.47, "2": 0.43}
    over = found["rft"]["over_sharpening_control"]
    # Over the control of the same seed, not over the base's T=1 (+17, +12, +11 points).
    assert over["points"] == {"over_control": 6.3, "per_seed": {"0": 10.0, "1": 3.0, "2": 6.0}} and over["met"]
    failed = [dict(r, status="failed") if r["seed"] == 2 else r for r in tested]
    assert not verdicts(acceptance, grid + failed + rft)[0]["rft"]["over_sharpening_control"]["met"]


def test_the_control_waits_for_every_validation_run_and_runs_after_them(acceptance):
    jobs = acceptance.job_list([3, 4], None, acceptance.assignments(["sharpening control:max_examples=4"]))
    labels = [label for label, *_ in jobs]
    grid = len(acceptance.SHARPENING_GRID)
    assert all(label.startswith(acceptance.VALIDATION_PREFIX) for label in labels[:grid])
    assert {seed for _, _, _, seed in jobs[:grid]} == {3}  # once: every seed has the same validation split
    assert [seed for label, _, _, seed in jobs if label == acceptance.CONTROL] == [3, 4]
    assert [seed for label, _, _, seed in jobs if label == acceptance.GREEDY] == [3]  # draws nothing: once
    assert [seed for label, _, _, seed in jobs if label == acceptance.LOW_TEMPERATURE] == [3, 4]
    assert {settings["max_examples"] for _, _, settings, _ in jobs[:grid]} == {"4"}
    assert [settings["temperature"] for _, _, settings, _ in jobs[:grid]] == list(acceptance.SHARPENING_GRID)
    choice = acceptance.TemperatureChoice(2)
    chosen = []
    waiter = threading.Thread(target=lambda: chosen.append(choice.temperature()))
    waiter.start()
    choice.add(row(f"{acceptance.VALIDATION_PREFIX}0.5", 3, accuracy=0.6, temperature=0.5))
    waiter.join(0.05)
    assert waiter.is_alive()  # one validation run still going
    choice.add(row(f"{acceptance.VALIDATION_PREFIX}1.0", 3, accuracy=0.4, temperature=1.0))
    waiter.join(5)
    assert chosen == [0.5]


def test_power_sampling_must_match_greedy_and_low_temperature_sampling(acceptance):
    def rows(power: float) -> list[dict]:
        accuracies = {acceptance.POWER: power, acceptance.GREEDY: 0.585, acceptance.LOW_TEMPERATURE: 0.56,
                      acceptance.TEMPERATURE_1: 0.39}
        return [row(label, seed, accuracy=accuracy, pass_at_k=None if label == acceptance.GREEDY else
                    {"1": accuracy, "16": accuracy + 0.2 + seed / 100})
                for label, accuracy in accuracies.items() for seed in range(2)]

    lower = verdicts(acceptance, rows(0.573))[0]["power-sampling"]
    assert lower["points"]["over_greedy"] == -1.2 and lower["points"]["over_low_temperature"] == 1.3
    assert lower["points"]["over_temperature_1"] == 18.3 and not lower["met"]  # far over T=1 is not enough
    assert lower["pass_at_k"][acceptance.POWER] == pytest.approx({"1": 0.573, "16": 0.778})
    assert acceptance.GREEDY not in lower["pass_at_k"]
    assert verdicts(acceptance, rows(0.585))[0]["power-sampling"]["met"]  # as accurate as greedy: met


def test_the_saved_model_check_agrees_within_the_sampling_error_of_its_100_problems(acceptance):
    # 100 of the run's 500 problems at 60%: 3 standard errors (4.4 points, finite population) + 2 problems.
    tolerance = acceptance.agreement_tolerance(0.6, 100, 500)
    assert tolerance == pytest.approx(3 * (0.6 * 0.4 / 100 * 400 / 499) ** 0.5 + 0.02) and 0.15 < tolerance < 0.152
    assert acceptance.agreement(0.50, 0.6, 100, 500)["agrees"]
    assert not acceptance.agreement(0.44, 0.6, 100, 500)["agrees"]
    # All of the run's problems: only near-ties may differ.
    assert acceptance.agreement_tolerance(0.6, 100, 100) == pytest.approx(0.02)
    assert not acceptance.agreement(0.57, 0.6, 100, 100)["agrees"]
    assert not acceptance.agreement(0.6, None, 100, 500)["agrees"]  # no run figure: nothing agrees
    assert acceptance.saved_model_text(acceptance.agreement(0.5, 0.6, 100, 500)) == "50.0% on 100: agrees (±15.2)"


def test_plain_transformers_scores_the_saved_model_as_the_recipes_prompt_it(acceptance):
    """The embedded model's folder scored with plain transformers: its prompts are the recipes' token for
    token, and a left-padded batch answers as each problem alone does."""
    from transformers import AutoTokenizer

    from gpuscale.data.answers import is_correct
    from gpuscale.data.models import model_path
    from gpuscale.data.prompts import prompt_ids
    from gpuscale.data.tasks import gold_answer, load_examples

    examples = load_examples("tiny-math", "test", max_examples=4)
    tokenizer = AutoTokenizer.from_pretrained(model_path(), local_files_only=True)
    for example in examples:
        text = acceptance.plain_prompt(tokenizer, example["question"])
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == prompt_ids(tokenizer, example["question"])
    questions = [example["question"] for example in examples]
    batched = acceptance.plain_greedy_answers(str(model_path()), questions, 48, batch_size=len(questions))
    assert batched == acceptance.plain_greedy_answers(str(model_path()), questions, 48, batch_size=1)
    assert all(answer.rstrip().splitlines()[-1].startswith("#### ") for answer in batched)  # the format it learned
    accuracy = acceptance.plain_greedy_accuracy(str(model_path()), examples, 48, batch_size=len(questions))
    assert accuracy == sum(is_correct(answer, gold_answer(example), mode="strict")
                           for answer, example in zip(batched, examples)) / len(examples)


def test_every_job_of_the_acceptance_is_valid_settings_of_its_recipe(acceptance):
    """Each run's settings, as `gpuscale run --set` passes them (text), pass its recipe's validation and
    check: the controls' temperature, split, answer rule and batch are ones the recipe takes."""
    from gpuscale.recipes.shared.registry import get_recipe
    from gpuscale.runs.settings import resolve_settings

    jobs = acceptance.job_list([0], None, {}, acceptance.variant_settings(["grpo-mtl:entropy_coef=-0.1"]))
    assert len(jobs) == len(acceptance.SHARPENING_GRID) + len(acceptance.JOBS) + 1
    for label, recipe_name, settings, seed in jobs:
        recipe = get_recipe(recipe_name)
        temperature = settings.get("temperature")
        typed = {**settings, "temperature": 0.5} if temperature == acceptance.CHOSEN else settings
        as_typed = {key: str(value) for key, value in {**typed, "seed": seed}.items()}
        resolved = resolve_settings(recipe.settings_cls, overrides=as_typed)
        recipe.check(resolved)
        if label.startswith(acceptance.VALIDATION_PREFIX):
            assert resolved.split == "validation" and resolved.max_examples == acceptance.VALIDATION_PROBLEMS
        if label == acceptance.LOW_TEMPERATURE:
            assert resolved.method == "sample" and resolved.temperature == 1 / resolved.alpha == 1 / 16


def test_a_variant_runs_right_after_its_job_with_the_jobs_settings_and_its_own_and_is_judged_by_its_targets(
        acceptance, capsys):
    """--variant "grpo-mtl:entropy_coef=-0.1": grpo-mtl's job again, its --set's settings too, then the variant's;
    listed even where --only leaves its job out; its rows judged by grpo-mtl's floors (+5 overall, +2 a domain)."""
    variants = acceptance.variant_settings(["grpo-mtl:entropy_coef=-0.1,beta=0.04"])
    label = "grpo-mtl with entropy_coef=-0.1,beta=0.04"
    assert variants == {label: {"entropy_coef": "-0.1", "beta": "0.04"}}
    jobs = [job[:3] for job in acceptance.job_list([0], None, {"grpo-mtl": {"max_steps": "2"}}, variants)]
    at = jobs.index(("grpo-mtl", "grpo-mtl", {**acceptance.SCORED, "max_steps": "2"}))
    assert jobs[at + 1] == (label, "grpo-mtl", {**acceptance.SCORED, "max_steps": "2", "entropy_coef": "-0.1",
                                                "beta": "0.04"})
    assert [job[0] for job in acceptance.job_list([0, 1], ["sft"], {}, variants)] == [label, "sft", label, "sft"]
    for bad in ("sft", "grpo-mtl:", "grpo-mtl:=1", "power-sampling:alpha=4", "nothing:lr=1"):
        with pytest.raises(SystemExit, match="--variant"):
            acceptance.variant_settings([bad])

    def rows(name: str, comparison_after: float) -> list[dict]:
        return [row(name, seed, greedy=(0.50, 0.57), sampled=(0.3, 0.5), domains=domains_of(
            arithmetic=(0.40, 0.50), comparison=(0.60, comparison_after))) for seed in range(3)]

    found, control = verdicts(acceptance, rows("grpo-mtl", 0.61) + rows(label, 0.65) + control_rows(acceptance, 0.40))
    assert found[label]["greedy"]["floors"] == found["grpo-mtl"]["greedy"]["floors"] == {
        "gain_greedy": 5, "gain_greedy_arithmetic": 2, "gain_greedy_comparison": 2}
    assert found[label]["greedy"]["met"] and not found["grpo-mtl"]["greedy"]["met"]  # comparison +5 against +1
    assert found[label]["over_sharpening_control"]["points"]["over_control"] == 10.0
    acceptance.print_targets(found, control)
    assert f"{label} greedy: MET" in capsys.readouterr().out


def test_runs_at_once_all_with_one_gpu_a_run_one_seeds_wave_and_a_rank_budget_with_several(acceptance):
    jobs = acceptance.job_list([0, 1, 2], None, {})
    assert acceptance.default_jobs(jobs, "1", found=4) == len(jobs)
    assert acceptance.default_jobs(jobs, "2", found=0) == len(jobs)  # CPU ranks
    assert acceptance.default_jobs(jobs, "4", found=4) == 6  # 24 ranks: what ended on 4 x H200
    assert acceptance.default_jobs(jobs, "0,1", found=4) == 12
    assert acceptance.default_jobs(jobs, "8", found=8) == 3
    two_labels = acceptance.job_list([0, 1, 2], ["sft", "eggroll"], {})
    # Two labels: the runs of one seed (2) are fewer than MULTI_GPU_RANKS_AT_ONCE allows (12).
    assert acceptance.default_jobs(two_labels, "2", found=2) == 2


def test_the_runs_at_once_share_the_cores_by_their_ranks(acceptance, monkeypatch):
    assert [acceptance.ranks_per_run(gpus) for gpus in ("1", "4", "0,3", "2,")] == [1, 4, 2, 1]
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setenv("OMP_NUM_THREADS", "restored after the test")
    for ranks, threads in ((12 * 4, "1"), (4, "16"), (0, "64")):
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        acceptance.shared_threads(ranks)
        assert os.environ["OMP_NUM_THREADS"] == threads
    acceptance.shared_threads(1)  # a value already set (the caller's) stays
    assert os.environ["OMP_NUM_THREADS"] == "64"


def test_one_gpu_runs_take_the_least_used_gpu_when_they_start_and_free_it_when_they_end(acceptance):
    from contextlib import ExitStack

    slots = acceptance.GpuSlots(4)
    with ExitStack() as running:
        first_four = [running.enter_context(slots.lease()) for _ in range(4)]
        assert sorted(first_four) == [0, 1, 2, 3]  # as many runs as GPUs: a card each (their energy their own)
        fifth = running.enter_context(slots.lease())
        assert slots.runs_on[fifth] == 2 and sum(slots.runs_on) == 5
    assert slots.runs_on == [0, 0, 0, 0]
    with slots.lease() as gpu, slots.lease(needed=False) as chosen_elsewhere:
        assert gpu == 0 and chosen_elsewhere is None  # a run whose GPUs are set takes no slot
    assert acceptance.GpuSlots(1).lease().__enter__() is None  # one GPU: nothing to choose
    # Runs that end free their card for the next: four threads, each leasing in turn, never share one.
    seen, errors = [], []

    def run_twice():
        for _ in range(2):
            with slots.lease() as gpu:
                if slots.runs_on[gpu] != 1:
                    errors.append(slots.runs_on[:])
                seen.append(gpu)

    threads = [threading.Thread(target=run_twice) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(seen) == 8


def test_machine_settings_leave_a_one_gpu_runs_gpu_to_its_lease_on_a_machine_of_several(acceptance):
    wave = [("sft", "sft", {}, 0)] * 4
    assert "gpus" not in acceptance.machine_settings("1", 4, wave)
    assert acceptance.machine_settings("1", 1, wave)["gpus"] == "1"
    assert acceptance.machine_settings("4", 4, wave)["gpus"] == "4"


FAKE_MPS_CONTROL = """#!/bin/sh
# Records each call: its arguments, its pipe folder, and what it read (the quit command).
echo "$* pipe=$CUDA_MPS_PIPE_DIRECTORY stdin=$(if [ -z "$1" ]; then cat; fi)" >> "$MPS_CALLS"
exit "${MPS_EXIT:-0}"
"""


@pytest.fixture
def fake_mps(tmp_path, monkeypatch):
    """nvidia-cuda-mps-control as a script on PATH that records its calls in the file it returns."""
    folder = tmp_path / "bin"
    folder.mkdir()
    script = folder / "nvidia-cuda-mps-control"
    script.write_text(FAKE_MPS_CONTROL)
    script.chmod(0o755)
    calls = tmp_path / "calls"
    monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")
    monkeypatch.setenv("MPS_CALLS", str(calls))
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # where the daemon's folder is made
    return calls


def test_runs_sharing_a_card_go_through_a_private_mps_daemon_stopped_at_the_end(acceptance, fake_mps):
    with acceptance.card_sharing("auto", shared=True) as sharing:
        pipe = acceptance.RUN_ENVIRONMENT["CUDA_MPS_PIPE_DIRECTORY"]  # what every run started meanwhile gets
        assert sharing == "mps" and Path(pipe).is_dir() and acceptance.RUN_ENVIRONMENT["CUDA_MPS_LOG_DIRECTORY"]
        assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ  # the check's own process stays outside MPS
    assert acceptance.RUN_ENVIRONMENT == {}
    assert fake_mps.read_text().splitlines() == [f"-d pipe={pipe} stdin=", f" pipe={pipe} stdin=quit"]
    assert not any(Path(tempfile.gettempdir()).iterdir())  # its folder is removed once the daemon has quit


def test_no_mps_where_no_card_is_shared_or_the_daemon_is_missing_or_fails(acceptance, fake_mps, monkeypatch):
    with acceptance.card_sharing("auto", shared=False) as sharing:
        assert sharing == "time-slicing" and acceptance.RUN_ENVIRONMENT == {}
    monkeypatch.setenv("MPS_EXIT", "1")
    with acceptance.card_sharing("auto", shared=True) as sharing:
        assert sharing == "time-slicing" and acceptance.RUN_ENVIRONMENT == {}
    assert not any(Path(tempfile.gettempdir()).iterdir())  # a failed start leaves no folder behind
    with pytest.raises(SystemExit, match="--share-card mps: nvidia-cuda-mps-control -d did not start"):
        with acceptance.card_sharing("mps", shared=True):
            pass
    assert fake_mps.read_text().count("-d ") == 2  # the failed starts; never the unshared card
    monkeypatch.setenv("PATH", "/nonexistent")
    with acceptance.card_sharing("auto", shared=True) as sharing:
        assert sharing == "time-slicing"


def test_the_gpu_tests_never_run_through_mps(acceptance, monkeypatch):
    """Their processes must be seen by NVML one by one: gpu_tests leaves MPS's variables out of their environment."""
    seen = {}
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/tmp/somewhere")

    def fake_run(argv, **kwargs):
        seen.update(kwargs["env"])
        return subprocess.CompletedProcess(argv, 0, "1 passed in 1.00s\n", "")

    monkeypatch.setattr(acceptance.subprocess, "run", fake_run)
    assert acceptance.gpu_tests("gpu")["exit_code"] == 0
    assert seen and "CUDA_MPS_PIPE_DIRECTORY" not in seen and seen["PATH"] == os.environ["PATH"]
