"""One run's samples and metrics, read incrementally from the store, and what the monitor's device
rows and charts show over a window the user picks.

`RunFeed` reads one run's new rows on each poll and keeps them in time buckets: per device (GPU, or
host and ranks on a CPU machine) the last sample of each bucket, per rank the tokens and samples
counted, per figure (loss, reward, ...) the mean of the run-wide values the supervisor combined over
the ranks (rows of rank RUN_WIDE_RANK), or of the ranks' own values for a run recorded before those.
It reads by rowid, not by time (through `Store.last_rowids`), so rows that a slow rank wrote late are
never skipped, and a poll costs what is new only. `device_views`, `rate_series` and `figure_series`
are what each row, sparkline and chart shows.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gpuscale.app.views.runs import PREFERRED_FIGURES
from gpuscale.app.views.text import format_mib, memory_text, short_gpu_name
from gpuscale.control import sample_fields
from gpuscale.control.metrics_tail import RUN_WIDE_RANK
from gpuscale.control.store import Store

# Chart windows the user cycles through (seconds); a live feed keeps the longest.
WINDOWS_S = (60, 300, 900, 3600)
KEEP_S = max(WINDOWS_S)
# A live chart ends this long before now: the ranks' lines of the last second or two reach the store
# only with the supervisor's next tick, and a half-filled last bucket would draw a false drop.
LIVE_LAG_S = 2.0

COUNT_NAMES = ("tokens", "samples")
NOT_FIGURES = set(COUNT_NAMES) | {"total"}


def device_key(kind: str, idx: int) -> str:
    return {"gpu": f"gpu{idx}", "host": "host", "rank": f"rank{idx}"}.get(kind, f"{kind}{idx}")


def _device_order(key: str) -> tuple[int, int]:
    kind = re.match(r"[a-z]+", key).group(0)
    number = int(key[len(kind):] or 0)
    return ({"gpu": 0, "host": 1, "rank": 2}.get(kind, 3), number)


@dataclass
class RunFeed:
    """One run's samples and metrics, bucketed by `resolution_s` seconds.

    A live monitor polls it every second with resolution 1 s and keeps `keep_s` seconds; a finished
    run's stored charts read it once with a resolution that gives a few hundred buckets in all.
    """

    run_id: int
    resolution_s: float = 1.0
    keep_s: float = KEEP_S
    devices: dict[str, dict[int, dict]] = field(default_factory=dict)  # key -> bucket -> sample
    device_names: dict[str, str] = field(default_factory=dict)
    counts: dict[tuple[str, int], dict[int, float]] = field(default_factory=dict)  # (name, rank) -> bucket -> sum
    figures: dict[str, dict[int, list[float]]] = field(default_factory=dict)  # name -> bucket -> [sum, n]
    run_wide: dict[str, dict[int, list[float]]] = field(default_factory=dict)  # the same, combined over ranks
    first_work_t: float | None = None  # when the first token or sample was counted
    _sample_rowid: int = 0
    _metric_rowid: int = 0
    _read_once: bool = False

    def poll(self, store: Store, now: float) -> bool:
        """Read what was added since the last poll; True if anything was."""
        sample_mark, metric_mark = store.last_rowids()
        since = now - self.keep_s
        first = not self._read_once
        samples = store.sample_buckets(self.run_id, self.resolution_s, sample_mark,
                                       after_rowid=None if first else self._sample_rowid, since=since)
        metrics = store.metric_buckets(self.run_id, self.resolution_s, metric_mark,
                                       after_rowid=None if first else self._metric_rowid, since=since)
        self._sample_rowid, self._metric_rowid, self._read_once = sample_mark, metric_mark, True
        self._add_samples(samples)
        self._add_metrics(metrics)
        self._forget_before(since)
        return bool(samples or metrics)

    def _add_samples(self, rows: Iterable[dict]) -> None:
        """Rows as `Store.sample_buckets` gives them: kind, idx, name, t and every declared field, by name."""
        for row in rows:
            key = device_key(row["kind"], row["idx"])
            self.device_names[key] = row["name"] or key
            sample = {name: value for name, value in row.items() if name != "bucket"}
            self.devices.setdefault(key, {})[row["bucket"]] = sample  # a later sample of the same bucket wins

    def _add_metrics(self, rows: Iterable[tuple]) -> None:
        for name, rank, bucket, total, count, first_t in rows:
            if name in COUNT_NAMES:
                buckets = self.counts.setdefault((name, rank), {})
                buckets[bucket] = buckets.get(bucket, 0.0) + total
                if total > 0:
                    self.first_work_t = first_t if self.first_work_t is None else min(self.first_work_t, first_t)
            elif name not in NOT_FIGURES:
                table = self.run_wide if rank == RUN_WIDE_RANK else self.figures
                cell = table.setdefault(name, {}).setdefault(bucket, [0.0, 0])
                cell[0] += total
                cell[1] += count

    def _forget_before(self, since: float) -> None:
        if math.isinf(self.keep_s):
            return
        oldest = int(since / self.resolution_s)
        tables = (*self.devices.values(), *self.counts.values(), *self.figures.values(), *self.run_wide.values())
        for table in tables:
            for bucket in [b for b in table if b < oldest]:
                del table[bucket]

    # ---- what the views read -------------------------------------------------------------------

    def device_keys(self) -> list[str]:
        return sorted(self.devices, key=_device_order)

    def latest(self, key: str) -> dict | None:
        buckets = self.devices.get(key)
        return buckets[max(buckets)] if buckets else None

    def latest_samples(self) -> list[dict]:
        return [s for s in (self.latest(key) for key in self.device_keys()) if s]

    def samples_since(self, since: float) -> list[dict]:
        first = int(since // self.resolution_s)
        return [sample for buckets in self.devices.values() for bucket, sample in sorted(buckets.items())
                if bucket >= first and sample["t"] >= since]

    def ranks(self) -> list[int]:
        return sorted({rank for (_name, rank) in self.counts})

    def figure_names(self) -> list[str]:
        """The recipe's own figures, the usual ones (accuracy, reward, loss) first."""
        names = sorted(set(self.figures) | set(self.run_wide))
        return [n for n in PREFERRED_FIGURES if n in names] + [n for n in names if n not in PREFERRED_FIGURES]


# ---- what each device row shows -------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceView:
    """One row of the monitor: a GPU, or on a CPU machine the host or one rank."""

    key: str
    kind: str
    label: str
    values: Mapping[str, float | None]  # the latest sample: every declared sample field, by name
    util_series: tuple[float, ...]
    mem_series: tuple[float, ...]

    @property
    def mem_used_mb(self) -> float | None:
        """What the memory bar fills: a rank's own RSS, a GPU's or the host's memory in use."""
        return self.values.get("run_mem_mb" if self.kind == "rank" else "mem_used_mb")

    @property
    def mem_total_mb(self) -> float | None:
        return self.values.get("mem_total_mb")

    @property
    def mem_text(self) -> str:
        if self.kind == "rank":
            return f"RSS {format_mib(self.mem_used_mb)}"
        return memory_text(self.mem_used_mb, self.mem_total_mb)

    @property
    def detail_text(self) -> str:
        """The fields declared `shown="detail"` (utilization, power, temperature) the device has."""
        return self._shown_text("detail")

    @property
    def wide_text(self) -> str:
        """The fields declared `shown="wide"` (the SM clock), drawn where the terminal has room."""
        return self._shown_text("wide")

    @property
    def fields_text(self) -> str:
        """Every field the device row draws, each with its label and unit ("SM clock 1980 MHz"): the
        row's tooltip, which also tells a narrow terminal what its row leaves out."""
        return " · ".join(f"{f.label} {self.values[f.name]:.0f} {f.unit}" for f in sample_fields.SAMPLE_FIELDS
                          if f.shown in ("detail", "wide") and self.values.get(f.name) is not None)

    def _shown_text(self, shown: str) -> str:
        return " ".join(f.format(self.values[f.name]) for f in sample_fields.SAMPLE_FIELDS
                        if f.shown == shown and self.values.get(f.name) is not None)


def device_label(sample: dict) -> str:
    if sample["kind"] == "gpu":
        return f"GPU {sample['idx']} {short_gpu_name(sample.get('name'))}".strip()
    if sample["kind"] == "host":
        return "host CPU"
    return f"rank {sample['idx']}"


def device_views(feed: RunFeed, now: float, window_s: float) -> list[DeviceView]:
    views = []
    first = int((now - window_s) // feed.resolution_s)
    for key in feed.device_keys():
        buckets = feed.devices[key]
        window = [buckets[b] for b in sorted(buckets) if b >= first]
        latest = buckets[max(buckets)]
        if latest["kind"] == "rank":  # a rank has no utilization: chart its memory instead
            memory = tuple(s["run_mem_mb"] or 0.0 for s in window)
        else:
            memory = tuple(_percent(s["mem_used_mb"], s["mem_total_mb"]) for s in window)
        views.append(
            DeviceView(
                key=key, kind=latest["kind"], label=device_label(latest),
                values={name: latest.get(name) for name in sample_fields.field_names()},
                util_series=tuple(s["util"] or 0.0 for s in window if s["util"] is not None),
                mem_series=memory,
            )
        )
    return views


def _percent(used: float | None, total: float | None) -> float:
    return 100.0 * used / total if used is not None and total else 0.0


@dataclass(frozen=True)
class Series:
    """Points of a chart: x in seconds relative to the window's end (negative = in the past)."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]


def chart_buckets(now: float, window_s: float, points: int, resolution_s: float) -> tuple[float, list[float]]:
    """Width and start times of `points` chart buckets covering the window, aligned to the feed's."""
    width = max(resolution_s, math.ceil(window_s / points / resolution_s) * resolution_s)
    end = math.floor(now / width) * width
    count = max(1, int(window_s // width))
    return width, [end - width * (count - i) for i in range(count)]


def rate_series(feed: RunFeed, name: str, now: float, window_s: float, points: int = 60,
                rank: int | None = None) -> Series:
    """`name` (tokens or samples) per second over the window, for one rank or all of them.

    The chart ends at the last complete bucket: the current one is still filling.
    """
    width, starts = chart_buckets(now, window_s, points, feed.resolution_s)
    tables = [t for (n, r), t in feed.counts.items() if n == name and (rank is None or r == rank)]
    xs, ys = [], []
    for start in starts:
        first, last = int(start / feed.resolution_s), int((start + width) / feed.resolution_s)
        total = sum(table.get(b, 0.0) for table in tables for b in range(first, last))
        xs.append(start + width - now)
        ys.append(total / width)
    return Series(tuple(xs), tuple(ys))


def figure_series(feed: RunFeed, name: str, now: float, window_s: float, points: int = 60) -> Series:
    """The mean of a figure's run-wide values in each chart bucket that has one (for a run recorded
    before the supervisor combined figures over the ranks, the mean over ranks and steps)."""
    width, starts = chart_buckets(now, window_s, points, feed.resolution_s)
    table = feed.run_wide[name] if name in feed.run_wide else feed.figures.get(name, {})
    xs, ys = [], []
    for start in starts:
        first, last = int(start / feed.resolution_s), int((start + width) / feed.resolution_s)
        cells = [table[b] for b in range(first, last) if b in table]
        count = sum(c[1] for c in cells)
        if count:
            xs.append(start + width - now)
            ys.append(sum(c[0] for c in cells) / count)
    return Series(tuple(xs), tuple(ys))


def stored_resolution(duration_s: float | None, buckets: int = 300) -> float:
    """Bucket width for a finished run's charts: a few hundred buckets whatever its length."""
    return float(max(1, math.ceil((duration_s or 1) / buckets)))
