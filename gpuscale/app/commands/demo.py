"""`gpuscale demo`: a newcomer's first command. Two real runs of the power-sampling recipe on the
embedded default (the tiny-math model and problems, no download): plain sampling at temperature 1,
then power sampling (MCMC from p^alpha), on the same problems; then both accuracies side by side and
`gpuscale compare` of the two runs. About a minute on a 2-core laptop; both runs stay in the history.

`probe` remains the health check of a node (`gpuscale run --recipe probe`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import time

from gpuscale.app.commands.common import BadInput
from gpuscale.app.commands.history import cmd_compare
from gpuscale.app.commands.launching import follow_run
from gpuscale.app.views.text import format_number
from gpuscale.control import launch
from gpuscale.control.store import Store
from gpuscale.recipes.shared.registry import get_recipe
from gpuscale.runs.devices import usable_cores
from gpuscale.runs.settings import resolve_settings

DEMO_PROBLEMS = 200
# Long enough for tiny-math's worked answers, short enough for a laptop CPU.
DEMO_SETTINGS = {"dataset": "tiny-math", "model": "tiny-math", "max_new_tokens": 96, "blocks": 4}
METHODS = {
    "plain sampling (temperature 1)": {"method": "sample", "temperature": 1.0},
    "power sampling (alpha 4, 4 blocks x 10 MH steps)": {"method": "power", "alpha": 4.0, "mcmc_steps": 10},
}


def add_demo_parser(sub) -> None:
    p = sub.add_parser("demo", help="a first look: power sampling against plain sampling on the embedded default")
    p.add_argument("--problems", type=int, default=DEMO_PROBLEMS,
                   help=f"tiny-math test problems per run (default {DEMO_PROBLEMS})")
    p.add_argument("--gpus", help="GPUs, or CPU ranks where there is no GPU (default: every GPU, else 2 CPU ranks)")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    if args.problems < 1:
        raise BadInput(f"problems: {args.problems}: at least 1")
    recipe = get_recipe("power-sampling")
    gpus = args.gpus or default_gpus(launch)
    store = Store()
    finished = []
    for label, method in METHODS.items():
        overrides = {**DEMO_SETTINGS, **method, "max_examples": args.problems, "gpus": gpus}
        settings = resolve_settings(recipe.settings_cls, overrides=overrides, environ={})
        plan = launch.plan_devices(settings.gpus)
        run_id = launch.start_run(store, recipe, settings, plan)
        print(f"run {run_id}: {label}, {args.problems} tiny-math problems on {plan.describe()}", file=sys.stderr)
        started = time.monotonic()
        with contextlib.redirect_stdout(io.StringIO()):  # each run's full summary: `gpuscale show ID`
            code = follow_run(store, run_id)
        if code != 0:
            print(f"run {run_id} did not succeed: gpuscale show {run_id}", file=sys.stderr)
            return 1
        finished.append((label, store.get_run(run_id), time.monotonic() - started))
    print()
    for label, run, seconds in finished:
        summary = run["summary"] or {}
        accuracy = summary.get("accuracy")
        shown = f"{100 * accuracy:.1f}%" if isinstance(accuracy, float) else "-"
        print(f"{label:<50} accuracy {shown:>6}  ({summary.get('problems', 0)} problems, "
              f"{format_number(summary.get('tokens_per_s'))} tokens/s, {seconds:.0f} s)")
    (_, a, _), (_, b, _) = finished
    print(f"\n$ gpuscale compare {a['id']} {b['id']}")
    sys.stdout.flush()
    return cmd_compare(argparse.Namespace(a=a["id"], b=b["id"], json=False))


def default_gpus(launch) -> str | int:
    """Every GPU; on a machine without one, two CPU ranks (one where there is a single core)."""
    if launch.plan_devices("all").on_gpu:
        return "all"
    return min(2, usable_cores())


PARSERS = {"demo": add_demo_parser}
