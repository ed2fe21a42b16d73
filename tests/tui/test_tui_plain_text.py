"""Text that a user, a recipe or a model wrote is shown as written, never read as Rich markup:
brackets in a dataset path, a summary, an error or a log line neither crash the app nor vanish."""

from __future__ import annotations

from pathlib import Path

from gpuscale.app.screens.history import HistoryScreen
from gpuscale.app.screens.run_detail import RunDetailScreen
from gpuscale.control.store import Store
from tui_helpers import FROZEN_NOW, PROBE_SETTINGS, frozen_app, run_async, screen_text, settle, wait_for

BRACKETED = ["q[/tmp]x.jsonl", "[bold]x[/]", "[cpu, cpu]", "ünï 🚀 [v1].jsonl"]


def bracketed_run(home: Path) -> int:
    """A finished run whose settings, summary, error, hint and log all hold markup-like text."""
    store = Store(home)
    settings = {**PROBE_SETTINGS, "dataset": BRACKETED[0], "model": BRACKETED[1]}
    run_id = store.create_run("probe", settings, [], "node[1]")
    store.update_run(run_id, status="failed", created_at=FROZEN_NOW - 100, started_at=FROZEN_NOW - 99,
                     ended_at=FROZEN_NOW - 10, exit_code=1, error=f"cannot open {BRACKETED[2]}",
                     hint=f"check {BRACKETED[3]}", summary={"note": BRACKETED[1], "files": BRACKETED[3]})
    logs = Path(store.get_run(run_id)["run_dir"]) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    (logs / "rank0.log").write_text("".join(f"read {text}\n" for text in BRACKETED))
    store.close()
    return run_id


def test_stored_text_is_shown_as_written(home):
    run_id = bracketed_run(home)

    async def scenario():
        app = frozen_app(home)
        async with app.run_test(size=(160, 50), notifications=True) as pilot:
            await settle(pilot)
            await pilot.press("f4")
            await settle(pilot)
            assert isinstance(app.screen, HistoryScreen)
            await pilot.press("enter")
            await settle(pilot)
            assert isinstance(app.screen, RunDetailScreen) and app.screen.run_id == run_id
            shown = screen_text(app)
            for text in ["q[/tmp]x.jsonl", "[bold]x[/]", "cannot open [cpu, cpu]", "check ünï 🚀 [v1].jsonl",
                         "host node[1]"]:
                assert text in shown, f"{text!r} not on the details screen:\n{shown}"
            await pilot.press("2")  # the stored run's charts and its log
            await wait_for(pilot, lambda: "read q[/tmp]x.jsonl" in screen_text(app), 10, "the log lines",
                           explain=lambda: screen_text(app))
            shown = screen_text(app)
            assert "cannot open [cpu, cpu]" in shown
            for text in BRACKETED:
                assert f"read {text}" in shown
            await app.open_monitor(run_id)  # the monitor's tab for the same run
            await wait_for(pilot, lambda: "cannot open [cpu, cpu]" in screen_text(app), 10, "the monitor's error",
                           explain=lambda: screen_text(app))
            # A toast with a user's path in it: the export's, to a folder and file named like markup.
            app._export(run_id, "json", home / "q[v1]" / "[bold]x[/].json")
            await wait_for(pilot, lambda: "q[v1]" in screen_text(app) and "[bold]x[/].json" in screen_text(app), 10,
                           "the export's toast", explain=lambda: screen_text(app))
            assert (home / "q[v1]" / "[bold]x[/].json").is_file()

    run_async(scenario())


def test_textuals_own_ctrl_c_hint_is_styled_not_shown_as_tags(home):
    """Ctrl+C does not quit (q and Ctrl+Q do): Textual says so in a toast whose text is its own markup,
    "Press [b]ctrl+q[/b] to quit the app". It reads with ctrl+q in bold, no tags."""

    async def scenario():
        app = frozen_app(home)
        async with app.run_test(size=(120, 40), notifications=True) as pilot:
            await settle(pilot)
            await pilot.press("ctrl+c")
            await wait_for(pilot, lambda: "to quit the app" in screen_text(app), 5, "the hint",
                           explain=lambda: screen_text(app))
            assert "Press ctrl+q to quit the app" in screen_text(app) and "[b]" not in screen_text(app)
            strips = app.screen._compositor.render_strips()
            bold = [segment.text for strip in strips for segment in strip
                    if "ctrl+q" in segment.text and segment.style and segment.style.bold]
            assert bold, "ctrl+q is not in bold"

    run_async(scenario())
