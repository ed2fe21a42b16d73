"""What a user sees of a live run's generations: the monitor and its generations screen (`a`) captured as
SVG while a run of the recipe is live, then the run's `gpuscale generations` and `gpuscale show` once it ends.

It watches the history at --home (the GPUSCALE_HOME another command's runs write to, the acceptance's
say) for a live run of --recipe whose generations file has records, opens the real Textual app headless
on it, saves monitor-RUN.svg and generations-RUN.svg under --out, waits for the run to end and writes
generations-RUN.txt and show-RUN.txt beside them. Issue 33's "What must be shown", on a GPU machine:

    python bench/acceptance.py --gpus 1 --home H &    python bench/generations_view.py --home H --out DIR

(Named samples_view.py, with samples-RUN.* files, before the generations were named for what they are:
bench/RESULTS.md's capture of 2026-11-27 is under that name.)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

BASELINE = """No baseline: a capture of what the monitor shows, not a comparison."""


def live_run_with_generations(home: Path, recipe: str) -> dict | None:
    """A live run of `recipe` whose generations file holds at least one record, or None."""
    from gpuscale.control.store import Store
    from gpuscale.runs.run_dir import RunDir

    store = Store.for_reading(home)
    try:
        for run in store.live_runs():
            generations = RunDir(run["run_dir"]).generations_to_read
            if run["recipe"] == recipe and generations.exists() and generations.stat().st_size > 0:
                return run
    finally:
        store.close()
    return None


def wait_for_run(home: Path, recipe: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (home / "runs.db").exists() and (run := live_run_with_generations(home, recipe)):
            return run
        time.sleep(2.0)
    raise SystemExit(f"no live {recipe} run with generations in {home} within {timeout:.0f} s")


async def capture(home: Path, run_id: int, out: Path, size: tuple[int, int]) -> list[Path]:
    """The monitor of the run, then its generations screen, saved as SVG once each has drawn its figures."""
    from gpuscale.app.screens.generations import GenerationsScreen
    from gpuscale.app.tui import GpuscaleApp

    app = GpuscaleApp(home=home)
    saved = []
    async with app.run_test(size=size) as pilot:
        await app.open_monitor(run_id)
        await pilot.pause(6.0)  # a few refreshes: curves, GPU rows and the mismatch figure drawn
        saved.append(Path(app.save_screenshot(f"monitor-{run_id}.svg", str(out))))
        await pilot.press("a")
        await pilot.pause(4.0)  # the generations file read and laid out
        if not isinstance(app.screen, GenerationsScreen):
            raise SystemExit(f"`a` did not open the generations screen (on {type(app.screen).__name__})")
        saved.append(Path(app.save_screenshot(f"generations-{run_id}.svg", str(out))))
    return saved


def wait_until_ended(home: Path, run_id: int, timeout: float) -> str:
    from gpuscale.control.store import Store
    from gpuscale.runs.statuses import LIVE_STATUSES

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        store = Store.for_reading(home)
        status = store.get_run(run_id)["status"]
        store.close()
        if status not in LIVE_STATUSES:
            return status
        time.sleep(5.0)
    return "still running"


def cli_output(home: Path, *argv: str) -> str:
    done = subprocess.run([sys.executable, "-m", "gpuscale.app.cli", *argv], capture_output=True, text=True,
                          env={**os.environ, "GPUSCALE_HOME": str(home)})
    return done.stdout + (f"\n(exit {done.returncode}) {done.stderr}" if done.returncode else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] + "\n\n" + BASELINE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", required=True, type=Path, help="GPUSCALE_HOME the watched runs write to")
    parser.add_argument("--recipe", default="grpo-mtl")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--size", default="140x48", help="terminal columns x rows")
    parser.add_argument("--wait", type=float, default=300, help="seconds to wait for a live run with generations")
    parser.add_argument("--end-wait", type=float, default=600, help="seconds to wait for that run to end")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    run = wait_for_run(args.home, args.recipe, args.wait)
    columns, rows = (int(part) for part in args.size.split("x"))
    for path in asyncio.run(capture(args.home, run["id"], args.out, (columns, rows))):
        print(f"saved {path}", flush=True)
    status = wait_until_ended(args.home, run["id"], args.end_wait)
    print(f"run {run['id']} ended: {status}", flush=True)
    for name, argv in (("generations", ("generations", str(run["id"]))), ("show", ("show", str(run["id"])))):
        path = args.out / f"{name}-{run['id']}.txt"
        path.write_text(cli_output(args.home, *argv))
        print(f"saved {path}", flush=True)


if __name__ == "__main__":
    main()
