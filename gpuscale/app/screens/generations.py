"""The monitor's generations screen: what the run of the shown tab generated, newest first (`a`)."""

from __future__ import annotations

from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer, Header

from gpuscale.app.widgets.generations_view import GenerationsView


class GenerationsScreen(Screen):
    """The monitor's view of a run's generations (the live run's file, read again as it grows)."""

    BINDINGS = [Binding("escape", "app.pop_screen", "Back")]

    def __init__(self, run_id: int, live: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.run_id, self.live = run_id, live

    def compose(self):
        yield Header(show_clock=False)
        yield GenerationsView(self.run_id, live=self.live, id="generations-view")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.sub_title = f"Run {self.run_id}: generations"
        self.query_one(GenerationsView).focus()
