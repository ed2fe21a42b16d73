"""Tuning in the launch form, through the real app driven by Pilot: `batch_size` takes `auto`, the
form shows a stored tuning result for its recipe, model, device, precision and shape, and a launch
with `auto` runs the real probe at the stored batch and records where it came from."""

from __future__ import annotations

import json
import time

import pytest

from gpuscale.app.tui import GpuscaleApp
from gpuscale.control.store import Store
from gpuscale.runs.statuses import LIVE_STATUSES
from tui_helpers import run_async, settle, store, wait_for  # noqa: F401 (store: a fixture)

SIZE = (120, 40)
TUNED_AT = 1_795_000_000.0
TUNED_DAY = time.strftime("%Y-%m-%d", time.localtime(TUNED_AT))


def save_probe_tuning(store: Store, batch_size: int, prompt_tokens: int) -> None:
    """A result as `gpuscale tune` stores it on this CPU machine (device "cpu", precision auto = fp32)."""
    key = {"recipe": "probe", "model": "tiny-math", "device": "cpu", "precision": "fp32",
           "shape": json.dumps({"prompt_tokens": prompt_tokens})}
    store.save_tuning(key, batch_size=batch_size, throughput=27.2, figure="tokens_per_s",
                      peak_memory_bytes=210_000_000, trials=[], created_at=TUNED_AT)


async def type_setting(pilot, name: str, text: str) -> None:
    pilot.app.screen.query_one(f"#field-{name}").focus()
    await pilot.press("ctrl+u", *text)


async def probe_form(pilot, **settings) -> None:
    """The probe's form, the first recipe in the list, with `settings` typed in."""
    await settle(pilot)
    recipes = pilot.app.screen.query_one("#recipes")
    recipes.highlighted = [option.id for option in recipes.options].index("probe")
    await settle(pilot)
    for name, value in settings.items():
        await type_setting(pilot, name, str(value))
    await settle(pilot)


def shown(app, selector: str) -> str:
    return str(app.screen.query_one(selector).render())


@pytest.mark.e2e
def test_auto_launches_at_the_stored_batch_and_the_form_shows_it(home, store):
    save_probe_tuning(store, batch_size=3, prompt_tokens=4)

    async def scenario():
        app = GpuscaleApp(cursor_blink=False, list_gpus=lambda: [])
        async with app.run_test(size=SIZE) as pilot:
            await probe_form(pilot, gpus=1, steps=2, prompt_tokens=16, batch_size="auto")
            # Another shape: nothing stored for it; on CPU, auto is the CPU default.
            await wait_for(pilot, lambda: "nothing tuned" in shown(app, "#tuning-line"), 10, "the no-result line")
            assert "the CPU default (8)" in shown(app, "#tuning-line")
            assert "batch_size" not in app.screen.query_one("SettingsForm").errors()  # auto is no error
            assert not app.screen.query("#error-batch_size") or shown(app, "#error-batch_size") == ""

            await type_setting(pilot, "prompt_tokens", "4")
            await settle(pilot)
            line = await wait_for(pilot, lambda: "tuned batch" in shown(app, "#tuning-line")
                                  and shown(app, "#tuning-line"), 10, "the stored result")
            assert line.startswith("tuned batch 3: 27.2 tokens_per_s, 0.21 GB")
            assert f"on cpu fp32, {TUNED_DAY}" in line
            assert "--batch-size auto" in shown(app, "#preview")

            await pilot.press("ctrl+r")
            run_id = (await wait_for(pilot, store.list_runs, 30, "the run row"))[0]["id"]
            await wait_for(pilot, lambda: store.get_run(run_id)["status"] not in LIVE_STATUSES, 120,
                           "the run to end")

    run_async(scenario())
    [run] = store.list_runs()
    assert run["status"] == "succeeded", run["error"]
    assert run["settings"]["batch_size"] == 3
    assert run["settings"]["batch_size_source"] == f"stored (tuned {TUNED_DAY})"
    assert run["summary"]["world_size"] == 1


def test_a_stored_result_is_shown_for_a_number_too_and_bad_values_are_named(home, store):
    save_probe_tuning(store, batch_size=5, prompt_tokens=4)

    async def scenario():
        app = GpuscaleApp(cursor_blink=False, list_gpus=lambda: [])
        async with app.run_test(size=SIZE) as pilot:
            await probe_form(pilot, gpus=1, prompt_tokens=4, batch_size=2)
            line = await wait_for(pilot, lambda: "tuned batch" in shown(app, "#tuning-line")
                                  and shown(app, "#tuning-line"), 10, "the stored result")
            assert line.startswith("tuned batch 5: ") and line.endswith("batch_size auto uses it")

            for bad, reason in (("lots", "valid integer"), ("0", "greater than or equal to 1")):
                await type_setting(pilot, "batch_size", bad)
                await settle(pilot)
                error = shown(app, "#error-batch_size")
                assert error.startswith("✗ batch_size: ") and reason in error
                assert "not ready to launch: batch_size:" in shown(app, "#preview")
                assert not app.screen.query_one("#tuning-line").display

            await type_setting(pilot, "batch_size", "AUTO")
            await settle(pilot)
            assert shown(app, "#error-batch_size") == ""
            await wait_for(pilot, lambda: "tuned batch 5" in shown(app, "#tuning-line"), 10, "the result again")
            assert "--batch-size auto" in shown(app, "#preview")

    run_async(scenario())
    assert store.list_runs() == []
