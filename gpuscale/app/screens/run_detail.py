"""One run: its status, error and hint, command, settings and summary; its stored charts and logs; what
it generated (its generations)."""

from __future__ import annotations

from rich.text import Text
from textual import work
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Static, TabbedContent, TabPane

from gpuscale.app.views.node_check import has_node_check, node_check_lines
from gpuscale.app.views.runs import lineage_lines, run_title, status_line, summary_rows
from gpuscale.app.views.text import format_time, setting_text
from gpuscale.app.widgets.generations_view import GenerationsView
from gpuscale.app.widgets.run_monitor import RunMonitor
from gpuscale.app.widgets.tables import PlainTable
from gpuscale.control import launch


def run_heading(run: dict, now: float, children: list[dict] = ()) -> Text:
    """Status line, times, the runs it resumed and that resumed it, error and hint, host and the
    launcher command, one per line."""
    text = Text.assemble((run_title(run), "bold"), " · ", status_line(run, now), "\n")
    text.append(f"started {format_time(run['started_at'])} · ended {format_time(run['ended_at'])}"
                f" · host {run.get('host') or '-'}\n")
    for line in lineage_lines(run, list(children)):
        text.append(line + "\n")
    if run.get("error"):
        text.append(f"✗ error: {run['error']}\n", style="bold")
    if run.get("hint"):
        text.append(f"hint: {run['hint']}\n", style="bold")
    if run.get("command"):
        text.append("$ " + launch.display_command(run["command"]), style="dim")
    return text


class RunDetailScreen(Screen):
    BINDINGS = [
        Binding("escape", "app.pop_screen", "Back"),
        Binding("1", "tab('summary')", "Summary"),
        Binding("2", "tab('charts')", "Charts"),
        Binding("3", "tab('generations')", "Generations", show=False),  # the footer must fit 80 columns
        Binding("e", "export", "Export"),
    ]

    def __init__(self, run_id: int, **kwargs):
        super().__init__(**kwargs)
        self.run_id = run_id
        self.run: dict | None = None

    def compose(self):
        yield Header(show_clock=False)
        with TabbedContent(id="detail-tabs"):
            with TabPane("Summary", id="summary"):
                with VerticalScroll(id="detail-summary"):
                    yield Static("reading the run…", id="detail-heading")
                    yield PlainTable(id="detail-figures", cursor_type="row", show_cursor=False)
                    yield Static("", id="detail-node-check")
                    yield PlainTable(id="detail-settings", cursor_type="row", show_cursor=False)
            with TabPane("Charts", id="charts"):
                yield RunMonitor(self.run_id, stored=True)
            with TabPane("Generations", id="generations"):
                yield GenerationsView(self.run_id, id="detail-generations")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.sub_title = f"Run {self.run_id}"
        self.query_one("#detail-figures", DataTable).add_columns("summary", "value")
        self.query_one("#detail-settings", DataTable).add_columns("setting", "value")
        self._read()

    def action_tab(self, tab: str) -> None:
        self.query_one("#detail-tabs", TabbedContent).active = tab
        if tab == "generations":
            self.query_one(GenerationsView).focus()  # its keys: d (domain), c (correct or not)

    def action_export(self) -> None:
        self.app.export_run(self.run_id)

    @work(thread=True, exclusive=True, group="detail", exit_on_error=False)
    def _read(self) -> None:
        children = []
        try:
            store = self.app.store()
            run, children = store.get_run(self.run_id), store.children(self.run_id)
        except Exception as exc:
            run = exc
        self.app.from_thread(self._show, run, children)

    def _show(self, run: dict | Exception, children: list[dict] = ()) -> None:
        heading = self.query_one("#detail-heading", Static)
        if isinstance(run, Exception):
            heading.update(Text(f"cannot read run {self.run_id}: {run}"))
            return
        self.run = run
        heading.update(run_heading(run, self.app.clock(), children))
        figures = self.query_one("#detail-figures", DataTable)
        figures.clear()
        summary = run["summary"] or {}
        for name, text in summary_rows(summary, run["recipe"]):  # the probe's node check: a table of its own, below
            figures.add_row(name, text)
        node_check = self.query_one("#detail-node-check", Static)
        node_check.update(Text("\n".join(node_check_lines(summary))))
        node_check.display = has_node_check(summary)
        if not run["summary"]:
            figures.add_row("-", "no summary (the run did not finish)")
        settings = self.query_one("#detail-settings", DataTable)
        settings.clear()
        for name, value in run["settings"].items():
            settings.add_row(name, setting_text(value))
