"""What a user sees of where a multi-GPU run's steps go: the monitor, with its row a rank and its advice,
captured as SVG during a real run, and how many logged steps a straggler takes to be named live.

    python bench/phases_view.py --gpus 2                       # sft at 0.5B, rank 1 slowed (the default)
    python bench/phases_view.py --gpus 4 --slow-rank none      # nothing slowed: only the split, any advice

One `gpuscale run --recipe R --gpus G --model M` (RUN_SETTINGS bound its length and turn off its
evaluation; `--set` after them) in a GPUSCALE_HOME of the script's, with GPUSCALE_SLOW_RANK=--slow-rank in
its environment (engines/step_phases.py's test aid: that rank sleeps the given seconds at each training
pass, as a slower card would make it). While it runs, the script reads the history as the monitor does,
every 0.1 s: each logged step's warnings (app/views/collapse.py's `run_collapse_warnings`, the lines the
monitor and the progress line show) and rows a rank (app/views/runs.py's `split_lines`). Once the slowed
rank is named a straggler (or, with nothing slowed, once every rank has a steady split), it opens the
real Textual app headless on the run's monitor and saves it at each --sizes (monitor-<size>.svg); at the
end it writes `gpuscale show` of the run (show.txt), all beside the JSON.

Target: the slowed rank named within LIVE_STEPS (3) logged steady steps (it is slowed from its
first step, and the first WARM_UP_STEPS are no steady ones), while the run goes on, and no other rank named.
The result (bench/record.py's schema) goes to bench/results/phases/monitor-<recipe>-<G>gpus-<date>-<card>.json,
the captures to a folder of the same name; the exit code is 1 where the target is missed.

On CPU (tiny-math, gloo; what the test runs; speeds mean nothing):

    python bench/phases_view.py --gpus 2 --model tiny-math --slow-rank 1:1.0 --sizes 120x40 \\
        --set max_steps=12 --set max_examples=64 --out /tmp/phases-view.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, also when loaded by path
from record import ROOT, write_result  # noqa: E402

sys.path.insert(0, str(ROOT))  # gpuscale from this checkout when run as a script
from faults import case_card  # noqa: E402
from generations_view import cli_output  # noqa: E402
from svg_text import svg_screen_text  # noqa: E402

from gpuscale.data.step_phases import LIVE_STEPS, WARM_UP_STEPS  # noqa: E402
from gpuscale.engines.step_phases import SLOW_RANK_ENV  # noqa: E402
from gpuscale.runs.statuses import LIVE_STATUSES  # noqa: E402

BASELINE = "No baseline: a capture of what the monitor shows and of when it names a straggler."
# Long enough that the run is still live when captured (sft at 0.5B: about 0.1 s a step on an H200),
# with evaluation and saving off.
RUN_SETTINGS = {"max_steps": "200", "eval_examples": "0", "save_model": "false", "checkpoint_every": "off"}
STRAGGLER = re.compile(r"^rank (\d+)(?: \(GPU \d+\))? is a straggler")


def slowed_rank(opts) -> int | None:
    return None if opts.slow_rank == "none" else int(opts.slow_rank.split(":")[0])


def named_stragglers(warnings: list[str]) -> list[int]:
    """The ranks the warnings name as stragglers."""
    return [int(match.group(1)) for line in warnings if (match := STRAGGLER.match(line))]


def start_run(opts, home: Path, log: Path) -> subprocess.Popen:
    sets = [item for key, value in {**RUN_SETTINGS, **dict(a.split("=", 1) for a in opts.assignments)}.items()
            for item in ("--set", f"{key}={value}")]
    argv = ["run", "--recipe", opts.recipe, "--gpus", str(opts.gpus), "--model", opts.model, *sets]
    env = {**os.environ, "GPUSCALE_HOME": str(home)}
    env.pop(SLOW_RANK_ENV, None)
    if opts.slow_rank != "none":
        env[SLOW_RANK_ENV] = opts.slow_rank
    print("$ gpuscale", " ".join(argv), f"({SLOW_RANK_ENV}={env.get(SLOW_RANK_ENV, '')})", flush=True)
    with log.open("w") as out:
        return subprocess.Popen([sys.executable, "-m", "gpuscale.app.cli", *argv], stdout=out,
                                stderr=subprocess.STDOUT, env=env)


def the_run_id(home: Path, front: subprocess.Popen, timeout: float = 300) -> int:
    from gpuscale.control.store import Store

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and front.poll() is None:
        if (home / "runs.db").exists():
            store = Store.for_reading(home)
            runs = store.list_runs()
            store.close()
            if runs:
                return runs[0]["id"]
        time.sleep(0.2)
    raise SystemExit(f"no run in {home} (the front exited {front.poll()})")


def observe(home: Path, run_id: int) -> dict:
    """The run as the monitor reads it now: its status, step, warnings and rows a rank."""
    from gpuscale.app.views.collapse import run_collapse_warnings
    from gpuscale.app.views.runs import split_lines
    from gpuscale.control.store import Store

    store = Store.for_reading(home)
    try:
        run = store.get_run(run_id)
        return {"status": run["status"], "step": (run.get("progress") or {}).get("step"),
                "warnings": run_collapse_warnings(store, run), "rows": split_lines(run)}
    finally:
        store.close()


def ready_to_capture(seen: dict, slowed: int | None, ranks: int) -> bool:
    """Slowed rank named, or with nothing slowed, a row for every rank (the header and one a rank)."""
    if slowed is not None:
        return slowed in named_stragglers(seen["warnings"])
    return len(seen["rows"]) == ranks + 1


async def capture(home: Path, run_id: int, folder: Path, sizes: list[tuple[int, int]]) -> list[str]:
    """The run's monitor saved at each size (monitor-<columns>x<rows>.svg), once it has drawn a few refreshes."""
    from gpuscale.app.tui import GpuscaleApp

    saved = []
    for columns, rows in sizes:
        app = GpuscaleApp(home=home)
        async with app.run_test(size=(columns, rows)) as pilot:
            await app.open_monitor(run_id)
            await pilot.pause(3.0)  # a few refreshes: GPU rows, the rows a rank, the advice
            saved.append(app.save_screenshot(f"monitor-{columns}x{rows}.svg", str(folder)))
    return saved


def watch(opts, home: Path, run_id: int, folder: Path) -> tuple[list[dict], list[str]]:
    """Each logged step's first observation, until the run ends; the captures' paths, made on the way."""
    slowed = slowed_rank(opts)
    observations: list[dict] = []
    saved: list[str] = []
    deadline = time.monotonic() + opts.timeout
    while time.monotonic() < deadline:
        seen = observe(home, run_id)
        if seen["status"] not in LIVE_STATUSES:
            break
        if seen["step"] is not None and (not observations or observations[-1]["step"] != seen["step"]):
            observations.append(seen)
            print(f"step {seen['step']}: named {named_stragglers(seen['warnings'])}", flush=True)
        if not saved and ready_to_capture(seen, slowed, opts.gpus):
            saved = asyncio.run(capture(home, run_id, folder, opts.sizes))
            print("saved", *saved, flush=True)
        time.sleep(0.1)
    return observations, saved


def figures_of_run(observations: list[dict], slowed: int | None) -> dict:
    named_at = next((seen["step"] for seen in observations if slowed in named_stragglers(seen["warnings"])), None)
    others = sorted({rank for seen in observations for rank in named_stragglers(seen["warnings"]) if rank != slowed})
    steps_to_name = None if named_at is None else named_at - WARM_UP_STEPS
    if slowed is None:
        met = not others
    else:
        met = steps_to_name is not None and steps_to_name <= LIVE_STEPS and not others
    return {"slowed_rank": slowed, "named_at_step": named_at, "steady_steps_to_name": steps_to_name,
            "target_steps": LIVE_STEPS, "other_ranks_named": others, "met": met,
            "observations": observations}


def parse_options(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + "\n\n" + BASELINE,
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=2, help="the run's --gpus (CPU ranks where there is no GPU)")
    parser.add_argument("--recipe", default="sft")
    parser.add_argument("--model", default="random-qwen2.5-0.5b")
    parser.add_argument("--slow-rank", default="1:0.05", help=f"{SLOW_RANK_ENV}'s RANK:SECONDS[:PHASE], or none")
    parser.add_argument("--sizes", default="120x40,80x24", help="the captures' columns x rows, comma-separated")
    parser.add_argument("--set", dest="assignments", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--timeout", type=float, default=480, help="seconds to watch the run for")
    parser.add_argument("--out", default=None,
                        help="the JSON (default: bench/results/phases/monitor-<recipe>-<G>gpus-<date>-<card>.json)")
    opts = parser.parse_args(argv)
    opts.sizes = [tuple(int(part) for part in size.split("x")) for size in opts.sizes.split(",")]
    if opts.slow_rank != "none" and not re.fullmatch(r"\d+:[0-9.]+(:\w+)?", opts.slow_rank):
        parser.error(f"--slow-rank: {opts.slow_rank!r}: not RANK:SECONDS[:PHASE] nor none")
    if opts.slow_rank != "none" and slowed_rank(opts) >= opts.gpus:
        parser.error(f"--slow-rank: {opts.slow_rank!r}: rank not below --gpus {opts.gpus}")
    return opts


def main(argv: list[str] | None = None) -> None:
    opts = parse_options(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with tempfile.TemporaryDirectory(prefix="gpuscale-phases-view-") as folder:  # the run's home, then gone
        home, staging = Path(folder) / "home", Path(folder) / "out"
        home.mkdir()
        staging.mkdir()
        figures = watch_and_record(opts, home, staging)
    named = (f"slowed rank {figures['slowed_rank']} named at step {figures['named_at_step']} "
             f"({figures['steady_steps_to_name']} steady steps; target {LIVE_STEPS}); others named"
             if figures["slowed_rank"] is not None else "nothing slowed; ranks named")
    print(f"{named} {figures['other_ranks_named']}: {'met' if figures['met'] else 'NOT met'}", flush=True)
    sys.exit(0 if figures["met"] and figures["status"] == "succeeded" and figures["screens"] else 1)


def watch_and_record(opts, home: Path, staging: Path) -> dict:
    """Start the run, watch it to its end, write the JSON and move the captures beside it: the figures."""
    front = start_run(opts, home, staging / "run.txt")
    run_id = the_run_id(home, front)
    observations, saved = watch(opts, home, run_id, staging)
    front.wait(timeout=120)
    (staging / "show.txt").write_text(cli_output(home, "show", str(run_id)))
    figures = {"run": run_id, "status": observe(home, run_id)["status"], "front_exit": front.returncode,
               **figures_of_run(observations, slowed_rank(opts)),
               # What each capture shows, as text: readable in the JSON, checked by the test.
               "screens": {Path(svg).stem: svg_screen_text(Path(svg).read_text()) for svg in saved}}
    path = write_result("phases", f"monitor-{opts.recipe}-{opts.gpus}gpus",
                        {**vars(opts), "run_settings": RUN_SETTINGS}, figures, out=opts.out,
                        card=case_card(opts.gpus))
    folder = path.with_suffix("")
    folder.mkdir(parents=True, exist_ok=True)
    for item in staging.iterdir():
        shutil.move(item, folder / item.name)
    print(f"captures and the run's output in {folder}: {sorted(p.name for p in folder.iterdir())}")
    return figures


if __name__ == "__main__":
    main()
