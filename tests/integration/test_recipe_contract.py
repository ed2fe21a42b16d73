"""The recipe contract, checked the same way for every registered recipe: a new recipe gets these
tests by being registered.

For each recipe: its default settings pass its own `check()`, its settings render as the TUI's launch
form (one control per setting, and the form reads back settings that validate), a 1-rank CPU run of its
smallest settings on the embedded default succeeds through the real CLI, and the run's summary holds
every figure the recipe promises.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from textual.app import App

from conftest import run_together
from gpuscale.app.widgets.settings_form import HIDDEN_FIELDS, SettingsForm
from gpuscale.recipes.shared.contract import Recipe
from gpuscale.recipes.shared.device_defaults import device_defaults_line
from gpuscale.recipes.shared.registry import all_recipes
from gpuscale.runs.settings import resolve_settings

RECIPES = sorted(all_recipes())


def smoke_arguments(recipe: Recipe) -> list[str]:
    arguments = []
    for key, value in recipe.smoke_settings.items():
        arguments += ["--set", f"{key}={value}"]
    return arguments


@pytest.mark.parametrize("name", RECIPES)
def test_the_recipe_declares_what_the_contract_asks(name):
    recipe = all_recipes()[name]
    assert isinstance(recipe, Recipe) and recipe.name == name
    assert recipe.summary and "\n" not in recipe.summary
    assert recipe.launcher in ("torchrun", "accelerate")
    assert recipe.promised_figures, "a recipe promises at least one summary figure"
    assert not recipe.uncatalogued_figures(), f"{name}: promised figures not in data/figures.py's catalogue"
    # The smallest settings are valid settings of the recipe (refused before launch otherwise).
    resolve_settings(recipe.settings_cls, overrides=recipe.smoke_settings, environ={})


@pytest.mark.parametrize("name", RECIPES)
def test_the_defaults_pass_the_recipe_s_own_checks(name):
    """What a user gets with nothing set is a run the recipe accepts: its data, split sizes and model."""
    recipe = all_recipes()[name]
    recipe.check(resolve_settings(recipe.settings_cls, overrides={}, environ={}))


@pytest.mark.parametrize("name", RECIPES)
def test_the_settings_render_in_the_launch_form(name):
    recipe = all_recipes()[name]

    class FormApp(App):
        def compose(self):
            yield SettingsForm(recipe.settings_cls, recipe.settings_cls())

    async def check():
        async with FormApp().run_test(size=(100, 60)) as pilot:
            await pilot.pause()
            form = pilot.app.query_one(SettingsForm)
            assert form.ready
            for field in recipe.settings_cls.model_fields:
                if field not in HIDDEN_FIELDS:  # resume_from: set by `gpuscale resume`, not typed
                    assert form.control(field) is not None
            # What the form holds, untouched, is the recipe's default settings.
            read_back = resolve_settings(recipe.settings_cls, overrides=form.values(), environ={})
            assert read_back == recipe.settings_cls()

    import asyncio

    asyncio.run(check())


SMOKE_TEST = "test_a_one_rank_cpu_run_of_the_smallest_settings_keeps_its_promises"


@pytest.fixture(scope="module")
def smoke_runs(request, module_home) -> dict[str, subprocess.CompletedProcess]:
    """The 1-rank smoke runs of the recipes the test below is selected for (all of them, or those -k
    picks), two at a time: each keeps one core busy."""
    names = [item.callspec.params["name"] for item in request.session.items
             if item.module is request.module and item.originalname == SMOKE_TEST]
    ended = {}
    for pair in (names[i:i + 2] for i in range(0, len(names), 2)):
        outcomes = run_together(*(["--recipe", name, "--gpus", "1", *smoke_arguments(all_recipes()[name])]
                                  for name in pair))
        ended.update(zip(pair, outcomes))
    return ended


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.e2e
def test_a_one_rank_cpu_run_of_the_smallest_settings_keeps_its_promises(smoke_runs, name):
    recipe = all_recipes()[name]
    result = smoke_runs[name]
    assert result.returncode == 0, result.stderr
    run = json.loads(result.stdout)
    assert run["status"] == "succeeded", run["error"]
    missing = [figure for figure in recipe.promised_figures if figure not in (run["summary"] or {})]
    assert not missing, f"{name}: the summary lacks promised figures {missing}"
    # The settings left to the device (those the smallest settings do not give) are the CPU's, and rank
    # 0's log says so in one line.
    settings = resolve_settings(recipe.settings_cls, overrides=recipe.smoke_settings, environ={})
    line = device_defaults_line(settings, on_gpu=False)
    log = (Path(run["run_dir"]) / "logs" / "rank0.log").read_text()
    assert (line in log.splitlines()) if line else "defaults (" not in log
