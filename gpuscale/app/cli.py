"""`gpuscale`: start runs without a screen and read the run history from the shell.

Bad input exits 2 with one line naming the field, the value and the reason, before anything is
started or written. `run` exits 0 only when the run succeeded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sqlite3
import sys
import time
import warnings
from pathlib import Path

from rich.console import Console
from rich.text import Text

from gpuscale.app.views.collapse import run_collapse_warnings
from gpuscale.app.views.export import FORMATS as EXPORT_FORMATS
from gpuscale.app.views.export import PARTS as EXPORT_PARTS
from gpuscale.app.views.export import NothingToExport, export_text
from gpuscale.app.views.logs import read_lines, world_size
from gpuscale.app.views.runs import (
    RUN_COLUMNS,
    compare_runs,
    delta_text,
    figure_text,
    key_figures,
    lineage_lines,
    progress_line,
    run_row,
)
from gpuscale.app.views.text import format_number, format_time, memory_text, setting_text
from gpuscale.data.data_error import DataError
from gpuscale.data.models import ModelError
from gpuscale.recipes.registry import all_recipes, get_recipe
from gpuscale.runs import launch, telemetry
from gpuscale.runs.run_dir import RunDir
from gpuscale.runs.settings import SettingsError, merge_layers, parse_assignments, resolve_settings
from gpuscale.runs.store import STATUSES, Store, StoreError, UnknownRun, gpuscale_home, store_error

EXIT_BAD_INPUT = 2
ID_HELP = "the run's id or label (see `gpuscale runs`)"
COMPARE_NEEDS = "compare needs two run ids, e.g. gpuscale compare 12 15; `gpuscale runs` lists them"
JSON_HELP = "print it as JSON"


class BadInput(Exception):
    """Raised for input errors found by the CLI itself; printed as one line, exit code 2."""


# Errors the user can act on: one line, exit code 2, no traceback. A history that cannot be opened or
# written (read-only, unreadable, damaged) is one of them: the line names the path and what to do.
USER_ERRORS = (SettingsError, UnknownRun, BadInput, DataError, ModelError, StoreError, NothingToExport)


# ---- shared argument groups -----------------------------------------------------------------------


def add_setting_options(parser: argparse.ArgumentParser, recipe_required: bool = True,
                        gpus_help: str = "'all', a count, or indices like 0,3 (CPU machines: number of ranks)") -> None:
    """The options that make a recipe's settings (shared by `run` and `tune`)."""
    parser.add_argument("--recipe", required=recipe_required, help="recipe name (see `gpuscale recipes`)")
    parser.add_argument("--gpus", help=gpus_help)
    parser.add_argument("--precision", help="auto | bf16 | fp16 | fp32")
    parser.add_argument("--model", help="model name, hub id or local path")
    parser.add_argument("--dataset",
                        help="tiny-math[:DOMAIN,...], tiny-math-conflict, gsm8k, or JSONL files (a.jsonl,b.jsonl)")
    parser.add_argument("--preset", type=Path, help="TOML file of settings (below env and --set)")
    parser.add_argument("--set", dest="assignments", action="append", default=[], metavar="KEY=VALUE",
                        help="any setting of the recipe; repeatable")


def add_run_options(parser: argparse.ArgumentParser, recipe_required: bool = True) -> None:
    add_setting_options(parser, recipe_required)
    parser.add_argument("--batch-size", type=str,
                        help="the recipe's batch_size, per rank (what it counts differs: rows, questions, "
                             "sequences per micro-batch...; see its settings' help, or `gpuscale recipes --json`): "
                             "a number, or auto (a stored `gpuscale tune` result, else tune first on a GPU; the CPU "
                             "default on CPU)")
    parser.add_argument("--nnodes", help="nodes in a multi-node job")
    parser.add_argument("--node-rank", help="this node's rank in a multi-node job")
    parser.add_argument("--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous (multi-node)")
    parser.add_argument("--label", help="a name for the run, shown by `gpuscale runs` and usable where its id is")


def add_follow_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--detach", action="store_true", help="print the run id and return at once")
    parser.add_argument("--json", action="store_true", help="print the finished run as JSON")


FLAG_FIELDS = ("gpus", "batch_size", "precision", "model", "dataset", "nnodes", "node_rank", "rdzv_endpoint")


def settings_from_args(args: argparse.Namespace):
    """The recipe and its validated settings from the command line (and preset, and environment)."""
    recipe = get_recipe(args.recipe)
    settings = resolve_settings(recipe.settings_cls, preset=args.preset, overrides=overrides_from_args(args))
    return recipe, settings


def overrides_from_args(args: argparse.Namespace) -> dict:
    overrides = {field: getattr(args, field) for field in FLAG_FIELDS if getattr(args, field, None) is not None}
    overrides.update(parse_assignments(args.assignments))
    return overrides


def run_settings_from_args(args: argparse.Namespace):
    """As settings_from_args, with `batch_size` resolved where it says `auto` (a stored tuning result,
    or `gpuscale tune` first on a GPU; app/batch_choice.py); also the notes recorded with the run."""
    from gpuscale.app.batch_choice import settings_with_batch

    recipe = get_recipe(args.recipe)
    merged = merge_layers(recipe.settings_cls, preset=args.preset, overrides=overrides_from_args(args))
    settings, notes = settings_with_batch(recipe, merged)
    return recipe, settings, notes


# ---- run ------------------------------------------------------------------------------------------


def checked_label(label: str | None) -> str | None:
    """A label names one run where an id could: not empty, and not a number (that is an id)."""
    if label is None:
        return None
    label = label.strip()
    if not label or label.isdigit():
        raise BadInput(f"label: {label!r}: give a name with a letter in it (a number would read as a run id)")
    return label


def cmd_run(args: argparse.Namespace) -> int:
    label = checked_label(args.label)
    recipe, settings, notes = run_settings_from_args(args)
    plan = launch.plan_devices(settings.gpus)
    store = Store()
    run_id = launch.start_run(store, recipe, settings, plan, notes=notes, label=label)
    say_questions_left_out(store.get_run(run_id))
    if args.detach:
        print(json.dumps({"id": run_id}) if args.json else run_id)
        return 0
    print(f"run {run_id}: {recipe.name} on {plan.describe()}; Ctrl-C stops it, a closed terminal does not "
          f"(gpuscale logs {run_id} --follow)", file=sys.stderr)
    return follow_run(store, run_id, as_json=args.json)


def say_questions_left_out(run: dict) -> None:
    """too_long=skip: how many questions the run leaves out as too long for the model's context."""
    settings = run["settings"] or {}
    if settings.get("questions_too_long"):
        print(f"run {run['id']}: {settings['questions_too_long']} question(s) longer than the model's context left "
              f"out (too_long=skip), the first at {settings['questions_too_long_first']}", file=sys.stderr)


def follow_run(store: Store, run_id: int, as_json: bool = False) -> int:
    """Show a live progress line until the run ends. SIGINT/SIGTERM here stop the run."""
    stop = {"asked": False}

    def ask_stop(*_):
        stop["asked"] = True

    signal.signal(signal.SIGINT, ask_stop)
    signal.signal(signal.SIGTERM, ask_stop)
    terminal = Console(file=sys.stderr)  # its width follows the terminal (and COLUMNS)
    interactive = terminal.is_terminal
    last_print = 0.0
    said: set[str] = set()  # warnings already printed whole on a line of their own
    while True:
        if stop["asked"]:
            print(f"\nstopping run {run_id} ...", file=sys.stderr)
            launch.stop_run(store, run_id)
        launch.reconcile(store)
        run = store.get_run(run_id)
        if run["status"] not in ("queued", "running"):
            break
        now = time.monotonic()
        warnings = run_collapse_warnings(store, run)
        if interactive:
            for warning in warnings:  # once each, whole: the redrawn line may be cut to the width
                if warning not in said:
                    print(f"\r\033[K! {warning}", file=sys.stderr, flush=True)
                    said.add(warning)
            line = fit_to_width(progress_line(run, time.time(), warnings), terminal.width)
            print("\r\033[K" + line, end="", file=sys.stderr, flush=True)
        elif now - last_print >= 10:
            print(progress_line(run, time.time(), warnings), file=sys.stderr, flush=True)
            last_print = now
        time.sleep(0.5)
    if interactive:
        print(file=sys.stderr)
    report_end(run, as_json, run_collapse_warnings(store, run))
    return 0 if run["status"] == "succeeded" else 1


def fit_to_width(line: str, width: int) -> str:
    """`line` cut with an ellipsis to less than `width` cells. A redrawn line must never wrap: `\r`
    returns to the start of the last row only, so each redraw would leave the wrapped part behind.
    One cell is kept free because a line that fills the row puts some terminals in a pending wrap."""
    text = Text(line)
    text.truncate(max(1, width - 1), overflow="ellipsis")
    return text.plain


def report_end(run: dict, as_json: bool, warnings: list[str] = ()) -> None:
    if as_json:
        print(json.dumps(public_run(run), indent=2))
        return
    print(progress_line(run, time.time(), warnings), file=sys.stderr)
    if run["error"]:
        print(f"error: {run['error']}", file=sys.stderr)
    if run["hint"]:
        print(f"hint: {run['hint']}", file=sys.stderr)
    summary = run["summary"] or {}
    for name, value in summary.items():
        print(f"  {name}: {figure_text(name, value)}")


def public_run(run: dict) -> dict:
    keys = ("id", "recipe", "status", "settings", "summary", "started_at", "ended_at", "error", "hint",
            "created_at", "exit_code", "run_dir", "host", "command", "progress", "supervisor_pid", "label",
            "parent_id")
    return {key: run.get(key) for key in keys}


# ---- resume ---------------------------------------------------------------------------------------


def cmd_resume(args: argparse.Namespace) -> int:
    """A stopped, failed or lost run continued from its last checkpoint, as a new run naming it."""
    store = open_store(write=True)
    parent = store.find_run(args.id)
    recipe = get_recipe(parent["recipe"])
    overrides = parse_assignments(args.assignments)
    if args.gpus is not None:
        overrides["gpus"] = args.gpus
    label = {} if args.label is None else {"label": checked_label(args.label)}  # else the parent's
    # Refused before anything starts: nothing to resume from, or (without --force) resumed already.
    run_id = launch.resume_run(store, recipe, parent, overrides, force=args.force, **label)
    if args.detach:
        print(json.dumps({"id": run_id}) if args.json else run_id)
        return 0
    run = store.get_run(run_id)
    plan = json.loads(RunDir(run["run_dir"]).plan.read_text())
    where = launch.DevicePlan(plan["nproc"], tuple(plan["gpu_indices"])).describe()
    print(f"run {run_id}: {recipe.name} resuming run {parent['id']} from {resumed_from(run, parent)} "
          f"on {where}; Ctrl-C stops it (gpuscale logs {run_id} --follow)", file=sys.stderr)
    return follow_run(store, run_id, as_json=args.json)


def resumed_from(run: dict, parent: dict) -> str:
    """What a resumed run continues from: its parent's checkpoint, and (rft) the answers it kept."""
    settings = run["settings"] or {}
    parts = [Path(settings["resume_from"]).name] if settings.get("resume_from") else []
    if settings.get("data_from") and settings["data_from"] == parent.get("run_dir"):
        parts.append("the answers it kept")
    return " and ".join(parts)


# ---- tune -----------------------------------------------------------------------------------------

PRECISIONS_TO_SEARCH = ("bf16", "fp16", "fp32")


def cmd_tune(args: argparse.Namespace) -> int:
    """Trials on one device (the first of --gpus; the CPU where there is none), the table and the
    choice printed and stored, for `--batch-size auto` to find later."""
    from gpuscale.app.batch_choice import pick_device

    if not 0 < args.memory_cap <= 1:
        raise BadInput(f"memory-cap: {args.memory_cap}: a share of the card's memory, above 0 and at most 1")
    if (args.max_batch is not None and args.max_batch < 1) or (args.start is not None and args.start < 1):
        raise BadInput(f"max-batch/start: {args.max_batch}/{args.start}: both must be at least 1")
    recipe, settings = tune_settings_from_args(args)
    if recipe.tuning is None:
        raise BadInput(f"recipe: {recipe.name!r}: cannot be tuned (it declares no trial)")
    device = pick_device(launch.plan_devices(settings.gpus).gpu_indices)
    store = Store()
    precisions = [settings.precision]
    if args.precision_search:
        precisions = [p for p in PRECISIONS_TO_SEARCH
                      if p != "fp16" or device.index is not None]  # fp16 on CPU: slow, never the best
    outcomes = [tune_once(recipe, settings.model_copy(update={"precision": p}), device, store, args)
                for p in precisions]
    best = max((o for o in outcomes if o.result.chosen), key=lambda o: o.result.chosen.throughput, default=None)
    if args.compile_search and best is not None:
        compare_compile(recipe, settings.model_copy(update={"precision": best.key.precision}), device, best, args)
    if args.json:
        print(json.dumps([{**o.key.as_dict(), "chosen": o.result.batch_size, "stopped": o.result.stopped,
                           "seconds": o.seconds, "trials": [t.as_dict() for t in o.result.trials]}
                          for o in outcomes], indent=2))
    return 0 if best is not None else 1


def tune_settings_from_args(args: argparse.Namespace):
    if args.settings_json:  # `--batch-size auto` hands its run's settings over as they are
        recipe = get_recipe(args.recipe)
        return recipe, recipe.settings_cls.model_validate_json(Path(args.settings_json).read_text())
    return settings_from_args(args)


def tune_once(recipe, settings, device, store: Store, args: argparse.Namespace):
    from gpuscale.app.batch_choice import outcome_record, trial_line, trial_rows
    from gpuscale.recipes.device_trials import default_max_batch, tune_recipe

    figure = recipe.tuning.figure
    max_batch = args.max_batch or default_max_batch(recipe, settings)  # the run's work per rank, where known
    print(f"tuning {recipe.name} ({recipe.tuning.knob}) on {device.name}, precision {settings.precision}, "
          f"memory cap {args.memory_cap:.0%}, batches up to {max_batch}", file=sys.stderr)
    count = {"trials": 0}

    def progress(trial) -> None:
        count["trials"] += 1
        print(trial_line(count["trials"], trial, figure), file=sys.stderr, flush=True)

    outcome = tune_recipe(recipe, settings, device, memory_cap=args.memory_cap, max_batch=max_batch,
                          start=args.start, progress=progress)
    out = sys.stderr if args.json else sys.stdout
    with contextlib.redirect_stdout(out):
        print_table(trial_rows([t.as_dict() for t in outcome.result.trials], figure))
    chosen = outcome.result.chosen
    print(f"doubling stopped: {outcome.result.stopped}; {count['trials']} trials in {outcome.seconds:.1f} s",
          file=out)
    if chosen is None:
        print(f"no batch fitted under {args.memory_cap:.0%} of {device.name}'s memory; nothing stored", file=out)
        return outcome
    if outcome.result.warning:
        print(f"warning: {outcome.result.warning}", file=sys.stderr)
    store.save_tuning(outcome.key.as_dict(), **outcome_record(outcome, figure))
    print(f"chosen: batch {chosen.batch_size}, {format_number(chosen.throughput)} {figure}, "
          f"{chosen.peak_memory_bytes / 1e9:.2f} GB peak of {outcome.memory_total_bytes / 1e9:.1f} GB "
          f"({outcome.key.precision}); stored: `--batch-size auto` uses it for this model and shape", file=out)
    return outcome


def compare_compile(recipe, settings, device, best, args: argparse.Namespace) -> None:
    """The chosen batch measured again with `compile` flipped; the faster one is said (not applied)."""
    from gpuscale.recipes.device_trials import tune_recipe

    batch = best.result.chosen.batch_size
    flipped = tune_recipe(recipe, settings.model_copy(update={"compile": not settings.compile}), device,
                          memory_cap=args.memory_cap, max_batch=batch, start=batch)
    other = flipped.result.chosen
    out = sys.stderr if args.json else sys.stdout
    if other is None:
        print(f"compile={not settings.compile}: batch {batch} did not fit", file=out)
        return
    gain = other.throughput / best.result.chosen.throughput - 1
    print(f"compile={not settings.compile} at batch {batch}: {format_number(other.throughput)} {recipe.tuning.figure} "
          f"({gain:+.0%}); " + (f"add --set compile={str(not settings.compile).lower()}" if gain > 0.05
                                else f"keep compile={str(settings.compile).lower()}"), file=out)


# ---- history --------------------------------------------------------------------------------------


def open_store(write: bool = False) -> Store:
    """The history, after marking runs whose supervisor died lost. For reading, a home that cannot be
    written is read as it is, and a home with no history yet is an empty history (reading it creates
    no folder); `write` refuses a home that cannot be written (StoreError naming the path)."""
    if write:
        store = Store()
    elif not has_history():
        store = Store(read_only=True)
    else:
        store = Store.for_reading()
    launch.reconcile(store)
    return store


def has_history() -> bool:
    """Whether the home holds a runs.db; a home that cannot be looked into counts as holding one, so
    that opening it names the path and the permission denied."""
    try:
        return (gpuscale_home() / "runs.db").exists()
    except PermissionError:
        return True


def cmd_runs(args: argparse.Namespace) -> int:
    if args.status and args.status not in STATUSES:
        raise BadInput(f"status: {args.status!r}: expected one of {', '.join(STATUSES)}")
    runs = open_store().list_runs(recipe=args.recipe, status=args.status, limit=max(args.limit, 0))
    if args.json:
        print(json.dumps([public_run(r) for r in runs], indent=2))
        return 0
    now = time.time()
    rows = [[name.upper() for name in RUN_COLUMNS]] + [list(run_row(run, now)) for run in runs]
    if any(run.get("label") for run in runs):  # a column only where some run has one
        rows = [[row[0], label, *row[1:]] for row, label in zip(rows, ["LABEL"] + [r.get("label") or "" for r in runs])]
    print_table(rows)
    return 0


def print_table(rows: list[list[str]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def cmd_show(args: argparse.Namespace) -> int:
    store = open_store()
    run = store.find_run(args.id)
    if args.json:
        print(json.dumps({**public_run(run), "children": [child["id"] for child in store.children(run["id"])],
                          "latest_samples": store.latest_samples(run["id"])}, indent=2))
        return 0
    print(progress_line(run, time.time(), run_collapse_warnings(store, run)))
    if figures := key_figures(run["summary"] or {}, limit=4):
        print("figures: " + " · ".join(figures))
    for key in ("started_at", "ended_at"):
        print(f"{key}: {format_time(run[key])}")
    for key in ("label", "error", "hint", "run_dir"):
        if run[key]:
            print(f"{key}: {run[key]}")
    for line in lineage_lines(run, store.children(run["id"])):
        print(line)
    print("command:", launch.display_command(run["command"]) if run["command"] else "-")
    print("settings:")
    for key, value in run["settings"].items():
        print(f"  {key}: {setting_text(value)}")
    print("summary:")
    for key, value in (run["summary"] or {}).items():
        print(f"  {key}: {figure_text(key, value)}")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    store = open_store()
    run = store.find_run(args.id)
    ranks = world_size(run)
    if args.rank is not None and ranks is not None and not 0 <= args.rank < ranks:
        has = f"ranks 0-{ranks - 1}" if ranks > 1 else "only rank 0"
        raise BadInput(f"rank: {args.rank}: run {run['id']} has {has}")
    folder = RunDir(run["run_dir"])
    offsets: dict[Path, int] = {}
    while True:
        for path in sorted(folder.logs.glob("*.log")):
            if args.rank is not None and path != folder.log(args.rank):
                continue
            offsets[path] = print_new_lines(path, offsets.get(path, 0), prefix=f"[{path.stem}] ")
        if not args.follow or store.get_run(run["id"])["status"] not in ("queued", "running"):
            return 0
        time.sleep(0.5)
        launch.reconcile(store)


def print_new_lines(path: Path, offset: int, prefix: str) -> int:
    lines, offset = read_lines(path, offset)
    for line in lines:
        print(prefix + line)
    sys.stdout.flush()
    return offset


def cmd_stop(args: argparse.Namespace) -> int:
    store = open_store(write=True)
    run = launch.stop_run(store, store.find_run(args.id)["id"])
    print(f"run {run['id']}: {run['status']}")
    return 0 if run["status"] not in ("queued", "running") else 1


def cmd_delete(args: argparse.Namespace) -> int:
    store = open_store(write=True)
    run = store.find_run(args.id)
    if run["status"] in ("queued", "running"):
        raise BadInput(f"run id: {run['id']}: the run is {run['status']}; stop it first")
    store.delete_run(run["id"])
    print(f"run {run['id']}: deleted (its folder {run['run_dir']} is kept)")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    if args.b is None:
        raise BadInput(COMPARE_NEEDS)
    store = open_store()
    result = compare_runs(store.find_run(args.a), store.find_run(args.b))
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"run {result['a']['id']} ({result['a']['status']}) vs run {result['b']['id']} ({result['b']['status']})")
    print("settings that differ:" if result["settings"] else "settings: identical")
    for key, (va, vb) in result["settings"].items():
        print(f"  {key}: {setting_text(va)} -> {setting_text(vb)}")
    print("figures that differ:" if result["figures"] else "figures: none differ")
    for key, f in result["figures"].items():
        print(f"  {key}: {format_number(f['a'])} -> {format_number(f['b'])}, {delta_text(f['delta'], f['a'])}")
    if result["same"]:
        print("same in both: " + ", ".join(f"{key} {format_number(v)}" for key, v in result["same"].items()))
    for side in ("a", "b"):
        if names := [name for name, f in result["only"].items() if f[side] is not None]:
            print(f"only run {result[side]['id']} has: "
                  + ", ".join(f"{name} {format_number(result['only'][name][side])}" for name in names))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    output = checked_output(args.output) if args.output else None  # before the history is read
    store = open_store()
    text = export_text(store, store.find_run(args.id)["id"], args.format, args.what)
    if output is None:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        return 0
    try:
        output.write_text(text)
    except OSError as error:
        raise BadInput(f"output: {args.output}: cannot be written ({(error.strerror or str(error)).lower()})") from None
    return 0


def checked_output(given: str) -> Path:
    """The file `--output` names: its folder must exist (it is not made: a typo would make a tree),
    and it must not be a folder itself."""
    path = Path(given).expanduser()
    if path.is_dir():
        raise BadInput(f"output: {given}: is a folder; give a file name in it")
    folder = path.parent
    if not folder.is_dir():
        why = "is not a folder" if folder.exists() else "does not exist"
        raise BadInput(f"output: {given}: the folder {folder} {why}")
    return path


def cmd_doctor(args: argparse.Namespace) -> int:
    from gpuscale.runs.doctor import examine

    findings = examine(gpuscale_home(), repair=args.repair, recipe_of=recipe_of_settings)
    for finding in findings:
        print(("ok       " if finding.ok else "PROBLEM  ") + finding.text)
    problems = sum(not finding.ok for finding in findings)
    print(f"{problems} problem(s) left" if problems else "the history is healthy")
    return 1 if problems else 0


def recipe_of_settings(settings: dict) -> str | None:
    """The one recipe whose settings have exactly these names (a run folder written before folders
    recorded their recipe), else None."""
    matches = [name for name, recipe in all_recipes().items() if set(recipe.settings_cls.model_fields) == set(settings)]
    return matches[0] if len(matches) == 1 else None


# ---- machine and recipes --------------------------------------------------------------------------


def cmd_recipes(args: argparse.Namespace) -> int:
    recipes = all_recipes()
    if args.json:
        print(json.dumps([
            {"name": r.name, "summary": r.summary, "launcher": r.launcher,
             "settings": r.settings_cls.model_json_schema()}
            for r in recipes.values()
        ], indent=2))
        return 0
    print_table([["RECIPE", "SUMMARY"]] + [[r.name, r.summary] for r in recipes.values()])
    for recipe in recipes.values():
        print(f"\n{recipe.name} settings (--set NAME=VALUE):")
        print_table([["  NAME", "DEFAULT", "DESCRIPTION"]] + [
            [f"  {name}", default_text(field.default), field.description or ""]
            for name, field in recipe.settings_cls.model_fields.items()])
    return 0


def default_text(value) -> str:
    """A setting's default as it is typed after --set (`true`, not `True`)."""
    return str(value).lower() if isinstance(value, bool) else setting_text(value)


def cmd_gpus(args: argparse.Namespace) -> int:
    gpus = telemetry.list_gpus()
    if args.json:
        print(json.dumps(gpus, indent=2))
        return 0
    if not gpus:
        print(f"no NVIDIA GPU found (NVML unavailable); runs use CPU ranks on gloo ({os.cpu_count()} cores)")
        return 0
    rows = [["GPU", "NAME", "MEMORY USED / TOTAL", "UTIL"]]
    for g in gpus:
        rows.append([str(g["index"]), g["name"], memory_text(g["mem_used_mb"], g["mem_total_mb"]),
                     f"{g['util']}%" if g["util"] is not None else "-"])
    print_table(rows)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from gpuscale.data.models import describe_models

    models = describe_models()
    if args.json:
        print(json.dumps(models, indent=2))
        return 0
    print_table([["MODEL", "ARCHITECTURE", "PARAMETERS", "PATH"]] + [
        [m["name"], str(m["architecture"] or "-"), format_number(m["parameters"]) if m["parameters"] else "-",
         str(m["path"] or "(built from its config)")]
        for m in models
    ])
    return 0


def cmd_data_export(args: argparse.Namespace) -> int:
    from gpuscale.data.tasks import load_examples

    if args.limit is not None and args.limit < 0:
        raise BadInput(f"limit: {args.limit}: must be 0 or more")
    for example in load_examples(args.name, args.split, args.limit, seed=args.seed):
        print(json.dumps({"question": example["question"], "answer": example["answer"],
                          **({"domain": example["domain"]} if example.get("domain") else {})}))
    return 0


def cmd_sbatch(args: argparse.Namespace) -> int:
    if args.nodes < 1 or args.gpus_per_node < 1:
        raise BadInput(f"nodes/gpus-per-node: {args.nodes}/{args.gpus_per_node}: both must be at least 1")
    recipe = get_recipe(args.recipe)
    overrides = parse_assignments(args.assignments)
    # Validate now, with the values the nodes will use, so a bad setting fails here and not in the queue.
    resolve_settings(recipe.settings_cls, preset=args.preset, overrides={
        **overrides, "nnodes": args.nodes, "gpus": args.gpus_per_node, "rdzv_endpoint": f"head:{args.port}"})
    run_args = [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]
    if args.preset:
        run_args += ["--preset", str(args.preset.resolve())]
    print(launch.sbatch_script(recipe.name, args.nodes, args.gpus_per_node, run_args,
                               time_limit=args.time, partition=args.partition, port=args.port), end="")
    return 0


# ---- parser ---------------------------------------------------------------------------------------


def installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gpuscale")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


class VersionAction(argparse.Action):
    """`--version`: `PROG VERSION`, the version looked up only when asked (importlib.metadata and the
    look-up cost some 15 ms of every start-up, the TUI's first frame included)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0,
                         help=help or "print the program's name and version, then exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog} {installed_version()}")  # on stdout, as argparse's own version action
        parser.exit()


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, like every other bad input
        program = self.prog.split()[0]  # `gpuscale` for `gpuscale run`'s errors too; `gpuscale-tui` for its own
        self.exit(EXIT_BAD_INPUT, f"{program}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="gpuscale", description="Launch, watch and remember multi-GPU LLM recipes.")
    parser.add_argument("--version", action=VersionAction)
    # Not required: a bare `gpuscale` gets the usage and the commands (main), not a one-line error.
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)

    p = sub.add_parser("run", help="start a run (follows it until it ends unless --detach)")
    add_run_options(p)
    add_follow_options(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("tune", help="find the throughput-best batch size on one GPU by short trials; stored "
                                    "for `--batch-size auto`")
    add_setting_options(p, gpus_help="the GPU to tune on, e.g. 3 or 3,4 (its first one); default the first GPU")
    p.add_argument("--max-batch", type=int, help="the largest batch tried (default: the run's work per rank "
                   "where the recipe knows it, e.g. power-sampling's max_examples over its ranks; at most 4096)")
    p.add_argument("--start", type=int, help="the first batch tried (default: the recipe's on a GPU, 1 on CPU)")
    p.add_argument("--memory-cap", type=float, default=0.9,
                   help="a batch whose peak memory passes this share of the card (of RAM on CPU) does not fit "
                        "(default 0.9)")
    p.add_argument("--precision-search", action="store_true", help="tune at bf16, fp16 and fp32 and compare")
    p.add_argument("--compile-search", action="store_true", help="measure the chosen batch with compile flipped")
    p.add_argument("--json", action="store_true", help="print the trials as JSON (the table goes to stderr)")
    p.add_argument("--settings-json", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_tune)

    p = sub.add_parser("runs", help="the run history")
    p.add_argument("--recipe", help="only the runs of this recipe")
    p.add_argument("--status", help=f"only the runs in this status ({', '.join(STATUSES)})")
    p.add_argument("--limit", type=int, default=50, help="at most this many runs, newest first (default 50)")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_runs)

    for name, func, help_text in (("show", cmd_show, "one run: settings, summary, status"),
                                  ("stop", cmd_stop, "stop a run (SIGTERM, then SIGKILL after a few seconds)"),
                                  ("delete", cmd_delete, "remove a finished run from the history")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("id", help=ID_HELP)
        if name == "show":
            p.add_argument("--json", action="store_true", help=JSON_HELP)
        p.set_defaults(func=func)

    p = sub.add_parser("resume", help="continue a stopped, failed or lost run from its last checkpoint, as a new run")
    p.add_argument("id", help=ID_HELP)
    p.add_argument("--gpus", help="'all', a count, or indices like 0,3 (default: the run's own)")
    p.add_argument("--set", dest="assignments", action="append", default=[], metavar="KEY=VALUE",
                   help="change a setting of the run; repeatable")
    p.add_argument("--force", action="store_true",
                   help="resume a run that was resumed before, again from the same checkpoint")
    p.add_argument("--label", help="a name for the new run (default: the run's own label)")
    add_follow_options(p)
    p.set_defaults(func=cmd_resume)

    p = sub.add_parser("logs", help="a run's launcher and rank logs")
    p.add_argument("id", help=ID_HELP)
    p.add_argument("--rank", type=int, help="only this rank's log")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new lines until the run ends")
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser("compare", help="two runs side by side: settings diff and figure deltas")
    # Optional here so that a missing id gets COMPARE_NEEDS rather than argparse's "required: a, b".
    p.add_argument("a", nargs="?", help="the first run's id or label")
    p.add_argument("b", nargs="?", help="the second run's id or label")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("export", help="a run's record, metrics and samples")
    p.add_argument("id", help=ID_HELP)
    p.add_argument("--format", choices=EXPORT_FORMATS, default="json", help="json (default) or csv")
    p.add_argument("--what", choices=EXPORT_PARTS, help="json: only this part (default: all of them); csv: "
                   "metrics (default; one row per logged value), summary (name,value) or results (one row per item)")
    p.add_argument("--output", "-o", help="write to this file instead of stdout")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("recipes", help="the recipes and their settings")
    p.add_argument("--json", action="store_true", help="print them as JSON, with every setting's schema")
    p.set_defaults(func=cmd_recipes)

    p = sub.add_parser("gpus", help="this machine's GPUs now")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_gpus)

    p = sub.add_parser("models", help="the models known by name (and any hub id or local path works)")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("data", help="data sets")
    data = p.add_subparsers(dest="data_command", required=True, parser_class=Parser)
    p = data.add_parser("export", help="a data set as JSON lines (question, answer)")
    p.add_argument("name", help="tiny-math[:DOMAIN,...], tiny-math-conflict, gsm8k, or a .jsonl file")
    p.add_argument("--split", default="test", choices=["test", "train"], help="which split (default test)")
    p.add_argument("--limit", type=int, help="at most this many examples")
    p.add_argument("--seed", type=int, default=0, help="the shuffle's seed, as a run's `seed` setting (default 0)")
    p.set_defaults(func=cmd_data_export)

    p = sub.add_parser("doctor", help="check the run history (runs.db, dead runs, run folders); repair what can be")
    p.add_argument("--repair", action="store_true",
                   help="also move a damaged runs.db aside and start a new history (the run folders are kept)")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("sbatch", help="print a SLURM batch script for a multi-node run")
    p.add_argument("--recipe", required=True, help="recipe name (see `gpuscale recipes`)")
    p.add_argument("--nodes", type=int, required=True, help="how many nodes")
    p.add_argument("--gpus-per-node", type=int, required=True, help="GPUs (ranks) per node")
    p.add_argument("--time", default="04:00:00", help="the job's time limit (default 04:00:00)")
    p.add_argument("--partition", help="the SLURM partition")
    p.add_argument("--port", type=int, default=29500, help="the rendezvous port on the head node (default 29500)")
    p.add_argument("--preset", type=Path, help="TOML file of settings (below --set)")
    p.add_argument("--set", dest="assignments", action="append", default=[], metavar="KEY=VALUE",
                   help="any setting of the recipe; repeatable")
    p.set_defaults(func=cmd_sbatch)

    from gpuscale.app.demo import add_demo_parser  # here: demo imports this module's commands

    add_demo_parser(sub)
    return parser


def quiet_broken_pipe() -> int:
    """The reader of our output went away (`gpuscale runs | head`): stop quietly, as Unix tools do,
    with the exit status of a process that SIGPIPE ended. Python's own flush of stdout at exit would
    fail again and print a traceback, so stdout now points at /dev/null."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 128 + signal.SIGPIPE


def main(argv: list[str] | None = None) -> int:
    # Libraries (transformers, torch) announce API changes to come as FutureWarnings: meant for the
    # developers of gpuscale, noise on a user's terminal. Filtered here, in the front end only.
    warnings.filterwarnings("ignore", category=FutureWarning)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_BAD_INPUT
    try:
        code = args.func(args)
        sys.stdout.flush()  # a reader that went away shows here, not in Python's flush at exit
        return code
    except BrokenPipeError:
        return quiet_broken_pipe()
    except USER_ERRORS as exc:
        print(f"gpuscale: error: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except sqlite3.DatabaseError as exc:  # met after the history opened (a page damaged later): still one line
        print(f"gpuscale: error: {store_error(gpuscale_home(), exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
