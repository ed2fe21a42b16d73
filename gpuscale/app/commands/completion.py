"""`gpuscale completion bash|zsh`: the shell's completion script for gpuscale's commands, their options
and the values a shell can offer (recipe names, statuses, precisions, file paths), written by shtab from
the same argparse parser that reads the command line, so that a new command or option completes as soon
as it exists."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from gpuscale.data.precision import PRECISIONS
from gpuscale.recipes.shared.registry import all_recipes
from gpuscale.runs.statuses import STATUSES

SHELLS = ("bash", "zsh")
PATH_OPTIONS = ("preset", "dataset", "model")  # a local path is the common case; names are typed whole


def cmd_completion(args: argparse.Namespace) -> int:
    import shtab  # only here: every other command starts without it

    print(shtab.complete(completion_parser(shtab.FILE), shell=args.shell), end="")
    return 0


def completion_parser(file_completion) -> argparse.ArgumentParser:
    """gpuscale's parser, with what a shell may offer after an option: the installed recipes' names, the
    statuses, the precisions (as choices, which shtab writes into the script), and file names for a path.
    Built for the script only: the parser that reads a command line keeps its own messages for a bad
    value (an unknown recipe's names the known ones)."""
    from gpuscale.app.cli import build_parser  # the CLI imports this module: at call time, not at import

    parser = build_parser()
    offered = {"recipe": sorted(all_recipes()), "status": list(STATUSES), "precision": list(PRECISIONS)}
    for action in every_action(parser):
        if action.dest in offered and not action.choices:
            action.choices = offered[action.dest]
        elif action.dest in PATH_OPTIONS:
            action.complete = file_completion
    return parser


def every_action(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    """Every option and positional of `parser` and of its subcommands, theirs too, each once."""
    for action in parser._actions:
        yield action
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # an alias maps to its command's parser
                yield from every_action(sub)


def add_completion_parser(sub) -> None:
    p = sub.add_parser("completion", help="print the shell completion script (source <(gpuscale completion bash))")
    p.add_argument("shell", choices=SHELLS, help="the shell: " + " or ".join(SHELLS))
    p.set_defaults(func=cmd_completion)


PARSERS = {"completion": add_completion_parser}
