"""A run waiting in the queue (`--queue`) shows its place in the TUI's history, as in `gpuscale runs`."""

from __future__ import annotations

import json
import socket

import pytest
from test_tui_pilot import choose_recipe, fill_form, monitor_of

from gpuscale.app.tui import GpuscaleApp
from gpuscale.control import launch
from gpuscale.control.store import Store
from gpuscale.runs.run_dir import RunDir
from gpuscale.runs.statuses import LIVE_STATUSES
from tui_helpers import history_screen, run_async, settle, wait_for


def recorded_run(store: Store, queue: bool, status: str = "queued") -> int:
    """A row and its plan on GPU 0; its supervisor counts as starting (no pid yet), so it stays live."""
    run_id = store.create_run("probe", {"queue": True} if queue else {}, [], "node1")
    folder = RunDir(store.get_run(run_id)["run_dir"]).make()
    folder.plan.write_text(json.dumps({"nproc": 1, "gpu_indices": [0]}))
    if status != "queued":
        store.update_run(run_id, status=status)
    return run_id


def test_the_history_shows_a_queued_runs_place(home):
    store = Store(home)
    running = recorded_run(store, queue=False, status="running")
    first, second = recorded_run(store, queue=True), recorded_run(store, queue=True)

    async def scenario():
        async with history_screen(home, (120, 40)) as (app, pilot):
            table = app.screen.query_one("#runs-table")

            def statuses() -> dict[int, str]:
                return {int(str(table.get_row_at(i)[0]).lstrip("*")): str(table.get_row_at(i)[2])
                        for i in range(table.row_count)}

            await wait_for(pilot, lambda: statuses() == {running: "running", first: "queued #1",
                                                         second: "queued #2"}, 20, "the queue's places")

    run_async(scenario())


@pytest.mark.e2e  # a real supervisor (it waits: no rank starts)
def test_f6_launches_queued_and_the_monitor_shows_the_place(home, monkeypatch):
    """F6 on the launch form is `gpuscale run --queue`: a run recorded as holding the one CPU slot keeps
    the launched run waiting; the monitor says where it is in the queue, and stopping it ends it."""
    monkeypatch.setenv("GPUSCALE_QUEUE_CPU_SLOTS", "1")
    store = Store(home)
    holder = store.create_run("probe", {}, [], socket.gethostname())  # its front end still starting it
    RunDir(store.get_run(holder)["run_dir"]).make().plan.write_text(json.dumps({"nproc": 1, "gpu_indices": []}))

    async def scenario():
        app = GpuscaleApp(cursor_blink=False, poll_s=0.5)
        async with app.run_test(size=(120, 40)) as pilot:
            await settle(pilot)
            await pilot.press("f2")  # the app opened on the monitor: a run is live
            await wait_for(pilot, lambda: app.current_mode == "launch" and app.screen.recipe, 30, "the launch form")
            await choose_recipe(pilot, "probe")
            await fill_form(pilot, gpus=1, batch_size=2, steps=4, prompt_tokens=8)
            await pilot.press("f6")
            run_id = (await wait_for(pilot, lambda: [r for r in store.list_runs() if r["id"] != holder], 30,
                                     "the run row"))[0]["id"]
            await wait_for(pilot, lambda: app.current_mode == "monitor" and monitor_of(app, run_id), 30, "the monitor")
            monitor = monitor_of(app, run_id)
            await wait_for(pilot, lambda: "queued #1" in str(monitor.query_one(".monitor-status").render()), 30,
                           "the queue's place in the monitor")
            return run_id

    run_id = run_async(scenario())
    assert store.get_run(run_id)["settings"]["queue"] is True and store.get_run(run_id)["status"] == "queued"
    assert launch.stop_run(store, run_id)["status"] == "stopped"
    assert store.get_run(holder)["status"] in LIVE_STATUSES
    store.finish_run(holder, "stopped")
