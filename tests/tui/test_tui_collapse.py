"""The monitor warns of a collapsed GRPO run where it warns of waste, from the run's stored metrics."""

from __future__ import annotations

import os

import psutil

from gpuscale.app.widgets.run_monitor import RunMonitor
from gpuscale.control.store import Store
from tui_helpers import FROZEN_NOW, frozen_app, run_async, settle, shown_whole, wait_for


def live_grpo_run(home, collapsed: bool) -> int:
    """A live grpo-mtl run (its supervisor is this test process) with 30 logged steps; the last 8
    at reward 0 and every completion at the 256-token cap if `collapsed`, the trainer's log-probs then
    0.08 nats from the sampler's (policy mismatch; 0.01 before)."""
    store = Store(home)
    run_id = store.create_run("grpo-mtl", {"max_completion_length": 256, "gpus": 1}, [], "node001")
    store.update_run(run_id, status="running", started_at=FROZEN_NOW - 60, supervisor_pid=os.getpid(),
                     supervisor_started=psutil.Process().create_time(),
                     progress={"t": FROZEN_NOW - 1, "step": 30, "total": 200, "latest": {"reward": 0.0}})
    rows = []
    for step in range(1, 31):
        bad = collapsed and step > 22
        figures = {"reward": 0.0 if bad else 0.4, "completions_clipped_ratio": 1.0 if bad else 0.05,
                   "completions_mean_length": 256.0 if bad else 90.0, "entropy": 0.5,
                   "sampling_sampling_logp_difference_mean": 0.08 if bad else 0.01}
        rows += [{"run_id": run_id, "rank": 0, "t": FROZEN_NOW - 31 + step, "step": step, "name": name,
                  "value": value} for name, value in figures.items()]
    store.add_rows(rows, [])
    store.close()
    return run_id


WARNING = ("! collapse: reward 0.00 and 100% of completions at the 256-token cap over the last 5 steps "
           "— lower learning_rate, check precision")
MISMATCH = ("! policy mismatch: the trainer's log-probs of the sampled tokens are 0.080 nats from the sampler's "
            "(over 0.05) over the last 3 steps — the loss trains on another policy's completions; compare a run "
            "with --precision fp32")


def monitor_warnings(home, collapsed: bool) -> tuple[tuple[str, ...], bool]:
    run_id = live_grpo_run(home, collapsed)

    async def scenario():
        app = frozen_app(home)
        async with app.run_test(size=(120, 40)) as pilot:
            await settle(pilot)
            monitor = await wait_for(pilot, lambda: next((m for m in app.screen.query(RunMonitor)
                                                          if m.run_id == run_id and m.view), None),
                                     20, "the run's monitor")
            return monitor.view.warnings, shown_whole(app, WARNING) and shown_whole(app, MISMATCH)

    return run_async(scenario())


def test_the_monitor_warns_of_a_collapse(home):
    warnings, on_screen = monitor_warnings(home, collapsed=True)
    assert warnings[0] == WARNING.removeprefix("! ") and MISMATCH.removeprefix("! ") in warnings
    assert on_screen


def test_the_monitor_is_quiet_about_a_healthy_run(home):
    warnings, on_screen = monitor_warnings(home, collapsed=False)
    assert not any("collapse" in w or "mismatch" in w for w in warnings) and not on_screen
