"""What the live monitor shows about a run, worked out without any UI (no textual, no torch).

The TUI's monitor is a thin face over this module:

- `RunFeed` reads one run's new rows from the store on each poll and keeps them in time buckets:
  per device (GPU, or host and ranks on a CPU machine) the last sample of each bucket, per rank the
  tokens and samples counted, per figure (loss, reward, ...) the mean. It reads by rowid, not by
  time, so rows that a slow rank wrote late are never skipped, and a poll costs what is new only.
- `device_views`, `rate_series`, `figure_series`: what each row, sparkline and chart shows over a
  window the user picks.
- `waste_warnings`: the waste the seeds complain about, pointed out while it happens: idle GPUs,
  GPUs with most of their memory unused, GPUs of the machine the run does not use, a straggling rank.
- `LogTail`: the last lines of each rank's log, read incrementally.
- `status_line`, `throughput_text`, `launch_preview`: the texts around them.

Everything takes `now` as an argument, so that tests and snapshots can freeze the clock.
"""

from __future__ import annotations

import math
import os
import re
import shlex
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from gpuscale.engines.history import KEY_FIGURES, eta_s, format_duration

# Chart windows the user cycles through (seconds); a live feed keeps the longest.
WINDOWS_S = (60, 300, 900, 3600)
KEEP_S = max(WINDOWS_S)
# A live chart ends this long before now: the ranks' lines of the last second or two reach the store
# only with the supervisor's next tick, and a half-filled last bucket would draw a false drop.
LIVE_LAG_S = 2.0

# Waste rules. A GPU below IDLE_UTIL_PERCENT on average over WASTE_WINDOW_S is idle; one whose memory
# in use stays below LOW_MEMORY_FRACTION could take a larger batch. Averages over a window (and only
# once the ranks do work) keep a checkpoint, an eval pass or model loading from raising false alarms.
IDLE_UTIL_PERCENT = 5.0
LOW_MEMORY_FRACTION = 0.25
WASTE_WINDOW_S = 30.0
MIN_SAMPLES = 3
STRAGGLER_RATIO = 0.7

COUNT_NAMES = ("tokens", "samples")
PREFERRED_FIGURES = ("accuracy", "reward", "loss")
NOT_FIGURES = set(COUNT_NAMES) | {"total"}
SAMPLE_FIELDS = ("mem_used_mb", "mem_total_mb", "util", "power_w", "temp_c", "run_mem_mb")

SPARK_BARS = "▁▂▃▄▅▆▇█"


# ---- formatting ----------------------------------------------------------------------------------


def format_figure(value: Any) -> str:
    """A summary figure for people: `0.6931`, `261`, `10,412` (never `1.041e+04`), lists item by item."""
    if isinstance(value, bool) or not isinstance(value, (int, float, list)):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(format_figure(v) for v in value) + "]"
    if isinstance(value, int) or abs(value) >= 1e4:
        return f"{value:,.0f}"
    return f"{value:.4g}"


def key_figures_text(run: dict, limit: int = 2) -> str:
    """The history table's figures column: the first `limit` of history.KEY_FIGURES the run has."""
    summary = run.get("summary") or {}
    shown = [f"{name} {format_figure(summary[name])}" for name in KEY_FIGURES if name in summary]
    return ", ".join(shown[:limit])


def format_mib(mb: float | None) -> str:
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
    return [max(values[int(i * step): max(int(i * step) + 1, int((i + 1) * step))]) for i in range(width)]


# ---- the feed: one run's rows, incrementally -----------------------------------------------------


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
    first_work_t: float | None = None  # when the first token or sample was counted
    _sample_rowid: int = 0
    _metric_rowid: int = 0
    _read_once: bool = False

    def poll(self, store, now: float) -> bool:
        """Read what was added since the last poll; True if anything was."""
        db = store.db
        sample_bound = db.execute("SELECT max(rowid) FROM samples").fetchone()[0] or 0
        metric_bound = db.execute("SELECT max(rowid) FROM metrics").fetchone()[0] or 0
        since = now - self.keep_s
        if self._read_once:
            # Rowid range first (the unary + keeps SQLite off the run_id index): a poll costs the new rows only.
            where, args = "rowid > ? AND rowid <= ? AND +run_id = ?", [self._sample_rowid, sample_bound, self.run_id]
            mwhere, margs = "rowid > ? AND rowid <= ? AND +run_id = ?", [self._metric_rowid, metric_bound, self.run_id]
        else:
            where, args = "run_id = ? AND t > ? AND rowid <= ?", [self.run_id, since, sample_bound]
            mwhere, margs = "run_id = ? AND t > ? AND rowid <= ?", [self.run_id, since, metric_bound]
        res = self.resolution_s
        samples = db.execute(
            f"SELECT kind, idx, name, CAST(t / {res} AS INTEGER) AS b, max(t), avg(mem_used_mb), max(mem_total_mb), "
            f"avg(util), avg(power_w), avg(temp_c), avg(run_mem_mb) FROM samples WHERE {where} GROUP BY kind, idx, b",
            args,
        ).fetchall()
        metrics = db.execute(
            f"SELECT name, rank, CAST(t / {res} AS INTEGER) AS b, sum(value), count(*), min(t) FROM metrics "
            f"WHERE {mwhere} GROUP BY name, rank, b",
            margs,
        ).fetchall()
        self._sample_rowid, self._metric_rowid, self._read_once = sample_bound, metric_bound, True
        self._add_samples(samples)
        self._add_metrics(metrics)
        self._forget_before(since)
        return bool(samples or metrics)

    def _add_samples(self, rows: Iterable[tuple]) -> None:
        for kind, idx, name, bucket, t, *values in rows:
            key = device_key(kind, idx)
            self.device_names[key] = name or key
            sample = {"kind": kind, "idx": idx, "name": name, "t": t, **dict(zip(SAMPLE_FIELDS, values))}
            self.devices.setdefault(key, {})[bucket] = sample  # a later sample of the same bucket wins

    def _add_metrics(self, rows: Iterable[tuple]) -> None:
        for name, rank, bucket, total, count, first_t in rows:
            if name in COUNT_NAMES:
                buckets = self.counts.setdefault((name, rank), {})
                buckets[bucket] = buckets.get(bucket, 0.0) + total
                if total > 0:
                    self.first_work_t = first_t if self.first_work_t is None else min(self.first_work_t, first_t)
            elif name not in NOT_FIGURES:
                cell = self.figures.setdefault(name, {}).setdefault(bucket, [0.0, 0])
                cell[0] += total
                cell[1] += count

    def _forget_before(self, since: float) -> None:
        if math.isinf(self.keep_s):
            return
        oldest = int(since / self.resolution_s)
        for table in (*self.devices.values(), *self.counts.values(), *self.figures.values()):
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
        return [s for buckets in self.devices.values() for b, s in sorted(buckets.items()) if b >= first and s["t"] >= since]

    def ranks(self) -> list[int]:
        return sorted({rank for (_name, rank) in self.counts})

    def figure_names(self) -> list[str]:
        """The recipe's own figures, the usual ones (accuracy, reward, loss) first."""
        names = sorted(self.figures)
        return [n for n in PREFERRED_FIGURES if n in names] + [n for n in names if n not in PREFERRED_FIGURES]


# ---- views over a window -------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceView:
    """One row of the monitor: a GPU, or on a CPU machine the host or one rank."""

    key: str
    kind: str
    label: str
    mem_used_mb: float | None
    mem_total_mb: float | None
    util: float | None
    power_w: float | None
    temp_c: float | None
    run_mem_mb: float | None
    util_series: tuple[float, ...]
    mem_series: tuple[float, ...]

    @property
    def mem_text(self) -> str:
        if self.kind == "rank":
            return f"RSS {format_mib(self.run_mem_mb)}"
        return memory_text(self.mem_used_mb, self.mem_total_mb)

    @property
    def detail_text(self) -> str:
        """Utilization, power and temperature where the device has them."""
        parts = []
        if self.util is not None:
            parts.append(f"{self.util:3.0f}%")
        if self.power_w is not None:
            parts.append(f"{self.power_w:4.0f} W")
        if self.temp_c is not None:
            parts.append(f"{self.temp_c:3.0f}°C")
        return " ".join(parts)


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
                mem_used_mb=latest["run_mem_mb"] if latest["kind"] == "rank" else latest["mem_used_mb"],
                mem_total_mb=latest["mem_total_mb"], util=latest["util"], power_w=latest["power_w"],
                temp_c=latest["temp_c"], run_mem_mb=latest["run_mem_mb"],
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
    """The mean of a figure (over ranks and steps) in each chart bucket that has one."""
    width, starts = chart_buckets(now, window_s, points, feed.resolution_s)
    table = feed.figures.get(name, {})
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


# ---- waste ---------------------------------------------------------------------------------------


def waste_warnings(
    samples: list[dict],
    now: float,
    working_since: float | None,
    tokens_by_rank: dict | None = None,
    machine_gpus: list[dict] | None = None,
    window_s: float = WASTE_WINDOW_S,
) -> list[str]:
    """Waste worth pointing out now, one line each, from plain sample dicts (rows of `samples`).

    `working_since` is when the ranks first counted tokens or samples: before that the run is
    loading, and an idle GPU is no waste yet (None: no warning at all).
    """
    if working_since is None:
        return []
    since = max(now - window_s, working_since)
    recent = [s for s in samples if s["kind"] == "gpu" and s["t"] >= since]
    by_gpu: dict[int, list[dict]] = {}
    for sample in recent:
        by_gpu.setdefault(sample["idx"], []).append(sample)
    judged = {idx: rows for idx, rows in sorted(by_gpu.items()) if len(rows) >= MIN_SAMPLES}
    warnings = []
    warnings += _idle_gpus(judged)
    warnings += _low_memory_gpus(judged)
    warnings += _unused_gpus(judged, machine_gpus)
    warnings += _stragglers(tokens_by_rank or {})
    return warnings


def _mean(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def _idle_gpus(judged: dict[int, list[dict]]) -> list[str]:
    idle = [idx for idx, rows in judged.items() if (_mean(r["util"] for r in rows) or 0.0) < IDLE_UTIL_PERCENT]
    if not idle:
        return []
    if len(idle) == len(judged):
        return [f"all {len(judged)} GPU(s) idle: the ranks wait on the CPU, data or each other"]
    return [f"{len(idle)} of {len(judged)} GPUs idle ({_gpu_list(idle)})"]


def _low_memory_gpus(judged: dict[int, list[dict]]) -> list[str]:
    low = {}
    for idx, rows in judged.items():
        fraction = _mean(r["mem_used_mb"] / r["mem_total_mb"] for r in rows
                         if r["mem_total_mb"] and r["mem_used_mb"] is not None)
        if fraction is not None and fraction < LOW_MEMORY_FRACTION:
            low[idx] = fraction
    if len(low) <= 2:  # one line per GPU while that stays short ...
        return [f"GPU {idx}: {100 * f:.0f}% of memory in use — raise batch_size" for idx, f in low.items()]
    spread = _percent_range([100 * f for f in low.values()])
    return [f"{_gpu_list(list(low))}: {spread} of memory in use — raise batch_size"]


def _percent_range(percents: list[float]) -> str:
    """`6%`, or `4-9%` when they differ."""
    lowest, highest = round(min(percents)), round(max(percents))
    return f"{lowest}%" if lowest == highest else f"{lowest}-{highest}%"


def _unused_gpus(judged: dict[int, list[dict]], machine_gpus: list[dict] | None) -> list[str]:
    """GPUs of this machine that sit idle outside the run: the "1 GPU of 8" of the seeds."""
    if not machine_gpus or not judged:
        return []
    others = [g for g in machine_gpus if g["index"] not in judged]
    idle = [g["index"] for g in others if (g.get("util") or 0) < IDLE_UTIL_PERCENT
            and g["mem_used_mb"] < LOW_MEMORY_FRACTION * g["mem_total_mb"]]
    if not idle:
        return []
    return [f"the run uses {len(judged)} of {len(machine_gpus)} GPUs; {_gpu_list(idle)} idle — set gpus=all"]


def _stragglers(tokens_by_rank: dict) -> list[str]:
    """Ranks well below the fastest: in a synchronous job every rank waits for them."""
    rates = {int(rank): rate for rank, rate in tokens_by_rank.items() if rate is not None}
    if len(rates) < 2 or max(rates.values()) <= 0:
        return []
    fastest = max(rates.values())
    slow = {rank: 100 * rate / fastest for rank, rate in sorted(rates.items()) if rate < STRAGGLER_RATIO * fastest}
    if not slow:
        return []
    if len(slow) == 1:
        (rank, percent), = slow.items()
        return [f"rank {rank} at {percent:.0f}% of the top rank's speed — every rank waits for it"]
    names = _gpu_list(list(slow), noun="ranks")
    return [f"{names} at {_percent_range(list(slow.values()))} of the top rank's speed — every rank waits for them"]


def _gpu_list(indices: list[int], noun: str = "GPU") -> str:
    """`GPU 3` or `GPU 1,4,5`; a run of 3 or more as `GPU 4-7`."""
    indices = sorted(indices)
    parts, start = [], 0
    while start < len(indices):
        end = start
        while end + 1 < len(indices) and indices[end + 1] == indices[end] + 1:
            end += 1
        span = indices[start: end + 1]
        parts.append(f"{span[0]}-{span[-1]}" if len(span) >= 3 else ",".join(map(str, span)))
        start = end + 1
    return f"{noun} " + ",".join(parts)


# ---- texts around the charts ---------------------------------------------------------------------


def elapsed_s(run: dict, now: float) -> float | None:
    if not run.get("started_at"):
        return None
    return (run.get("ended_at") or now) - run["started_at"]


def status_line(run: dict, now: float) -> str:
    """`running · 1:23 elapsed · step 40/100 (40%) · ETA 2:04`."""
    progress = run.get("progress") or {}
    parts = [run["status"], f"{format_duration(elapsed_s(run, now))} elapsed"]
    step, total = progress.get("step") or 0, progress.get("total")
    if total:
        parts.append(f"step {step}/{total} ({100 * step / total:.0f}%)")
        eta = eta_s(progress, run.get("started_at")) if run["status"] == "running" else None
        if eta is not None:
            parts.append(f"ETA {format_duration(eta)}")
    elif step:
        parts.append(f"step {step}")
    return " · ".join(parts)


def throughput_text(progress: dict) -> str:
    """`tokens/s 4,210 · samples/s 12.0`: the whole run's rates."""
    tokens, samples = progress.get("tokens_per_s") or 0.0, progress.get("samples_per_s") or 0.0
    return f"tokens/s {_rate(tokens)} · samples/s {samples:,.1f}"


def per_rank_text(progress: dict) -> str:
    """`tokens/s per rank: 1,060 1,050 1,052 1,048` (rank order); empty for a single rank."""
    by_rank = progress.get("tokens_per_s_by_rank") or {}
    if len(by_rank) < 2:
        return ""
    rates = [_rate(v) for _, v in sorted(by_rank.items(), key=lambda kv: int(kv[0]))]
    return "tokens/s per rank: " + " ".join(rates)


def _rate(value: float) -> str:
    return f"{value:,.1f}" if value < 100 else f"{value:,.0f}"


def figures_text(progress: dict, limit: int = 4) -> str:
    """The recipe's latest figures, the usual ones first: `loss 1.23 · reward 0.5`."""
    latest = progress.get("latest") or {}
    names = [n for n in PREFERRED_FIGURES if n in latest] + sorted(n for n in latest if n not in PREFERRED_FIGURES)
    return " · ".join(f"{name} {format_figure(latest[name])}" for name in names[:limit])




# ---- the launch screen's preview -----------------------------------------------------------------


def launch_preview(recipe, settings, plan, home: Path, environ: dict | None = None) -> str:
    """The launcher command the run will execute. Its run folder is known only once it starts (NEW
    stands for its id), and the store's folder is written as the user set it ($GPUSCALE_HOME or ~)."""
    from gpuscale.engines.launch import display_command, launcher_argv

    settings_path = Path(home) / "runs" / "NEW" / "settings.json"
    command = display_command(launcher_argv(recipe, settings, plan, settings_path))
    return command.replace(str(home), home_text(Path(home), os.environ if environ is None else environ))


def home_text(home: Path, environ) -> str:
    """`$GPUSCALE_HOME` when that is where the store is, else the path with `~` for the home folder."""
    if environ.get("GPUSCALE_HOME") and Path(environ["GPUSCALE_HOME"]).expanduser() == home:
        return "$GPUSCALE_HOME"
    try:
        return "~/" + str(home.relative_to(Path.home()))
    except ValueError:
        return str(home)


SHELL_FLAGS = {"gpus": "--gpus", "batch_size": "--batch-size", "precision": "--precision", "model": "--model",
               "dataset": "--dataset"}


def shell_equivalent(recipe_name: str, settings) -> str:
    """The same run from a shell: `gpuscale run --recipe NAME` plus every setting that differs from
    the recipe's default (the environment may still add its own; the TUI form already shows them)."""
    defaults = type(settings).model_construct().model_dump()
    argv = ["gpuscale", "run", "--recipe", recipe_name]
    for name, value in settings.model_dump().items():
        if value == defaults.get(name):
            continue
        text = ",".join(map(str, value)) if isinstance(value, list) else ("" if value is None else str(value))
        argv += [SHELL_FLAGS[name], text] if name in SHELL_FLAGS else ["--set", f"{name}={text}"]
    return shlex.join(argv)


# ---- logs ----------------------------------------------------------------------------------------


class LogTail:
    """The last lines of each rank's log (and the launcher's), read incrementally by byte offset."""

    FIRST_READ_BYTES = 32 * 1024

    def __init__(self, log_dir: str | Path, keep_lines: int = 200):
        self.log_dir = Path(log_dir)
        self.keep_lines = keep_lines
        self._offsets: dict[str, int] = {}
        self._lines: dict[str, deque[str]] = {}

    def sources(self) -> list[str]:
        """`rank0`, `rank1`, ... by rank, then `launcher`."""
        ranks = sorted((s for s in self._lines if s.startswith("rank")), key=lambda s: int(s[4:] or 0))
        return ranks + [s for s in self._lines if not s.startswith("rank")]

    def read_new(self) -> int:
        """Read what the logs gained since the last call; returns how many lines were added."""
        added = 0
        for path in sorted(self.log_dir.glob("*.log")):
            source = path.stem
            if source == "supervisor" or not (source.startswith("rank") or source == "launcher"):
                continue
            added += self._read_file(path, source)
        return added

    def _read_file(self, path: Path, source: str) -> int:
        try:
            size = path.stat().st_size
        except OSError:
            return 0
        offset = self._offsets.get(source)
        if offset is None:
            offset = max(0, size - self.FIRST_READ_BYTES)
        if size <= offset:
            return 0
        with open(path, "rb") as handle:
            handle.seek(offset)
            data = handle.read(size - offset)
        complete = data[: data.rfind(b"\n") + 1]
        lines = complete.decode(errors="replace").splitlines()
        if offset and source not in self._offsets and lines:
            lines = lines[1:]  # the first read started mid-line
        self._offsets[source] = offset + len(complete)
        self._lines.setdefault(source, deque(maxlen=self.keep_lines)).extend(lines)
        return len(lines)

    def lines(self, source: str | None = None) -> list[str]:
        """The kept lines of one source, or of all (each prefixed with its source)."""
        if source is not None:
            return list(self._lines.get(source, ()))
        return [f"[{s}] {line}" for s in self.sources() for line in self._lines[s]]
