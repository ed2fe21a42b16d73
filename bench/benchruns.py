"""What the bench scripts share: one real `gpuscale run ... --json`, and why it failed if it did."""

from __future__ import annotations

import json
import subprocess
import sys


class RunFailed(RuntimeError):
    pass


def gpuscale_run(arguments: list[str], env: dict | None = None) -> dict:
    """The run's record (`gpuscale show --json`'s form); RunFailed, with the rank's log printed, if the
    run did not succeed."""
    print("$ gpuscale run", " ".join(arguments), flush=True)
    done = subprocess.run([sys.executable, "-m", "gpuscale.app.cli", "run", *arguments, "--json"],
                          capture_output=True, text=True, env=env)
    try:  # a run that failed still prints its record (exit 1); only bad input prints none (exit 2)
        run = json.loads(done.stdout)
    except json.JSONDecodeError:
        print(done.stderr[-3000:], flush=True)
        raise RunFailed("the run could not start: " + done.stderr.strip()[-300:]) from None
    if run["status"] != "succeeded":
        logs = subprocess.run([sys.executable, "-m", "gpuscale.app.cli", "logs", str(run["id"]), "--rank", "0"],
                              capture_output=True, text=True, env=env)
        print(logs.stdout[-3000:], flush=True)  # the rank's traceback
        raise RunFailed(f"run {run['id']} {run['status']}: {run['error']}")
    return run
