"""The formatters: every number, rate, duration, time and memory size that the CLI or the TUI shows
is written by one of these, so both say `12,345` and `1:23` the same way."""

from __future__ import annotations

import math
import re
import time
from typing import Any

SPARK_BARS = "▁▂▃▄▅▆▇█"


MISSING = "—"


def format_number(value: Any) -> str:
    """A figure for people: `0.6931`, `261.5`, `2,261`, `12,345` (never `1.234e+04`); `—` for a value
    that is missing; a list item by item (`1,341 1,778`: a comma is already the thousands separator),
    a dict as `name value · name value`; anything else as it is (`bf16`, `True`). Four significant
    digits, and from 1,000 on whole numbers with thousands separators, whether an int or a float."""
    if value is None:
        return MISSING
    if isinstance(value, dict):
        return " · ".join(f"{name} {format_number(v)}" for name, v in value.items()) or MISSING
    if isinstance(value, (list, tuple)):
        return " ".join(format_number(v) for v in value) or MISSING
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) or abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.4g}"


SI_PREFIXES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def short_number(value: float, step: float | None = None) -> str:
    """A chart axis's label, SI-style: `490k`, `1.25M`, `12`, `0.25`. `step`: the spacing of the
    axis's ticks, to which the label is exact (`487.5k` beside `490k`); none: three digits."""
    if not step:
        value = float(f"{value:.3g}")  # first, so that 999.9 is 1k, not 1e+03
    scale, prefix = next(((scale, prefix) for scale, prefix in SI_PREFIXES if abs(value) >= scale), (1.0, ""))
    if step:
        decimals = next((d for d in range(7) if abs(round(step / scale, d) - step / scale) < 1e-9 * step / scale), 6)
        text = f"{value / scale:.{decimals}f}"
        text = text.rstrip("0").rstrip(".") if "." in text else text
    else:
        text = f"{value / scale:.3g}"
    return ("0" if text in ("-0", "") else text) + prefix


def axis_ticks(lo: float, hi: float, most: int = 5) -> list[float]:
    """As many round values (1, 2, 2.5 or 5 times a power of ten apart) from lo to hi as fit in `most`."""
    if not hi > lo:
        return [lo]
    power = 10 ** math.floor(math.log10((hi - lo) / max(1, most)))
    for step in (power * m for m in (1, 2, 2.5, 5, 10, 20, 25, 50, 100)):
        first, last = math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9)
        if last - first + 1 <= most:
            return [round(k * step, 12) for k in range(first, last + 1)]
    return [lo, hi]


def format_rate(per_second: float | None) -> str:
    """A throughput: `4,210`, or one decimal below 100 (`12.5`) where the decimal still matters."""
    per_second = per_second or 0.0
    return f"{per_second:,.1f}" if per_second < 100 else f"{per_second:,.0f}"


def format_duration(seconds: float | None) -> str:
    """`1:05`, `1:02:03`; `-` when unknown."""
    if seconds is None:
        return "-"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def format_time(timestamp: float | None) -> str:
    """Local time, `2025-01-31 14:05:09`; `-` when unknown."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp)) if timestamp else "-"


def format_mib(mb: float | None) -> str:
    """`357 MiB`, `45.1 GiB`; `-` when unknown."""
    if mb is None:
        return "-"
    return f"{mb / 1024:.1f} GiB" if mb >= 1024 else f"{mb:.0f} MiB"


def memory_text(used_mb: float | None, total_mb: float | None) -> str:
    """`45.1/79.6 GiB 57%`: always in words and digits, so a bar that lost its colours still reads."""
    if used_mb is None or not total_mb:
        return format_mib(used_mb)
    unit, scale = ("GiB", 1024) if total_mb >= 1024 else ("MiB", 1)
    digits = 1 if unit == "GiB" else 0
    return f"{used_mb / scale:.{digits}f}/{total_mb / scale:.{digits}f} {unit} {100 * used_mb / total_mb:.0f}%"


def short_gpu_name(name: str | None) -> str:
    """`NVIDIA H100 80GB HBM3` -> `H100 80GB HBM3`: the vendor is the same on every row."""
    return re.sub(r"^NVIDIA\s+(GeForce\s+)?", "", name or "").strip()


def setting_text(value: Any) -> str:
    """A setting as the user would type it: `0,3` for a GPU list, `-` for none."""
    if value is None:
        return "-"
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def spark_text(values: list[float], width: int, lo: float | None = 0.0, hi: float | None = 100.0) -> str:
    """A one-line sparkline on a fixed scale (0-100 % by default), newest value on the right.

    A fixed scale matters: a GPU at 97-99 % must look flat and full, not like wild swings; `lo` or
    `hi` None scales to the data instead (for values with no natural range, like a rank's RSS).
    """
    if width <= 0:
        return ""
    points = _resample_max(values, width)
    if not points:
        return " " * width
    low = min(points) if lo is None else lo
    high = max(points) if hi is None else hi
    span = (high - low) or 1.0
    bars = []
    for value in points:
        level = (min(max(value, low), high) - low) / span
        bars.append(SPARK_BARS[min(len(SPARK_BARS) - 1, int(level * len(SPARK_BARS)))])
    return " " * (width - len(bars)) + "".join(bars)


def _resample_max(values: list[float], width: int) -> list[float]:
    """At most `width` points: each the max of its share of `values` (a short spike stays visible)."""
    if len(values) <= width:
        return list(values)
    step = len(values) / width
    return [max(values[int(i * step) : max(int(i * step) + 1, int((i + 1) * step))]) for i in range(width)]


def cut_text(text: str, room: int) -> str:
    """`text` in at most `room` characters, its end replaced by `…` where it is cut."""
    return text if len(text) <= room else text[: max(room - 1, 0)] + "…"


def fit_columns(rows: list[tuple[str, ...]], width: int, padding: int = 2, least: int = 6) -> list[tuple[str, ...]]:
    """Rows of a table (its header first) cut so that the columns, each with `padding` cells around
    it, fit in `width`: the widest column gives up a cell at a time (down to `least`), and a cell
    longer than its column ends in `…`. A table wider than its screen would otherwise lose its last
    columns, or the end of its values, with nothing to say so."""
    if not rows:
        return rows
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    room = width - padding * len(widths)
    while sum(widths) > room and max(widths) > least:
        widest = widths.index(max(widths))
        widths[widest] -= 1
    return [tuple(cut_text(cell, w) for cell, w in zip(row, widths)) for row in rows]
