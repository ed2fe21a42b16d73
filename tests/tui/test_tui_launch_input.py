"""The TUI's launch form on the data a new user hands it: a file with a line that is not UTF-8, a
question of 10 MB (refused where the CLI refuses them, with file and line, nothing started), and a
dataset typed relative to where the app was started (the run finds it: no CalledProcessError)."""

from __future__ import annotations

import json

import pytest

from gpuscale.app.tui import GpuscaleApp
from gpuscale.app.widgets.run_monitor import RunMonitor
from gpuscale.data.tasks import load_examples
from gpuscale.recipes.shared.registry import get_recipe
from gpuscale.runs.statuses import LIVE_STATUSES
from tui_helpers import run_async, settle, store, wait_for  # noqa: F401 (store: a fixture)

SIZE = (120, 40)


async def fill_form(pilot, **settings) -> None:
    """Each setting's field focused, cleared and typed, as a user would."""
    for name, value in settings.items():
        pilot.app.screen.query_one(f"#field-{name}").focus()
        await pilot.press("ctrl+u", *str(value))
    await settle(pilot)


def monitor_status(app, run_id: int) -> str:
    monitors = [monitor for monitor in app.screen.query(RunMonitor) if monitor.run_id == run_id]
    return str(monitors[0].query_one(".monitor-status").render()) if monitors else ""


def app_with(recipe: str) -> tuple[GpuscaleApp, list[str]]:
    """The app with one recipe and no GPUs, and the list its notifications go to."""
    app = GpuscaleApp(recipes={recipe: get_recipe(recipe)}, list_gpus=lambda: [], cursor_blink=False, poll_s=0.5)
    shown: list[str] = []
    notify = app.notify
    app.notify = lambda message, **options: (shown.append(message), notify(message, **options))[1]
    return app, shown


def problems(path, count: int = 8, extra: dict[int, bytes] | None = None):
    lines = [json.dumps({"question": r["question"], "answer": r["answer"]}).encode()
             for r in load_examples("tiny-math", "test", count)]
    for number, line in (extra or {}).items():
        lines.insert(number - 1, line)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def refusal_shown(data, expected: str, monkeypatch) -> None:
    """The form's dataset typed relative to the app's folder (short to type; made absolute)."""
    monkeypatch.chdir(data.parent)

    async def scenario():
        app, shown = app_with("power-sampling")
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            await fill_form(pilot, dataset=data.name, max_examples=2)
            await pilot.press("ctrl+r")
            await wait_for(pilot, lambda: any(message.startswith("not launched") for message in shown), 60,
                           "the refusal", explain=lambda: f"shown: {shown}")
            assert [m for m in shown if m.startswith("not launched")] == [f"not launched: {expected}"]
            assert app.current_mode == "launch"

    run_async(scenario())


def test_a_line_that_is_not_utf8_is_refused_with_file_and_line(home, store, tmp_path, monkeypatch):
    latin1 = json.dumps({"question": "Combien font 2 + 2 ?", "answer": "#### 4"}).replace("font", "f\u00e9nt")
    data = problems(tmp_path / "latin1.jsonl", 40, extra={31: latin1.encode("latin-1")})
    refusal_shown(data, f"dataset: {data}, line 31: not UTF-8 (byte 0xe9 at byte 24 of the line); "
                        "save the file as UTF-8", monkeypatch)
    assert store.list_runs() == []


def test_a_question_too_long_for_the_model_is_refused_with_file_and_line(home, store, tmp_path, monkeypatch):
    long_line = json.dumps({"question": "x" * 10_000_000, "answer": "#### 1"}).encode()
    data = problems(tmp_path / "bigline.jsonl", extra={2: long_line})
    refusal_shown(data, f"dataset: {data}, line 2: the question is too long for the model: 10,000,000 characters, "
                        "2,051 or more tokens as a prompt, and tiny-math's context is 256 tokens (the prompt and "
                        "its answer must fit); remove the line, or set too_long=skip to leave such questions out",
                  monkeypatch)
    assert store.list_runs() == []


@pytest.mark.e2e
def test_a_relative_dataset_runs_from_the_form(home, store, tmp_path, monkeypatch):
    """sft on accelerate's one process: before, the rank could not find the file from the run
    folder and the run's error was accelerate's CalledProcessError."""
    problems(tmp_path / "data" / "rel.jsonl")
    monkeypatch.chdir(tmp_path)

    async def scenario():
        app, shown = app_with("sft")
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            await fill_form(pilot, eval_examples=0, max_steps=1, max_examples=4, batch_size=2, max_length=64,
                            dataset="data/rel.jsonl")
            await pilot.press("ctrl+r")
            run_id = (await wait_for(pilot, store.list_runs, 30, "the run row", explain=lambda: f"{shown}"))[0]["id"]
            ended = await wait_for(pilot, lambda: store.get_run(run_id)["status"] not in LIVE_STATUSES, 120,
                                   "the run to end")
            assert ended
            run = store.get_run(run_id)
            assert run["status"] == "succeeded", run["error"]
            assert run["settings"]["dataset"] == str(tmp_path / "data" / "rel.jsonl")
            await wait_for(pilot, lambda: "succeeded" in monitor_status(app, run_id), 30, "the monitor's status",
                           explain=lambda: monitor_status(app, run_id))

    run_async(scenario())
