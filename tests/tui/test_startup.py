"""The TUI's start-up rule (ARCHITECTURE.md): importing and opening it never imports torch (the first
frame must come within a second on a login node), checked in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

HEAVY = ("torch", "transformers")


def modules_in_fresh_python(code: str, env: dict | None = None) -> set[str]:
    script = textwrap.dedent(code) + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))\n"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env,
                         timeout=120)
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_importing_the_tui_loads_no_torch():
    loaded = modules_in_fresh_python("import gpuscale.app.tui")
    assert "gpuscale.app.tui" in loaded and "textual" in loaded
    assert not [name for name in HEAVY if name in loaded]


def test_opening_the_tui_loads_no_torch(home):
    """Up to the first frame and the first store reads: the launch form, the recipes, NVML."""
    import os

    loaded = modules_in_fresh_python(
        """
        import asyncio
        from textual.worker import WorkerCancelled
        from gpuscale.app.tui import GpuscaleApp

        async def settled(app):
            # An exclusive worker that a newer one replaced ends cancelled (on a busy machine the
            # launch form's can be): wait for the newer one instead.
            while True:
                try:
                    return await app.workers.wait_for_complete()
                except WorkerCancelled:
                    continue

        async def first_frame():
            app = GpuscaleApp(cursor_blink=False)
            async with app.run_test(size=(80, 24)) as pilot:
                await pilot.pause(0.5)
                await settled(app)
                await pilot.press("f4")  # the history reads the store in a worker
                await pilot.pause(0.5)
                await settled(app)

        asyncio.run(first_frame())
        """,
        env=dict(os.environ),
    )
    assert "gpuscale.app.screens.launch" in loaded and "gpuscale.app.widgets.settings_form" in loaded
    assert not [name for name in HEAVY if name in loaded]


def test_a_bare_gpuscale_tui_imports_no_cli_before_its_first_frame(home):
    """`gpuscale-tui` with nothing to parse goes straight to the app: the CLI and what only it needs
    (the data sets' readers, its views) are not imported on the way to the first frame."""
    import os

    loaded = modules_in_fresh_python(
        """
        from gpuscale.app import tui, tui_main

        tui.GpuscaleApp.run = lambda self: None  # what is imported when the app would start
        assert tui_main.main([]) == 0
        """,
        env=dict(os.environ),
    )
    assert "gpuscale.app.tui" in loaded
    assert not [name for name in ("gpuscale.app.cli", "gpuscale.data.tasks", *HEAVY) if name in loaded]


def test_the_first_frame_leaves_for_later_what_it_does_not_show(home):
    """Up to the first frame (Textual's Ready): not the launcher, the batch choice, NVML's helper and
    psutil, DataTable, sqlite-utils, whose imports the launch form, the GPU picker's worker and the
    other screens pay after it (the first frame's target, 0.5 s on 2 cores: bench/RESULTS.md, TUI)."""
    import os

    loaded = modules_in_fresh_python(
        """
        import sys
        from gpuscale.app.tui import GpuscaleApp

        class FirstFrame(GpuscaleApp):
            def on_ready(self):
                self.loaded = sorted(sys.modules)
                self.exit()

        app = FirstFrame(cursor_blink=False)
        app.run(headless=True, size=(80, 24))
        import json
        print(json.dumps(app.loaded))  # what was loaded then, not what the app's exit loaded
        raise SystemExit(0)
        """,
        env=dict(os.environ),
    )
    later = ("gpuscale.control.launch", "gpuscale.app.batch_choice", "gpuscale.control.telemetry", "psutil",
             "textual.widgets._data_table", "sqlite_utils", *HEAVY)
    assert "gpuscale.app.screens.launch" in loaded
    assert not [name for name in later if name in loaded]
