"""Tables that show text as written (see plain.py): kept apart from plain.py so that the launch
screen, the first frame, does not import Textual's DataTable, which only the other screens show."""

from __future__ import annotations

from typing import Any

from textual.events import Resize
from textual.widgets import DataTable

from gpuscale.app.views.text import fit_columns
from gpuscale.app.widgets.plain import plain


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
