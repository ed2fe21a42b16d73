"""What every group of `gpuscale` commands shares: the one-line errors (exit 2), the parser class,
the options that make a recipe's settings, opening the history, and printing a table or a run."""

from __future__ import annotations

import argparse
import unicodedata
from pathlib import Path

from gpuscale.app.views.export import NothingToExport
from gpuscale.control import launch
from gpuscale.control.store import Store, StoreError, UnknownRun, gpuscale_home, label_problem
from gpuscale.data.data_error import DataError
from gpuscale.data.models import ModelError
from gpuscale.data.precision import PRECISIONS
from gpuscale.recipes.shared.registry import all_recipes, get_recipe
from gpuscale.runs.settings import SettingsError, parse_assignments, read_preset, resolve_settings

EXIT_BAD_INPUT = 2
ID_HELP = "the run's id or label (see `gpuscale runs`)"
JSON_HELP = "print it as JSON"


class BadInput(Exception):
    """Raised for input errors found by the CLI itself; printed as one line, exit code 2."""


# Errors the user can act on: one line, exit code 2, no traceback. A history that cannot be opened or
# written (read-only, unreadable, damaged) is one of them: the line names the path and what to do.
USER_ERRORS = (SettingsError, UnknownRun, BadInput, DataError, ModelError, StoreError, NothingToExport)


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


def add_setting_options(parser: argparse.ArgumentParser, recipe_required: bool = True,
                        gpus_help: str = "'all', a count, or indices like 0,3 (CPU machines: number of ranks)") -> None:
    """The options that make a recipe's settings (shared by `run` and `tune`)."""
    parser.add_argument("--recipe", required=recipe_required, help="recipe name (see `gpuscale recipes`)")
    parser.add_argument("--gpus", help=gpus_help)
    parser.add_argument("--precision", help=" | ".join(PRECISIONS))
    parser.add_argument("--model", help="model name, hub id or local path")
    parser.add_argument("--dataset",
                        help="tiny-math[:DOMAIN,...], tiny-math-conflict, gsm8k, or JSONL files (a.jsonl,b.jsonl)")
    parser.add_argument("--preset", type=Path, help=PRESET_HELP + " (below env and --set)")
    parser.add_argument("--set", dest="assignments", action="append", default=[], metavar="KEY=VALUE",
                        help="any setting of the recipe; repeatable")


PRESET_HELP = "TOML file of settings: its top-level keys for every recipe, a [RECIPE] table's for that recipe"


def preset_of(args: argparse.Namespace, recipe) -> dict:
    """`--preset`'s settings for `recipe`: the file's top-level keys and its [recipe] table's (another
    recipe's table skipped); {} without one."""
    return read_preset(args.preset, recipe.name, all_recipes()) if args.preset else {}


FLAG_FIELDS = ("gpus", "batch_size", "precision", "model", "dataset", "nnodes", "node_rank", "rdzv_endpoint")


def settings_from_args(args: argparse.Namespace):
    """The recipe and its validated settings from the command line (and preset, and environment)."""
    recipe = get_recipe(args.recipe)
    settings = resolve_settings(recipe.settings_cls, preset=preset_of(args, recipe),
                                overrides=overrides_from_args(args))
    return recipe, settings


def overrides_from_args(args: argparse.Namespace) -> dict:
    overrides = {field: getattr(args, field) for field in FLAG_FIELDS if getattr(args, field, None) is not None}
    overrides.update(parse_assignments(args.assignments))
    return overrides


def checked_label(label: str | None) -> str | None:
    """A label names one run where an id could: not empty, not a number (that is an id), and on one
    line (a control character such as a newline or an escape would break the tables that show it)."""
    if label is None:
        return None
    label = label.strip()
    if problem := label_problem(label):
        raise BadInput(f"label: {label!r}: {problem}")
    if any(unicodedata.category(char) == "Cc" for char in label):
        raise BadInput(f"label: {label!r}: a control character (newline, tab, escape...) is not allowed in a label")
    return label


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


def print_table(rows: list[list[str]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def public_run(run: dict) -> dict:
    """The run as `--json` prints it; `queue_position` only for a run waiting in the queue (1: next)."""
    keys = ("id", "recipe", "status", "settings", "summary", "started_at", "ended_at", "error", "hint",
            "created_at", "exit_code", "run_dir", "host", "command", "progress", "supervisor_pid", "label",
            "parent_id")
    queued = {"queue_position": run["queue_position"]} if run.get("queue_position") else {}
    return {**{key: run.get(key) for key in keys}, **queued}
