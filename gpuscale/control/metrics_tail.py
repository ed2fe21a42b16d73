"""Rank metrics, the reading side: the supervisor tails the JSON lines the ranks write (through
`gpuscale.engines.reporter.Reporter`, to RUN_DIR/metrics/rank<R>.jsonl) into the store.

`MetricsTailer` reads only complete new lines; `Throughput` turns token and sample counts into
per-rank and total rates over a sliding window, and combines every other figure over the ranks: a
rank logs its own running value (its accuracy so far, its acceptance rate), so the run's figure is
each rank's latest value weighted by the samples that rank has done. The supervisor stores the
combined values as metric rows of rank RUN_WIDE_RANK, which the front ends chart.

`MetricsTailer.step_phases` keeps each rank's logged steps' phase seconds for the run's summary
(data/step_phases.py:summarise).

Every line a rank writes is also its heartbeat (runs/heartbeat.py): `MetricsTailer.take_beats` hands
the supervisor's hang watch (control/hang_watch.py) each rank's lines since the last call, as
`Beat`s: when, at which step, in which phase.
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuscale.data.step_phases import phases_of
from gpuscale.runs import heartbeat

RATE_WINDOW_S = 10.0
# The rank of the metric rows that hold a figure combined over every rank (see Throughput.combined).
RUN_WIDE_RANK = -1


@dataclass(frozen=True)
class Beat:
    """A line a rank wrote: at `t`, at `step` and in `phase` (None where the line does not say: a
    summary, the announced total)."""

    rank: int
    t: float
    step: int | None
    phase: str | None


def beat_of(record: dict) -> Beat:
    """What a metric line says of its rank's progress: a heartbeat its phase and step, a logged step
    that the rank is stepping, a summary or the total only that the rank lives."""
    rank, t = int(record.get("rank", -1)), float(record["t"])
    if heartbeat.BEAT_KEY in record:
        return Beat(rank, t, int(record.get("step", 0)), str(record[heartbeat.BEAT_KEY]))
    if "summary" in record or "total" in record:
        return Beat(rank, t, None, None)
    return Beat(rank, t, int(record.get("step", 0)), heartbeat.STEP)


class MetricsTailer:
    """Reads what ranks appended since the last call; a partly written line waits for the next."""

    def __init__(self, metrics_dir: Path, run_id: int):
        self.metrics_dir = Path(metrics_dir)
        self.run_id = run_id
        self._offsets: dict[Path, int] = {}
        self.summaries: dict[int, dict] = {}
        # (figure, rank) -> (first step, "nan" / "inf" / "-inf") while the rank's latest value of the
        # figure is not finite. Such values are not stored (SQLite has no NaN, and one would poison
        # every mean and chart), but a loss that turned nan is the first thing a user must see.
        self._nonfinite: dict[tuple[str, int], tuple[int, str]] = {}
        self._beats: list[Beat] = []
        # rank -> its logged steps' phase -> seconds, in the order logged (data/step_phases.py summarises them).
        self.step_phases: dict[int, list[dict[str, float]]] = {}

    def take_beats(self) -> list[Beat]:
        """The ranks' lines read since the last call, as heartbeats, in the order read."""
        beats, self._beats = self._beats, []
        return beats

    def read_new(self) -> list[dict]:
        rows: list[dict] = []
        for path in sorted(self.metrics_dir.glob("rank*.jsonl")):
            for record in self._new_records(path):
                rows.extend(self._to_rows(record))
        return rows

    def _new_records(self, path: Path) -> list[dict]:
        offset = self._offsets.get(path, 0)
        with open(path, "rb") as handle:
            handle.seek(offset)
            data = handle.read()
        complete = data[: data.rfind(b"\n") + 1]
        self._offsets[path] = offset + len(complete)
        records = []
        for line in complete.splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a rank killed mid-write leaves a torn line; the rest is still good
        return records

    def _to_rows(self, record: dict) -> list[dict]:
        rank = int(record.get("rank", -1))
        if "t" in record:
            self._beats.append(beat_of(record))
        if "summary" in record:
            # Each summary record is merged over the earlier ones: a partial one (figures so far,
            # the run going on) stays marked partial until a whole one comes.
            merged = {key: value for key, value in self.summaries.get(rank, {}).items() if key != "partial"}
            merged.update(record["summary"])
            if record.get("partial"):
                merged["partial"] = True
            self.summaries[rank] = merged
            return []
        if seconds := phases_of(record):
            self.step_phases.setdefault(rank, []).append(seconds)
        t, step = float(record["t"]), int(record.get("step", 0))
        rows = []
        for name, value in record.items():
            if name in ("t", "rank", "step") or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                self._nonfinite.pop((name, rank), None)
                rows.append({"run_id": self.run_id, "rank": rank, "t": t, "step": step, "name": name, "value": value})
            else:
                self._nonfinite.setdefault((name, rank), (step, str(float(value))))
        return rows

    def nonfinite(self) -> dict[str, dict]:
        """The figures whose latest value (on some rank) is not finite: `{"loss": {"step": 168,
        "value": "nan"}}`, the step where it turned so (the earliest over the ranks)."""
        found: dict[str, dict] = {}
        for (name, _rank), (step, text) in sorted(self._nonfinite.items()):
            if name not in found or step < found[name]["step"]:
                found[name] = {"step": step, "value": text}
        return found


class Throughput:
    """Per-rank and total tokens/s and samples/s over the last RATE_WINDOW_S seconds, every other
    metric combined over the ranks, the step reached and the total announced by the ranks."""

    COUNTS = ("tokens", "samples")

    def __init__(self):
        self._events: dict[tuple[str, int], deque] = {}
        self.by_rank: dict[str, dict[int, float]] = {}  # figure -> rank -> the rank's latest value
        self.counted: dict[tuple[str, int], float] = {}  # (tokens or samples, rank) -> count so far
        self.step: dict[int, int] = {}
        self.totals: dict[int, int] = {}
        self.cumulative: dict[str, float] = {name: 0.0 for name in self.COUNTS}
        self.first_t: float | None = None
        self.last_t: float | None = None
        # When the ranks' first step was seen, and that step: the pace of the run's steps is measured
        # from there, not from its start (loading the model and the evaluation before training are
        # minutes of a short run on a shared card, and would multiply its ETA many times early on).
        self.paced_from: tuple[float, int] | None = None
        self._changed: dict[str, float] = {}  # figure -> time of its newest row since run_wide_rows

    def add(self, rows: list[dict]) -> None:
        for row in rows:
            name, rank, t = row["name"], row["rank"], row["t"]
            self.first_t = t if self.first_t is None else min(self.first_t, t)
            self.last_t = t if self.last_t is None else max(self.last_t, t)
            if name == "total":
                self.totals[rank] = int(row["value"])
                continue
            self.step[rank] = max(self.step.get(rank, 0), row["step"])
            if name in self.COUNTS:
                self._events.setdefault((name, rank), deque()).append((t, row["value"]))
                self.cumulative[name] += row["value"]
                self.counted[name, rank] = self.counted.get((name, rank), 0.0) + row["value"]
            else:
                self.by_rank.setdefault(name, {})[rank] = row["value"]
                self._changed[name] = max(t, self._changed.get(name, t))

    def combined(self, name: str) -> float:
        """The run's value of a figure: each rank's latest value weighted by the samples that rank
        has done, so running means (accuracy, acceptance rate) combine into the run's own mean. A
        plain mean over the ranks where none counts samples (a benchmark logs samples=0)."""
        values = self.by_rank[name]
        weights = {rank: self.counted.get(("samples", rank), 0.0) for rank in values}
        weight = sum(weights.values())
        if weight <= 0:
            return sum(values.values()) / len(values)
        return sum(values[rank] * weights[rank] for rank in values) / weight

    @property
    def latest(self) -> dict[str, float]:
        return {name: self.combined(name) for name in self.by_rank}

    def run_wide_rows(self, run_id: int) -> list[dict]:
        """Metric rows of rank RUN_WIDE_RANK for the figures that changed since the last call."""
        step = min(self.step.values()) if self.step else 0
        rows = [{"run_id": run_id, "rank": RUN_WIDE_RANK, "t": t, "step": step, "name": name,
                 "value": self.combined(name)} for name, t in sorted(self._changed.items())]
        self._changed.clear()
        return rows

    def rates(self, name: str, now: float) -> dict[int, float]:
        """Count per second for each rank: what it logged in the window over the window's span."""
        result = {}
        for (metric, rank), events in self._events.items():
            if metric != name:
                continue
            while events and events[0][0] < now - RATE_WINDOW_S:
                events.popleft()
            if len(events) >= 2:
                span = events[-1][0] - events[0][0]
                result[rank] = sum(v for _, v in list(events)[1:]) / span if span > 0 else 0.0
        return result

    def average_rates(self, name: str) -> dict[int, float]:
        """Count per second for each rank over the whole run (first row to last), for a finished run."""
        span = (self.last_t or 0.0) - (self.first_t or 0.0)
        return {rank: count / span for (metric, rank), count in self.counted.items() if metric == name and span > 0}

    def progress(self, now: float, finished: bool = False) -> dict[str, Any]:
        """Where the run is; `finished`: its rates are the averages over the whole run, not the last
        RATE_WINDOW_S seconds (which, once the ranks have stopped, hold nothing)."""
        if finished:
            tokens, samples = self.average_rates("tokens"), self.average_rates("samples")
        else:
            tokens, samples = self.rates("tokens", now), self.rates("samples", now)
        done = min(self.step.values()) if self.step else 0
        total = max(self.totals.values()) if self.totals else None
        if self.paced_from is None and done:
            self.paced_from = (self.last_t or now, done)
        return {
            "t": now,
            "step": done,
            "total": total,
            **({"paced_from_t": self.paced_from[0], "paced_from_step": self.paced_from[1]} if self.paced_from else {}),
            "tokens_per_s": sum(tokens.values()),
            "samples_per_s": sum(samples.values()),
            "tokens_per_s_by_rank": {str(r): v for r, v in sorted(tokens.items())},
            "tokens": self.cumulative["tokens"],
            "samples": self.cumulative["samples"],
            "latest": self.latest,
        }
