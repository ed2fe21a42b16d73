"""The text of a Textual SVG screenshot, one string per row of cells: what a capture shows, readable in a
result JSON and checkable by a test without an SVG viewer (bench/phases_view.py, tests/tui's helpers)."""

from __future__ import annotations

import html
import re


def svg_screen_text(svg: str) -> list[str]:
    """A Textual SVG screenshot's text, one string per row of cells."""
    rows: dict[float, list[str]] = {}
    for y, text in re.findall(r'<text[^>]*\by="([\d.]+)"[^>]*>(.*?)</text>', svg):
        rows.setdefault(float(y), []).append(html.unescape(re.sub("<[^>]+>", "", text)).replace("\xa0", " "))
    return ["".join(parts).rstrip() for _, parts in sorted(rows.items())]
