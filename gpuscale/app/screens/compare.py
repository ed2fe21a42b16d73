"""Two runs side by side: the settings that differ, and each summary figure with its delta."""

from __future__ import annotations

from rich.text import Text
from textual import work
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Static

from gpuscale.app.views.runs import compare_runs, delta_text
from gpuscale.app.views.text import format_number, setting_text
from gpuscale.app.widgets.plain import PlainTable


class CompareScreen(Screen):
    BINDINGS = [Binding("escape", "app.pop_screen", "Back")]

    def __init__(self, a: int, b: int, **kwargs):
        super().__init__(**kwargs)
        self.ids = (a, b)

    def compose(self):
        yield Header(show_clock=False)
        yield Static("reading both runs…", id="compare-title")
        with Horizontal(id="compare-body"):
            with Vertical(classes="compare-half"):
                yield Static("settings that differ", classes="compare-heading")
                yield PlainTable(id="compare-settings", cursor_type="row")
            with Vertical(classes="compare-half"):
                yield Static("summary figures", classes="compare-heading")
                yield PlainTable(id="compare-figures", cursor_type="row")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        a, b = self.ids
        self.sub_title = f"Compare runs {a} and {b}"
        self.query_one("#compare-settings", DataTable).add_columns("setting", f"run {a}", f"run {b}")
        self.query_one("#compare-figures", DataTable).add_columns("figure", f"run {a}", f"run {b}", "delta")
        self._read()

    @work(thread=True, exclusive=True, group="compare", exit_on_error=False)
    def _read(self) -> None:
        try:
            store = self.app.store()
            result = compare_runs(*(store.get_run(i) for i in self.ids))
        except Exception as exc:
            result = exc
        self.app.from_thread(self._show, result)

    def _show(self, result: dict | Exception) -> None:
        title = self.query_one("#compare-title", Static)
        if isinstance(result, Exception):
            title.update(Text(f"cannot compare: {result}"))
            return
        a, b = result["a"], result["b"]
        title.update(Text.assemble(
            (f"run {a['id']}", "bold"), f" ({a['recipe']}, {a['status']})  vs  ",
            (f"run {b['id']}", "bold"), f" ({b['recipe']}, {b['status']})"))
        settings = self.query_one("#compare-settings", DataTable)
        for name, (va, vb) in result["settings"].items():
            settings.add_row(name, setting_text(va), setting_text(vb))
        if not result["settings"]:
            settings.add_row("(none)", "identical", "identical")
        figures = self.query_one("#compare-figures", DataTable)
        for name, f in result["figures"].items():
            figures.add_row(name, format_number(f["a"]), format_number(f["b"]), delta_text(f["delta"], f["a"]))
        for name, value in result["same"].items():
            figures.add_row(name, format_number(value), format_number(value), "same")
        if not result["figures"] and not result["same"]:
            figures.add_row("(none)", "-", "-", "no figure in both")
