"""`gpuscale-tui`: the Textual app; with `--recipe NAME` the same run as `gpuscale run`, no screen.

A bare `gpuscale-tui` goes straight to the app: with nothing to parse, the CLI's parser (and what the
CLI imports: its views, the data sets' readers) is not imported before the first frame."""

from __future__ import annotations

import sys


def build_parser():
    from gpuscale.app.commands.common import Parser, VersionAction
    from gpuscale.app.commands.launching import add_follow_options, add_run_options

    parser = Parser(prog="gpuscale-tui", description="Pick, tune, launch, watch and look back at runs.")
    parser.add_argument("--version", action=VersionAction)
    add_run_options(parser, recipe_required=False)
    add_follow_options(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv:
        from gpuscale.app.commands.common import EXIT_BAD_INPUT, USER_ERRORS
        from gpuscale.app.commands.launching import cmd_run

        args = build_parser().parse_args(argv)
        if args.recipe:  # headless: scripts, SLURM jobs, CI
            try:
                return cmd_run(args)
            except USER_ERRORS as exc:  # one line, exit 2, as `gpuscale run`
                print(f"gpuscale-tui: error: {exc}", file=sys.stderr)
                return EXIT_BAD_INPUT
    from gpuscale.app.tui import GpuscaleApp

    GpuscaleApp().run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
