"""The app in a real terminal (tmux): keys in, screen text out. It launches a run and quits cleanly."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time

import pytest

from gpuscale.control import launch
from gpuscale.control.store import Store

pytestmark = [pytest.mark.e2e,  # the test launches a real run
              pytest.mark.skipif(shutil.which("tmux") is None,
                                 reason="tmux is not installed (apt-get install tmux; CI installs it)")]


class Tmux:
    """One tmux server of our own (its own socket), so nothing of the user's is touched."""

    def __init__(self, name: str):
        self.base = ["tmux", "-L", name]

    def run(self, *args: str) -> str:
        return subprocess.run(self.base + list(args), capture_output=True, text=True, check=True).stdout

    def start(self, command: str, width: int = 120, height: int = 40) -> None:
        self.run("new-session", "-d", "-x", str(width), "-y", str(height), "-s", "tui", command)

    def keys(self, *keys: str, pause: float = 0.2) -> None:
        """Send keys one at a time, at a person's pace: a focus change lands before the next key."""
        for key in keys:
            self.run("send-keys", "-t", "tui", key)
            time.sleep(pause)

    def screen(self) -> str:
        return self.run("capture-pane", "-p", "-t", "tui")

    def wait_for(self, text: str, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = self.screen()
            if text in screen:
                return screen
            time.sleep(0.3)
        raise AssertionError(f"{text!r} not on the screen after {timeout}s:\n{self.screen()}")

    def wait_for_field(self, name: str, value: str, timeout: float) -> None:
        """Until the launch form's field `name` shows `value` (its line: the name, spaces, the value)."""
        line = re.compile(rf"(^|\s){re.escape(name)}\s+{re.escape(value)}\s*$")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(line.search(row.rstrip(" │")) for row in self.screen().splitlines()):
                return
            time.sleep(0.2)
        raise AssertionError(f"{name} does not show {value!r} after {timeout}s:\n{self.screen()}")

    def kill(self) -> None:
        subprocess.run(self.base + ["kill-server"], capture_output=True)


def test_launch_a_run_and_quit_in_a_real_terminal(home, tmp_path):
    exit_file = tmp_path / "exit-code"
    # COLUMNS/LINES, when the test runner's environment has them, would override the pane's real size.
    app = f"env -u COLUMNS -u LINES {shlex.quote(sys.executable)} -m gpuscale.app.tui_main"
    # The pane outlives the app (sleep), so its last screen and exit code can be read.
    tmux = Tmux(f"gpuscale-test-{os.getpid()}")
    tmux.start(f"{app}; echo $? > {shlex.quote(str(exit_file))}; echo APP-EXITED; sleep 120")
    try:
        tmux.wait_for("Command", 30)
        tmux.keys("Home")
        # Walk the recipe list to probe one recipe at a time, each summary on screen before the next key: on
        # a loaded machine the pane lags the keys, and a walk that looks at the screen between keys overran.
        for summary in ("eggroll: evolution", "grpo-mtl: GRPO", "power-sampling: MCMC"):
            tmux.wait_for(summary, 15)
            tmux.keys("Down")
        tmux.wait_for("probe: decode speed", 15)
        screen = tmux.wait_for("prompt_tokens", 15)  # probe's own form is in, not the last recipe's
        assert "Recipes" in screen and "GPUs" in screen and "Command" in screen
        # Tab from the recipe list: model, dataset, gpus, batch_size, label, steps, prompt_tokens. Each value
        # on screen in its field before the next Tab: on a loaded machine a Tab's focus lands after keys
        # typed 0.2 s behind it, which then went to the field before.
        fields = ("model", "dataset", "gpus", "batch_size", "label", "steps", "prompt_tokens")
        for name, value in zip(fields, (None, None, "1", "2", None, "100000", "8")):
            tmux.keys("Tab", pause=0.6)
            if value is not None:
                tmux.keys("C-u", value)
                tmux.wait_for_field(name, value, 15)
        tmux.wait_for("--batch-size 2 --set steps=100000 --set prompt_tokens=8", 10)  # the shell equivalent
        tmux.keys("C-r")
        screen = tmux.wait_for("running", 60)
        assert "run 1 probe" in screen
        tmux.keys("C-q")
        screen = tmux.wait_for("APP-EXITED", 20)
        assert exit_file.read_text().strip() == "0"
        assert "Traceback" not in screen
        assert "Command" not in screen  # the alternate screen is gone: the terminal is the shell's again
    finally:
        tmux.kill()
        store = Store(home)
        for run in store.live_runs():  # the run outlives the app by design; end it here
            launch.stop_run(store, run["id"])
    assert Store(home).get_run(1)["settings"]["steps"] == 100000
