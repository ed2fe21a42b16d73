"""Two runs side by side: the settings that differ, and each summary figure with its delta."""

from __future__ import annotations

from rich.text import Text
from textual import work
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer, Header, Static

from gpuscale.app.views.runs import compare_runs, delta_text, figure_text
from gpuscale.app.views.text import MISSING, setting_text
from gpuscale.app.widgets.tables import FittedTable
from gpuscale.data.step_phases import label as phase_label


class CompareScreen(Screen):
    BINDINGS = [Binding("escape", "app.pop_screen", "Back")]

    def __init__(self, a: int, b: int, **kwargs):
        super().__init__(**kwargs)
        self.ids = (a, b)
        self.result: dict | None = None

    def compose(self):
        yield Header(show_clock=False)
        yield Static("reading both runs…", id="compare-title")
        with Horizontal(id="compare-body"):
            with Vertical(classes="compare-half"):
                yield Static("settings that differ", classes="compare-heading")
                yield FittedTable(id="compare-settings", cursor_type="row")
            with Vertical(classes="compare-half"):
                yield Static("summary figures", classes="compare-heading")
                yield FittedTable(id="compare-figures", cursor_type="row")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        a, b = self.ids
        self.sub_title = f"Compare runs {a} and {b}"
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
        self.result = result
        self._fill()

    def _fill(self) -> None:
        result, (a, b) = self.result, self.ids
        settings = [(name, setting_text(va), setting_text(vb)) for name, (va, vb) in result["settings"].items()]
        self.query_one("#compare-settings", FittedTable).show(("setting", f"run {a}", f"run {b}"),
                                                               settings or [("(none)", "identical", "identical")])
        # Values as the catalogue writes them (MFU as a percentage), without units: the table is narrow.
        figures = [(name, figure_text(name, f["a"], unit=False), figure_text(name, f["b"], unit=False),
                    delta_text(f["delta"], f["a"])) for name, f in result["figures"].items()]
        figures += [(name, figure_text(name, value, unit=False), figure_text(name, value, unit=False), "same")
                    for name, value in result["same"].items()]
        # A figure only one run has (per-domain accuracy over other domains): — on the other side.
        figures += [(name, figure_text(name, f["a"], unit=False), figure_text(name, f["b"], unit=False), MISSING)
                    for name, f in result["only"].items()]
        # Where a step goes, phase by phase (seconds of the mean steady step): what changed it.
        figures += [(f"step: {phase_label(name)}", _seconds(p["a"]), _seconds(p["b"]),
                     delta_text(p["delta"], p["a"] or 0)) for name, p in result["phases"].items()]
        self.query_one("#compare-figures", FittedTable).show(("figure", f"run {a}", f"run {b}", "delta"),
                                                              figures or [("(none)", "-", "-", "no figure in either")])


def _seconds(value: float | None) -> str:
    return MISSING if value is None else f"{value:.3g} s"
