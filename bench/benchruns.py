"""What the bench scripts share: one real `gpuscale run ... --json`, and why it failed if it did; the
comparison of runs with a cost switched on and off (`on_off`)."""

from __future__ import annotations

import json
import statistics
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


def step_side(times: list[float]) -> dict:
    """One side's runs: their steady step times, median and spread ((max - min) / median; None for one run)."""
    middle = statistics.median(times)
    return {"step_seconds": times, "median_s": middle,
            "spread": (max(times) - min(times)) / middle if len(times) > 1 else None}


def on_off(runs: list[dict], switch: str) -> dict:
    """Runs alternating with `switch` (a key of each run: True on, False off) compared: each side,
    on / off of the median step times, and the noise (the larger spread; None with one run a side)."""
    on, off = (step_side([run["step_seconds"] for run in runs if run[switch] == value]) for value in (True, False))
    noise = None if None in (on["spread"], off["spread"]) else max(on["spread"], off["spread"])
    return {"on": on, "off": off, "on_over_off": on["median_s"] / off["median_s"], "noise": noise}
