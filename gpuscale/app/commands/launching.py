"""`gpuscale run`, `resume` and `sbatch`: starting runs, and following one until it ends."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.text import Text

from gpuscale.app.commands.common import (
    ID_HELP,
    PRESET_HELP,
    BadInput,
    add_setting_options,
    checked_label,
    open_store,
    overrides_from_args,
    preset_of,
    public_run,
)
from gpuscale.app.views.collapse import run_collapse_warnings
from gpuscale.app.views.runs import progress_line, status_text, summary_lines
from gpuscale.control import launch
from gpuscale.control.store import Store, gpuscale_home
from gpuscale.data.tasks import parse_dataset
from gpuscale.recipes.shared.registry import get_recipe
from gpuscale.runs.process import private_files
from gpuscale.runs.run_dir import RunDir
from gpuscale.runs.settings import merge_layers, parse_assignments, resolve_settings
from gpuscale.runs.statuses import LIVE_STATUSES


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
    add_queue_option(parser)
    parser.add_argument("--slurm-requeue", action="store_true",
                        help="inside a job of `gpuscale sbatch --requeue`: a requeued job (SLURM_RESTART_COUNT > 0) "
                             "continues this node's run of the same SLURM_JOB_ID from its checkpoint, and a run "
                             "preempted by SLURM's signal exits 0 (the job requeues itself)")


def add_queue_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--queue", action="store_true",
                        help="wait, status queued, until the GPUs (on a machine without GPUs: the CPU ranks, out of "
                             "its cores) the run asks for carry no other gpuscale run, first in first out; "
                             "`gpuscale runs` shows its place")


def add_follow_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--detach", action="store_true", help="print the run id and return at once")
    parser.add_argument("--json", action="store_true", help="print the finished run as JSON")


def run_settings_from_args(args: argparse.Namespace):
    """As settings_from_args, with `batch_size` resolved where it says `auto` (a stored tuning result,
    or `gpuscale tune` first on a GPU; app/batch_choice.py); also the notes recorded with the run."""
    from gpuscale.app.batch_choice import settings_with_batch

    recipe = get_recipe(args.recipe)
    merged = merge_layers(recipe.settings_cls, preset=preset_of(args, recipe), overrides=overrides_from_args(args))
    settings, notes = settings_with_batch(recipe, merged)
    return recipe, settings, notes


def cmd_run(args: argparse.Namespace) -> int:
    label = checked_label(args.label)
    launch.refuse_without_room(gpuscale_home())  # before a tuning, and before the history is opened
    job = slurm_job(os.environ) if args.slurm_requeue else None
    if job is not None:  # SLURM's signal may come before the run has started: kept for follow_run
        signal.signal(signal.SIGUSR1, lambda *_: PREEMPTION.update(asked=True))
    recipe, settings, notes = run_settings_from_args(args)
    plan = launch.plan_devices(settings.gpus)
    with private_files(settings.private):  # a history this run creates is private too
        store = Store()
    if job is not None:
        notes = {**notes, "slurm_job_id": job["id"], "slurm_restart_count": job["restarts"]}
        if job["restarts"]:
            continued = continue_slurm_job(store, recipe, settings, args, job, notes, label)
            if continued is not None:
                return continued
    if not args.queue:
        warn_if_oversubscribed(store, plan)
    run_id = launch.start_run(store, recipe, settings, plan, notes=notes, label=label, queue=args.queue)
    run = store.get_run(run_id)
    say_questions_left_out(run)
    say_fitted_to_ranks(run)
    say_file_domains(recipe, settings)
    if args.detach:
        print(json.dumps({"id": run_id}) if args.json else run_id)
        return 0
    where = f", {status_text(run)}" if args.queue else ""
    print(f"run {run_id}: {recipe.name} on {plan.describe()}{where}; Ctrl-C stops it, a closed terminal does not "
          f"(gpuscale logs {run_id} --follow)", file=sys.stderr)
    return follow_run(store, run_id, as_json=args.json, preempted_ok=job is not None)


def warn_if_oversubscribed(store: Store, plan) -> None:
    """One line on stderr where this run and the live ones would take more of the host's memory or
    cores than it has (control/host_load.py); the run still starts."""
    from gpuscale.control.host_load import oversubscription

    if warning := oversubscription(store.live_runs(), plan.nproc):
        print(warning, file=sys.stderr)


def slurm_job(environ) -> dict:
    """`--slurm-requeue`: the job's id and how often SLURM requeued it, from its environment."""
    job_id = environ.get("SLURM_JOB_ID", "").strip()
    if not job_id:
        raise BadInput("--slurm-requeue: SLURM_JOB_ID is not set: it is for the script of `gpuscale sbatch --requeue`")
    restarts = environ.get("SLURM_RESTART_COUNT", "0").strip() or "0"
    if not restarts.isdigit():
        raise BadInput(f"SLURM_RESTART_COUNT: {restarts!r}: expected a count (0, 1, ...)")
    return {"id": job_id, "restarts": int(restarts)}


def continue_slurm_job(store: Store, recipe, settings, args: argparse.Namespace, job: dict, notes: dict,
                       label: str | None) -> int | None:
    """A requeued job: this node's earlier run of the job (`launch.earlier_attempt`) continued from
    its checkpoint, as `gpuscale resume` does (a new run, its parent the earlier one), with this
    command's settings on top (the rendezvous host may have changed). Returns the exit status, or
    None where the run starts over: no earlier run here, or one with nothing to resume from (no
    checkpoint, nor work its recipe keeps: `Recipe.resume_overrides`)."""
    where = f"SLURM job {job['id']} (restart {job['restarts']})"
    earlier = launch.earlier_attempt(store, job["id"], settings.node_rank)
    if earlier is None:
        print(f"{where}: no earlier run of this job on node {settings.node_rank} in the history: starting afresh",
              file=sys.stderr)
        return None
    if earlier["status"] == "succeeded":
        print(f"{where}: run {earlier['id']} of this job succeeded: nothing left to do", file=sys.stderr)
        return 0
    # What `gpuscale resume` would continue from: a checkpoint, or the work a recipe keeps besides (rft's answers).
    if launch.checkpoint_of(earlier) is None and not recipe.resume_overrides(earlier):
        print(f"{where}: run {earlier['id']} ended {earlier['status']} with no checkpoint (recipe {recipe.name} "
              "writes none, or it ended before its first): starting over", file=sys.stderr)
        return None
    overrides = {key: value for key, value in overrides_from_args(args).items() if key != "batch_size"}
    run_id = launch.resume_run(store, recipe, earlier, overrides, force=True, notes=notes,
                               **({} if label is None else {"label": label}))
    run = store.get_run(run_id)
    print(f"run {run_id}: {recipe.name} resuming run {earlier['id']} of {where} from {resumed_from(run, earlier)}; "
          f"Ctrl-C stops it (gpuscale logs {run_id} --follow)", file=sys.stderr)
    if args.detach:
        print(json.dumps({"id": run_id}) if args.json else run_id)
        return 0
    return follow_run(store, run_id, as_json=args.json, preempted_ok=True)


def say_file_domains(recipe, settings) -> None:
    """JSONL files: a row that names no domain takes its file's name, and the per-domain figures are
    named for it (gsm8k's test.jsonl gives accuracy_greedy_test_after): said at launch, with how to
    name it, unless the `domain` setting names it already."""
    if settings.domain is not None or not recipe.reads_questions:
        return
    paths = parse_dataset(settings.dataset).paths
    if paths:
        named = ", ".join(f"{path.name}: {path.stem!r}" for path in paths)
        print(f"dataset: a row with no 'domain' field takes its file's name as its domain ({named}), which names "
              f"its figures (accuracy_greedy_{paths[0].stem}_after...); --set domain=NAME names it", file=sys.stderr)


def say_fitted_to_ranks(run: dict) -> None:
    """Defaults the ranks could not share, moved to the nearest values that split (recipes/shared/rank_split.py)."""
    if fitted := (run["settings"] or {}).get("fitted_to_ranks"):
        print(f"run {run['id']}: {fitted}", file=sys.stderr)


def say_questions_left_out(run: dict) -> None:
    """too_long=skip: how many questions the run leaves out as too long for the model's context."""
    settings = run["settings"] or {}
    if settings.get("questions_too_long"):
        print(f"run {run['id']}: {settings['questions_too_long']} question(s) longer than the model's context left "
              f"out (too_long=skip), the first at {settings['questions_too_long_first']}", file=sys.stderr)


def follow_run(store: Store, run_id: int, as_json: bool = False, preempted_ok: bool = False) -> int:
    """Show a live progress line until the run ends. SIGINT/SIGTERM here stop the run; SIGUSR1
    (SLURM's, from `gpuscale sbatch --requeue`'s script) goes to its supervisor: the run writes a
    checkpoint and ends `preempted`, which exits 0 where `preempted_ok` (the job requeues itself)."""
    stop = {"asked": False}

    def ask_stop(*_):
        stop["asked"] = True

    signal.signal(signal.SIGINT, ask_stop)
    signal.signal(signal.SIGTERM, ask_stop)
    signal.signal(signal.SIGUSR1, lambda *_: PREEMPTION.update(asked=True))
    terminal = Console(file=sys.stderr)  # its width follows the terminal (and COLUMNS)
    interactive = terminal.is_terminal
    last_print = 0.0
    # Warnings already printed whole on a line of their own, by what they are about (`warning_subject`):
    # a live one's figures change every step (a straggler's seconds, a late rank's, a phase's share).
    said: set[str] = set()
    while True:
        if stop["asked"]:
            print(f"\nstopping run {run_id} ...", file=sys.stderr)
            launch.stop_run(store, run_id)
        launch.reconcile(store)
        run = store.get_run(run_id)
        if run["status"] not in LIVE_STATUSES:
            break
        pass_on_preemption(run)
        now = time.monotonic()
        warnings = run_collapse_warnings(store, run)
        if interactive:
            for warning in warnings:  # once each, whole: the redrawn line may be cut to the width
                if warning_subject(warning) not in said:
                    print(f"\r\033[K! {warning}", file=sys.stderr, flush=True)
                    said.add(warning_subject(warning))
            line = fit_to_width(progress_line(run, time.time(), warnings), terminal.width)
            print("\r\033[K" + line, end="", file=sys.stderr, flush=True)
        elif now - last_print >= 10:
            print(progress_line(run, time.time(), warnings), file=sys.stderr, flush=True)
            last_print = now
        launch.wait_for_own_supervisor(run, 0.5)
    if interactive:
        print(file=sys.stderr)
    report_end(run, as_json, run_collapse_warnings(store, run))
    return 0 if run["status"] == "succeeded" or (preempted_ok and run["status"] == "preempted") else 1


# SIGUSR1 received (SLURM's, through srun), and whether the run's supervisor has been told.
PREEMPTION = {"asked": False, "passed": False}


def pass_on_preemption(run: dict) -> None:
    """SLURM's signal to the run's supervisor, once it runs (its own handler is in place by then)."""
    if not PREEMPTION["asked"] or PREEMPTION["passed"] or run["status"] != "running":
        return
    PREEMPTION["passed"] = True
    print(f"\nSIGUSR1: run {run['id']} writes a checkpoint and ends (preempted)", file=sys.stderr)
    try:
        os.kill(run["supervisor_pid"], signal.SIGUSR1)
    except (ProcessLookupError, TypeError):
        pass  # gone meanwhile: reconcile records how it ended


def fit_to_width(line: str, width: int) -> str:
    """`line` cut with an ellipsis to less than `width` cells. A redrawn line must never wrap: `\r`
    returns to the start of the last row only, so each redraw would leave the wrapped part behind.
    One cell is kept free because a line that fills the row puts some terminals in a pending wrap."""
    text = Text(line)
    text.truncate(max(1, width - 1), overflow="ellipsis")
    return text.plain


def warning_subject(warning: str) -> str:
    """What a warning is about: its words before the first colon, numbers left out (`rank 1 (GPU 3) is a
    straggler`, `waiting for the other ranks at the all-reduce takes # of a step`)."""
    return re.sub(r"\d[\d.,]*%?", "#", warning.split(":")[0])


def report_end(run: dict, as_json: bool, warnings: list[str] = ()) -> None:
    if as_json:
        print(json.dumps(public_run(run), indent=2))
        return
    print(progress_line(run, time.time(), warnings), file=sys.stderr)
    if run["error"]:
        print(f"error: {run['error']}", file=sys.stderr)
    if run["hint"]:
        print(f"hint: {run['hint']}", file=sys.stderr)
    for line in summary_lines(run["summary"] or {}, run["recipe"]):
        print(line)


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
    run_id = launch.resume_run(store, recipe, parent, overrides, force=args.force, queue=args.queue, **label)
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


def cmd_sbatch(args: argparse.Namespace) -> int:
    if args.nodes < 1 or args.gpus_per_node < 1:
        raise BadInput(f"nodes/gpus-per-node: {args.nodes}/{args.gpus_per_node}: both must be at least 1")
    if not 1 <= args.port <= MAX_PORT:
        raise BadInput(f"port: {args.port}: a TCP port is 1 to {MAX_PORT}")
    recipe = get_recipe(args.recipe)
    overrides = parse_assignments(args.assignments)
    # Validate now, with the values the nodes will use, so a bad setting fails here and not in the queue.
    resolve_settings(recipe.settings_cls, preset=preset_of(args, recipe), overrides={
        **overrides, "nnodes": args.nodes, "gpus": args.gpus_per_node, "rdzv_endpoint": f"head:{args.port}"})
    if args.requeue and not 1 <= args.signal_margin <= MAX_SIGNAL_MARGIN_S:
        raise BadInput(f"signal-margin: {args.signal_margin}: SLURM takes 1 to {MAX_SIGNAL_MARGIN_S} seconds")
    # Free text (a setting's value, the preset's path, the label) goes into the command quoted
    # (launch.sbatch_script); the #SBATCH values are checked against SLURM's syntax there.
    run_args = [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]
    if args.preset:
        run_args += ["--preset", str(args.preset.resolve())]
    if args.label is not None:
        run_args += ["--label", checked_label(args.label)]
    slurm_options = {"time": args.time, "partition": args.partition, "account": args.account, "qos": args.qos}
    print(launch.sbatch_script(recipe.name, args.nodes, args.gpus_per_node, run_args, slurm_options,
                               port=args.port, requeue_margin_s=args.signal_margin if args.requeue else None), end="")
    return 0


MAX_PORT = 65535
MAX_SIGNAL_MARGIN_S = 65535  # sbatch's --signal takes at most this many seconds
# SLURM's signal ahead of the time limit: time to finish the optimizer step under way (the ranks stop
# only at a step's end), write its checkpoint (model, optimizer state and RNG: tens of GB for a
# full fine-tune of a 7B model, a minute or more at the file system's speed) and end the ranks,
# with room for SLURM, which sends it up to 60 s late or early (its event resolution).
SIGNAL_MARGIN_S = 300


def add_run_parser(sub) -> None:
    p = sub.add_parser("run", help="start a run (follows it until it ends unless --detach)")
    add_run_options(p)
    add_follow_options(p)
    p.set_defaults(func=cmd_run)


def add_resume_parser(sub) -> None:
    p = sub.add_parser("resume", help="continue a stopped, failed or lost run from its last checkpoint, as a new run")
    p.add_argument("id", help=ID_HELP)
    p.add_argument("--gpus", help="'all', a count, or indices like 0,3 (default: the run's own)")
    p.add_argument("--set", dest="assignments", action="append", default=[], metavar="KEY=VALUE",
                   help="change a setting of the run; repeatable")
    p.add_argument("--force", action="store_true",
                   help="resume a run that was resumed before, again from the same checkpoint")
    p.add_argument("--label", help="a name for the new run (default: the run's own label)")
    add_queue_option(p)
    add_follow_options(p)
    p.set_defaults(func=cmd_resume)


def add_sbatch_parser(sub) -> None:
    p = sub.add_parser("sbatch", help="print a SLURM batch script for a multi-node run")
    p.add_argument("--recipe", required=True, help="recipe name (see `gpuscale recipes`)")
    p.add_argument("--nodes", type=int, required=True, help="how many nodes")
    p.add_argument("--gpus-per-node", type=int, required=True, help="GPUs (ranks) per node")
    p.add_argument("--time", default=launch.DEFAULT_TIME_LIMIT,
                   help="the job's time limit: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or UNLIMITED "
                        f"(default {launch.DEFAULT_TIME_LIMIT})")
    p.add_argument("--partition", help="the SLURM partition (several joined by commas)")
    p.add_argument("--account", help="the SLURM account the job is charged to")
    p.add_argument("--qos", help="the SLURM quality of service")
    p.add_argument("--label", help="a name for each node's run, as `gpuscale run --label` gives")
    p.add_argument("--port", type=int, default=29500, help="the rendezvous port on the head node (default 29500)")
    p.add_argument("--preset", type=Path, help=PRESET_HELP + " (below --set)")
    p.add_argument("--set", dest="assignments", action="append", default=[], metavar="KEY=VALUE",
                   help="any setting of the recipe; repeatable")
    p.add_argument("--requeue", action="store_true",
                   help="survive the time limit and preemption: SLURM signals the job --signal-margin seconds "
                        "before its limit, every node's run writes a checkpoint and ends `preempted`, the job "
                        "requeues itself, and the requeued job continues the runs from their checkpoints")
    p.add_argument("--signal-margin", type=int, default=SIGNAL_MARGIN_S,
                   help=f"with --requeue, seconds before the time limit for the signal (default {SIGNAL_MARGIN_S}): "
                        "enough for a step to end and its checkpoint to be written")
    p.set_defaults(func=cmd_sbatch)


PARSERS = {"run": add_run_parser, "resume": add_resume_parser, "sbatch": add_sbatch_parser}
