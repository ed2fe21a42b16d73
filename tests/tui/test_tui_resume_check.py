"""The monitor warns while a resumed run goes on when its resume check failed (the optimizer's state not
restored): the ranks' check so far, which the supervisor keeps in the run's progress."""

from __future__ import annotations

import os

import psutil

from gpuscale.app.widgets.run_monitor import RunMonitor
from gpuscale.control.store import Store
from gpuscale.runs.resume_check import ResumeCheck, check_line, optimizer_part
from tui_helpers import FROZEN_NOW, frozen_app, run_async, settle, shown_whole, wait_for


def live_resumed_run(home, optimizer: dict) -> tuple[int, str]:
    """A live sft run resumed from run 1's checkpoint-5 (its supervisor is this test process), its
    check so far in its progress as the supervisor keeps it; returns its id and the check's line."""
    store = Store(home)
    parent = store.create_run("sft", {"gpus": 1}, [], "node001")
    store.update_run(parent, status="failed", started_at=FROZEN_NOW - 600, ended_at=FROZEN_NOW - 300)
    checkpoint = f"/runs/{parent}/checkpoints/checkpoint-5"
    run_id = store.create_run("sft", {"gpus": 1, "resume_from": checkpoint}, [], "node001", parent_id=parent)
    check = ResumeCheck(checkpoint, before=[1.0] * 5, total=8, optimizer=optimizer).record()
    store.update_run(run_id, status="running", started_at=FROZEN_NOW - 60, supervisor_pid=os.getpid(),
                     supervisor_started=psutil.Process().create_time(),
                     progress={"t": FROZEN_NOW - 1, "step": 6, "total": 8, "latest": {"loss": 1.0},
                               "resume_check": check})
    store.close()
    return run_id, check_line(check)


def monitor_warnings(home, optimizer: dict) -> tuple[tuple[str, ...], str, bool]:
    run_id, line = live_resumed_run(home, optimizer)

    async def scenario():
        app = frozen_app(home)
        async with app.run_test(size=(120, 40)) as pilot:
            await settle(pilot)
            monitor = await wait_for(pilot, lambda: next((m for m in app.screen.query(RunMonitor)
                                                          if m.run_id == run_id and m.view), None),
                                     20, "the run's monitor")
            return monitor.view.warnings, line, shown_whole(app, f"! {line}")

    return run_async(scenario())


def test_the_monitor_warns_of_a_resume_that_lost_its_optimizer_state(home):
    warnings, line, on_screen = monitor_warnings(home, optimizer_part("AdamW", True, 38, 0, 0))
    assert line.startswith("resume check: FAILED: Adam state missing (0 of 38 parameters have moments")
    assert warnings[0] == line and on_screen


def test_the_monitor_is_quiet_while_a_resume_check_is_passing(home):
    warnings, line, on_screen = monitor_warnings(home, optimizer_part("AdamW", True, 38, 38, 38))
    assert line.startswith("resume check: pending: ")
    assert not any(w.startswith("resume check") for w in warnings) and not on_screen
