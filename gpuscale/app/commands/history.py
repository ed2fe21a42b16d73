"""`gpuscale runs`, `show`, `stop`, `delete`, `logs`, `generations` (or `samples`), `compare`, `export` and
`doctor`: reading (and tidying) the run history."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from gpuscale.app.commands.common import (
    ID_HELP,
    JSON_HELP,
    BadInput,
    open_store,
    print_table,
    public_run,
)
from gpuscale.app.views import generations as generations_view
from gpuscale.app.views.collapse import run_collapse_warnings
from gpuscale.app.views.export import FORMATS as EXPORT_FORMATS
from gpuscale.app.views.export import PARTS as EXPORT_PARTS
from gpuscale.app.views.export import export_text
from gpuscale.app.views.logs import read_lines, world_size
from gpuscale.app.views.runs import (
    RUN_COLUMNS,
    compare_runs,
    delta_text,
    figure_text,
    key_figures,
    lineage_lines,
    phase_change_lines,
    progress_line,
    run_row,
    step_lines,
    summary_lines,
)
from gpuscale.app.views.text import format_time, setting_text
from gpuscale.control import launch
from gpuscale.control.store import gpuscale_home, planned_gpus
from gpuscale.recipes.shared.registry import all_recipes
from gpuscale.runs.generations import read_run_generations
from gpuscale.runs.run_dir import RunDir
from gpuscale.runs.statuses import LIVE_STATUSES, STATUSES

COMPARE_NEEDS = "compare needs two run ids, e.g. gpuscale compare 12 15; `gpuscale runs` lists them"


def cmd_runs(args: argparse.Namespace) -> int:
    if args.status and args.status not in STATUSES:
        raise BadInput(f"status: {args.status!r}: expected one of {', '.join(STATUSES)}")
    runs = open_store().list_runs(recipe=args.recipe, status=args.status, limit=max(args.limit, 0), label=args.label)
    if args.json:
        print(json.dumps([public_run(r) for r in runs], indent=2))
        return 0
    now = time.time()
    rows = [[name.upper() for name in RUN_COLUMNS]] + [list(run_row(run, now)) for run in runs]
    if any(run.get("label") for run in runs):  # a column only where some run has one
        rows = [[row[0], label, *row[1:]] for row, label in zip(rows, ["LABEL"] + [r.get("label") or "" for r in runs])]
    print_table(rows)
    return 0


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
    for line in step_lines(run["summary"] or {}, store.device_peaks(run["id"], kinds=("gpu",)),
                           planned_gpus(run["run_dir"])):
        print(line)
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
    for line in summary_lines(run["summary"] or {}, run["recipe"]):
        print(line)
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
        if not args.follow or store.get_run(run["id"])["status"] not in LIVE_STATUSES:
            return 0
        time.sleep(0.5)
        launch.reconcile(store)


def cmd_generations(args: argparse.Namespace) -> int:
    """What the run generated, as kept in its generations file (`gpuscale generations`, or its older name
    `gpuscale samples`): the newest step's (or --step N's), newest first, with --domain only that domain's."""
    run = open_store().find_run(args.id)
    records = read_run_generations(run["run_dir"])
    steps, domains = generations_view.steps_of(records), generations_view.domains_of(records)
    if records and args.step is not None and args.step not in steps:
        raise BadInput(f"step: {args.step}: run {run['id']} kept generations of steps "
                       f"{generations_view.steps_text(steps)}")
    if records and args.domain is not None and args.domain not in domains:
        raise BadInput(f"domain: {args.domain!r}: run {run['id']}'s generations are of "
                       f"{', '.join(domains) or 'no domain'}")
    step = args.step if args.step is not None else (steps[-1] if steps else None)
    shown = generations_view.filtered(records, step=step, domain=args.domain)
    if args.json:
        print(json.dumps(shown, indent=2))
        return 0
    if not records:
        print(f"run {run['id']} ({run['recipe']}) kept no generations: a recipe that generates keeps them from its "
              "first step on, a training recipe its held-out answers from its first evaluation on")
        return 0
    print(f"run {run['id']}: {len(shown)} generations of step {step} (steps kept: "
          f"{generations_view.steps_text(steps)}; --step N for another), newest first")
    for record in shown:
        print()
        print(generations_view.generation_text(record))
    return 0


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
    return 0 if run["status"] not in LIVE_STATUSES else 1


def cmd_delete(args: argparse.Namespace) -> int:
    store = open_store(write=True)
    run = store.find_run(args.id)
    if run["status"] in LIVE_STATUSES:
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
        change = delta_text(f["delta"], f["a"], f.get("better"))  # `better`/`worse` by the figure's direction
        print(f"  {key}: {figure_text(key, f['a'])} -> {figure_text(key, f['b'])}, {change}")
    for run_id, why in result["energy_shared"].items():  # its energy counts other runs' work: no better/worse
        print(f"  run {run_id}'s energy counts other runs' work: {why}")
    if result["same"]:
        print("same in both: " + ", ".join(f"{key} {figure_text(key, v)}" for key, v in result["same"].items()))
    for side in ("a", "b"):
        if names := [name for name, f in result["only"].items() if f[side] is not None]:
            print(f"only run {result[side]['id']} has: "
                  + ", ".join(f"{name} {figure_text(name, result['only'][name][side])}" for name in names))
    for line in phase_change_lines(result["phases"]):
        print(line)
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
    from gpuscale.control.doctor import examine

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


def add_runs_parser(sub) -> None:
    p = sub.add_parser("runs", help="the run history")
    p.add_argument("--recipe", help="only the runs of this recipe")
    p.add_argument("--status", help=f"only the runs in this status ({', '.join(STATUSES)})")
    p.add_argument("--label", help="only the runs with this label; * and ? match as in the shell (--label 'sweep-*')")
    p.add_argument("--limit", type=int, default=50, help="at most this many runs, newest first (default 50)")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_runs)


def add_run_id_parser(sub, name: str, func, help_text: str, json_option: bool = False) -> None:
    """A command that takes one run's id or label (show, stop, delete)."""
    p = sub.add_parser(name, help=help_text)
    p.add_argument("id", help=ID_HELP)
    if json_option:
        p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=func)


def add_show_parser(sub) -> None:
    add_run_id_parser(sub, "show", cmd_show, "one run: settings, summary, status", json_option=True)


def add_stop_parser(sub) -> None:
    add_run_id_parser(sub, "stop", cmd_stop, "stop a run (SIGTERM, then SIGKILL after a few seconds)")


def add_delete_parser(sub) -> None:
    add_run_id_parser(sub, "delete", cmd_delete, "remove a finished run from the history")


def add_logs_parser(sub) -> None:
    p = sub.add_parser("logs", help="a run's launcher and rank logs")
    p.add_argument("id", help=ID_HELP)
    p.add_argument("--rank", type=int, help="only this rank's log")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new lines until the run ends")
    p.set_defaults(func=cmd_logs)


def add_generations_parser(sub) -> None:
    # `samples`: the command's name before it was named for what it shows (not the telemetry samples).
    p = sub.add_parser("generations", aliases=["samples"],
                       help="what a run generated: prompts, completions, rewards, a few per step")
    p.add_argument("id", help=ID_HELP)
    p.add_argument("--step", type=int, help="this step's generations (default: the newest step's)")
    p.add_argument("--domain", help="only this domain's generations")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_generations)


def add_compare_parser(sub) -> None:
    p = sub.add_parser("compare", help="two runs side by side: settings diff and figure deltas")
    # Optional here so that a missing id gets COMPARE_NEEDS rather than argparse's "required: a, b".
    p.add_argument("a", nargs="?", help="the first run's id or label")
    p.add_argument("b", nargs="?", help="the second run's id or label")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_compare)


def add_export_parser(sub) -> None:
    p = sub.add_parser("export", help="a run's record, metrics, telemetry samples and results")
    p.add_argument("id", help=ID_HELP)
    p.add_argument("--format", choices=EXPORT_FORMATS, default="json", help="json (default) or csv")
    p.add_argument("--what", choices=EXPORT_PARTS, help="json: only this part (default: all of them); csv: "
                   "metrics (default; one row per logged value), summary (name,value) or results (one row per item)")
    p.add_argument("--output", "-o", help="write to this file instead of stdout")
    p.set_defaults(func=cmd_export)


def add_doctor_parser(sub) -> None:
    p = sub.add_parser("doctor", help="check the run history (runs.db, dead runs, run folders); repair what can be")
    p.add_argument("--repair", action="store_true",
                   help="also move a damaged runs.db aside and start a new history (the run folders are kept)")
    p.set_defaults(func=cmd_doctor)


PARSERS = {"runs": add_runs_parser, "show": add_show_parser, "stop": add_stop_parser, "delete": add_delete_parser,
           "logs": add_logs_parser, "generations": add_generations_parser, "compare": add_compare_parser,
           "export": add_export_parser, "doctor": add_doctor_parser}
