"""The settings whose default depends on the device (recipes/shared/device_defaults.py), for every recipe:
what a rank runs with nothing set is the GPU's defaults on a GPU (unchanged by the CPU's) and the CPU's on
CPU ranks, a value the user gave is kept on both, the descriptions say both values, and rank 0's log
says in one line which defaults it took."""

from __future__ import annotations

import pytest
import torch

from gpuscale.engines.distributed import RankContext
from gpuscale.recipes.shared.device_defaults import AUTO, device_defaults, device_defaults_line, shown
from gpuscale.recipes.shared.registry import all_recipes
from gpuscale.runs.settings import SettingsError, check_field, resolve_settings

# (GPU, CPU) of every setting left to the device, by recipe. The GPU's are the defaults every GPU run has
# had (chosen on the validation split, bench/RESULTS.md); the CPU's keep a 2-rank run on 2 cores to about
# 3 minutes. A recipe that gains or loses one, or a value that moves, fails here first.
EXPECTED = {
    "eggroll": {"population": (2048, 64), "steps": (200, 60), "eval_every": (50, 0)},
    "grpo-mtl": {"max_steps": (500, 50)},
    "power-sampling": {"max_examples": (None, 500)},
    "probe": {},
    "rft": {"epochs": (9.0, 2.0), "samples_per_question": (16, 4)},
    "sft": {"epochs": (3.0, 1.0)},
}


def test_every_recipe_is_listed_here():
    assert set(EXPECTED) == set(all_recipes())


def rank(device: str, index: int, tmp_path) -> RankContext:
    """A rank's context on `device`: "cuda" fakes a GPU rank (nothing is allocated on it)."""
    return RankContext(index, index, 2, torch.device(device), torch.float32, tmp_path)


def settings_a_rank_runs(name: str, device: str, tmp_path, overrides=None, index: int = 0):
    """What the recipe's `run` gets on a rank of `device`, through the rank's own entry (run_on_device)."""
    recipe = type(all_recipes()[name])()
    got = []
    recipe.run = lambda settings, ctx, reporter: got.append(settings)
    settings = resolve_settings(recipe.settings_cls, overrides=overrides or {}, environ={})
    recipe.run_on_device(settings, rank(device, index, tmp_path), reporter=None)
    return got[0]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_with_nothing_set_a_cpu_rank_runs_the_cpu_defaults_and_a_gpu_rank_the_gpu_ones(name, tmp_path):
    recipe = all_recipes()[name]
    assert {field: (d.gpu, d.cpu) for field, d in device_defaults(recipe.settings_cls).items()} == EXPECTED[name]
    nothing_set = resolve_settings(recipe.settings_cls, overrides={}, environ={})
    on_cpu = settings_a_rank_runs(name, "cpu", tmp_path)
    on_gpu = settings_a_rank_runs(name, "cuda", tmp_path)
    for field, (gpu, cpu) in EXPECTED[name].items():
        assert getattr(nothing_set, field) == AUTO  # the history keeps the word; the rank resolves it
        assert (getattr(on_gpu, field), getattr(on_cpu, field)) == (gpu, cpu), field
    # Nothing else differs between the devices but what a recipe sizes for its rank (eggroll's batch).
    untouched = set(recipe.settings_cls.model_fields) - set(EXPECTED[name]) - {"batch_size"}
    for field in untouched:
        assert getattr(on_cpu, field) == getattr(on_gpu, field) == getattr(nothing_set, field), field


@pytest.mark.parametrize("name", sorted(name for name, fields in EXPECTED.items() if fields))
def test_a_value_the_user_gave_is_kept_on_both_devices(name, tmp_path):
    given = {field: 1 if cpu is None else max(1, int(cpu)) + 2 for field, (_gpu, cpu) in EXPECTED[name].items()}
    if name == "eggroll":
        given["population"] = 6  # antithetic pairs: an even number
    for device in ("cpu", "cuda"):
        ran = settings_a_rank_runs(name, device, tmp_path, overrides={k: str(v) for k, v in given.items()})
        assert {field: getattr(ran, field) for field in given} == given


@pytest.mark.parametrize("name", sorted(name for name, fields in EXPECTED.items() if fields))
def test_each_description_says_both_values(name):
    fields = all_recipes()[name].settings_cls.model_fields
    for field, (gpu, cpu) in EXPECTED[name].items():
        assert f"auto: {shown(gpu)} on a GPU, {shown(cpu)} on CPU" in fields[field].description, field


@pytest.mark.parametrize("name", sorted(name for name, fields in EXPECTED.items() if fields))
def test_rank_0_s_log_says_which_defaults_it_took(name, tmp_path, capsys):
    settings_a_rank_runs(name, "cpu", tmp_path)
    line = capsys.readouterr().out.strip()
    assert line.startswith("CPU defaults (no GPU on this rank): ") and "\n" not in line
    for field, (gpu, cpu) in EXPECTED[name].items():
        assert f"{field} {shown(cpu)} ({shown(gpu)} on a GPU)" in line
    settings_a_rank_runs(name, "cuda", tmp_path)
    line = capsys.readouterr().out.strip()
    assert line.startswith("GPU defaults (a GPU on this rank): ")
    for field, (gpu, cpu) in EXPECTED[name].items():
        assert f"{field} {shown(gpu)} ({shown(cpu)} on CPU)" in line
    settings_a_rank_runs(name, "cpu", tmp_path, index=1)
    assert capsys.readouterr().out == ""  # one line for the run: rank 0's


def test_a_run_that_sets_every_one_of_them_logs_no_line(tmp_path, capsys):
    overrides = {"population": "8", "steps": "3", "eval_every": "1"}
    settings_a_rank_runs("eggroll", "cpu", tmp_path, overrides=overrides)
    assert capsys.readouterr().out == ""
    settings = resolve_settings(all_recipes()["eggroll"].settings_cls, overrides=overrides, environ={})
    assert device_defaults_line(settings, on_gpu=False) is None


def test_a_value_that_is_neither_auto_nor_a_number_is_refused_naming_the_number_s_rule():
    sft = all_recipes()["sft"].settings_cls
    with pytest.raises(SettingsError, match=r"^epochs: '0': Input should be greater than 0 \(or 'auto'\)$"):
        resolve_settings(sft, overrides={"epochs": "0"}, environ={})
    with pytest.raises(SettingsError, match=r"^epochs: 'many': Input should be a valid number.* \(or 'auto'\)$"):
        resolve_settings(sft, overrides={"epochs": "many"}, environ={})
    # The TUI's inline error says the same.
    assert check_field(sft, "epochs", "0") == "Input should be greater than 0 (or 'auto')"
    assert check_field(sft, "epochs", "auto") is None and check_field(sft, "epochs", "1.5") is None
