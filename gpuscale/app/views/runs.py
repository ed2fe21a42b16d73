"""One run in words: its progress line, throughput and figures, its row in a table of runs, and two
runs compared. The CLI prints these, the TUI lays them out; both read them here."""

from __future__ import annotations

from gpuscale.app.views.text import format_duration, format_number, format_rate, format_time
from gpuscale.control.metrics_tail import RATE_WINDOW_S
from gpuscale.control.run_queue import waits_in_queue
from gpuscale.data.figures import better, figure
from gpuscale.data.step_phases import LIVE_STEPS, WAIT, advice, shares, where_a_step_goes
from gpuscale.data.step_phases import label as phase_label
from gpuscale.runs.resume_check import check_failed, check_line
from gpuscale.runs.statuses import LIVE_STATUSES

# What a training run is for comes first in a table of runs: held-out accuracy before -> after
# training, then (RL) the training reward at the start -> at the end. Each is a (label, pairs) entry:
# the first pair of summary names the run has both of wins; the later pairs are the names older runs
# and other recipes used for the same figure.
LEAD_FIGURES = (
    ("accuracy", (("accuracy_greedy_before", "accuracy_greedy_after"), ("accuracy_before", "accuracy_after"),
                  ("greedy_accuracy_before", "greedy_accuracy_after"))),
    ("sampled accuracy", (("accuracy_sampled_before", "accuracy_sampled_after"),
                          ("sampled_accuracy_before", "sampled_accuracy_after"))),
    ("reward", (("reward_first", "reward_last"), ("fitness_mean_first", "fitness_mean_last"))),
)
# Then single summary figures, in order of preference, to fill the column.
KEY_FIGURES = ("accuracy", "reward", "loss", "tokens_per_s", "samples_per_s", "problems_per_s")
# The figures a recipe reports as it goes that people look for first (`phase`: which part of a run
# of several parts is running, e.g. rft's generate / train / evaluate; `accuracy_greedy`: eggroll's
# held-out accuracy every eval_every steps; `sampling_sampling_logp_difference_mean`: grpo-mtl's policy
# mismatch, the trainer's log-probs of the sampled tokens against the engine's, which TRL's other
# `sampling_` figures would leave out of the headline). How each is written (unit, a share as a
# percentage) is the catalogue's, data/figures.py.
PREFERRED_FIGURES = ("accuracy", "accuracy_greedy", "reward", "loss", "mfu", "sampling_sampling_logp_difference_mean",
                     "phase")
# The summary's record of a resumed run's check (runs/resume_check.py), shown as its line.
RESUME_CHECK = "resume_check"
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
    """Time left at the pace of the steps so far: from the first step the supervisor saw
    (`paced_from_t`, `paced_from_step`: the start's loading and evaluation left out) once a later one
    came, else from the run's start."""
    step, total, at = progress.get("step") or 0, progress.get("total"), progress.get("t")
    if not total or not step or not started_at or not at or step >= total:
        return None
    first_t, first_step = progress.get("paced_from_t"), progress.get("paced_from_step")
    if first_t is not None and first_step is not None and step > first_step and at > first_t:
        return (at - first_t) * (total - step) / (step - first_step)
    return (at - started_at) * (total - step) / step


def status_text(run: dict) -> str:
    """The run's status; a run waiting in the queue (`--queue`) with its place: `queued #2` (#1 is
    the next to start on its host); a run recorded without `--queue` whose supervisor has not yet
    started it: `starting` (its stored status is `queued`, but it waits for nothing)."""
    if run["status"] == "queued" and run.get("queue_position"):
        return f"queued #{run['queue_position']}"
    if run["status"] == "queued" and not waits_in_queue(run):
        return "starting"
    return run["status"]


def status_line(run: dict, now: float) -> str:
    """`running · 1:23 elapsed · step 40/100 (40%) · ETA 2:04`; `stopping` once a stop was asked for
    (no ETA then), and no elapsed time before the run started."""
    progress = run.get("progress") or {}
    stopping = run["status"] == "running" and progress.get("stopping")
    parts = ["stopping" if stopping else status_text(run)]
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


# The label of a live rate: the supervisor's rates are over its last RATE_WINDOW_S seconds, which is
# not the figure a run's summary gives (a recipe times its own loop: probe its decode steps only).
LIVE_RATE = f"last {RATE_WINDOW_S:.0f} s"
# The label of a finished run's rate the summary does not give: the supervisor's count over the time
# from the ranks' first metric row to their last, loading and warm-up steps included.
RUN_AVERAGE = "run average"
# The labels of a summary's two rates where it has both: over all of its timed work, warm-up included,
# and its steady steps' (`tokens_per_s_steady`: recipes/shared/training.py:training_figures; rft's
# `samples_per_s_steady`: its generation's calls, the first left out).
WHOLE_RUN, STEADY = "warm-up included", "steady"


def _rates(run: dict) -> list[tuple[str, float | None, str | None]]:
    """(name, per second, label) of tokens/s and samples/s as a run shows them: live, the windowed
    rates; ended, the summary's figure where it has one (label None: it is the run's own figure, the
    one `gpuscale show` and the history give), else the run average."""
    progress, summary = run.get("progress") or {}, run.get("summary") or {}
    ended = run.get("status") not in LIVE_STATUSES
    rates = []
    for name, key in (("tokens/s", "tokens_per_s"), ("samples/s", "samples_per_s")):
        steady = summary.get(f"{key}_steady")
        if ended and _is_number(summary.get(key)) and _is_number(steady):
            # A training run's two figures, each said for what it is (data/figures.py's notes).
            rates += [(name, summary[key], WHOLE_RUN), (name, steady, STEADY)]
        elif ended and _is_number(summary.get(key)):
            rates.append((name, summary[key], None))
        else:
            rates.append((name, progress.get(key), RUN_AVERAGE if ended else LIVE_RATE))
    return rates


def throughput_text(run: dict) -> str:
    """`tokens/s 4,210 · samples/s 12.0 (last 10 s)` while the run lives; once it ended, the
    summary's figures (`tokens/s 5,219`; a training run's whole-run and steady rates, each labelled:
    `tokens/s 46,210 (warm-up included) · tokens/s 109,000 (steady)`), a rate it lacks as `(run average)`,
    and a rate it lacks that is zero left out. Empty before the ranks report any."""
    rates = _rates(run)
    if not any(value for _, value, _ in rates) and not any(label is None for _, _, label in rates):
        return ""
    if run.get("status") in LIVE_STATUSES:
        return " · ".join(f"{name} {format_rate(value)}" for name, value, _ in rates) + f" ({LIVE_RATE})"
    return " · ".join(f"{name} {format_rate(value)}" + (f" ({label})" if label else "")
                      for name, value, label in rates if label is None or value)


def per_rank_text(run: dict) -> str:
    """`tokens/s per rank (last 10 s): 1,060 1,050` (rank order) while the run lives; once it ended,
    the summary's `tokens_per_s_per_rank` where it has it, else each rank's share of the summary's
    `tokens_per_s` (by the tokens it counted), so that the ranks' figures add up to the run's figure
    shown above them; empty for a single rank."""
    progress, summary = run.get("progress") or {}, run.get("summary") or {}
    ended = run.get("status") not in LIVE_STATUSES
    per_rank = summary.get("tokens_per_s_per_rank")
    by_rank = progress.get("tokens_per_s_by_rank") or {}
    counted = [v for _, v in sorted(by_rank.items(), key=lambda kv: int(kv[0]))]
    if ended and isinstance(per_rank, list) and all(_is_number(v) for v in per_rank):
        rates, label = per_rank, ""
    elif ended and _is_number(summary.get("tokens_per_s")) and sum(counted) > 0:
        rates, label = [summary["tokens_per_s"] * v / sum(counted) for v in counted], ""
    else:
        rates, label = counted, f" ({RUN_AVERAGE if ended else LIVE_RATE})"
    if len(rates) < 2:
        return ""
    return f"tokens/s per rank{label}: " + " ".join(format_rate(v) for v in rates)


# Figures a trainer logs at every step that say little on a one-line headline: TRL GRPO's clip ratios
# (0 at every step where each batch is trained on once: grpo-mtl's line read `clip_ratio_high_max 0 ·
# clip_ratio_high_mean 0`), its completion-length and sampling statistics, the zero-std share.
# Each step's phase seconds (`phase_seconds_<phase>`) are charted; `step_lines` writes where a step goes.
QUIET_FIGURES = ("clip_ratio", "completions_", "sampling_", "frac_reward_zero_std", "entropy_coef", "phase_seconds_")


def _quiet(name: str, value) -> bool:
    return name.startswith(QUIET_FIGURES) or value == 0


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
    """The recipe's figures for the headline, the usual ones first, each under the catalogue's label
    (`reward 0.5 · loss 1.23 · MFU 28.2% · policy mismatch (mean) 0.0024 nats`, not TRL's flattened
    names). Of the others, not the trainer's diagnostics (QUIET_FIGURES) nor any at 0: they stay in
    the charts."""
    latest = headline_figures(run)
    others = sorted(n for n in latest if n not in PREFERRED_FIGURES and not _quiet(n, latest[n]))
    names = [n for n in PREFERRED_FIGURES if n in latest] + others
    return " · ".join(labelled_text(name, latest[name]) for name in names[:limit])


def figure_text(name: str, value, unit: bool = True) -> str:
    """A figure's value for people, as the catalogue (data/figures.py) says: its format (MFU, a share,
    as `28.2%`) and its unit (`5,219 tokens/s`, `12.5 ms`, `1,341 1,778 MiB` for a value per rank;
    `unit=False` for a table whose column already names the figure); a missing value as `—`, with no
    unit. A figure the catalogue does not know: `format_number`'s."""
    known = figure(name)
    if isinstance(value, dict) and known is not None and any(_is_number(v) for v in value.values()):
        return " · ".join(f"{key} {figure_text(name, v, unit)}" for key, v in value.items())  # per GPU, per rank
    if isinstance(value, dict) and known is not None and value and all(isinstance(v, dict) for v in value.values()):
        return " · ".join(f"{key} ({figure_text(name, v, unit)})" for key, v in value.items())  # per rank, per phase
    values = value if isinstance(value, (list, tuple)) else [value]
    if known is None or not values or not any(_is_number(v) for v in values):
        return format_number(value)
    text = " ".join(f"{100 * v:.1f}%" if known.format == "percent" and _is_number(v) else format_number(v)
                    for v in values)
    return f"{text} {known.unit}" if known.unit and unit else text


def labelled_text(name: str, value) -> str:
    """A figure with the catalogue's label, for a line of a run's key figures: `MFU 28.2%`,
    `step time (median) 0.52 s`; a label that is its unit says it once (`tokens/s 5,219`). A figure
    the catalogue does not know keeps its name (`update_ratio 2`)."""
    known, text = figure(name), figure_text(name, value)
    if known is None:
        return f"{name} {text}"
    if known.unit and known.label == known.unit:
        text = text.removesuffix(f" {known.unit}")
    return f"{known.label} {text}"


def progress_line(run: dict, now: float, warnings: tuple[str, ...] | list[str] = ()) -> str:
    """Everything about a run on one line, for a terminal with no screen (`gpuscale run`, `show`):
    `run 3 probe · running · 1:23 elapsed · step 40/100 (40%) · ETA 2:04 · tokens/s 4,210 · samples/s
    12.0 (last 10 s) · loss 1.23`. The rates appear once the ranks report any (`throughput_text`:
    once the run ended, the summary's). `warnings` (a collapse, see
    views/collapse.py) come right after the status, each marked `!`: a line fitted to a narrow
    terminal loses its end, and a warning is what must not be lost."""
    parts = [run_title(run), status_line(run, now), *(f"! {warning}" for warning in warnings)]
    if rates := throughput_text(run):
        parts.append(rates)
    if figures := figures_text(run):
        parts.append(figures)
    return " · ".join(parts)


def lead_figures(summary: dict) -> list[str]:
    """The LEAD_FIGURES a summary has, in words: `accuracy 0.12 -> 0.48`, `reward 0.05 -> 0.61`."""
    shown = []
    for label, pairs in LEAD_FIGURES:
        for first, last in pairs:
            if _is_number(summary.get(first)) and _is_number(summary.get(last)):
                shown.append(f"{label} {figure_text(first, summary[first])} -> {figure_text(last, summary[last])}")
                break
    return shown


def key_figures(summary: dict, limit: int = 2) -> list[str]:
    """What a run's summary shows first, at most `limit` of them: LEAD_FIGURES (what a training run
    is for), then KEY_FIGURES (a benchmark's rate), with the catalogue's labels (`tokens/s 5,219`).
    One place decides, for the CLI and the TUI."""
    shown = lead_figures(summary)
    shown += [labelled_text(name, summary[name]) for name in KEY_FIGURES if name in summary]
    return shown[:limit]


def key_figures_text(run: dict, limit: int = 2) -> str:
    """A table of runs' figures column: `key_figures` of the run's summary, then the energy its GPUs
    used where it was measured (`energy 41,230 J`; control/telemetry.py's EnergyMeter), `(GPU shared)`
    where other runs used them meanwhile (their work counts too)."""
    summary = run.get("summary") or {}
    shown = key_figures(summary, limit)
    if _is_number(summary.get("energy_j")):
        shown.append(labelled_text("energy_j", summary["energy_j"]) + shared_gpu_mark(summary))
    return ", ".join(shown)


def shared_gpu_mark(summary: dict) -> str:
    """` (GPU shared)` after an energy figure that counts other runs' work, ` (GPU shared?)` where the
    history could not say; "" otherwise."""
    if "energy_shared" not in summary:
        return ""
    return " (GPU shared)" if summary.get("energy_shared_with") else " (GPU shared?)"


def run_id_text(run: dict) -> str:
    """`13`, or `13 ↻12` for a run resumed from run 12's checkpoint."""
    return f"{run['id']} ↻{run['parent_id']}" if run.get("parent_id") else str(run["id"])


def lineage_lines(run: dict, children: list[dict]) -> list[str]:
    """The runs a run is linked to by `gpuscale resume`: `resumed from: run 12, <checkpoint>`, its
    resume check's line (runs/resume_check.py: passed, FAILED or pending), and `continued by: run 14
    (succeeded), run 15 (running)` (its children, oldest first)."""
    lines = []
    if run.get("parent_id"):
        checkpoint = (run.get("settings") or {}).get("resume_from")
        lines.append(f"resumed from: run {run['parent_id']}" + (f", {checkpoint}" if checkpoint else ""))
    if check := resume_check_of(run):
        lines.append(check_line(check))
    if children:
        lines.append("continued by: " + ", ".join(f"run {child['id']} ({child['status']})" for child in children))
    return lines


def resume_check_of(run: dict) -> dict | None:
    """A resumed run's resume check: its summary's once it ended, else the ranks' so far (the
    supervisor's progress), None for a run not resumed from a checkpoint."""
    return (run.get("summary") or {}).get(RESUME_CHECK) or (run.get("progress") or {}).get(RESUME_CHECK)


def resume_check_warnings(run: dict) -> list[str]:
    """The resume check's line where a part of it failed: a warning wherever the run is shown."""
    check = resume_check_of(run)
    return [check_line(check)] if check_failed(check) else []


def run_row(run: dict, now: float) -> tuple[str, ...]:
    """The run's cells under RUN_COLUMNS."""
    return (run_id_text(run), run["recipe"], status_text(run), format_duration(elapsed_s(run, now)),
            key_figures_text(run), format_time(run["started_at"]))


# ---- two runs compared -----------------------------------------------------------------------


def compare_runs(a: dict, b: dict) -> dict:
    """The settings that differ; the numeric summary figures both runs have that differ (a, b, b - a,
    and `better`: "a" or "b" by the catalogue's direction, None for a figure with none); the figures
    that are the same in both (`same`); and the figures only one of them has (`only`: a and b, None
    on the side without it; e.g. the per-domain accuracy of two runs over different domains). A
    summary entry that is also a setting (a recipe echoes `method`, `chains`) is a setting, compared
    as one, not a figure."""
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
            figures[name] = {"a": va, "b": vb, "delta": vb - va, "better": better(name, va, vb)}
    summary_a, summary_b = a["summary"] or {}, b["summary"] or {}
    # Energy that counts other runs' work (a GPU shared) is neither better nor worse than another.
    energy_shared = {run["id"]: run["summary"]["energy_shared"] for run in (a, b)
                     if (run["summary"] or {}).get("energy_shared")}
    for name in figures:
        if energy_shared and name.startswith("energy_j"):
            figures[name]["better"] = None
    only = {name: {"a": summary_a.get(name), "b": summary_b.get(name)}
            for name in sorted((set(summary_a) ^ set(summary_b)) - set(keys))
            if _is_number(summary_a.get(name, summary_b.get(name)))}
    return {
        "a": {"id": a["id"], "recipe": a["recipe"], "status": a["status"]},
        "b": {"id": b["id"], "recipe": b["recipe"], "status": b["status"]},
        "settings": settings_diff,
        "figures": figures,
        "same": same,
        "only": only,
        "energy_shared": energy_shared,
        "phases": phase_changes(summary_a, summary_b),
    }


def phase_changes(a: dict, b: dict) -> dict[str, dict]:
    """Where the two runs' mean steady step went (their summaries' `step_phase_seconds`), phase by
    phase, the larger first: seconds `a` and `b` (None where a run has no such phase), each one's
    share of its step, and `delta` (b - a, a missing phase counting 0). {} unless both timed phases."""
    seconds_a, seconds_b = a.get("step_phase_seconds") or {}, b.get("step_phase_seconds") or {}
    if not (seconds_a and seconds_b):
        return {}
    shares_a, shares_b = shares(seconds_a), shares(seconds_b)
    names = sorted(set(seconds_a) | set(seconds_b), key=lambda n: -max(seconds_a.get(n, 0.0), seconds_b.get(n, 0.0)))
    return {name: {"a": seconds_a.get(name), "b": seconds_b.get(name), "share_a": shares_a.get(name),
                   "share_b": shares_b.get(name), "delta": seconds_b.get(name, 0.0) - seconds_a.get(name, 0.0)}
            for name in names}


def phase_change_lines(phases: dict[str, dict]) -> list[str]:
    """`gpuscale compare`'s lines of `phase_changes`: `  forward+backward: 0.412 s (71%) -> 0.380 s (69%),
    -0.032 (-7.8%)`, a step's total first."""
    if not phases:
        return []

    def side(seconds, share):
        return "-" if seconds is None else f"{seconds:.3g} s ({share:.0%})"

    total_a = sum(p["a"] or 0.0 for p in phases.values())
    total_b = sum(p["b"] or 0.0 for p in phases.values())
    lines = ["where a step goes:",
             f"  step: {total_a:.3g} s -> {total_b:.3g} s, {delta_text(total_b - total_a, total_a)}"]
    for name, p in phases.items():
        lines.append(f"  {phase_label(name)}: {side(p['a'], p['share_a'])} -> {side(p['b'], p['share_b'])}, "
                     f"{delta_text(p['delta'], p['a'] or 0.0)}")
    return lines


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def delta_text(delta: float, a: float, better: str | None = None) -> str:
    """`+12.5 (+4.1%)`; the relative change only where it means something (a is not zero); then
    `better` or `worse` where the figure has a direction (`compare_runs`' `better`: b's side or a's)."""
    text = ("+" if delta >= 0 else "-") + format_number(abs(delta))
    if a:
        text += f" ({100 * delta / abs(a):+.1f}%)"
    return text + {"b": " better", "a": " worse"}.get(better, "")


def known_recipe(name: str | None):
    """The installed recipe a run's `recipe` names (recipes/shared/registry.py), None for one no
    longer installed (a plugin's run in an old history)."""
    from gpuscale.recipes.shared.registry import get_recipe
    from gpuscale.runs.settings import SettingsError

    try:
        return get_recipe(name) if name else None
    except SettingsError:
        return None


def figure_notes(recipe: str | None) -> dict[str, str]:
    """What each figure of a run of `recipe` counts where a note says it: the recipe's own
    (`Recipe.figure_notes`) over the catalogue's (data/figures.py). Only the recipe's notes are listed;
    `figure_note` falls back to the catalogue's (which alone hold for a recipe no longer installed)."""
    known = known_recipe(recipe)
    return dict(known.figure_notes) if known else {}


def figure_note(name: str, notes: dict[str, str]) -> str:
    """The note of figure `name`: `notes`' (a recipe's, `figure_notes`), else the catalogue's; "" if none."""
    known = figure(name)
    return notes.get(name) or (known.note if known else "")


def step_lines(summary: dict, peaks: list[dict] = (), gpu_indices: list[int] = ()) -> list[str]:
    """Where a run's step goes and what to change (data/step_phases.py), for `gpuscale show`:
    `step: forward+backward 71% · optimizer 12% · data 3% · other 2%`, then an `advice:` line each.
    `peaks` are the store's device peaks (a card's memory: the run's own where known), `gpu_indices`
    the run's GPUs in rank order (a straggler's card). Nothing for a run that timed no phases."""
    shares = summary.get("step_phases")
    if not shares:
        return []
    memory = {f"GPU {peak['idx']}": (peak["peak_run_mem_mb"] or peak["peak_mem_used_mb"] or 0.0, peak["mem_total_mb"])
              for peak in peaks if peak["kind"] == "gpu" and peak["mem_total_mb"]}
    cards = {str(rank): f"GPU {gpu}" for rank, gpu in enumerate(gpu_indices)}
    lines = advice(shares, summary.get("step_phase_seconds_by_rank"), memory, cards)
    return [f"step: {where_a_step_goes(shares)}", *(f"advice: {line}" for line in lines)]


def split_lines(run: dict) -> list[str]:
    """Where each rank's last steps went, from the run's progress (`step_phases`: the supervisor's
    data/step_phases.py:recent_by_rank), a compact row a rank, its card first where the run has GPUs:
    `GPU 3 rank 3: 0.412 s a step, waited 0.091 s (22%) · forward+backward 60% · data 10% · other 1%`.
    Nothing before a rank has a steady step, nor for a run that times no phases."""
    from gpuscale.control.store import planned_gpus

    recent = (run.get("progress") or {}).get("step_phases")
    if not recent:
        return []
    gpus = planned_gpus(run.get("run_dir"))
    lines = [f"where a step goes (each rank's last {LIVE_STEPS} steps):"]
    for rank, seconds in sorted(recent.items(), key=lambda item: int(item[0])):
        step, waited = sum(seconds.values()), seconds.get(WAIT, 0.0)
        card = f"GPU {gpus[int(rank)]} " if int(rank) < len(gpus) else ""
        worked = where_a_step_goes({name: share for name, share in shares(seconds).items() if name != WAIT})
        wait = f", waited {waited:.3g} s ({waited / step:.0%})" if step and waited else ""
        lines.append(f"  {card}rank {rank}: {step:.3g} s a step{wait} · {worked}")
    return lines


def summary_rows(summary: dict, recipe: str | None = None) -> list[tuple[str, str]]:
    """(name, value) of each summary figure the node check's table does not hold, the value as the
    catalogue writes it, followed by what it counts where a note says (`46,210 tokens/s  (whole
    run: ...)`): what `gpuscale show` and the TUI's run page list."""
    from gpuscale.app.views.node_check import table_names

    in_table, notes = table_names(summary), figure_notes(recipe)
    rows = []
    for name, value in summary.items():
        if name in in_table:
            continue
        if name == RESUME_CHECK:  # a record, not a figure: its line, after the name that says what it is
            rows.append((name, check_line(value).removeprefix("resume check: ")))
            continue
        note = figure_note(name, notes)
        rows.append((name, figure_text(name, value) + (f"  ({note})" if note else "")))
    return rows


def summary_lines(summary: dict, recipe: str | None = None) -> list[str]:
    """A run's summary for the terminal (`gpuscale run`'s end, `gpuscale show`): `summary_rows`, then
    the node check's table for the figures that table holds."""
    from gpuscale.app.views.node_check import node_check_lines

    return [f"  {name}: {text}" for name, text in summary_rows(summary, recipe)] + node_check_lines(summary)
