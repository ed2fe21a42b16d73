"""Reading the run history for people: figures to show, two runs compared, a run exported.

Shared by the CLI and the TUI, so both say the same thing about a run.
"""

from __future__ import annotations

import csv
import io
import json
import time
from pathlib import Path
from typing import Any

from gpuscale.engines.store import Store

# Summary figures worth a column in a table of runs, in order of preference.
KEY_FIGURES = ("accuracy", "reward", "loss", "tokens_per_s", "samples_per_s", "problems_per_s")


def duration_s(run: dict) -> float | None:
    if not run.get("started_at"):
        return None
    return (run.get("ended_at") or time.time()) - run["started_at"]


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def format_time(timestamp: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp)) if timestamp else "-"


def format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def key_figures(run: dict, limit: int = 2) -> str:
    summary = run.get("summary") or {}
    shown = [f"{name} {format_value(summary[name])}" for name in KEY_FIGURES if name in summary]
    return ", ".join(shown[:limit])


def eta_s(progress: dict, started_at: float | None) -> float | None:
    step, total = progress.get("step") or 0, progress.get("total")
    if not total or not step or not started_at or step >= total:
        return None
    elapsed = progress.get("t", time.time()) - started_at
    return elapsed * (total - step) / step


def progress_line(run: dict) -> str:
    """One line: status, elapsed, step/total, ETA, throughput and the recipe's latest figures."""
    progress = run.get("progress") or {}
    parts = [f"run {run['id']} {run['recipe']} {run['status']} {format_duration(duration_s(run))}"]
    if progress.get("total"):
        step, total = progress.get("step", 0), progress["total"]
        eta = eta_s(progress, run.get("started_at"))
        parts.append(f"step {step}/{total} ({100 * step / total:.0f}%)" + (f" ETA {format_duration(eta)}" if eta else ""))
    if progress.get("tokens_per_s"):
        parts.append(f"{progress['tokens_per_s']:,.0f} tok/s")
    if progress.get("samples_per_s"):
        parts.append(f"{progress['samples_per_s']:,.1f} samples/s")
    latest = progress.get("latest") or {}
    shown = [f"{name} {format_value(latest[name])}" for name in ("accuracy", "reward", "loss") if name in latest]
    if shown:
        parts.append(" ".join(shown))
    return " | ".join(parts)


def compare_runs(a: dict, b: dict) -> dict:
    """Settings that differ, and for every numeric summary figure both have: a, b and b - a."""
    keys = sorted(set(a["settings"]) | set(b["settings"]))
    settings_diff = {
        k: [a["settings"].get(k), b["settings"].get(k)] for k in keys if a["settings"].get(k) != b["settings"].get(k)
    }
    figures = {}
    for name in sorted(set(a["summary"]) & set(b["summary"])):
        va, vb = a["summary"][name], b["summary"][name]
        if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and not isinstance(va, bool):
            figures[name] = {"a": va, "b": vb, "delta": vb - va}
    return {
        "a": {"id": a["id"], "recipe": a["recipe"], "status": a["status"]},
        "b": {"id": b["id"], "recipe": b["recipe"], "status": b["status"]},
        "settings": settings_diff,
        "figures": figures,
    }


def read_results(run: dict) -> list[dict]:
    """Per-item results a recipe merged into RUN_DIR/results.jsonl (empty if it writes none)."""
    path = Path(run["run_dir"] or "") / "results.jsonl"
    if not run["run_dir"] or not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def export_run(store: Store, run_id: int, fmt: str) -> str:
    run = store.get_run(run_id)
    metrics = store.metrics(run_id)
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=["run_id", "rank", "t", "step", "name", "value"], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(metrics)
        return out.getvalue()
    return json.dumps(
        {"run": run, "metrics": metrics, "samples": store.samples(run_id), "results": read_results(run)}, indent=2
    )
