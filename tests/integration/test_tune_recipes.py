"""Tuning for every recipe beyond power-sampling and probe: `gpuscale tune` runs each recipe's real
trial on CPU (the embedded tiny-math model, tiny settings) and stores a choice; a training recipe's
tuned micro-batch keeps the global batch the user asked for when `--batch-size auto` applies it; and
`--max-batch` defaults to the run's work per rank where the recipe knows it.

The CLI runs in this process (`cli.main`): the trials are the same code, without a second torch import
per recipe."""

from __future__ import annotations

import json

import pytest

from gpuscale.app import cli
from gpuscale.app.batch_choice import settings_with_batch
from gpuscale.control.store import Store
from gpuscale.recipes.grpo_mtl import accumulation_steps
from gpuscale.recipes.shared.contract import RUN_SETTINGS_NOT_SHAPING
from gpuscale.recipes.shared.device_trials import default_max_batch, tune_recipe
from gpuscale.recipes.shared.registry import BUILTIN, get_recipe
from gpuscale.recipes.shared.tuning_key import Device, tuning_key
from gpuscale.runs.settings import merge_layers, parse_assignments, resolve_settings

# Tiny settings per recipe; eggroll and rft leave --max-batch to its default (the run's work per rank).
TINY = {
    "eggroll": ["--set", "population=4", "--set", "prompts_per_step=2", "--set", "max_new_tokens=6",
                "--set", "max_examples=16"],  # not the whole 200,000-problem split (~6 s a trial to generate)
    "rft": ["--set", "max_examples=4", "--set", "samples_per_question=2", "--set", "max_new_tokens=6",
            "--set", "eval_examples=2"],
    # 16 sequences per step (over all ranks: one here).
    "sft": ["--set", "rows_per_step=16", "--set", "max_length=48", "--set", "max_examples=16",
            "--set", "eval_examples=2", "--max-batch", "4"],
    # 4 prompts x 2 completions = 8 completions per step.
    "grpo-mtl": ["--set", "prompts_per_step=4", "--set", "num_generations=2", "--set", "max_completion_length=6",
                 "--set", "max_examples=8", "--set", "eval_examples=2", "--max-batch", "4"],
}
DEFAULT_MAX_BATCH = {"eggroll": 2 * 4, "rft": 4}  # prompts x members; max_examples on one rank


def tiny_settings(name: str):
    """The recipe's settings as `gpuscale tune` with TINY[name] resolves them."""
    assignments = [arg.split("=", 1) for arg in TINY[name] if "=" in arg]
    overrides = parse_assignments([f"{key}={value}" for key, value in assignments])
    return resolve_settings(get_recipe(name).settings_cls, overrides=overrides, environ={})


def recording_reads(settings_cls, reads: set[str]):
    """`settings_cls` with every read of one of its fields noted in `reads` (model_copy keeps the class)."""
    class Recording(settings_cls):
        def __getattribute__(self, name):
            if name in settings_cls.model_fields:
                reads.add(name)
            return super().__getattribute__(name)

    return Recording


@pytest.fixture(scope="module")
def tunings(module_home) -> dict[str, tuple[int, str, str]]:
    """Each recipe's `gpuscale tune` in the module's home, once: the tests below read the same tuning
    (`tune` fills this in on the first test that asks)."""
    return {}


def tune(name: str, capsys, tunings: dict) -> tuple[int, str, str]:
    """`gpuscale tune` of TINY[name], in this process: (exit code, stdout, stderr)."""
    if name not in tunings:
        code = cli.main(["tune", "--recipe", name, *TINY[name]])
        out = capsys.readouterr()
        tunings[name] = (code, out.out, out.err)
    return tunings[name]


@pytest.mark.parametrize("name", sorted(TINY))
@pytest.mark.e2e
def test_tune_runs_the_recipes_real_trials_on_cpu_and_stores_a_choice(name, module_home, tunings, capsys,
                                                                      one_torch_thread):
    recipe = get_recipe(name)
    code, out, err = tune(name, capsys, tunings)
    assert code == 0, err
    [stored] = Store(module_home).list_tunings(name)
    assert (stored["device"], stored["precision"], stored["model"]) == ("cpu", "fp32", "tiny-math")
    assert stored["figure"] == recipe.tuning.figure and stored["throughput"] > 0
    assert stored["peak_memory_bytes"] > 50 * 2**20  # the process holds the model: tens of MB at least
    assert f"chosen: batch {stored['batch_size']}," in out
    trials = stored["trials"]
    assert len(trials) >= 2 and all(trial["throughput"] > 0 for trial in trials)
    assert len({trial["batch_size"] for trial in trials}) >= 2  # a search, not one measurement
    settings = tiny_settings(name)
    allowed = recipe.tune_batch_sizes(settings, 1)
    if allowed is not None:
        assert all(trial["batch_size"] in allowed for trial in trials)
    largest = DEFAULT_MAX_BATCH.get(name, 4)
    assert f"batches up to {largest}" in err
    assert max(trial["batch_size"] for trial in trials) <= largest
    assert json.loads(stored["shape"]) == {key: getattr(settings, key) for key in recipe.tuning.shape_settings}


@pytest.mark.parametrize("name", sorted(BUILTIN))
@pytest.mark.e2e
def test_every_setting_a_trial_reads_is_in_its_key_or_declared_not_to_shape_the_work(name, one_torch_thread):
    """A setting the trial reads changes what it measures unless declared otherwise: one missing from the
    key (`Tuning.shape_settings`, or a property there such as sft's `step_asked`) would let
    `--batch-size auto` reuse a tuning of other work. Declared: `Tuning.not_shaping` and
    `RUN_SETTINGS_NOT_SHAPING`. Every registered recipe, on its `smoke_settings`."""
    recipe, reads = get_recipe(name), set()
    if recipe.tuning is None:
        pytest.skip(f"{name} declares no tuning: it has no trial")
    # The recipe's smallest complete run (its smoke_settings): a recipe added later is checked as it comes.
    settings = resolve_settings(recording_reads(recipe.settings_cls, reads), overrides=recipe.smoke_settings,
                                environ={})
    reads.clear()
    tuning_key(recipe, settings, "cpu", "fp32")
    in_key = set(reads)
    reads.clear()
    tune_recipe(recipe, settings, Device(None, "cpu", None), max_batch=2)
    assert reads, "the trial read no setting: the recording saw nothing"
    declared = in_key | set(recipe.tuning.not_shaping) | set(RUN_SETTINGS_NOT_SHAPING)
    assert sorted(reads - declared) == []
    assert sorted(set(recipe.tuning.not_shaping) - reads) == []  # a stale entry hides nothing


@pytest.mark.parametrize("name", ["sft", "grpo-mtl"])
@pytest.mark.e2e
def test_auto_takes_the_tuned_micro_batch_and_keeps_the_global_batch(name, module_home, tunings, capsys,
                                                                     one_torch_thread):
    recipe = get_recipe(name)
    code, _out, err = tune(name, capsys, tunings)
    assert code == 0, err
    [stored] = Store(module_home).list_tunings(name)
    asked = tiny_settings(name)
    overrides = {**parse_assignments([a for a in TINY[name] if "=" in a]), "batch_size": "auto", "gpus": 1}
    settings, notes = settings_with_batch(recipe, merge_layers(recipe.settings_cls, overrides=overrides, environ={}),
                                          Store(module_home))
    assert notes["batch_size_source"].startswith("stored (tuned ")
    assert settings.batch_size == stored["batch_size"] <= 4
    if name == "sft":
        # The step keeps its 16 rows; the rank makes them up with 16 / batch_size micro-batches.
        assert settings.rank_rows(1) == asked.rank_rows(1) == 16 and settings.gradient_accumulation is None
        assert 16 % settings.batch_size == 0
    else:
        accumulation = accumulation_steps(settings, 1)  # what the run's trainer is given
        assert settings.batch_size * accumulation == asked.completions_per_step == 8
        assert accumulation >= 2


def test_a_tuned_batch_that_does_not_divide_the_step_is_brought_down_to_one_that_does():
    sft, grpo = get_recipe("sft"), get_recipe("grpo-mtl")
    settings = resolve_settings(sft.settings_cls, overrides={"batch_size": 4, "gradient_accumulation": 3},
                                environ={})
    assert sft.tune_batch_sizes(settings) == [1, 2, 3, 4, 6, 12]
    tuned = sft.with_batch_size(settings, 8)  # tuned for another share: 8 does not divide 12
    assert (tuned.batch_size, tuned.gradient_accumulation) == (6, 2)  # TRL's count keeps the step's 12 rows
    settings = resolve_settings(sft.settings_cls, overrides={"rows_per_step": 24, "gpus": 2}, environ={})
    assert sft.tune_batch_sizes(settings, 2) == [1, 2, 3, 4, 6, 12]  # 12 rows a rank
    tuned = sft.with_batch_size(settings, 8)
    assert (tuned.batch_size, tuned.gradient_accumulation, tuned.rows_per_step) == (6, None, 24)
    settings = resolve_settings(grpo.settings_cls, overrides={"prompts_per_step": 3, "num_generations": 4,
                                                              "gpus": 1}, environ={})
    assert grpo.tune_batch_sizes(settings, 1) == [1, 2, 3, 4, 6, 12]
    assert grpo.tune_batch_sizes(settings, 2) == [1, 2, 3, 6]  # 6 completions per rank
    assert grpo.with_batch_size(settings, 5).batch_size == 4


def test_max_batch_defaults_to_the_runs_work_per_rank():
    power = get_recipe("power-sampling")
    settings = resolve_settings(power.settings_cls, overrides={"max_examples": 5}, environ={})
    assert default_max_batch(power, settings, ranks=1) == 5
    assert default_max_batch(power, settings, ranks=2) == 3  # every second problem: 3 on rank 0
    unbounded = resolve_settings(power.settings_cls, environ={})
    assert default_max_batch(power, unbounded, ranks=1) == 4096  # unknown: the search's own cap
    eggroll = get_recipe("eggroll")
    settings = resolve_settings(eggroll.settings_cls, overrides={"population": 8, "prompts_per_step": 3},
                                environ={})
    assert default_max_batch(eggroll, settings, ranks=2) == 3 * 4  # 4 members per rank, 3 rows each
    assert eggroll.tune_batch_sizes(settings, 2) == [3, 6, 9, 12]
