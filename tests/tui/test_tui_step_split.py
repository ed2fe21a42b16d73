"""The monitor shows where each rank's last steps went, a row a rank with the time it waited for the
others, and the advice read from it (a straggler named with its GPU), at 80x24 and at 120x40."""

from __future__ import annotations

import json
import os
from pathlib import Path

import psutil
import pytest

from gpuscale.app.widgets.run_monitor import RunMonitor
from gpuscale.control.store import Store
from gpuscale.runs.run_dir import RunDir
from tui_helpers import FROZEN_NOW, frozen_app, run_async, settle, shown_whole, wait_for

# Rank 1 works 0.6 s a step where rank 0 works 0.3 s and waits 0.3 s for it at the all-reduce.
RECENT = {"0": {"data": 0.02, "forward_backward": 0.26, "wait": 0.3, "optimizer": 0.02},
          "1": {"data": 0.02, "forward_backward": 0.56, "wait": 0.0, "optimizer": 0.02}}


def live_run(home, recent: dict | None) -> int:
    """A live sft run on GPUs 2 and 3 (its supervisor is this test process), its progress holding the
    ranks' recent steps (the supervisor's data/step_phases.py:recent_by_rank)."""
    store = Store(home)
    run_id = store.create_run("sft", {"gpus": "2,3"}, [], "node001")
    run_dir = Path(store.get_run(run_id)["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    RunDir(run_dir).plan.write_text(json.dumps({"gpu_indices": [2, 3], "nproc": 2}))
    progress = {"t": FROZEN_NOW - 1, "step": 12, "total": 100, **({"step_phases": recent} if recent else {})}
    store.update_run(run_id, status="running", started_at=FROZEN_NOW - 60, supervisor_pid=os.getpid(),
                     supervisor_started=psutil.Process().create_time(), progress=progress)
    store.close()
    return run_id


def monitor_of(home, run_id: int, size: tuple[int, int]):
    async def scenario():
        app = frozen_app(home)
        async with app.run_test(size=size) as pilot:
            await settle(pilot)
            monitor = await wait_for(pilot, lambda: next((m for m in app.screen.query(RunMonitor)
                                                          if m.run_id == run_id and m.view), None),
                                     20, "the run's monitor")
            rows = ("GPU 2 rank 0: 0.6 s a step, waited 0.3 s (50%) · forward+backward 43% · optimizer 3% · data 3%",
                    "GPU 3 rank 1: 0.6 s a step · forward+backward 93% · optimizer 3% · data 3%")
            return monitor.view, all(shown_whole(app, row) for row in rows)

    return run_async(scenario())


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
def test_the_monitor_shows_each_rank_s_split_and_names_the_straggler_with_its_gpu(home, size):
    view, shown = monitor_of(home, live_run(home, RECENT), size)
    assert view.split[0] == "where a step goes (each rank's last 3 steps):"
    assert view.split[1].startswith("  GPU 2 rank 0: 0.6 s a step, waited 0.3 s (50%) · forward+backward 43%")
    assert view.split[2].startswith("  GPU 3 rank 1: 0.6 s a step · forward+backward 93%")
    straggler = [w for w in view.warnings if "straggler" in w]
    assert straggler and straggler[0].startswith("rank 1 (GPU 3) is a straggler: it works 0.6 s a step, 33% over")
    assert any(w.startswith("waiting for the other ranks at the all-reduce takes 25%") for w in view.warnings)
    assert shown  # on screen, whole, in either terminal


def test_a_run_without_phases_shows_no_split_and_no_advice(home):
    view, shown = monitor_of(home, live_run(home, None), (120, 40))
    assert view.split == () and not shown and not any("straggler" in w for w in view.warnings)
