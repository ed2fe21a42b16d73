"""The launch form on a rank count the recipe's defaults do not split over (recipes/shared/rank_split.py):
a default left as it is moves to the nearest value that splits, said under the command, which carries it;
a value typed that does not split is refused inline, on its field, with the values that would."""

from __future__ import annotations

from test_tui_launch_input import SIZE, fill_form

from gpuscale.app.tui import GpuscaleApp
from gpuscale.recipes.shared.registry import get_recipe
from tui_helpers import run_async, settle, wait_for


def preview_text(app) -> str:
    return str(app.screen.query_one("#preview").render())


def test_the_form_fits_a_default_to_the_ranks_and_refuses_a_typed_value_inline(home):
    async def scenario():
        app = GpuscaleApp(recipes={"grpo-mtl": get_recipe("grpo-mtl")}, list_gpus=lambda: [], cursor_blink=False)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            await fill_form(pilot, gpus=3)
            fitted = ("prompts_per_step 64 -> 63: the default's 64 prompts x 4 generations = 256 completions do "
                      "not split over 3 ranks; --set prompts_per_step=N chooses")
            await wait_for(pilot, lambda: fitted in preview_text(app), 20, "the fitted line",
                           explain=lambda: preview_text(app))
            assert "--set prompts_per_step=63" in preview_text(app)  # the command runs what the line says
            await fill_form(pilot, prompts_per_step=17)
            error = ("✗ prompts_per_step: 17 prompts x 4 generations = 68 completions do not split over 3 ranks "
                     "(each takes an equal share of a step); use prompts_per_step 15 or 18, or 2 or 4 ranks")
            await wait_for(pilot, lambda: error in str(app.screen.query_one("#error-prompts_per_step").render()), 20,
                           "the inline refusal", explain=lambda: preview_text(app))
            assert "not ready to launch: prompts_per_step: 17: " in preview_text(app)

    run_async(scenario())
