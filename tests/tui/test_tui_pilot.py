"""The real app, driven by keys through Pilot, against real runs of `probe` on CPU ranks."""

from __future__ import annotations

import pytest

from conftest import spawn_gpuscale
from gpuscale.app.screens.compare import CompareScreen
from gpuscale.app.screens.history import HistoryScreen
from gpuscale.app.tui import GpuscaleApp
from gpuscale.app.widgets.run_monitor import DeviceRow, RunMonitor
from gpuscale.control import telemetry
from gpuscale.control.store import Store
from gpuscale.runs.run_dir import RunDir
from tui_helpers import run_async, settle, store, wait_for  # noqa: F401 (store: a fixture)

SIZE = (120, 40)


async def type_setting(pilot, name: str, text: str) -> None:
    """Focus one setting of the launch form, clear it and type `text`, as a user would."""
    pilot.app.screen.query_one(f"#field-{name}").focus()
    await pilot.press("ctrl+u", *text)


async def choose_recipe(pilot, name: str) -> None:
    """Walk the recipe list with the arrow keys to `name` (the form follows the highlight)."""
    recipes = pilot.app.screen.query_one("#recipes")
    recipes.focus()
    await pilot.press("home")
    for _ in range(recipes.option_count):
        if recipes.get_option_at_index(recipes.highlighted).id == name:
            break
        await pilot.press("down")
    await settle(pilot)
    assert pilot.app.screen.recipe.name == name


async def fill_form(pilot, **settings) -> None:
    for name, value in settings.items():
        await type_setting(pilot, name, str(value))
    await settle(pilot)


def monitor_of(app, run_id: int) -> RunMonitor | None:
    for monitor in app.screen.query(RunMonitor):
        if monitor.run_id == run_id:
            return monitor
    return None


def explain_monitor(monitor: RunMonitor, store: Store) -> str:
    """What the monitor shows next to what the store holds: which of the two is behind."""
    run = store.get_run(monitor.run_id)
    shown = monitor.view.run if monitor.view else {}
    return (f"store: {run['status']}, progress {run['progress']}, error {run['error']}; monitor shows "
            f"{shown.get('status')}, progress {shown.get('progress')}; status line "
            f"{monitor.query_one('.monitor-status').render()}")


def test_bad_batch_size_is_shown_at_the_field_and_refused(home, store):
    async def scenario():
        app = GpuscaleApp(cursor_blink=False)
        async with app.run_test(size=SIZE) as pilot:
            await choose_recipe(pilot, "probe")
            await type_setting(pilot, "batch_size", "0")
            await settle(pilot)
            error = app.screen.query_one("#error-batch_size")
            assert "greater than or equal to 1" in str(error.render())
            await pilot.press("ctrl+r")
            await settle(pilot)
            assert app.current_mode == "launch"  # still here, nothing started
            assert app.focused.id == "field-batch_size"  # the launch key took the user to the bad field
            # Fixing the value clears the error at once.
            await type_setting(pilot, "batch_size", "2")
            await settle(pilot)
            assert str(error.render()) == ""

    run_async(scenario())
    assert store.list_runs() == []


@pytest.mark.e2e
def test_launch_watch_stop_and_find_a_real_run(home, store):
    async def scenario():
        app = GpuscaleApp(cursor_blink=False, poll_s=0.5)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            if not telemetry.list_gpus():
                assert "no GPU: 1 CPU rank" in str(app.screen.query_one("#gpu-none").render())
            await choose_recipe(pilot, "probe")
            await fill_form(pilot, gpus=1, batch_size=2, steps=100000, prompt_tokens=8, telemetry_interval=0.5)
            # one process: the rank itself, no launcher (control/launch.py:launcher_argv)
            assert "$ python -m gpuscale.recipes --recipe probe" in str(app.screen.query_one("#preview").render())
            await pilot.press("ctrl+r")
            run_id = (await wait_for(pilot, store.list_runs, 30, "the run row"))[0]["id"]
            assert store.get_run(run_id)["settings"]["batch_size"] == 2

            # The monitor opens on the new run; its figures and samples arrive.
            await wait_for(pilot, lambda: app.current_mode == "monitor" and monitor_of(app, run_id), 30, "the monitor")
            monitor = monitor_of(app, run_id)
            def tokens_counted():
                return monitor.view and (monitor.view.run["progress"] or {}).get("tokens_per_s", 0) > 0

            await wait_for(pilot, tokens_counted, 90, "tokens/s above zero",
                           explain=lambda: explain_monitor(monitor, store))
            await wait_for(pilot, lambda: monitor.query(DeviceRow), 30, "a sample row")
            labels = [row.view.label for row in monitor.query(DeviceRow)]
            assert "host CPU" in labels or any(label.startswith("GPU") for label in labels)
            assert "tokens/s" in str(monitor.query_one(".monitor-throughput").render())
            assert "running" in str(monitor.query_one(".monitor-status").render())

            # Stop it, confirming in the dialog.
            await pilot.press("s")
            await settle(pilot)
            assert "Stop run" in str(app.screen.query_one(".dialog-question").render())
            await pilot.press("y")
            await wait_for(pilot, lambda: monitor.view.run["status"] == "stopped", 40, "status stopped")
            assert "stopped" in str(monitor.query_one(".monitor-status").render())

            # The history has it.
            await pilot.press("f4")
            await settle(pilot)
            history = app.screen
            assert isinstance(history, HistoryScreen)
            await wait_for(pilot, lambda: [r for r in history.runs if r["id"] == run_id], 10, "the run in the history")
            table = history.query_one("#runs-table")
            assert str(table.get_row(str(run_id))[2]) == "stopped"

    run_async(scenario())
    assert store.get_run(1)["status"] == "stopped"


@pytest.mark.e2e
def test_compare_two_real_runs(home, store):
    short = ["--recipe", "probe", "--gpus", "1", "--set", "steps=4", "--set", "prompt_tokens=8"]
    cli_run = spawn_gpuscale("run", *short, "--batch-size", "3", "--detach")  # run 1, from the shell
    assert cli_run.wait(60) == 0, cli_run.stderr.read()

    async def scenario():
        app = GpuscaleApp(cursor_blink=False, poll_s=0.5)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            await pilot.press("f2")  # the app opened on the monitor of the live CLI run
            await choose_recipe(pilot, "probe")
            await fill_form(pilot, gpus=1, batch_size=2, steps=4, prompt_tokens=8, label="first try")
            assert "--label 'first try'" in str(app.screen.query_one("#preview").render())
            await pilot.press("ctrl+r")  # run 2, from the TUI
            await wait_for(pilot, lambda: len(store.list_runs()) == 2, 30, "the second run")
            finished = lambda: all(r["status"] == "succeeded" for r in store.list_runs())  # noqa: E731
            await wait_for(pilot, finished, 120, "both runs to succeed")

            await pilot.press("f4")
            await settle(pilot)
            await wait_for(pilot, lambda: len(app.screen.runs) == 2 and app.screen._shown_rows, 10, "two rows")
            await pilot.press("c", "down", "c")  # pick run 2, then run 1
            await settle(pilot)
            compare = app.screen
            assert isinstance(compare, CompareScreen)
            settings_table = compare.query_one("#compare-settings")
            rows = [[str(cell) for cell in settings_table.get_row_at(i)] for i in range(settings_table.row_count)]
            assert ["batch_size", "2", "3"] in rows
            figures = compare.query_one("#compare-figures")
            assert "tokens_per_s" in [str(figures.get_row_at(i)[0]) for i in range(figures.row_count)]
            await pilot.press("escape")
            await settle(pilot)
            assert isinstance(app.screen, HistoryScreen)

    run_async(scenario())
    # The label typed in the form is the label of the run it started, as `gpuscale run --label` records it:
    # the history's (`gpuscale runs`, an id's stand-in) and the run folder's.
    run = store.find_run("first try")
    assert run["id"] == 2 and run["status"] == "succeeded", run["error"]
    assert run["label"] == "first try" and RunDir(run["run_dir"]).read_info()["label"] == "first try"
