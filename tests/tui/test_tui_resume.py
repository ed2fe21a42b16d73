"""The history's R: resume the run under the cursor (launch.resume_run, as `gpuscale resume`); a run
with no checkpoint is refused in a toast, one with a checkpoint starts a new run naming it."""

from __future__ import annotations

import json

import pytest

from gpuscale.app.screens.dialogs import ConfirmDialog
from gpuscale.app.screens.run_detail import RunDetailScreen
from gpuscale.control.store import Store
from gpuscale.recipes.shared.registry import get_recipe
from gpuscale.runs.run_dir import RunDir
from gpuscale.runs.statuses import LIVE_STATUSES
from tui_helpers import app_recording_notifications, run_async, settle, wait_for

SIZE = (120, 40)



def failed_probe_run(home, with_checkpoint: bool) -> int:
    """A failed probe run in the history, with its settings file, and a checkpoint folder if asked."""
    store = Store(home)
    settings = get_recipe("probe").settings_cls.model_validate(
        {"steps": 2, "prompt_tokens": 8, "batch_size": 2, "gpus": 1})
    run_id = store.create_run("probe", settings.model_dump(), [], "h")
    folder = RunDir(store.get_run(run_id)["run_dir"]).make()
    folder.settings.write_text(settings.model_dump_json())
    if with_checkpoint:
        folder.checkpoint(2).mkdir(parents=True)
        (folder.checkpoint(2) / "checkpoint.json").write_text(json.dumps({"step": 2}))
    store.finish_run(run_id, "failed", error="rank 0: RuntimeError: boom")
    store.close()
    return run_id


@pytest.mark.e2e
def test_r_refuses_a_run_without_checkpoint_and_resumes_one_with_a_checkpoint(home):
    bare = failed_probe_run(home, with_checkpoint=False)
    saved = failed_probe_run(home, with_checkpoint=True)
    app, shown = app_recording_notifications(home)

    async def scenario():
        async with app.run_test(size=SIZE, notifications=True) as pilot:
            await pilot.press("f4")
            await settle(pilot)
            history = app.screen
            await wait_for(pilot, lambda: history.current_run_id() == saved, 10, "the newest run under the cursor")
            await pilot.press("down")
            assert history.current_run_id() == bare
            await pilot.press("R")
            await wait_for(pilot, lambda: any("has no checkpoint" in m for m in shown), 10, "the refusal toast")
            assert f"not resumed: run {bare} has no checkpoint to resume from (it saved none: it stopped before " \
                   "step 50, or its recipe writes no checkpoints)" in shown
            await pilot.press("up")
            await pilot.press("R")
            await wait_for(pilot, lambda: app.current_mode == "monitor", 20, "the new run's monitor")
            store = Store(home)
            child = store.list_runs(limit=1)[0]
            assert child["parent_id"] == saved and child["id"] not in (bare, saved)
            assert child["settings"]["resume_from"] == str(RunDir(store.get_run(saved)["run_dir"]).checkpoint(2))
            await wait_for(pilot, lambda: Store(home).get_run(child["id"])["status"] not in LIVE_STATUSES,
                           120, "the resumed run's end")

            # Resumed once already: R asks first (the CLI's --force); n starts nothing.
            await pilot.press("f4")
            await wait_for(pilot, lambda: app.screen.current_run_id() is not None, 10, "the history")
            while app.screen.current_run_id() != saved:
                await pilot.press("down")
            await pilot.press("R")
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog), 10, "the question")
            assert app.screen.question == (f"Run {saved} was already resumed by run {child['id']} (succeeded). "
                                           f"Resume run {saved} again from the same point?")
            await pilot.press("n")
            await settle(pilot)
            assert [run["id"] for run in Store(home).children(saved)] == [child["id"]]

            # The parent's page lists the run that continued it.
            await pilot.press("enter")
            await wait_for(pilot, lambda: isinstance(app.screen, RunDetailScreen), 10, "the run's page")
            await wait_for(pilot, lambda: f"continued by: run {child['id']} (succeeded)"
                           in str(app.screen.query_one("#detail-heading").render()), 10, "the children line")
            # y resumes it again, as a second child.
            await pilot.press("escape")
            await wait_for(pilot, lambda: app.screen.current_run_id() == saved, 10, "back on the history")
            await pilot.press("R")
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog), 10, "the question again")
            await pilot.press("y")
            await wait_for(pilot, lambda: len(Store(home).children(saved)) == 2, 20, "a second child")
            await wait_for(pilot, lambda: Store(home).children(saved)[1]["status"] not in LIVE_STATUSES,
                           120, "the second child's end")

    run_async(scenario())
