"""The launch form by keyboard, as a new user meets it: Tab from the recipe list goes through the
model, the dataset, the GPUs, the batch size and the run's label first, in every recipe's form, then
the recipe's own settings; an empty model or dataset says it is required; the label typed in the
form is the label of the run it starts."""

from __future__ import annotations

import pytest

from gpuscale.app.tui import GpuscaleApp
from gpuscale.recipes.shared.registry import all_recipes
from gpuscale.runs.settings import RunSettings
from tui_helpers import run_async, settle, store, wait_for  # noqa: F401 (store: a fixture)

SIZE = (80, 24)
FIRST = ["model", "dataset", "gpus", "batch_size", "label"]


def app_with(recipe: str) -> tuple[GpuscaleApp, list[str]]:
    """The app with one recipe and no GPUs, and the list its notifications go to."""
    app = GpuscaleApp(recipes={recipe: all_recipes()[recipe]}, list_gpus=lambda: [], cursor_blink=False,
                      poll_s=0.5)
    shown: list[str] = []
    notify = app.notify
    app.notify = lambda message, **options: (shown.append(message), notify(message, **options))[1]
    return app, shown


async def typed(pilot, name: str, text: str) -> None:
    """One field focused, cleared and typed, as a user would."""
    pilot.app.screen.query_one(f"#field-{name}").focus()
    await pilot.press("ctrl+u", *text)
    await settle(pilot)


def own_settings(recipe) -> list[str]:
    """The recipe's settings beyond those every recipe has, in their class's order."""
    return [name for name in recipe.settings_cls.model_fields if name not in RunSettings.model_fields]


@pytest.mark.parametrize("name", ["sft", "probe", *sorted(set(all_recipes()) - {"sft", "probe"})])
def test_tab_goes_through_what_every_run_needs_first(home, name):
    recipe = all_recipes()[name]

    async def scenario():
        app, _ = app_with(name)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            assert app.focused.id == "recipes"
            visited, helps = [], []
            for _ in range(len(FIRST) + 1):
                await pilot.press("tab")
                visited.append(app.focused.id.removeprefix("field-"))
                helps.append(str(app.screen.query_one("#field-help").render()))
            assert visited == FIRST + own_settings(recipe)[:1], f"{name}: Tab went {visited}"
            # The help line describes the focused field, the label too.
            assert helps[FIRST.index("label")].startswith("label: a name for the run"), helps

    run_async(scenario())


@pytest.mark.parametrize("field", ["dataset", "model"])
def test_an_empty_required_field_says_it_is_required(home, store, field):
    """Before: an empty dataset was read as the current folder and said "is a directory"."""
    async def scenario():
        app, shown = app_with("probe")
        async with app.run_test(size=(120, 40)) as pilot:
            await settle(pilot)
            await typed(pilot, field, "")
            error = str(app.screen.query_one(f"#error-{field}").render())
            assert error.startswith(f"✗ {field}: required: give a "), error
            assert "directory" not in error
            await pilot.press("ctrl+r")
            await settle(pilot)
            refusals = [message for message in shown if message.startswith("not launched")]
            assert refusals and refusals[-1].startswith(f"not launched: {field}: required"), shown
            assert app.focused.id == f"field-{field}"  # the launch key took the user to it
            assert app.current_mode == "launch"

    run_async(scenario())
    assert store.list_runs() == []


def test_a_label_that_reads_as_an_id_is_refused_at_its_field(home, store):
    async def scenario():
        app, shown = app_with("probe")
        async with app.run_test(size=(120, 40)) as pilot:
            await settle(pilot)
            await typed(pilot, "label", "42")
            assert "a number would read as a run id" in str(app.screen.query_one("#error-label").render())
            await pilot.press("ctrl+r")
            await settle(pilot)
            assert any(message.startswith("not launched: label:") for message in shown), shown
            await typed(pilot, "label", "baseline")  # fixed: the error goes, the command says it
            assert str(app.screen.query_one("#error-label").render()) == ""
            assert "--label baseline" in str(app.screen.query_one("#preview").render())

    run_async(scenario())
    assert store.list_runs() == []
