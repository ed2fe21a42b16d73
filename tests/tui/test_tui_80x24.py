"""The app in an 80x24 terminal, and the keys every terminal tool answers: what must be on screen
(the whole command, the headline figures, the log, a run's figures in the history) and q to quit."""

from __future__ import annotations

from gpuscale.app.screens.dialogs import ExportDialog
from gpuscale.app.views.commands import shell_equivalent
from gpuscale.app.views.runs import figures_text, throughput_text
from gpuscale.control.store import Store
from tui_helpers import (  # noqa: F401 (fixtures)
    FROZEN_NOW,
    frozen_app,
    frozen_home,
    frozen_template,
    run_async,
    screen_text,
    settle,
    settle_screen,
    shown_whole,
)

SMALL = (80, 24)
# What power sampling reports as it goes: four figures, longer than one 80-column line holds.
POWER_FIGURES = {"accuracy": 0.4583, "acceptance_rate": 0.2113, "forward_passes": 1234.0, "problems": 24.0}


def test_q_quits_wherever_no_text_field_has_focus(frozen_home):
    home, _ = frozen_home

    async def scenario(keys: tuple[str, ...]) -> bool:
        app = frozen_app(home)
        async with app.run_test(size=SMALL) as pilot:
            await settle(pilot)
            for key in keys:
                await pilot.press(key)
                await settle(pilot)
            await pilot.press("q")
            await settle(pilot)
            return app.is_running

    assert not run_async(scenario(()))  # the monitor of the live run
    assert not run_async(scenario(("f4",)))  # the history table

    async def typing_q_in_a_field() -> None:
        app = frozen_app(home)
        async with app.run_test(size=SMALL) as pilot:
            await settle(pilot)
            await pilot.press("f2")
            await settle(pilot)
            field = app.screen.query_one("#field-model")
            field.focus()
            await pilot.press("end", "q")
            await settle(pilot)
            assert app.is_running and field.value.endswith("q")

    run_async(typing_q_in_a_field())


def test_monitor_shows_the_whole_headline_and_the_log(frozen_home):
    home, ids = frozen_home
    store = Store(home)
    live = store.get_run(ids["live"])
    store.update_run(ids["live"], progress={**live["progress"], "latest": POWER_FIGURES})
    store.close()

    async def scenario():
        app = frozen_app(home)
        async with app.run_test(size=SMALL) as pilot:
            await settle_screen(pilot)
            headline = figures_text({**live, "progress": {"latest": POWER_FIGURES}})
            assert len(f"{throughput_text(live)} · {headline}") > 78  # once cut to `fo…`
            assert shown_whole(app, headline), screen_text(app)
            assert "log: all logs" in screen_text(app) and "[rank1] step 1200 loss 0.93" in screen_text(app)
            assert "GPU 0 H100" in screen_text(app)

    run_async(scenario())


def test_launch_shows_the_whole_shell_command(frozen_home):
    home, _ = frozen_home

    async def scenario():
        app = frozen_app(home)
        async with app.run_test(size=SMALL) as pilot:
            await settle(pilot)
            await pilot.press("f2")
            await settle(pilot)
            for name, text in (("batch_size", "64"), ("steps", "1000"), ("prompt_tokens", "128"),
                               ("warmup_steps", "4"), ("seed", "7"), ("max_examples", "100"),
                               ("telemetry_interval", "0.5")):
                app.screen.query_one(f"#field-{name}").focus()
                await pilot.press("ctrl+u", *text)
            await settle_screen(pilot)
            command = shell_equivalent("probe", app.screen.settings)
            assert "--set telemetry_interval=0.5" in command
            assert shown_whole(app, command), screen_text(app)

    run_async(scenario())


def test_history_shows_a_runs_figures_whole_and_exports_into_the_home(frozen_home):
    home, _ = frozen_home
    store = Store(home)
    run_id = store.create_run("power-sampling", {}, [], "node001")
    store.update_run(run_id, status="succeeded", started_at=FROZEN_NOW - 60, ended_at=FROZEN_NOW - 10,
                     summary={"accuracy": 0.4583, "tokens_per_s": 1234.5, "problems_per_s": 2.5})
    store.close()

    async def scenario():
        app = frozen_app(home)
        async with app.run_test(size=SMALL) as pilot:
            await settle(pilot)
            await pilot.press("f4")
            await settle_screen(pilot)
            # Whole figures, as many as leave the Started column on screen.
            assert "accuracy 0.4583, tokens/s 1,234" in screen_text(app), screen_text(app)
            assert "Started" in screen_text(app)
            await pilot.press("e")  # the newest run, under the cursor
            await settle(pilot)
            assert isinstance(app.screen, ExportDialog)
            field = app.screen.query_one("#export-path")
            path = str(home / "exports" / f"gpuscale-run-{run_id}.json")
            assert field.value == path
            # The path is not selected on focus: keys edit it at its end instead of replacing it.
            await pilot.press("backspace", "backspace", "backspace", "backspace", "c", "s", "v")
            await settle(pilot)
            assert field.value == path.removesuffix("json") + "csv"

    run_async(scenario())
