"""Snapshots of every screen at 80x24 and 120x40, from a fixed history with a frozen clock.

Regenerate after an intended change with `pytest tests/tui --snapshot-update`, then look at the
SVGs under __snapshots__/ (a browser shows them) before checking them in.
"""

from __future__ import annotations

import pytest

from tui_helpers import SNAPSHOT_SIZES, frozen_app, frozen_home, frozen_template, settle, settle_screen, snap_compare  # noqa: F401 (fixtures)

sizes = pytest.mark.parametrize("size", SNAPSHOT_SIZES, ids=lambda s: f"{s[0]}x{s[1]}")


def snapshot_of(keys: tuple[str, ...] = (), focus: str | None = None, typed: tuple[str, ...] = ()):
    """A run_before that lets the app find the live run, presses `keys`, focuses the widget `focus`
    and types `typed` there, then waits for the screen to settle."""

    async def run_before(pilot) -> None:
        await settle(pilot)
        for key in keys:
            await pilot.press(key)
            await settle(pilot)
        if focus:
            pilot.app.screen.query_one(focus).focus()
            await pilot.press(*typed)
            await settle(pilot)
        pilot.app.clear_notifications()  # toasts time out: not part of a stable picture
        await settle_screen(pilot)

    return run_before


@sizes
def test_launch_screen(frozen_home, snap_compare, size):
    home, _ = frozen_home
    assert snap_compare(frozen_app(home), terminal_size=size, run_before=snapshot_of(("f2",)))


def test_launch_screen_with_an_inline_error(frozen_home, snap_compare):
    home, _ = frozen_home
    before = snapshot_of(("f2",), focus="#field-batch_size", typed=("ctrl+u", "0"))
    assert snap_compare(frozen_app(home), terminal_size=(80, 24), run_before=before)


@sizes
def test_monitor_of_a_live_run_on_eight_gpus(frozen_home, snap_compare, size):
    """The app opens on the monitor (there is a live run) and points out its idle GPUs."""
    home, _ = frozen_home
    assert snap_compare(frozen_app(home), terminal_size=size, run_before=snapshot_of())


def test_monitor_with_no_color(frozen_home, snap_compare, monkeypatch):
    """NO_COLOR: Textual draws in grey only; every bar still has its figures, every state a word."""
    home, _ = frozen_home
    monkeypatch.setenv("NO_COLOR", "1")
    assert snap_compare(frozen_app(home), terminal_size=(80, 24), run_before=snapshot_of())


def test_launch_form_with_no_color(frozen_home, snap_compare, monkeypatch):
    home, _ = frozen_home
    monkeypatch.setenv("NO_COLOR", "1")
    before = snapshot_of(("f2",), focus="#field-batch_size", typed=("ctrl+u", "0"))
    assert snap_compare(frozen_app(home), terminal_size=(80, 24), run_before=before)


@sizes
def test_history(frozen_home, snap_compare, size):
    home, _ = frozen_home
    assert snap_compare(frozen_app(home), terminal_size=size, run_before=snapshot_of(("f4",)))


@sizes
def test_run_details(frozen_home, snap_compare, size):
    home, _ = frozen_home  # run 3, third row from the top
    assert snap_compare(frozen_app(home), terminal_size=size, run_before=snapshot_of(("f4", "down", "down", "enter")))


@sizes
def test_stored_charts_of_a_finished_run(frozen_home, snap_compare, size):
    home, _ = frozen_home
    keys = ("f4", "down", "down", "enter", "2")
    assert snap_compare(frozen_app(home), terminal_size=size, run_before=snapshot_of(keys))


@sizes
def test_compare_two_runs(frozen_home, snap_compare, size):
    home, _ = frozen_home  # run 3 against run 1
    keys = ("f4", "down", "down", "c", "down", "down", "c")
    assert snap_compare(frozen_app(home), terminal_size=size, run_before=snapshot_of(keys))


def test_launch_screen_with_a_long_command(frozen_home, snap_compare):
    """80x24 with several settings changed: the command box shows the whole shell command, wrapped."""
    home, _ = frozen_home

    async def run_before(pilot) -> None:
        await settle(pilot)
        await pilot.press("f2")
        await settle(pilot)
        for name, text in (("batch_size", "64"), ("steps", "1000"), ("prompt_tokens", "128"), ("seed", "7")):
            pilot.app.screen.query_one(f"#field-{name}").focus()
            await pilot.press("ctrl+u", *text)
        pilot.app.screen.query_one("#recipes").focus()
        pilot.app.clear_notifications()
        await settle_screen(pilot)

    assert snap_compare(frozen_app(home), terminal_size=(80, 24), run_before=run_before)
