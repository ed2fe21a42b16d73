"""The launch form at 80x24 and 120x40: every setting's whole name is on screen, apart from its
value; the history keeps its Started column at 80 columns; a toast leaves the command box readable."""

from __future__ import annotations

import re
import time

import pytest
from textual.widgets._toast import Toast

from gpuscale.recipes.shared.registry import all_recipes
from tui_helpers import FROZEN_NOW, frozen_app, history_screen, run_async, screen_text, settle

# The recipes whose settings have the longest names (`activation_checkpointing`, `generations_per_prompt`).
LONG_NAMED = ("rft", "eggroll", "grpo-mtl")


async def show_recipe(pilot, name: str) -> None:
    recipes = pilot.app.screen.query_one("#recipes")
    recipes.highlighted = [option.id for option in recipes.options].index(name)
    await settle(pilot)




async def names_not_shown_whole(pilot) -> list[str]:
    """Each field of the form whose name is not whole on its label's line of the screen, with that line.

    The form is scrolled to put the first field not read yet at its top, and every field then wholly
    in view is read from that one screen: a render of the whole screen per field made this test take
    15 s a size, one per screenful takes a few."""
    app = pilot.app
    form = app.screen.form()
    unread, missing = list(form.fields), []
    while unread:
        target = unread[0]
        form.scroll_to_widget(form.control(target).parent, animate=False, immediate=True, top=True)
        await pilot.pause()
        lines = screen_text(app).splitlines()
        for name in list(unread):
            label = form.control(name).parent.query_one(".field-label")
            # The field scrolled to is read wherever it ended (the form's last ones cannot reach the top).
            if name != target and not form.region.contains_region(label.region):
                continue
            unread.remove(name)
            line = lines[label.region.y]
            if not re.search(rf"(^|[\s│]){re.escape(name)}\s", line):
                missing.append(f"{name}: {line.strip()!r}")
    return missing


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
def test_every_setting_name_is_shown_whole(home, size):
    async def scenario():
        recipes = all_recipes()
        app = frozen_app(home, recipes={name: recipes[name] for name in LONG_NAMED})
        async with app.run_test(size=size) as pilot:
            await settle(pilot)
            for recipe in LONG_NAMED:
                await show_recipe(pilot, recipe)
                missing = await names_not_shown_whole(pilot)
                assert not missing, f"{recipe} at {size}: " + "; ".join(missing)

    run_async(scenario())


def test_history_keeps_started_at_80_columns(home):
    """Runs whose figures are long (a power-sampling summary), two with a label: the Label column, the
    start times (short at 80 columns) and a readable Figures column all stay on screen; the
    duration gives way (the details give it)."""
    from gpuscale.control.store import Store

    store = Store(home)
    for i, label in enumerate(("baseline", None, "a label longer than its column")):
        run_id = store.create_run("power-sampling", {}, [], "h")
        store.update_run(run_id, status="succeeded", started_at=FROZEN_NOW - 3600 * (i + 1), ended_at=FROZEN_NOW,
                         label=label,
                         summary={"accuracy": 0.4583 + i / 100, "reward": 0.5233, "tokens_per_s": 12_750.0})
    store.close()

    async def scenario():
        async with history_screen(home, (80, 24)) as (app, pilot):
            shown = screen_text(app)
            header = next(line for line in shown.splitlines() if "Started" in line)
            assert header.split() == ["ID", "Label", "Recipe", "Status", "Figures", "Started"], shown
            for i in range(3):
                assert time.strftime("%m-%d %H:%M", time.localtime(FROZEN_NOW - 3600 * (i + 1))) in shown, shown
            assert "baseline" in shown and "a label l…" in shown  # cut, and said to be
            for accuracy in ("0.4583", "0.4683", "0.4783"):  # the first figure whole (80 columns cut it at 12)
                assert f"accuracy {accuracy}" in shown, shown

    run_async(scenario())


def test_a_toast_leaves_the_command_box_readable(home):
    async def scenario():
        app = frozen_app(home)
        async with app.run_test(size=(80, 24), notifications=True) as pilot:
            await settle(pilot)
            app.notify("launching probe on CPU: 1 rank (gloo), a message long enough to take three lines")
            await settle(pilot)
            toasts = list(app.screen.query(Toast))
            assert toasts
            preview = app.screen.query_one("#preview").region
            assert all(not toast.region.overlaps(preview) for toast in toasts), (preview, [t.region for t in toasts])

    run_async(scenario())
