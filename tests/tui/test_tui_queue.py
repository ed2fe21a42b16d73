"""A run waiting in the queue (`--queue`) shows its place in the TUI's history, as in `gpuscale runs`."""

from __future__ import annotations

import json

from gpuscale.control.store import Store
from gpuscale.runs.run_dir import RunDir
from tui_helpers import history_screen, run_async, wait_for


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
