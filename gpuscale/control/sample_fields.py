"""The fields of a telemetry sample, declared once.

A sample is one device at one tick: a GPU (through NVML), or on a machine without NVML the host or one
rank (through psutil). Its identity (run, time, kind, index, name) is the store's own; everything measured
is a `SampleField` below, and the rest follows from this list by name:

- `control/store.py`: the `samples` table's columns (created from it, and added where an older history lacks
  one, with its rows kept), the supervisor's inserts, and the monitor's bucketed SELECT;
- `control/telemetry.py`: the sampler fills each field by its name (`NVML_READS` for the one-query fields);
- `app/views/feed.py`: every field of the latest sample reaches `DeviceView.values` by name, and its text
  in the device row follows `shown` and `text`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Where a field is drawn in the monitor's device row (`app/views/feed.py:DeviceView`).
SHOWN = {
    "memory": "the row's memory bar and its text (read by name there: used, total, the run's own)",
    "detail": "the row's detail text, at any width",
    "wide": "after the detail text, in a terminal of 100 columns or more",
    "": "stored and exported only",
}
BUCKET_AGGREGATES = ("avg", "max")  # SQL aggregates: how the monitor combines a time bucket's samples
SQL_TYPES = (float, int, str)  # as sqlite-utils takes a column's type: REAL, INTEGER, TEXT


@dataclass(frozen=True)
class SampleField:
    """One measured value of a sample: a column of `samples` and a key of a sample's dict."""

    name: str  # the column and the dict key; interpolated into SQL, so a plain identifier
    sql_type: type
    label: str  # what a person reads ("power")
    unit: str  # "W", "MiB", "%"
    bucket: str = "avg"
    shown: str = ""
    text: str = ""  # how a value is written where shown, e.g. "{:4.0f} W" (fixed width: the row does not jump)

    def __post_init__(self):
        problems = {
            "name": (self.name, re.fullmatch(r"[a-z][a-z0-9_]*", self.name), "a lower-case identifier"),
            "sql_type": (self.sql_type, self.sql_type in SQL_TYPES, "one of float, int, str"),
            "bucket": (self.bucket, self.bucket in BUCKET_AGGREGATES, f"one of {', '.join(BUCKET_AGGREGATES)}"),
            "shown": (self.shown, self.shown in SHOWN, f"one of {', '.join(map(repr, SHOWN))}"),
            "text": (self.text, not self.shown or self.shown == "memory" or self.text, "a format where it is shown"),
        }
        for attribute, (value, ok, expected) in problems.items():
            if not ok:
                raise ValueError(f"sample field {self.name!r}: {attribute} = {value!r}: must be {expected}")

    def format(self, value: float) -> str:
        return self.text.format(value)


SAMPLE_FIELDS: tuple[SampleField, ...] = (
    SampleField("mem_used_mb", float, "memory used", "MiB", shown="memory"),
    SampleField("mem_total_mb", float, "memory", "MiB", bucket="max", shown="memory"),
    SampleField("util", float, "utilization", "%", shown="detail", text="{:3.0f}%"),
    SampleField("power_w", float, "power", "W", shown="detail", text="{:4.0f} W"),
    SampleField("temp_c", float, "temperature", "°C", shown="detail", text="{:3.0f}°C"),
    SampleField("sm_clock_mhz", float, "SM clock", "MHz", shown="wide", text="{:4.0f} MHz"),
    SampleField("run_mem_mb", float, "the run's memory", "MiB", shown="memory"),
    # The share of the card's time its kernels ran, from NVML's per-process utilization (as `nvidia-smi pmon`):
    # on a card several runs share, `util` is the card's and this is the run's own.
    SampleField("run_util", float, "the run's own utilization", "%", shown="wide", text="own {:3.0f}%"),
)


def field_names() -> tuple[str, ...]:
    return tuple(f.name for f in SAMPLE_FIELDS)
