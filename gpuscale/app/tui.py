"""`gpuscale-tui`: pick a recipe, tune it, launch it, watch it live, look back at every run.

Three modes, each with its own screen stack: Launch (F2), Monitor (F3, a tab per live run) and
History (F4, which pushes one run's details or two runs compared). The app only reads the store and
sends signals; what it shows is worked out in `gpuscale.app.views`, shared with the CLI. Every
read of the store or NVML runs in a thread worker with its own SQLite connection; the next poll is
armed only when the last one was shown. Importing this module never imports torch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from textual import work
from textual.app import App
from textual.binding import Binding

from gpuscale.app.screens.launch import LaunchScreen
from gpuscale.app.widgets.plain import literal
from gpuscale.control.store import Store, StoreError, gpuscale_home
from gpuscale.recipes.shared.registry import all_recipes

# The first frame is the launch screen; the other screens (and textual-plotext, which draws the
# monitor's charts) are imported when first shown: about 50 ms less before the first frame. So is
# what only a worker calls (the launcher, NVML's helper, the exports), imported in the worker.


def monitor_screen():
    from gpuscale.app.screens.monitor import MonitorScreen

    return MonitorScreen()


def history_screen():
    from gpuscale.app.screens.history import HistoryScreen

    return HistoryScreen()


def machine_gpus() -> list[dict]:
    """This machine's GPUs through NVML (called in the GPU picker's worker)."""
    from gpuscale.control import telemetry

    return telemetry.list_gpus()


# One Store (one SQLite connection) per worker thread and GPUSCALE_HOME: sqlite3 connections belong
# to the thread that opened them, and Textual runs thread workers on a small reused pool.
_thread_stores = threading.local()


class GpuscaleApp(App):
    TITLE = "gpuscale"
    CSS_PATH = Path(__file__).with_name("tui.tcss")  # absolute: subclasses elsewhere find it too
    ENABLE_COMMAND_PALETTE = False
    MODES = {"launch": LaunchScreen, "monitor": monitor_screen, "history": history_screen}
    DEFAULT_MODE = "launch"
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (100, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (32, "-tall")]
    BINDINGS = [
        # q quits as in htop or k9s; a focused text field takes the key first and types it.
        Binding("q", "quit", "Quit", show=False),
        Binding("f2", "switch_mode('launch')", "Launch"),
        Binding("f3", "switch_mode('monitor')", "Monitor"),
        Binding("f4", "switch_mode('history')", "History"),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(
        self,
        home: str | Path | None = None,
        clock: Callable[[], float] = time.time,
        recipes: dict | None = None,
        list_gpus: Callable[[], list[dict]] | None = None,
        poll_s: float = 1.0,
        cursor_blink: bool = True,
    ):
        """`clock`, `recipes` and `list_gpus` are there for tests and snapshots (a frozen clock, a
        fixed recipe list, no NVML; None: this machine's, through NVML); `poll_s` is the monitor's
        refresh period."""
        super().__init__()
        self.home = Path(home) if home else gpuscale_home()
        self.clock = clock
        self.recipes = all_recipes() if recipes is None else recipes
        self.list_gpus = list_gpus or machine_gpus
        self.poll_s = poll_s
        self.cursor_blink = cursor_blink
        self.first_frame_shown = False

    def store(self) -> Store:
        """This thread's Store for this app's home (only ever called from worker threads)."""
        stores = getattr(_thread_stores, "stores", None)
        if stores is None:
            stores = _thread_stores.stores = {}
        if self.home not in stores:
            for other in list(stores):  # a test's previous home: close it rather than keep it open
                stores.pop(other).close()
            stores[self.home] = Store.for_reading(self.home)  # a read-only home still shows its history
        return stores[self.home]

    def on_ready(self) -> None:
        """The first frame is on the terminal: now the GPUs and the launch form, the costliest part
        of the screen, and the store (opening it imports sqlite-utils and may switch to the monitor of
        a live run)."""
        self.first_frame_shown = True
        if isinstance(self.screen, LaunchScreen):
            self.screen.after_first_frame()
        self._find_live_runs()

    @work(thread=True, exclusive=True, group="startup", exit_on_error=False)
    def _find_live_runs(self) -> None:
        """Reopening the app shows every live run again: start on the monitor when there is one."""
        from gpuscale.control import launch

        try:
            store = self.store()
            launch.reconcile(store)
            live = [run["id"] for run in store.live_runs()]
        except StoreError as exc:  # read-only, unreadable or damaged: its line names the file and what to do
            self.from_thread(self.notify, literal(exc), severity="error", timeout=30)
            return
        except Exception as exc:
            self.from_thread(self.notify, f"cannot read {literal(self.home)}: {literal(exc)}", severity="error")
            return
        if live:
            self.from_thread(self._show_live_runs, live)

    def from_thread(self, callback, *args, **kwargs) -> None:
        """For worker threads: call_from_thread, unless the app closed meanwhile (no one to tell)."""
        try:
            self.call_from_thread(callback, *args, **kwargs)
        except RuntimeError:
            pass

    async def _show_live_runs(self, live: list[int]) -> None:
        """On the monitor where the user has not moved on yet; its tabs name the runs, so no toast
        then (one would cover the log box). Elsewhere a toast says where they are."""
        if self.current_mode == "launch" and len(self.screen_stack) == 1:
            await self.switch_mode("monitor")
        if self.current_mode == "monitor" and len(self.screen_stack) == 1:
            return
        runs = "1 live run" if len(live) == 1 else f"{len(live)} live runs"
        self.notify(f"{runs}: " + ", ".join(map(str, live)) + " (F3: monitor)")

    # ---- navigation used by the screens ------------------------------------------------------

    async def open_monitor(self, run_id: int) -> None:
        await self.switch_mode("monitor")
        await self.screen_stack[0].open_run(run_id)

    def open_details(self, run_id: int) -> None:
        from gpuscale.app.screens.run_detail import RunDetailScreen

        self.push_screen(RunDetailScreen(run_id))

    def open_compare(self, a: int, b: int) -> None:
        from gpuscale.app.screens.compare import CompareScreen

        self.push_screen(CompareScreen(a, b))

    def export_run(self, run_id: int) -> None:
        from gpuscale.app.screens.dialogs import ExportDialog

        def chosen(choice) -> None:
            if choice:
                self._export(run_id, *choice)

        self.push_screen(ExportDialog(run_id, self.home / "exports", cursor_blink=self.cursor_blink), chosen)

    @work(thread=True, group="export", exit_on_error=False)
    def _export(self, run_id: int, fmt: str, path: Path) -> None:
        from gpuscale.app.views.export import export_text

        try:
            path.parent.mkdir(parents=True, exist_ok=True)  # GPUSCALE_HOME/exports on the first export
            path.write_text(export_text(self.store(), run_id, fmt))
            message, severity = f"run {run_id} exported to {literal(path.resolve())}", "information"
        except Exception as exc:
            message, severity = f"run {run_id}: export failed: {literal(exc)}", "error"
        self.from_thread(self.notify, message, severity=severity)
