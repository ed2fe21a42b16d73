"""History actions on the fixed history: filter, open a failed run, export, delete; and the
monitor's keys that need no real run (window, figure, log source)."""

from __future__ import annotations

import asyncio
import json

from gpuscale.app.screens.history import HistoryScreen
from gpuscale.app.screens.run_detail import RunDetailScreen
from gpuscale.app.views.feed import DeviceView
from gpuscale.app.widgets.run_monitor import BAR_STEPS, DeviceRow, RunMonitor
from gpuscale.control.store import Store
from tui_helpers import frozen_app, frozen_home, frozen_template, history_screen, run_async, settle, wait_for  # noqa: F401


def shown_ids(history: HistoryScreen) -> list[int]:
    table = history.query_one("#runs-table")
    return [int(str(table.get_row_at(i)[0]).lstrip("*")) for i in range(table.row_count)]


async def pick(pilot, select_id: str, label: str) -> None:
    """Choose `label` in a Select with the keyboard: focus, open, type-ahead is not there, so walk."""
    select = pilot.app.screen.query_one(select_id)
    select.focus()
    await pilot.press("enter")
    await settle(pilot)
    for _ in range(10):
        overlay = select.query_one("SelectOverlay")
        if str(overlay.get_option_at_index(overlay.highlighted).prompt) == label:
            break
        await pilot.press("down")
    await pilot.press("enter")
    await settle(pilot)


def test_filter_by_status_and_recipe(frozen_home):
    home, ids = frozen_home

    async def scenario():
        async with history_screen(home, (120, 40)) as (app, pilot):
            history = app.screen
            assert shown_ids(history) == [5, 4, 3, 2, 1]
            await pick(pilot, "#status-filter", "failed")
            await wait_for(pilot, lambda: shown_ids(history) == [ids["failed"]], 10, "only the failed run")
            await pick(pilot, "#status-filter", "all")  # the blank choice
            await pick(pilot, "#recipe-filter", "probe")
            await wait_for(pilot, lambda: shown_ids(history) == [5, 4, 3, 2, 1], 10, "all probe runs")

    run_async(scenario())


def test_failed_run_shows_its_error_and_hint(frozen_home):
    home, ids = frozen_home

    async def scenario():
        app = frozen_app(home)
        async with app.run_test(size=(120, 40)) as pilot:
            await settle(pilot)
            await pilot.press("f4", "down", "down", "down", "enter")  # 5, 4, 3, then 2: the failed one
            await settle(pilot)
            assert isinstance(app.screen, RunDetailScreen) and app.screen.run_id == ids["failed"]
            heading = str(app.screen.query_one("#detail-heading").render())
            assert "torch.OutOfMemoryError" in heading and "lower batch_size (now 4096; try 2048)" in heading
            await pilot.press("escape")
            await settle(pilot)
            assert isinstance(app.screen, HistoryScreen)

    run_async(scenario())


def test_export_then_delete(frozen_home, tmp_path, monkeypatch):
    home, ids = frozen_home
    monkeypatch.chdir(tmp_path)  # not where the export goes: GPUSCALE_HOME/exports

    async def scenario():
        app = frozen_app(home)
        async with app.run_test(size=(120, 40)) as pilot:
            await settle(pilot)
            await pilot.press("f4", "down", "down")  # run 3
            await pilot.press("e")
            await settle(pilot)
            await pilot.press("enter")  # the offered json file
            exported_file = home / "exports" / "gpuscale-run-3.json"
            await wait_for(pilot, exported_file.exists, 10, "the export")
            assert not (tmp_path / "gpuscale-run-3.json").exists()
            exported = json.loads(exported_file.read_text())
            assert exported["run"]["id"] == 3 and exported["metrics"] and exported["samples"]

            await pilot.press("d")
            await settle(pilot)
            await pilot.press("y")
            history = app.screen
            await wait_for(pilot, lambda: 3 not in shown_ids(history), 10, "run 3 gone")

            await pilot.press("home", "d")  # run 5 is live: refused, no dialog
            await settle(pilot)
            assert app.screen is history

    run_async(scenario())
    assert [r["id"] for r in Store(home).list_runs()] == [5, 4, 2, 1]


def test_monitor_keys_change_window_figure_and_log(frozen_home):
    home, _ = frozen_home

    async def scenario():
        app = frozen_app(home)
        async with app.run_test(size=(120, 40)) as pilot:
            await settle(pilot)
            assert app.current_mode == "monitor"  # reopening the app shows every live run again
            assert not app._notifications  # its tab names the run: no toast over the log box
            monitor = app.screen.query_one(RunMonitor)
            assert monitor.view.window_text == "last 1:00" and monitor.view.figure_name == "reward"
            assert monitor.view.log_source == "all logs"
            await pilot.press("w", "f", "r")
            await settle(pilot)
            await wait_for(pilot, lambda: monitor.view.window_text == "last 5:00", 10, "a 5 minute window")
            assert monitor.view.figure_name == "loss" and monitor.view.log_source == "rank0"
            assert monitor.query_one(".monitor-log").lines[0].startswith("rank 0/2")

    run_async(scenario())


def test_one_run_opened_twice_at_once_gets_one_tab(frozen_home):
    """The launch screen and the live-run poll may open the same new run at the same moment."""
    home, ids = frozen_home

    async def scenario():
        app = frozen_app(home)
        async with app.run_test(size=(120, 40)) as pilot:
            await settle(pilot)
            screen = app.screen
            await asyncio.gather(screen.open_run(ids["failed"]), screen.open_run(ids["failed"]))
            await settle(pilot)
            opened = [m for m in screen.query(RunMonitor) if m.run_id == ids["failed"]]
            assert len(opened) == 1 and screen.active_monitor() is opened[0]

    run_async(scenario())


def test_a_poll_that_cannot_be_shown_is_reported_and_polling_goes_on(frozen_home, monkeypatch):
    home, _ = frozen_home
    failures, status_after_show = [], []

    def fail_once(self, view):
        if not failures:
            failures.append(view)
            raise ValueError("chart cannot be drawn")
        return show_charts(self, view)

    def recording_show(self, view):
        show(self, view)
        status_after_show.append(str(self.query_one(".monitor-status").render()))

    show_charts, show = RunMonitor._show_charts, RunMonitor._show
    monkeypatch.setattr(RunMonitor, "_show_charts", fail_once)
    monkeypatch.setattr(RunMonitor, "_show", recording_show)

    async def scenario():
        app = frozen_app(home, poll_s=0.2)
        async with app.run_test(size=(120, 40)) as pilot:
            # Polls go on after the failed one: the timer, not just a key or a new tab, brings them.
            await wait_for(pilot, lambda: len(status_after_show) >= 6, 20, "six polls shown")
            failed = next(i for i, text in enumerate(status_after_show) if "cannot show run" in text)
            assert "chart cannot be drawn" in status_after_show[failed]
            later = status_after_show[failed + 1:]
            assert all("running ·" in text for text in later), later

    run_async(scenario())


def test_a_device_row_updated_before_it_mounted_shows_the_newer_view():
    """A poll can reach a GPU row mounted by the poll before it while the row is still being composed
    (seen on a loaded machine: "cannot show run 5: AttributeError('DeviceRow' object has no attribute
    '_bar')"); the row then shows the newer figures once it is mounted."""
    from textual.app import App

    def gpu(used_mb: float) -> DeviceView:
        values = {"mem_used_mb": used_mb, "mem_total_mb": 81_559.0, "util": 90.0, "power_w": 300.0,
                  "temp_c": 60.0, "run_mem_mb": used_mb}
        return DeviceView(key="gpu0", kind="gpu", label="GPU 0", values=values, util_series=(90.0,),
                          mem_series=(used_mb,))

    async def scenario():
        app = App()
        async with app.run_test(size=(120, 10)) as pilot:
            row = DeviceRow(gpu(1_024.0))
            app.screen.mount(row)
            row.show(gpu(40_960.0))  # in the same turn as the mount: not composed yet
            await settle(pilot)
            assert str(row.query_one(".device-mem").render()) == gpu(40_960.0).mem_text
            assert row.query_one(".device-bar").progress == round(BAR_STEPS * 40_960.0 / 81_559.0)

    run_async(scenario())


def ended_sft_runs(home, runs: list[tuple[str, dict]]) -> list[int]:
    """Succeeded sft runs in the history, one per (dataset, summary); their ids."""
    from tui_helpers import FROZEN_NOW

    store = Store(home)
    ids = []
    for dataset, summary in runs:
        run_id = store.create_run("sft", {"dataset": dataset, "seed": 0}, [], "h")
        store.update_run(run_id, status="succeeded", started_at=FROZEN_NOW - 100, ended_at=FROZEN_NOW, summary=summary)
        ids.append(run_id)
    store.close()
    return ids


async def open_compare(app, pilot, ids: list[int], shown: str) -> None:
    """The compare screen of runs `ids`, once `shown` is on it."""
    from gpuscale.app.screens.compare import CompareScreen
    from tui_helpers import screen_text

    await settle(pilot)
    app.open_compare(*ids)
    await settle(pilot)
    assert isinstance(app.screen, CompareScreen)
    await wait_for(pilot, lambda: shown in screen_text(app), 10, "the figures", explain=lambda: screen_text(app))


def test_compare_at_80_columns_cuts_long_values_and_shows_one_sided_figures(home):
    """Two runs over different domains: each one's per-domain accuracy is shown, `—` on the side
    without it; a dataset path longer than its column ends in `…` rather than off the screen."""
    from tui_helpers import screen_text

    long_path = "/data/" + "a-very-long-folder-name/" * 4 + "questions.jsonl"
    runs = (("algebra", long_path, 0.41), ("geometry", "tiny-math", 0.52))
    ids = ended_sft_runs(home, [(dataset, {"accuracy_greedy_after": accuracy,
                                           f"accuracy_greedy_{domain}_after": accuracy})
                                for domain, dataset, accuracy in runs])

    async def scenario():
        app = frozen_app(home)
        async with app.run_test(size=(80, 24)) as pilot:
            await open_compare(app, pilot, ids, "accuracy_greedy_geometry_after")
            lines = screen_text(app).splitlines()
            assert all(len(line.rstrip()) <= 80 for line in lines)
            algebra = next(line for line in lines if "accuracy_greedy_algebra_after" in line).split()
            geometry = next(line for line in lines if "accuracy_greedy_geometry_after" in line).split()
            assert algebra[1:] == ["0.41", "—", "—"] and geometry[1:] == ["—", "0.52", "—"]
            dataset = next(line for line in lines if line.split()[:1] == ["dataset"])
            assert "/data/a-very-long" in dataset and "…" in dataset and "tiny-math" in dataset

    run_async(scenario())


def test_compare_refits_its_tables_when_the_terminal_narrows_from_side_by_side_to_stacked(home):
    """At 120 columns the two tables sit side by side and cut the long figure names; at 80 they are
    stacked, each as wide as the screen, and the names are whole again (the tables resized, the
    screen's breakpoint changed the layout)."""
    from tui_helpers import screen_text

    long_name = "a_much_longer_figure_name_than_fits"
    ids = ended_sft_runs(home, [("tiny-math", {"accuracy_greedy_after": accuracy, long_name: 1.0})
                                for accuracy in (0.41, 0.52)])

    async def scenario():
        app = frozen_app(home)
        async with app.run_test(size=(120, 24)) as pilot:
            await open_compare(app, pilot, ids, "0.52")
            assert long_name not in screen_text(app)  # cut beside the settings
            await pilot.resize_terminal(80, 40)
            await wait_for(pilot, lambda: long_name in screen_text(app), 10,
                           "the whole names at 80 columns", explain=lambda: screen_text(app))

    run_async(scenario())
