"""A run exported as a file: the CLI's `gpuscale export` and the TUI's export dialog write the same text.

JSON holds everything in one document: the run's record (with its settings and summary), what its
summary's figures count where a note says (`figure_notes`), its metrics, telemetry samples and
per-item results. A CSV file is one table, so it holds one part (`what`):
`metrics` (one row per logged value: run_id, rank, t, step, name, value; rank -1 is a figure
combined over every rank), `summary` (name, value, and note: what the figure counts where a note
says, as `gpuscale show` writes it: the whole run's tokens/s and the steady one) or `results` (one
row per item of results.jsonl, lists such as token ids written as JSON). A part the run has nothing in is refused
(`NothingToExport`), not written as an empty file.
"""

from __future__ import annotations

import csv
import io
import json

from gpuscale.app.views.runs import figure_note, figure_notes
from gpuscale.control.store import METRIC_COLUMNS, Store

FORMATS = ("json", "csv")
PARTS = ("metrics", "summary", "results")
# Why a part can be empty, said where it is.
EMPTY_PART = {
    "metrics": "its ranks logged no metrics",
    "summary": "its summary is empty",
    "results": "it has no per-item results (no results.jsonl in its folder: its recipe writes none, "
               "or it ended before any)",
}


class NothingToExport(ValueError):
    """The part asked for holds nothing; one line naming the run, the part and why."""


def export_text(store: Store, run_id: int, fmt: str, what: str | None = None) -> str:
    """The run as `fmt`: JSON, the whole record or only the part `what`; CSV, the part `what`
    (metrics unless told)."""
    if fmt not in FORMATS:
        raise ValueError(f"format: {fmt!r}: expected one of {', '.join(FORMATS)}")
    if what is not None and what not in PARTS:
        raise ValueError(f"what: {what!r}: expected one of {', '.join(PARTS)}")
    run = store.get_run(run_id)
    if fmt == "json":
        if what is None:
            record = {"run": run, "figure_notes": summary_notes(run), "metrics": store.metrics(run["id"]),
                      "samples": store.samples(run["id"]), "results": store.results(run["id"])}
            return json.dumps(record, indent=2)
        return json.dumps(_part(store, run, what), indent=2)
    what = what or "metrics"
    part = _part(store, run, what)
    if what == "metrics":
        return _csv(part, METRIC_COLUMNS)
    if what == "summary":
        notes = summary_notes(run)
        rows = [{"name": name, "value": _cell(value), "note": notes.get(name, "")} for name, value in part.items()]
        return _csv(rows, ("name", "value", "note"))
    rows = part
    columns = list(dict.fromkeys(key for row in rows for key in row))  # every key, in first-seen order
    return _csv([{key: _cell(value) for key, value in row.items()} for row in rows], columns)


def summary_notes(run: dict) -> dict[str, str]:
    """What each figure of the run's summary counts, where a note says (app/views/runs.py:figure_note)."""
    notes = figure_notes(run["recipe"])
    return {name: note for name in run["summary"] or {} if (note := figure_note(name, notes))}


def _part(store: Store, run: dict, what: str):
    if what == "metrics":
        found = store.metrics(run["id"])
    elif what == "summary":
        found = run["summary"] or {}
    else:
        found = store.results(run["id"])
    if not found:
        raise NothingToExport(f"run {run['id']}: nothing to export: {EMPTY_PART[what]}")
    return found


def _cell(value):
    """A CSV cell: numbers and text as they are, lists and mappings as JSON, None as empty."""
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return "" if value is None else value


def _csv(rows: list[dict], columns) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(columns), extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()
