"""Opening a live run's monitor as the app starts (a script driving the app, a user quick off the mark):
the app's own start-up switches to the monitor at the same time, as there is a live run; the monitor
screen's tabs are mounted a refresh after the switch, and the run's tab must wait for them rather than
fail (`NoMatches` in TabbedContent.add_pane, seen about one start in three by bench/phases_view.py)."""

from __future__ import annotations

import os

import psutil

from gpuscale.app.widgets.run_monitor import RunMonitor
from gpuscale.control.store import Store
from tui_helpers import FROZEN_NOW, frozen_app, run_async, wait_for

# The race was lost about one start in three: several starts make a regression show.
STARTS = 8


def test_a_runs_monitor_opened_as_the_app_starts_shows_the_run(home):
    store = Store(home)
    run_id = store.create_run("probe", {"gpus": 1}, [], "node001")
    # Live: its supervisor is this test process, so the app's `reconcile` keeps it so.
    store.update_run(run_id, status="running", started_at=FROZEN_NOW - 60, supervisor_pid=os.getpid(),
                     supervisor_started=psutil.Process().create_time())
    store.close()

    async def start_and_open() -> int:
        app = frozen_app(home)
        async with app.run_test(size=(120, 40)) as pilot:
            await app.open_monitor(run_id)  # no pause: before the monitor screen's tabs are mounted
            monitor = await wait_for(pilot, lambda: next(iter(app.screen.query(RunMonitor)), None), 20,
                                     "the run's monitor")
            return monitor.run_id

    for _ in range(STARTS):
        assert run_async(start_and_open()) == run_id
