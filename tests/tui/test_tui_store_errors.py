"""The TUI on a history it cannot write or cannot read says so in one line, as the CLI does,
and keeps running; a read-only history is still shown."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from file_modes import as_file_modes_apply, set_modes, write_history
from gpuscale.app.screens.history import HistoryScreen
from gpuscale.control.store import Store
from tui_helpers import app_recording_notifications, run_async, settle, wait_for

SIZE = (120, 40)


def test_a_damaged_history_is_one_line_in_the_tui_and_the_app_goes_on(home):
    store = Store(home)
    store.create_run("probe", {}, [], "h")
    store.close()
    with open(home / "runs.db", "r+b") as handle:
        handle.write(b"\0garbage" * 16)
    line = (f"{home / 'runs.db'}: the run history is damaged (file is not a database); move it aside "
            "(`gpuscale doctor --repair` does, keeping the run folders) and gpuscale starts a new one")

    async def scenario():
        app, shown = app_recording_notifications(home)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            await wait_for(pilot, lambda: line in shown, 10, "the start-up's line")
            await pilot.press("f4")
            await settle(pilot)
            await wait_for(pilot, lambda: f"cannot read the history: {line}" in shown, 10, "the history's line")
            assert isinstance(app.screen, HistoryScreen) and app.is_running

    run_async(scenario())


# The app in a fresh interpreter, where file modes bind it (tests/file_modes.py).
READ_ONLY_SCENARIO = """
    import asyncio, json, sys
    from gpuscale.app.tui import GpuscaleApp
    from gpuscale.recipes.shared.registry import get_recipe
    from textual.worker import WorkerCancelled

    async def settled(app):
        # An exclusive worker that a newer one replaced ends cancelled (on a busy machine the
        # start-up's can be): wait for the newer one instead.
        while True:
            try:
                return await app.workers.wait_for_complete()
            except WorkerCancelled:
                continue

    async def main():
        app = GpuscaleApp(home=sys.argv[1], recipes={"probe": get_recipe("probe")}, list_gpus=lambda: [],
                          cursor_blink=False)
        shown = []
        notify = app.notify
        app.notify = lambda message, **options: (shown.append(message), notify(message, **options))[1]
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause(0.5)
            await settled(app)
            await pilot.press("f4")
            for _ in range(40):
                await pilot.pause(0.25)
                table = app.screen.query("#runs-table")
                if table and table.first().row_count:
                    break
            table = app.screen.query_one("#runs-table")
            rows = [str(table.get_row_at(i)[0]) for i in range(table.row_count)]
        print(json.dumps({"rows": rows, "notifications": shown}))

    asyncio.run(main())
"""


def test_a_read_only_history_is_shown(home, tmp_path):
    prefix = as_file_modes_apply(tmp_path)
    run_id = write_history(home)
    set_modes(home, 0o555)
    try:
        result = subprocess.run([*prefix, sys.executable, "-c", textwrap.dedent(READ_ONLY_SCENARIO), str(home)],
                                capture_output=True, text=True, timeout=120)
    finally:
        set_modes(home, 0o755)
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout.strip().splitlines()[-1])
    assert shown["rows"] == [str(run_id)]
    assert not [message for message in shown["notifications"] if "cannot" in message or "error" in message]
