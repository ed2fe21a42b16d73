"""A history of 10,000 runs: the History screen reads a page of the newest, shows them, and reads the
next page when the cursor nears the last row; `gpuscale runs --limit` reads only what it prints."""

from __future__ import annotations

from gpuscale.app.screens.history import HistoryScreen
from gpuscale.control.store import Store
from tui_helpers import FROZEN_NOW, history_screen, run_async, wait_for

RUNS = 10_000


def fill_history(home) -> None:
    store = Store(home)
    for i in range(RUNS):
        run_id = store.create_run("probe" if i % 2 else "sft", {"batch_size": i}, [], "h")
        store.update_run(run_id, status="succeeded" if i % 3 else "failed", started_at=FROZEN_NOW - RUNS + i,
                         ended_at=FROZEN_NOW - RUNS + i + 1, summary={"tokens_per_s": 1000.0 + i})
    store.close()


def test_a_long_history_is_read_a_page_at_a_time(home):
    fill_history(home)

    async def scenario():
        async with history_screen(home, (120, 40)) as (app, pilot):
            history = app.screen
            assert isinstance(history, HistoryScreen)
            table = history.query_one("#runs-table")
            await wait_for(pilot, lambda: table.row_count, 10, "the first rows")
            first = table.row_count
            assert first <= 500, f"{first} rows read at first: a page, not the whole history"
            assert str(table.get_row_at(0)[0]) == str(RUNS)  # the newest first
            await pilot.press("ctrl+end")  # to the last row loaded: the next page comes
            await wait_for(pilot, lambda: table.row_count > first, 10, "the next page",
                           explain=lambda: f"{table.row_count} rows")
            loaded = table.row_count
            assert loaded <= 2 * first and str(table.get_row_at(loaded - 1)[0]) == str(RUNS - loaded + 1)

    run_async(scenario())


def test_store_and_cli_read_only_a_page(home):
    from conftest import gpuscale

    fill_history(home)
    store = Store(home)
    page = store.list_runs(status="failed", limit=50)
    assert len(page) == 50 and all(run["status"] == "failed" for run in page)
    assert [run["id"] for run in page] == sorted((run["id"] for run in page), reverse=True)
    result = gpuscale("runs", "--limit", "3")
    assert result.returncode == 0 and len(result.stdout.splitlines()) == 4
