"""The TUI's history leads a training run's figures with held-out accuracy before -> after."""

from __future__ import annotations

from gpuscale.control.store import Store
from tui_helpers import FROZEN_NOW, history_screen, run_async, wait_for


def test_the_history_shows_accuracy_before_and_after(home):
    store = Store(home)
    run_id = store.create_run("grpo-mtl", {}, [], "node001")
    store.update_run(run_id, started_at=FROZEN_NOW - 600)
    store.finish_run(run_id, "succeeded", ended_at=FROZEN_NOW - 60,
                     summary={"tokens_per_s": 2_783.0, "samples_per_s": 3.5, "accuracy_greedy_before": 0.125,
                              "accuracy_greedy_after": 0.5, "reward_first": 0.05, "reward_last": 0.61})
    store.close()

    async def scenario():
        async with history_screen(home, (120, 40)) as (app, pilot):
            table = app.screen.query_one("#runs-table")
            row = await wait_for(pilot, lambda: table.row_count and table.get_row_at(0), 10, "the run's row")
            return [str(cell) for cell in row]

    row = run_async(scenario())
    assert "accuracy 0.125 -> 0.5, reward 0.05 -> 0.61" in row, row
