"""One run's monitor: status and progress, collapse and waste warnings, where each rank's last steps
went (a row a rank: its step, the time it waited for the others, its phases' shares), a row per GPU
(or host and ranks on a CPU machine), throughput and the recipe's figures as charts, and the tail of the ranks' logs.

The store and NVML are read in a thread worker; the next poll is scheduled only when the last one
was shown, and a monitor that is not on screen does no work. Everything it shows is computed by
`gpuscale.app.views` (feed, collapse, waste, runs); this module only lays it out.
"""

from __future__ import annotations

from dataclasses import dataclass

from textual import work
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.widgets import Label, Log, ProgressBar, Static

from gpuscale.app.views import feed as feeds
from gpuscale.app.views.collapse import run_collapse_warnings
from gpuscale.app.views.feed import DeviceView, RunFeed, Series
from gpuscale.app.views.logs import LogTail
from gpuscale.app.views.runs import (
    elapsed_s,
    figures_text,
    per_rank_text,
    run_title,
    split_lines,
    status_line,
    throughput_text,
)
from gpuscale.app.views.text import format_duration
from gpuscale.app.views.waste import WASTE_WINDOW_S, waste_warnings
from gpuscale.app.widgets.charts import GaugeSparkline, TimeChart
from gpuscale.app.widgets.plain import PlainLabel, PlainStatic
from gpuscale.runs.run_dir import RunDir
from gpuscale.runs.statuses import LIVE_STATUSES


def set_text(widget: Static, text, fixed_size: bool = False) -> None:
    """Update a Static only when its text changed. Each update of a Static asks for a new layout of the
    screen unless its size is fixed in the CSS (`fixed_size`): at one poll a second over a dozen
    labels, that is most of what the monitor costs."""
    if getattr(widget, "_shown_text", None) == text:
        return
    widget._shown_text = text
    widget.update(text, layout=not fixed_size)


MACHINE_GPUS_EVERY_S = 5.0
BAR_STEPS = 200  # the machine's other GPUs (for "the run uses 1 of 8") change slowly
CHART_POINTS = 60


@dataclass(frozen=True)
class MonitorView:
    """Everything one poll found, computed in the worker thread, shown on the UI thread."""

    run: dict
    live: bool
    status: str
    step: int
    total: int | None
    throughput: str
    per_rank: str
    figures: str
    warnings: tuple[str, ...]
    devices: tuple[DeviceView, ...]
    rate_lines: tuple[tuple[str, Series], ...]
    figure_name: str | None
    figure_line: Series | None
    window_text: str
    window_s: float  # what the charts' x axis spans, in seconds before their end
    log_lines: tuple[str, ...] | None  # None: unchanged since the last poll
    log_source: str
    error: str | None = None
    split: tuple[str, ...] = ()  # where each rank's last steps went (views/runs.py:split_lines)


class DeviceRow(Horizontal):
    """`GPU 0 H100 80GB  [bar]  45.1/79.6 GiB 57%   98%  312 W  61°C 1980 MHz  ▁▂▅▇█`: the fields that
    `control/sample_fields.py` declares shown, the `wide` ones (the SM clock) only in a terminal of 100
    columns or more (the CSS hides `.device-wide` below), every one of them in the detail's tooltip."""

    def __init__(self, view: DeviceView, **kwargs):
        super().__init__(classes="device-row", **kwargs)
        self.view = view
        self._bar: ProgressBar | None = None  # until mounted

    def compose(self):
        yield PlainLabel(self.view.label, classes="device-name")
        yield ProgressBar(total=BAR_STEPS, show_eta=False, show_percentage=False, classes="device-bar")
        yield PlainLabel("", classes="device-mem")
        yield PlainLabel("", classes="device-detail")
        yield PlainLabel("", classes="device-wide")
        relative = self.view.kind == "rank"  # RSS has no natural ceiling: scale to its own range
        yield GaugeSparkline(lo=None if relative else 0.0, hi=None if relative else 100.0, classes="device-spark")

    def on_mount(self) -> None:
        # Looked up once: a query per widget per poll would cost more than the update itself.
        self._bar = self.query_one(".device-bar", ProgressBar)
        self._mem = self.query_one(".device-mem", Label)
        self._detail = self.query_one(".device-detail", Label)
        self._wide = self.query_one(".device-wide", Label)
        self._spark = self.query_one(".device-spark", GaugeSparkline)
        self.show(self.view)

    def show(self, view: DeviceView) -> None:
        self.view = view
        if self._bar is None:  # a poll that came before the row mounted: on_mount shows its view
            return
        # The bar in steps of 0.5 %: finer than its cells can show, coarse enough that memory moving by a
        # few MB does not redraw it every second.
        used, total = view.mem_used_mb or 0.0, view.mem_total_mb or 0.0
        steps = round(BAR_STEPS * min(used, total) / total) if total else 0
        if steps != self._bar.progress:
            self._bar.update(progress=steps)
        set_text(self._mem, view.mem_text, fixed_size=True)
        set_text(self._detail, view.detail_text, fixed_size=True)
        set_text(self._wide, view.wide_text, fixed_size=True)
        tooltip = view.fields_text or None
        if self._detail.tooltip != tooltip:  # only when it changed: a new tooltip is redrawn if shown
            self._detail.tooltip = tooltip
        series = list(view.mem_series if view.kind == "rank" else view.util_series)
        if series != self._spark.data:
            self._spark.data = series


class RunMonitor(VerticalScroll):
    """The monitor of one run; `stored=True` shows a finished run's whole history instead of a window."""

    def __init__(self, run_id: int, stored: bool = False, **kwargs):
        super().__init__(classes="run-monitor -stored" if stored else "run-monitor", **kwargs)
        self.run_id = run_id
        self.stored = stored
        self.window_index = 0
        self.figure_index = 0
        self.log_source_index = 0  # 0: every log; then each rank's, then the launcher's
        self.run: dict | None = None
        self.view: MonitorView | None = None  # what the last poll showed
        self.live = True
        self._feed: RunFeed | None = None
        self._logs: LogTail | None = None
        self._machine_gpus: list[dict] = []
        self._machine_read_at = float("-inf")
        self._log_key: tuple | None = None
        self._polling = False
        self._poll_again = False
        self._timer = None

    def compose(self):
        # The lines that change every second are one line each, so updating them needs no new layout.
        yield PlainStatic("reading the run…", classes="monitor-status one-line")
        yield ProgressBar(show_eta=False, classes="monitor-progress")
        yield PlainStatic("", classes="monitor-warnings")
        yield PlainStatic("", classes="monitor-throughput one-line")
        yield PlainStatic("", classes="monitor-figures")  # the headline figures: wrapped, never cut
        yield PlainStatic("", classes="monitor-per-rank one-line")
        yield PlainStatic("", classes="monitor-split")  # a row a rank: changes at each logged step
        yield Vertical(classes="monitor-devices")
        with Horizontal(classes="monitor-charts"):
            yield TimeChart(classes="rate-chart")
            yield TimeChart(classes="figure-chart")
        yield PlainStatic("", classes="monitor-log-title")
        yield Log(max_lines=400, classes="monitor-log")
        if not self.stored:
            yield PlainStatic("w: chart window · f: next figure · r: next log · n/p: next/previous run · "
                              "x: close a finished run's tab · d: details · a: generations · s: stop · "
                              "c: charts or devices (short terminals)", classes="monitor-hint")

    def on_mount(self) -> None:
        self._status = self.query_one(".monitor-status", Static)
        self._progress = self.query_one(".monitor-progress", ProgressBar)
        self._warnings = self.query_one(".monitor-warnings", Static)
        self._throughput = self.query_one(".monitor-throughput", Static)
        self._figures = self.query_one(".monitor-figures", Static)
        self._per_rank = self.query_one(".monitor-per-rank", Static)
        self._split = self.query_one(".monitor-split", Static)
        self._devices = self.query_one(".monitor-devices", Vertical)
        self._rate_chart = self.query_one(".rate-chart", TimeChart)
        self._figure_chart = self.query_one(".figure-chart", TimeChart)
        self._log_title = self.query_one(".monitor-log-title", Static)
        self._log = self.query_one(".monitor-log", Log)
        for widget in (self._progress, self._warnings, self._per_rank, self._figures, self._split):
            widget.display = False
        self.poll_now()

    # ---- user controls -----------------------------------------------------------------------

    @property
    def window_s(self) -> int:
        return feeds.WINDOWS_S[self.window_index % len(feeds.WINDOWS_S)]

    def next_window(self) -> None:
        self.window_index += 1
        self.poll_now()

    def next_figure(self) -> None:
        self.figure_index += 1
        self.poll_now()

    def toggle_charts(self) -> None:
        """In a short terminal the charts and the device rows share one place: show the other one."""
        self.toggle_class("-charts")

    def next_log_source(self) -> None:
        self.log_source_index += 1
        self.poll_now()

    # ---- polling -----------------------------------------------------------------------------

    def poll_now(self) -> None:
        """Poll at once (or right after the poll in flight); the timer is re-armed when it is shown."""
        if self._polling:
            self._poll_again = True
            return
        if self._timer is not None:
            self._timer.stop()
            self._timer = None
        if not self._visible():
            self._timer = self.set_timer(self.app.poll_s, self.poll_now)  # check again later, cheaply
            return
        self._polling = True
        self._poll()

    def _visible(self) -> bool:
        """On the current screen and in the shown tab: a hidden monitor does no work."""
        if not self.screen.is_current:
            return False
        node = self
        while node is not None and node is not self.screen:
            if not node.display:
                return False
            node = node.parent
        return True

    # Not `exclusive`: `_polling` already keeps one read in flight, and an exclusive worker would
    # cancel the previous one while its thread still returns from showing its poll.
    @work(thread=True, group="monitor-poll", exit_on_error=False)
    def _poll(self) -> None:
        try:
            view = self._read()
        except Exception as exc:  # a locked or vanished store: say so and try again next time
            view = exc
        self.app.from_thread(self._show, view)

    def _read(self) -> MonitorView:
        """Runs in a worker thread: the store, NVML and the log files, never the UI."""
        store = self.app.store()
        now = self.app.clock()
        run = store.get_run(self.run_id)
        live = run["status"] in LIVE_STATUSES
        if self._feed is None:
            self._start_feed(run, live)
        self._feed.poll(store, now)
        if live and now - self._machine_read_at >= MACHINE_GPUS_EVERY_S:
            self._machine_gpus, self._machine_read_at = self.app.list_gpus(), now
        self._logs.read_new()
        # A run that collapsed stays marked after it ended too: its figures say why it learned nothing.
        return self._view(run, live, now, tuple(run_collapse_warnings(store, run)))

    def _start_feed(self, run: dict, live: bool) -> None:
        if self.stored and not live:
            duration = elapsed_s(run, self.app.clock())
            self._feed = RunFeed(self.run_id, feeds.stored_resolution(duration), keep_s=float("inf"))
        else:
            self._feed = RunFeed(self.run_id)
        self._logs = LogTail(RunDir(run["run_dir"] or ".").logs)

    def _view(self, run: dict, live: bool, now: float, collapse: tuple[str, ...] = ()) -> MonitorView:
        feed = self._feed
        progress = run.get("progress") or {}
        end, window = self._chart_span(run, live, now)
        figure_names = feed.figure_names()
        figure_name = figure_names[self.figure_index % len(figure_names)] if figure_names else None
        warnings = collapse  # first: a collapsed run wastes every GPU it holds
        if live:
            warnings += tuple(waste_warnings(
                feed.samples_since(now - WASTE_WINDOW_S), now, feed.first_work_t,
                progress.get("tokens_per_s_by_rank"), self._machine_gpus,
            ))
        sources = [None, *self._logs.sources()]
        source = sources[self.log_source_index % len(sources)]
        log_key = (source, len(self._logs.lines(source)), self._logs.lines(source)[-1:])
        log_lines = tuple(self._logs.lines(source)) if log_key != self._log_key else None
        self._log_key = log_key
        return MonitorView(
            run=run, live=live, status=f"{run_title(run)} · {status_line(run, now)}",
            step=progress.get("step") or 0, total=progress.get("total"),
            throughput=throughput_text(run), per_rank=per_rank_text(run),
            figures=figures_text(run), split=tuple(split_lines(run)),
            warnings=warnings, devices=tuple(feeds.device_views(feed, end, window)),
            rate_lines=self._rate_lines(feed, end, window), figure_name=figure_name,
            figure_line=feeds.figure_series(feed, figure_name, end, window, CHART_POINTS) if figure_name else None,
            window_text=("whole run" if not live and self.stored else f"last {format_duration(window)}"),
            window_s=window,
            log_lines=log_lines, log_source=source or "all logs",
            error=run.get("error") and f"{run['error']}" + (f" — hint: {run['hint']}" if run.get("hint") else ""),
        )

    def _chart_span(self, run: dict, live: bool, now: float) -> tuple[float, float]:
        """Where the charts end and how much they cover: the chosen window up to now while the run
        lives; a finished run's last window (or, stored, the whole run) up to its end."""
        if live:
            return now - feeds.LIVE_LAG_S, self.window_s
        end = run.get("ended_at") or now
        if self.stored:
            return end, max(10.0, elapsed_s(run, now) or 10.0)
        return end, self.window_s

    def _rate_lines(self, feed: RunFeed, end: float, window: float) -> tuple[tuple[str, Series], ...]:
        lines = [("total", feeds.rate_series(feed, "tokens", end, window, CHART_POINTS))]
        ranks = feed.ranks()
        if 1 < len(ranks) <= 4:  # more lines than that is noise: the text line gives each rank's figure
            lines += [(f"rank {r}", feeds.rate_series(feed, "tokens", end, window, CHART_POINTS, rank=r))
                      for r in ranks]
        return tuple(lines)

    # ---- showing -----------------------------------------------------------------------------

    def _show(self, view: MonitorView | Exception) -> None:
        self._polling = False
        live = True
        try:
            if isinstance(view, Exception):
                raise view
            live = view.live
            self._show_view(view)
        except Exception as exc:  # say so, and keep polling: a monitor that stops silently is the worst case
            failed = "read" if isinstance(view, Exception) else "show"  # the store, or this widget
            self.log.error(f"run {self.run_id}: cannot {failed} the poll: {exc!r}")
            set_text(self._status, f"cannot {failed} run {self.run_id}: {exc!r}", fixed_size=True)
        finally:
            self._schedule(live)

    def _show_view(self, view: MonitorView) -> None:
        self.run, self.live, self.view = view.run, view.live, view
        self._show_status(view)
        self._show_devices(view.devices)
        self._show_charts(view)
        self._show_log(view)
        self.post_message(RunMonitor.Updated(self, view))

    def _schedule(self, live: bool) -> None:
        if self._poll_again:
            self._poll_again = False
            self.call_later(self.poll_now)
        elif live:
            self._timer = self.set_timer(self.app.poll_s, self.poll_now)

    def _show_status(self, view: MonitorView) -> None:
        set_text(self._status, view.status, fixed_size=True)
        self.set_class(view.run["status"] in ("failed", "lost"), "-failed")
        self._progress.display = bool(view.total)  # no total, no bar: an indeterminate one animates forever
        if view.total:
            self._progress.update(total=view.total, progress=min(view.step, view.total))
        lines = [f"! {w}" for w in view.warnings]
        if view.error:
            lines.insert(0, f"✗ {view.error}")
        set_text(self._warnings, "\n".join(lines))  # changes seldom; may take several lines
        self._warnings.display = bool(lines)
        set_text(self._throughput, view.throughput, fixed_size=True)
        set_text(self._figures, view.figures)  # changes a few times a minute; may take two lines
        self._figures.display = bool(view.figures)
        set_text(self._per_rank, view.per_rank, fixed_size=True)
        self._per_rank.display = bool(view.per_rank)
        set_text(self._split, "\n".join(view.split))
        self._split.display = bool(view.split)

    def _show_devices(self, devices: tuple[DeviceView, ...]) -> None:
        rows = {row.view.key: row for row in self._devices.query(DeviceRow)}
        placeholder = self._devices.query(".device-none")
        if not devices and not rows and not placeholder:
            self._devices.mount(PlainStatic("no telemetry sample yet", classes="device-none"))
        if devices and placeholder:
            placeholder.remove()
        for view in devices:
            if view.key in rows:
                rows[view.key].show(view)
            else:
                self._devices.mount(DeviceRow(view))

    def _show_charts(self, view: MonitorView) -> None:
        x_label = "seconds before now" if view.live else "seconds before the end"
        self._rate_chart.show_lines(f"tokens/s ({view.window_text})", list(view.rate_lines), x_label, from_zero=True,
                                    window_s=view.window_s)
        if view.figure_name:
            self._figure_chart.show_lines(f"{view.figure_name} ({view.window_text})",
                                          [(view.figure_name, view.figure_line)], x_label, window_s=view.window_s)
        else:
            self._figure_chart.show_lines("recipe figures", [], x_label)

    def _show_log(self, view: MonitorView) -> None:
        swap = " · c: charts or devices" if self.screen.has_class("-short") and not self.stored else ""
        set_text(self._log_title, f"log: {view.log_source}{swap}", fixed_size=True)
        if view.log_lines is not None:
            self._log.clear()
            self._log.write_lines(view.log_lines)

    # ---- messages ----------------------------------------------------------------------------

    class Updated(Message):
        """Posted after each poll was shown (the monitor screen titles its tab with the status)."""

        def __init__(self, monitor: RunMonitor, view: MonitorView):
            super().__init__()
            self.monitor, self.view = monitor, view
