"""README's CPU commands, each alone, timed: the demo, the node check, and every recipe's default run on
2 CPU ranks (README's table "CPU command (2 cores)").

Each command runs in a fresh GPUSCALE_HOME, one after another, never two at once. Beside its wall time the
script records the load average before it starts (a quiet machine: under 0.5 a core) and what the run's
summary says (held-out accuracy before and after, or the accuracy of power sampling).

No baseline: README states these times and accuracies for a user to expect, not a speed-up.

    python bench/cpu_commands.py [--only demo,probe,...] [--home DIR] [--out OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import write_result  # noqa: E402

# name -> the arguments after `gpuscale`, as README gives them.
COMMANDS = {
    "demo": ["demo"],
    "probe": ["run", "--recipe", "probe", "--gpus", "2"],
    "power-sampling": ["run", "--recipe", "power-sampling", "--gpus", "2"],
    "power-sampling-method-sample": ["run", "--recipe", "power-sampling", "--gpus", "2", "--set", "method=sample"],
    "sft": ["run", "--recipe", "sft", "--gpus", "2"],
    "rft": ["run", "--recipe", "rft", "--gpus", "2"],
    "grpo-mtl": ["run", "--recipe", "grpo-mtl", "--gpus", "2"],
    "eggroll": ["run", "--recipe", "eggroll", "--gpus", "2"],
}
FIGURES = ("accuracy", "accuracy_greedy_before", "accuracy_greedy_after", "accuracy_sampled_before",
           "accuracy_sampled_after", "steps", "duration_s")


def timed(name: str, home: Path) -> dict:
    """One command alone in its own GPUSCALE_HOME: wall time, load before, exit code, summary figures."""
    env = {**os.environ, "GPUSCALE_HOME": str(home / name)}
    load_before = os.getloadavg()
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "gpuscale.app.cli", *COMMANDS[name]], env=env,
                          capture_output=True, text=True)
    wall = time.monotonic() - started
    figures = {"wall_s": round(wall, 1), "exit_code": done.returncode, "load_before_1_5_15": load_before,
               "load_after_1_5_15": os.getloadavg(), "runs": summaries(env)}
    if done.returncode:
        figures["stderr_tail"] = done.stderr[-2000:]
    return figures


def summaries(env: dict) -> list[dict]:
    """Every run the command recorded, with its summary's headline figures."""
    listed = subprocess.run([sys.executable, "-m", "gpuscale.app.cli", "runs", "--json"], env=env,
                            capture_output=True, text=True)
    runs = json.loads(listed.stdout or "[]")
    return [{"id": run["id"], "recipe": run["recipe"], "status": run["status"],
             **{key: (run.get("summary") or {}).get(key) for key in FIGURES}} for run in runs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help=f"comma-separated, of {', '.join(COMMANDS)}")
    parser.add_argument("--home", type=Path, help="a folder for the commands' GPUSCALE_HOMEs (default: a new one)")
    parser.add_argument("--out", help="the result's path (default bench/results/cpu_commands/...)")
    args = parser.parse_args(argv)
    names = args.only.split(",") if args.only else list(COMMANDS)
    unknown = [name for name in names if name not in COMMANDS]
    if unknown:
        parser.error(f"--only: unknown {', '.join(unknown)}; known: {', '.join(COMMANDS)}")
    home = args.home or Path(tempfile.mkdtemp(prefix="gpuscale-cpu-commands-"))
    figures = {}
    for name in names:
        figures[name] = timed(name, home)
        print(f"{name}: {figures[name]['wall_s']} s, exit {figures[name]['exit_code']}, load before "
              f"{figures[name]['load_before_1_5_15'][0]:.2f}; {figures[name]['runs']}", flush=True)
    settings = {"commands": {name: "gpuscale " + " ".join(COMMANDS[name]) for name in names},
                "machine": f"{os.cpu_count()} CPU cores, no GPU, each command alone"}
    write_result("cpu_commands", "readme-cpu-commands", settings, figures, out=args.out, card="cpu")
    return 0 if all(figure["exit_code"] == 0 for figure in figures.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
