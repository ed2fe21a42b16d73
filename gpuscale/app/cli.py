"""`gpuscale`: start runs without a screen and read the run history from the shell.

Bad input exits 2 with one line naming the field, the value and the reason, before anything is
started or written. `run` exits 0 only when the run succeeded.
"""

from __future__ import annotations

import logging
import os
import signal
import sqlite3
import sys
import warnings

from gpuscale.app.commands import completion, demo, history, launching, listings, tuning
from gpuscale.app.commands.common import EXIT_BAD_INPUT, USER_ERRORS, Parser, VersionAction
from gpuscale.control.store import gpuscale_home, store_error
from gpuscale.data.question_length import PROGRESS

# The commands in the order `gpuscale --help` lists them; each group's module adds its own parsers.
COMMANDS = ("run", "tune", "runs", "show", "stop", "delete", "resume", "logs", "generations", "compare",
            "export", "recipes", "gpus", "models", "data", "doctor", "sbatch", "demo", "completion")


def build_parser() -> Parser:
    parser = Parser(prog="gpuscale", description="Launch, watch and remember multi-GPU LLM recipes.")
    parser.add_argument("--version", action=VersionAction)
    # Not required: a bare `gpuscale` gets the usage and the commands (main), not a one-line error.
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    adders = {**launching.PARSERS, **tuning.PARSERS, **history.PARSERS, **listings.PARSERS, **demo.PARSERS,
              **completion.PARSERS}
    for name in COMMANDS:
        adders[name](sub)
    return parser


class StderrLines(logging.Handler):
    """A log record as a line on the stderr of the moment (tests swap it)."""

    def emit(self, record: logging.LogRecord) -> None:
        print(self.format(record), file=sys.stderr, flush=True)


def show_progress() -> None:
    """The progress lines of a long check (data/question_length.py's PROGRESS) on stderr, where the
    CLI's other messages go; once a process."""
    if not any(isinstance(handler, StderrLines) for handler in PROGRESS.handlers):
        PROGRESS.addHandler(StderrLines())
    PROGRESS.setLevel(logging.INFO)
    PROGRESS.propagate = False


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
    show_progress()
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
