"""Small modal dialogs: a yes/no confirmation and the export form."""

from __future__ import annotations

from pathlib import Path

from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select, Static

from gpuscale.app.widgets.plain import PlainStatic


class ConfirmDialog(ModalScreen[bool]):
    """y confirms, n or Escape declines; the buttons are there for mouse users."""

    BINDINGS = [
        Binding("y", "answer(True)", "Yes"),
        Binding("n,escape", "answer(False)", "No"),
    ]

    def __init__(self, question: str):
        super().__init__(classes="dialog-screen")
        self.question = question

    def compose(self):
        with Vertical(classes="dialog"):
            yield PlainStatic(self.question, classes="dialog-question")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Yes (y)", id="yes", variant="error", compact=True)
                yield Button("No (n)", id="no", compact=True)

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


class ExportDialog(ModalScreen[tuple[str, Path] | None]):
    """Format and file name for `export_run`; Enter writes, Escape cancels."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, run_id: int, directory: Path, cursor_blink: bool = True):
        super().__init__(classes="dialog-screen")
        self.run_id = run_id
        self.directory = directory
        self.cursor_blink = cursor_blink

    def compose(self):
        with Vertical(classes="dialog"):
            yield Static(f"Export run {self.run_id}: its record, metrics, telemetry samples and results",
                         classes="dialog-question")
            with Horizontal(classes="dialog-row"):
                yield Label("format ", classes="field-label")
                yield Select([("json", "json"), ("csv (metrics)", "csv")], value="json", allow_blank=False,
                             compact=True, id="export-format")
            with Horizontal(classes="dialog-row"):
                yield Label("file ", classes="field-label")
                # Not selected on focus: a key typed then edits the path (at its end) rather than replacing it.
                path = Input(str(self.directory / f"gpuscale-run-{self.run_id}.json"), id="export-path", compact=True,
                             select_on_focus=False)
                path.cursor_blink = self.cursor_blink
                yield path
            yield Static("Enter: export · Escape: cancel", classes="dialog-hint")

    def on_mount(self) -> None:
        self.query_one("#export-path", Input).focus()

    def on_select_changed(self, event: Select.Changed) -> None:
        path = self.query_one("#export-path", Input)
        path.value = str(Path(path.value).with_suffix(f".{event.value}"))

    def on_input_submitted(self, event: Input.Submitted) -> None:
        fmt = self.query_one("#export-format", Select).value
        self.dismiss((fmt, Path(event.value).expanduser()))

    def action_cancel(self) -> None:
        self.dismiss(None)
