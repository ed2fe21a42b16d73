"""Monitor: a tab per live run (and per run opened here since), each a RunMonitor.

Every few seconds a worker lists the live runs (after `reconcile`, which marks dead ones lost), so a
run started elsewhere, or before the app was opened, gets its tab too.
"""

from __future__ import annotations

import asyncio

from rich.text import Text
from textual import on, work
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer, Header, Static, TabbedContent, TabPane

from gpuscale.app.screens.dialogs import ConfirmDialog
from gpuscale.app.views.runs import run_title, status_text
from gpuscale.app.widgets.plain import literal
from gpuscale.app.widgets.run_monitor import RunMonitor
from gpuscale.control import launch
from gpuscale.runs.statuses import LIVE_STATUSES

LIVE_RUNS_EVERY_S = 2.0
# How long a run's tab waits for the tab list of a monitor screen that is still being mounted.
TAB_LIST_WAIT_S = 5.0


def tab_title(run: dict) -> str:
    marker = "●" if run["status"] in LIVE_STATUSES else "○"
    return f"{marker} {run_title(run)} {status_text(run)}"


class MonitorScreen(Screen):
    BINDINGS = [
        Binding("s", "stop", "Stop"),
        Binding("w", "window", "Window"),
        Binding("f", "figure", "Figure"),
        Binding("r", "log", "Log"),
        Binding("d", "details", "Details"),
        # Named in each monitor's hint line rather than in the footer, which must fit 80 columns.
        Binding("n", "next_tab", "Next run", show=False),
        Binding("p", "previous_tab", "Previous run", show=False),
        Binding("x", "close", "Close tab", show=False),
        Binding("c", "charts", "Charts", show=False),
        Binding("a", "generations", "Generations", show=False),
    ]

    def __init__(self):
        super().__init__()
        self._opening = asyncio.Lock()

    def compose(self):
        yield Header(show_clock=False)
        yield Static("No live run. F2: launch one · F4: the history.", id="no-runs")
        yield TabbedContent(id="run-tabs")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.sub_title = "Monitor"
        self._show_empty()
        self.list_live_runs()

    # ---- tabs --------------------------------------------------------------------------------

    def tabs(self) -> TabbedContent:
        return self.query_one("#run-tabs", TabbedContent)

    def monitors(self) -> list[RunMonitor]:
        return list(self.query(RunMonitor))

    def active_monitor(self) -> RunMonitor | None:
        pane = self.tabs().active_pane
        return pane.query_one(RunMonitor) if pane is not None else None

    async def open_run(self, run_id: int, activate: bool = True) -> None:
        # One at a time: the launch screen and the live-run poll can both open the same new run; a
        # second caller must find the first one's tab mounted, not add another or activate a half one.
        async with self._opening:
            pane_id = f"run-{run_id}"
            tabs = await self._mounted_tabs()
            if not tabs.query(f"#{pane_id}"):
                await tabs.add_pane(TabPane(f"run {run_id}", RunMonitor(run_id), id=pane_id))
            self._show_empty()  # first: a monitor polls only once it is displayed
            if activate:
                tabs.active = pane_id
                self.active_monitor().poll_now()

    async def _mounted_tabs(self) -> TabbedContent:
        """The tabs, once they and their tab list are mounted: the screen's TabbedContent, then its list,
        mount a refresh or two after the screen is switched to, and the app's start-up (a live run) and a
        caller (the launch screen, a script) may both switch to the monitor and open a run at once;
        `add_pane` needs the list."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + TAB_LIST_WAIT_S
        while loop.time() < deadline:
            found = self.query("#run-tabs")
            if found and found.first().query("#tabs-list"):
                break
            await asyncio.sleep(0.01)
        return self.tabs()

    def _show_empty(self) -> None:
        empty = not self.monitors()
        self.query_one("#no-runs").display = empty
        self.tabs().display = not empty

    @on(RunMonitor.Updated)
    def _retitle(self, event: RunMonitor.Updated) -> None:
        tab = self.tabs().get_tab(f"run-{event.monitor.run_id}")
        title = tab_title(event.view.run)
        if str(tab.label) != title:
            tab.label = Text(title)  # the recipe's name, as stored: not markup

    @on(TabbedContent.TabActivated)
    def _tab_shown(self, event: TabbedContent.TabActivated) -> None:
        monitor = self.active_monitor()
        if monitor is not None:
            monitor.poll_now()  # do not wait for the hidden tab's slow timer

    def action_previous_tab(self) -> None:
        self._step_tab(-1)

    def action_next_tab(self) -> None:
        self._step_tab(+1)

    def _step_tab(self, step: int) -> None:
        panes = [m.parent.id for m in self.monitors()]
        if panes:
            current = self.tabs().active
            index = panes.index(current) if current in panes else 0
            self.tabs().active = panes[(index + step) % len(panes)]

    # ---- live runs ---------------------------------------------------------------------------

    @work(thread=True, exclusive=True, group="live-runs", exit_on_error=False)
    def list_live_runs(self) -> None:
        try:
            store = self.app.store()
            launch.reconcile(store)
            ids = [run["id"] for run in store.live_runs()]
        except Exception:
            ids = []
        self.app.from_thread(self._add_live_runs, ids)

    async def _add_live_runs(self, ids: list[int]) -> None:
        shown = {m.run_id for m in self.monitors()}
        for run_id in ids:
            if run_id not in shown:
                await self.open_run(run_id, activate=not shown)
                shown.add(run_id)
        self.set_timer(LIVE_RUNS_EVERY_S, self._list_if_shown)

    def _list_if_shown(self) -> None:
        if self.is_current:
            self.list_live_runs()
        else:
            self.set_timer(LIVE_RUNS_EVERY_S, self._list_if_shown)

    # ---- actions on the shown run ------------------------------------------------------------

    def action_window(self) -> None:
        if monitor := self.active_monitor():
            monitor.next_window()

    def action_figure(self) -> None:
        if monitor := self.active_monitor():
            monitor.next_figure()

    def action_charts(self) -> None:
        if monitor := self.active_monitor():
            monitor.toggle_charts()

    def action_log(self) -> None:
        if monitor := self.active_monitor():
            monitor.next_log_source()

    def action_details(self) -> None:
        if monitor := self.active_monitor():
            self.app.open_details(monitor.run_id)

    def action_generations(self) -> None:
        if monitor := self.active_monitor():
            from gpuscale.app.screens.generations import GenerationsScreen

            self.app.push_screen(GenerationsScreen(monitor.run_id, live=monitor.live))

    async def action_close(self) -> None:
        monitor = self.active_monitor()
        if monitor is None:
            return
        if monitor.live:
            self.notify("the run is still live: stop it first (s), or leave its tab open", severity="warning")
            return
        await self.tabs().remove_pane(monitor.parent.id)
        self._show_empty()

    def action_stop(self) -> None:
        monitor = self.active_monitor()
        if monitor is None or not monitor.live:
            self.notify("no live run in this tab", severity="warning")
            return
        run_id = monitor.run_id

        def confirmed(yes: bool | None) -> None:
            if yes:
                self.notify(f"stopping run {run_id}…")
                self._stop(run_id)

        self.app.push_screen(ConfirmDialog(f"Stop run {run_id}? Its ranks get SIGTERM, then SIGKILL after 7 s."),
                             confirmed)

    @work(thread=True, group="stop", exit_on_error=False)
    def _stop(self, run_id: int) -> None:
        """stop_run blocks until the run has ended (up to ~15 s): never on the UI thread."""
        try:
            run = launch.stop_run(self.app.store(), run_id)
            message, severity = f"run {run_id}: {run['status']}", "information"
        except Exception as exc:
            message, severity = f"run {run_id}: could not stop: {literal(exc)}", "error"
        self.app.from_thread(self._stopped, run_id, message, severity)

    def _stopped(self, run_id: int, message: str, severity: str) -> None:
        self.notify(message, severity=severity)
        for monitor in self.monitors():
            if monitor.run_id == run_id:
                monitor.poll_now()
