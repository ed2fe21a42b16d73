"""Widgets that show text as written. Textual reads a plain `str` given to a Static, a Label, a
DataTable cell, a tab or a toast as markup: a dataset path `q[/tmp]x.jsonl` then crashes the app
(`MarkupError`) and `[v1]` vanishes. Whatever a run holds (settings, summaries, errors, logs, paths)
was written by a user, a recipe or a model, so the app shows it through these; a toast, whose
message is markup (Textual's own ones are styled: "Press [b]ctrl+q[/b] to quit"), puts such text in
through `literal`."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.events import Resize
from textual.markup import escape
from textual.widgets import DataTable, Label, Static

from gpuscale.app.views.text import fit_columns


def plain(value: Any) -> Text:
    """`value` as literal text (a Rich Text is kept: its styles were set by this app)."""
    return value if isinstance(value, Text) else Text(str(value))


def literal(value: Any) -> str:
    """`value` escaped for a markup string (a toast's message): shown as written, brackets and all."""
    return escape(str(value))


class PlainStatic(Static):
    def __init__(self, content: Any = "", **kwargs):
        super().__init__(content, markup=False, **kwargs)


class PlainLabel(Label):
    def __init__(self, content: Any = "", **kwargs):
        super().__init__(content, markup=False, **kwargs)


class PlainTable(DataTable):
    """A DataTable whose string cells are literal text."""

    def add_row(self, *cells: Any, **kwargs):
        return super().add_row(*(plain(cell) for cell in cells), **kwargs)

    def update_cell(self, row_key, column_key, value: Any, **kwargs) -> None:
        super().update_cell(row_key, column_key, plain(value), **kwargs)


class FittedTable(PlainTable):
    """A PlainTable whose values are cut with … to its own width, and cut again whenever that width
    changes (a layout that turns from side by side to stacked resizes the table, not the screen)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._whole: list[tuple[str, ...]] = []
        self._fitted_to: int | None = None

    def show(self, header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
        self._whole = [header, *rows]
        self._fitted_to = None
        self._fit()

    def on_resize(self, event: Resize) -> None:
        self._fit()

    def _fit(self) -> None:
        width = self.scrollable_content_region.width
        if not self._whole or width == self._fitted_to:
            return
        self._fitted_to = width
        fitted = fit_columns(self._whole, width) if width > 0 else self._whole  # before its first layout: whole
        self.clear(columns=True)  # new columns: a DataTable's columns never narrow by themselves
        self.add_columns(*fitted[0])
        for row in fitted[1:]:
            self.add_row(*row)
