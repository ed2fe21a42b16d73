"""One run in words: its progress line, throughput and figures, its row in a table of runs, and two
runs compared. The CLI prints these, the TUI lays them out; both read them here."""

from __future__ import annotations

from gpuscale.app.views.text import format_duration, format_number, format_rate, format_time
from gpuscale.runs.store import LIVE_STATUSES

# Summary figures worth a column in a table of runs, in order of preference (`accuracy_greedy_after`:
# the held-out accuracy every training recipe ends with, named the same in all of them).
KEY_FIGURES = ("accuracy", "accuracy_greedy_after", "reward", "loss", "tokens_per_s", "samples_per_s",
               "problems_per_s")
# The figures a recipe reports as it goes that people look for first (`phase`: which part of a run
# of several parts is running, e.g. rft's generate / train / evaluate; `accuracy_greedy`: eggroll's
# held-out accuracy every eval_every steps).
PREFERRED_FIGURES = ("accuracy", "accuracy_greedy", "reward", "loss", "phase")
# A table of runs: the CLI's `gpuscale runs` and the TUI's history. The TUI's history cuts the figures
# to the room left at its width, so that the start time stays on screen at 80 columns.
RUN_COLUMNS = ("ID", "Recipe", "Status", "Duration", "Figures", "Started")


def run_title(run: dict) -> str:
    """`run 3 probe`, and its label where it has one: `run 3 probe (baseline)`."""
    title = f"run {run['id']} {run['recipe']}"
    return f"{title} ({run['label']})" if run.get("label") else title


def elapsed_s(run: dict, now: float) -> float | None:
    """Time since the run started, up to its end if it ended; None before it started."""
    if not run.get("started_at"):
        return None
    return (run.get("ended_at") or now) - run["started_at"]


def eta_s(progress: dict, started_at: float | None) -> float | None:
    """Time left at the pace so far, from the step count at the progress record's time."""
    step, total, at = progress.get("step") or 0, progress.get("total"), progress.get("t")
    if not total or not step or not started_at or not at or step >= total:
        return None
    return (at - started_at) * (total - step) / step


def status_line(run: dict, now: float) -> str:
    """`running · 1:23 elapsed · step 40/100 (40%) · ETA 2:04`; `stopping` once a stop was asked for
    (no ETA then), and no elapsed time before the run started."""
    progress = run.get("progress") or {}
    stopping = run["status"] == "running" and progress.get("stopping")
    parts = ["stopping" if stopping else run["status"]]
    if (elapsed := elapsed_s(run, now)) is not None:
        parts.append(f"{format_duration(elapsed)} elapsed")
    step, total = progress.get("step") or 0, progress.get("total")
    if total:
        parts.append(f"step {step}/{total} ({100 * step / total:.0f}%)")
        eta = eta_s(progress, run.get("started_at")) if run["status"] == "running" and not stopping else None
        if eta is not None:
            parts.append(f"ETA {format_duration(eta)}")
    elif step:
        parts.append(f"step {step}")
    return " · ".join(parts)


def throughput_text(progress: dict) -> str:
    """`tokens/s 4,210 · samples/s 12.0`: the whole run's rates."""
    tokens, samples = progress.get("tokens_per_s"), progress.get("samples_per_s")
    return f"tokens/s {format_rate(tokens)} · samples/s {format_rate(samples)}"


def per_rank_text(progress: dict) -> str:
    """`tokens/s per rank: 1,060 1,050 1,052 1,048` (rank order); empty for a single rank."""
    by_rank = progress.get("tokens_per_s_by_rank") or {}
    if len(by_rank) < 2:
        return ""
    rates = [format_rate(v) for _, v in sorted(by_rank.items(), key=lambda kv: int(kv[0]))]
    return "tokens/s per rank: " + " ".join(rates)


def headline_figures(run: dict) -> dict:
    """The figures a run's headline shows: while it runs, the latest ones combined over the ranks
    (the supervisor's progress); once it ended, its summary's value wherever the summary has one,
    so the headline and the summary never disagree."""
    latest = dict((run.get("progress") or {}).get("latest") or {})
    if run["status"] not in LIVE_STATUSES:
        summary = run.get("summary") or {}
        latest.update({name: summary[name] for name in latest if _is_number(summary.get(name))})
    return latest


def figures_text(run: dict, limit: int = 4) -> str:
    """The recipe's figures for the headline, the usual ones first: `reward 0.5 · loss 1.23`."""
    latest = headline_figures(run)
    names = [n for n in PREFERRED_FIGURES if n in latest] + sorted(n for n in latest if n not in PREFERRED_FIGURES)
    return " · ".join(f"{name} {format_number(latest[name])}" for name in names[:limit])


def progress_line(run: dict, now: float) -> str:
    """Everything about a run on one line, for a terminal with no screen (`gpuscale run`, `show`):
    `run 3 probe · running · 1:23 elapsed · step 40/100 (40%) · ETA 2:04 · tokens/s 4,210 · samples/s
    12.0 · loss 1.23`. The rates appear once the ranks report any."""
    progress = run.get("progress") or {}
    parts = [run_title(run), status_line(run, now)]
    if progress.get("tokens_per_s") or progress.get("samples_per_s"):
        parts.append(throughput_text(progress))
    if figures := figures_text(run):
        parts.append(figures)
    return " · ".join(parts)


def key_figures_text(run: dict, limit: int = 2) -> str:
    """A table of runs' figures column: the first `limit` of KEY_FIGURES the run's summary has."""
    summary = run.get("summary") or {}
    shown = [f"{name} {format_number(summary[name])}" for name in KEY_FIGURES if name in summary]
    return ", ".join(shown[:limit])


def run_row(run: dict, now: float) -> tuple[str, ...]:
    """The run's cells under RUN_COLUMNS."""
    return (str(run["id"]), run["recipe"], run["status"], format_duration(elapsed_s(run, now)),
            key_figures_text(run), format_time(run["started_at"]))


# ---- two runs compared -----------------------------------------------------------------------


def compare_runs(a: dict, b: dict) -> dict:
    """The settings that differ; the numeric summary figures both runs have that differ (a, b and
    b - a); and the figures that are the same in both (`same`). A summary entry that is also a setting
    (a recipe echoes `method`, `chains`) is a setting, compared as one, not a figure."""
    keys = sorted(set(a["settings"]) | set(b["settings"]))
    settings_diff = {
        k: [a["settings"].get(k), b["settings"].get(k)] for k in keys if a["settings"].get(k) != b["settings"].get(k)
    }
    figures, same = {}, {}
    for name in sorted((set(a["summary"] or {}) & set(b["summary"] or {})) - set(keys)):
        va, vb = a["summary"][name], b["summary"][name]
        if not (_is_number(va) and _is_number(vb)):
            continue
        if va == vb:
            same[name] = va
        else:
            figures[name] = {"a": va, "b": vb, "delta": vb - va}
    return {
        "a": {"id": a["id"], "recipe": a["recipe"], "status": a["status"]},
        "b": {"id": b["id"], "recipe": b["recipe"], "status": b["status"]},
        "settings": settings_diff,
        "figures": figures,
        "same": same,
    }


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def delta_text(delta: float, a: float) -> str:
    """`+12.5 (+4.1%)`; the relative change only where it means something (a is not zero)."""
    text = ("+" if delta >= 0 else "-") + format_number(abs(delta))
    if a:
        text += f" ({100 * delta / abs(a):+.1f}%)"
    return text
