"""The recipe contract, checked the same way for every registered recipe: a new recipe gets these
tests by being registered.

For each recipe: its default settings pass its own `check()`, its settings render as the TUI's launch
form (one control per setting, and the form reads back settings that validate), a 1-rank CPU run of its
smallest settings on the embedded default succeeds through the real CLI, and the run's summary holds
every figure the recipe promises.
"""

from __future__ import annotations

import pytest
from textual.app import App

from conftest import run_json
from gpuscale.app.widgets.settings_form import HIDDEN_FIELDS, SettingsForm
from gpuscale.recipes.contract import Recipe
from gpuscale.recipes.registry import all_recipes
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


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.e2e
def test_a_one_rank_cpu_run_of_the_smallest_settings_keeps_its_promises(home, name):
    recipe = all_recipes()[name]
    run = run_json("run", "--recipe", name, "--gpus", "1", *smoke_arguments(recipe))
    assert run["status"] == "succeeded", run["error"]
    missing = [figure for figure in recipe.promised_figures if figure not in (run["summary"] or {})]
    assert not missing, f"{name}: the summary lacks promised figures {missing}"
