"""What a run generated, in the TUI: the monitor's generations screen (`a`) and the run page's
Generations tab show the run's generations file newest first, filter it by domain (`d`) and correctness
(`c`), and show a completion as the model wrote it (`[/x]`, `[bold]`: never markup) wrapped to the screen."""

from __future__ import annotations

from gpuscale.app.screens.generations import GenerationsScreen
from gpuscale.control.store import Store
from gpuscale.runs.generations import GenerationLog, generation_record
from tui_helpers import FROZEN_NOW, PROBE_SETTINGS, frozen_app, run_async, screen_text, settle, shown_whole, wait_for

MARKUP_LIKE = "so the answer is [/x] [bold]42 and"
LONG_TAIL = " ".join(f"word{i}" for i in range(60)) + " THE-END"


def run_with_generations(home) -> int:
    store = Store(home)
    run_id = store.create_run("grpo-mtl", PROBE_SETTINGS, [], "node")
    store.update_run(run_id, status="succeeded", started_at=FROZEN_NOW - 99, ended_at=FROZEN_NOW - 10, exit_code=0)
    log = GenerationLog(store.get_run(run_id)["run_dir"])
    store.close()
    log.add(1, [generation_record(1, "old question", "old answer", domain="count", correct=False,
                                  rewards={"correctness": 0.0})])
    log.add(2, [generation_record(2, "q add", "#### 5", domain="add", correct=True, rewards={"correctness": 1.0},
                                  advantage=0.5),
                generation_record(2, "q count [b]", f"{MARKUP_LIKE} {LONG_TAIL}", domain="count", correct=False,
                                  rewards={"correctness": 0.0}, advantage=-0.5, truncated=True)])
    return run_id


def headings(app) -> list[str]:
    return [line.strip() for line in screen_text(app).splitlines() if line.strip().startswith("step ")]


def test_the_generations_are_shown_newest_first_filtered_literal_and_wrapped(home):
    run_id = run_with_generations(home)

    async def scenario():
        app = frozen_app(home)
        async with app.run_test(size=(80, 40)) as pilot:
            await settle(pilot)
            await app.open_monitor(run_id)
            await settle(pilot)
            await pilot.press("a")
            await wait_for(pilot, lambda: "THE-END" in screen_text(app), 10, "the generations",
                           explain=lambda: screen_text(app))
            assert isinstance(app.screen, GenerationsScreen)
            assert app.screen.sub_title == f"Run {run_id}: generations"
            assert MARKUP_LIKE in screen_text(app) and "q count [b]" in screen_text(app)  # literal
            assert shown_whole(app, LONG_TAIL)  # wrapped over several lines, nothing cut off
            assert [line.split(" · ")[:3] for line in headings(app)] == [
                ["step 2", "count", "incorrect"], ["step 2", "add", "correct"], ["step 1", "count", "incorrect"]]
            assert shown_whole(app, "advantage -0.5 · hit the length cap")  # the heading wraps too

            await pilot.press("d")  # the first domain: add
            await wait_for(pilot, lambda: shown_whole(app, "domain: add (d)"), 5, "the domain filter")
            assert [line.split(" · ")[1] for line in headings(app)] == ["add"]
            await pilot.press("d", "c", "c")  # count, then incorrect
            await wait_for(pilot, lambda: shown_whole(app, "domain: count (d) · incorrect (c)"), 5, "both filters",
                           explain=lambda: screen_text(app))
            assert [line.split(" · ")[0] for line in headings(app)] == ["step 2", "step 1"]

            await pilot.press("escape")
            app.open_details(run_id)  # the history's run page, its Generations tab
            await settle(pilot)
            await pilot.press("3")
            await wait_for(pilot, lambda: MARKUP_LIKE in screen_text(app), 10, "the run page's generations",
                           explain=lambda: screen_text(app))

    run_async(scenario())
