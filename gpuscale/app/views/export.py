"""A run exported as a file: the CLI's `gpuscale export` and the TUI's export dialog write the same text."""

from __future__ import annotations

import csv
import io
import json

from gpuscale.engines.store import METRIC_COLUMNS, Store

FORMATS = ("json", "csv")


def export_text(store: Store, run_id: int, fmt: str) -> str:
    """`json`: the run's record, metrics, telemetry samples and per-item results, in one document;
    `csv`: its metrics, one row each (what a spreadsheet or pandas reads)."""
    if fmt not in FORMATS:
        raise ValueError(f"format: {fmt!r}: expected one of {', '.join(FORMATS)}")
    run = store.get_run(run_id)
    metrics = store.metrics(run["id"])
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=METRIC_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(metrics)
        return out.getvalue()
    record = {"run": run, "metrics": metrics, "samples": store.samples(run["id"]), "results": store.results(run["id"])}
    return json.dumps(record, indent=2)
