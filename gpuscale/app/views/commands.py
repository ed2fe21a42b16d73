"""The launch screen's texts: the launcher command a run will execute, and the same run as a
`gpuscale run` line to paste into a script."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from gpuscale.control.launch import display_command, launcher_argv
from gpuscale.runs.run_dir import RunDir


def launch_preview(recipe, settings, plan, home: Path, environ: dict | None = None) -> str:
    """The launcher command the run will execute. Its run folder is known only once it starts (NEW
    stands for its id), and the store's folder is written as the user set it ($GPUSCALE_HOME or ~)."""
    settings_path = RunDir(Path(home) / "runs" / "NEW").settings
    command = display_command(launcher_argv(recipe, settings, plan, settings_path))
    return command.replace(str(home), home_text(Path(home), os.environ if environ is None else environ))


def home_text(home: Path, environ) -> str:
    """`$GPUSCALE_HOME` when that is where the store is, else the path with `~` for the home folder."""
    if environ.get("GPUSCALE_HOME") and Path(environ["GPUSCALE_HOME"]).expanduser().absolute() == home:
        return "$GPUSCALE_HOME"
    try:
        return "~/" + str(home.relative_to(Path.home()))
    except ValueError:
        return str(home)


SHELL_FLAGS = {"gpus": "--gpus", "batch_size": "--batch-size", "precision": "--precision", "model": "--model",
               "dataset": "--dataset"}


def shell_equivalent(recipe_name: str, settings, label: str | None = None) -> str:
    """The same run from a shell: `gpuscale run --recipe NAME` plus every setting that differs from
    the recipe's default (the environment may still add its own; the TUI form already shows them),
    and its label."""
    defaults = type(settings).model_construct().model_dump()
    argv = ["gpuscale", "run", "--recipe", recipe_name] + (["--label", label] if label else [])
    for name, value in settings.model_dump().items():
        if value == defaults.get(name):
            continue
        text = ",".join(map(str, value)) if isinstance(value, list) else ("" if value is None else str(value))
        argv += [SHELL_FLAGS[name], text] if name in SHELL_FLAGS else ["--set", f"{name}={text}"]
    return shlex.join(argv)
