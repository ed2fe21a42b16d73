"""Charts: a fixed-scale sparkline and a time chart (textual-plotext) that redraws only on new data."""

from __future__ import annotations

import time

from rich.text import Text
from textual.widgets import Sparkline
from textual_plotext import PlotextPlot

from gpuscale.app.views.feed import Series
from gpuscale.app.views.text import axis_ticks, short_number, spark_text

SERIES_COLORS = ("cyan", "orange", "green", "magenta", "blue", "red")
AXIS_ROWS = 4  # a chart's rows that are not its canvas: title, x ticks, x label, border

class GaugeSparkline(Sparkline):
    """Textual's Sparkline on a fixed scale (0-100 % by default).

    The stock one scales to the data's own min and max, which draws a GPU steady at 97-99 % as wild
    swings; a gauge must show full as full. `lo`/`hi` None scales to the data (e.g. a rank's RSS).
    """

    def __init__(self, lo: float | None = 0.0, hi: float | None = 100.0, **kwargs):
        super().__init__(**kwargs)
        self.lo, self.hi = lo, hi

    def render(self) -> Text:
        return Text(spark_text(list(self.data or ()), self.size.width, self.lo, self.hi), no_wrap=True)


class TimeChart(PlotextPlot):
    """A line chart over a time window; x is seconds before now.

    Rebuilding a plotext figure costs 5-10 ms, the largest part of a poll, so the chart redraws only
    when its lines changed, and new data alone at most every MIN_REDRAW_S (a new title, i.e. a user's
    key, redraws at once).
    """

    MIN_REDRAW_S = 2.0

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._shown: tuple | None = None
        self._y_range: tuple[float, float] | None = None
        self._drawn_at = float("-inf")

    def show_lines(self, title: str, lines: list[tuple[str, Series]], x_label: str = "seconds before now",
                   from_zero: bool = False, window_s: float | None = None) -> None:
        """`from_zero`: the y axis starts at 0 (a rate; scaled to its own range, noise looks like swings).
        `window_s`: the x axis spans the window, -window_s to 0, whatever points there are (left to
        itself, plotext labels the axis of a single point from right to left: -2.5 ... -7.5)."""
        key = (title, x_label, from_zero, window_s, tuple((label, s.xs, s.ys) for label, s in lines))
        if key == self._shown:
            return
        same_chart = self._shown is not None and key[:4] == self._shown[:4]
        if same_chart and time.monotonic() - self._drawn_at < self.MIN_REDRAW_S:
            return  # only newer data: the next poll draws it
        self._shown, self._drawn_at = key, time.monotonic()
        plt = self.plt
        plt.clear_data()
        plt.title(title)
        self._y_axis([y for _, s in lines for y in s.ys], from_zero)
        if window_s:
            plt.xlim(-window_s, 0)
        else:
            plt.xlim(None, None)
        plt.xlabel(x_label)
        drawn = [(label, s) for label, s in lines if s.xs]
        for index, (label, series) in enumerate(drawn):
            # An explicit colour per series: plotext's own colour cycle depends on how many plots the
            # figure has seen, so the same data could come out in another colour.
            plt.plot(list(series.xs), list(series.ys), label=label if len(drawn) > 1 else None, marker="braille",
                     color=SERIES_COLORS[index % len(SERIES_COLORS)])
        if not drawn:
            plt.title(f"{title}: no data yet")
        self.refresh()

    def _y_axis(self, ys: list[float], from_zero: bool) -> None:
        """The y range; its ticks are set at each render, where the chart's height is known."""
        if not ys:
            self._y_range = None
            self.plt.ylim(None, None)
            return
        lo, hi = (0.0 if from_zero and max(ys) > 0 else min(ys)), max(ys)
        if from_zero and hi > 0:
            hi *= 1.1
        if hi == lo:  # one value: plotext's own rule, around it
            lo, hi = (0.5 * lo, 1.5 * lo) if lo > 0 else (1.5 * lo, 0.5 * lo) if lo < 0 else (-1.0, 1.0)
        self._y_range = (lo, hi)
        self.plt.ylim(lo, hi)

    def render(self):
        """The y ticks at round values labelled SI-style (`490k`, not plotext's `489825.6`), one
        every other row of the canvas at most."""
        if self._y_range:
            canvas_rows = self.size.height - AXIS_ROWS
            ticks = axis_ticks(*self._y_range, most=max(2, min(6, canvas_rows // 2 + 1)))
            step = ticks[1] - ticks[0] if len(ticks) > 1 else None
            self.plt.yticks(ticks, [short_number(tick, step) for tick in ticks])
        else:
            self.plt.yticks([], [])
        return super().render()
