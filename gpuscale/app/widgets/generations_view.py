"""What a run generated (runs/generations.py), newest first: in the monitor's generations screen (`a`
on a run's tab, app/screens/generations.py) and the run page's Generations tab. `d` steps through the domains, `c`
through all / correct / incorrect; a live run's file is read again every few seconds. Every prompt
and completion is shown as written (a model writes `[/x]` as readily as anything: never read as
markup) and wraps."""

from __future__ import annotations

from rich.text import Text
from textual import work
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll

from gpuscale.app.views import generations as view
from gpuscale.app.widgets.plain import PlainStatic
from gpuscale.runs.generations import read_run_generations

READ_EVERY_S = 3.0
SHOWN = 60  # generations drawn at once: the latest step's can be hundreds, each several lines
CORRECT_ORDER = list(view.CORRECT_CHOICES)  # all, correct, incorrect


class GenerationsView(VerticalScroll):
    BINDINGS = [
        Binding("d", "next_domain", "Domain"),
        Binding("c", "next_correct", "Correct?"),
    ]

    def __init__(self, run_id: int, live: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.run_id, self.live = run_id, live
        self.records: list[dict] = []
        self.domain: str | None = None
        self.correct = "all"
        self._shown_key: tuple | None = None

    def compose(self):
        yield PlainStatic("reading the generations…", classes="generations-filter")
        yield Vertical(classes="generations-list")

    def on_mount(self) -> None:
        self.read()
        if self.live:
            self.set_interval(READ_EVERY_S, self.read)

    @work(thread=True, exclusive=True, group="generations", exit_on_error=False)
    def read(self) -> None:
        try:
            records = read_run_generations(self.app.store().get_run(self.run_id)["run_dir"])
        except Exception as exc:
            self.app.from_thread(self._say, f"cannot read run {self.run_id}'s generations: {exc}")
            return
        self.app.from_thread(self._got, records)

    def _got(self, records: list[dict]) -> None:
        self.records = records
        self.redraw()

    def _say(self, message: str) -> None:
        self.query_one(".generations-filter", PlainStatic).update(Text(message))

    def action_next_domain(self) -> None:
        choices = [None, *view.domains_of(self.records)]
        self.domain = choices[(choices.index(self.domain) + 1) % len(choices)] if self.domain in choices else None
        self.redraw()

    def action_next_correct(self) -> None:
        self.correct = CORRECT_ORDER[(CORRECT_ORDER.index(self.correct) + 1) % len(CORRECT_ORDER)]
        self.redraw()

    def redraw(self) -> None:
        shown = view.filtered(self.records, domain=self.domain, correct=view.CORRECT_CHOICES[self.correct])
        key = (len(self.records), self.records[-1]["t"] if self.records else None, self.domain, self.correct)
        if key == self._shown_key:
            return  # nothing new: keep the reader's scroll position
        self._shown_key = key
        self._say(self.filter_line(len(shown)))
        listing = self.query_one(".generations-list", Vertical)
        listing.remove_children()
        listing.mount_all(PlainStatic(generation_text(record), classes="generation") for record in shown[:SHOWN])

    def filter_line(self, matching: int) -> str:
        if not self.records:
            return f"run {self.run_id}: no generations yet (a recipe that generates keeps them from its first step)"
        steps = view.steps_text(view.steps_of(self.records))
        shown = f"{min(matching, SHOWN)} of {matching}" if matching > SHOWN else str(matching)
        return (f"run {self.run_id}: {shown} generations, newest first (steps kept: {steps}) · domain: "
                f"{self.domain or 'all'} (d) · {self.correct} (c)")


def generation_text(record: dict) -> Text:
    """One generation: its heading in bold, then its prompt and completion, literal."""
    text = Text(view.heading(record) + "\n", style="bold")
    text.append("prompt: ", style="dim")
    text.append((record.get("prompt") or "") + "\n")
    text.append("completion: ", style="dim")
    text.append(record.get("completion") or "")
    return text
