"""The monitor of a finished run gives its summary's tokens/s (the figure `gpuscale show` gives), not
the supervisor's average over the whole run; a live run's rates are labelled as the last seconds'."""

from __future__ import annotations

from gpuscale.app.widgets.run_monitor import RunMonitor
from gpuscale.control.store import Store
from tui_helpers import FROZEN_NOW, frozen_app, run_async, settle, wait_for


def test_a_finished_runs_monitor_shows_the_summarys_rate(home):
    store = Store(home)
    run_id = store.create_run("probe", {"gpus": 2}, [], "node001")
    store.update_run(run_id, started_at=FROZEN_NOW - 120)
    store.finish_run(run_id, "succeeded", ended_at=FROZEN_NOW - 60,
                     summary={"tokens_per_s": 2_783.0, "tokens_per_s_per_rank": [1_391.6, 1_391.4]},
                     progress={"t": FROZEN_NOW - 60, "step": 32, "total": 32, "tokens_per_s": 1_828.0,
                               "samples_per_s": 0.0, "tokens_per_s_by_rank": {"0": 914.0, "1": 914.0}})
    store.close()

    async def scenario():
        app = frozen_app(home)
        async with app.run_test(size=(120, 40)) as pilot:
            await settle(pilot)
            await app.open_monitor(run_id)
            monitor = await wait_for(pilot, lambda: next((m for m in app.screen.query(RunMonitor)
                                                          if m.run_id == run_id and m.view), None),
                                     20, "the run's monitor")
            await settle(pilot)
            return (str(monitor.query_one(".monitor-throughput").render()),
                    str(monitor.query_one(".monitor-per-rank").render()))

    throughput, per_rank = run_async(scenario())
    assert throughput == "tokens/s 2,783"
    assert per_rank == "tokens/s per rank: 1,392 1,391"
