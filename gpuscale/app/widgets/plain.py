"""Widgets that show text as written. Textual reads a plain `str` given to a Static, a Label, a
DataTable cell, a tab or a toast as markup: a dataset path `q[/tmp]x.jsonl` then crashes the app
(`MarkupError`) and `[v1]` vanishes. Whatever a run holds (settings, summaries, errors, logs, paths)
was written by a user, a recipe or a model, so the app shows it through these (and tables.py's); a toast, whose
message is markup (Textual's own ones are styled: "Press [b]ctrl+q[/b] to quit"), puts such text in
through `literal`."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.markup import escape
from textual.widgets import Label, Static


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
