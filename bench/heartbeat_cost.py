"""Heartbeats cost nothing measurable: a real run's steady step time with its ranks' heartbeats on and
off, the same call, the runs alternating.

    python bench/heartbeat_cost.py [--recipes sft,grpo-mtl] [--model random-qwen2.5-0.5b] [--gpus 1]
                                   [--repeats 3] [--warmups 1] [--set [RECIPE:]KEY=VALUE ...] [--home DIR]
                                   [--out FILE]

Every run is a real `gpuscale run` (CLI, supervisor, accelerate launch, the rank) in a GPUSCALE_HOME of
the script's, with the same arguments on both sides: `--recipe R --gpus G --model M --set max_steps=N
--set eval_examples=0 --set save_model=false --set checkpoint_every=off` and RECIPE_SETTINGS' (N: sft
150, grpo-mtl 20; `--set [RECIPE:]KEY=VALUE` replaces one), the recipe's defaults otherwise. Only the
environment differs: heartbeats on (the users' default: no GPUSCALE_HEARTBEATS) or off (GPUSCALE_HEARTBEATS=0,
runs/heartbeat.py's bench aid; the supervisor's hang watch runs on both sides). A recipe's runs
alternate on, off, on, off... (--repeats of each), so that a drift of the machine falls on both sides,
after --warmups runs not compared (a cold machine's first run may step slower).

A run's figure is its steady step time as the run records it (bench/scaling.py's, the first step left
out): sft the median of the `step_time_ms` rank 0 logged (the wall time between the trainer's logs, one
an optimizer step, callbacks and their beats included); grpo-mtl its summary's `step_seconds_median`
(the wall time of each optimizer step, the device synchronised). Each run also counts the heartbeat
lines its ranks wrote: none with heartbeats off and some with them on, or the measurement is void.

Per recipe: the median over each side's runs, their ratio (on / off) and the noise, the larger of the
two sides' spreads ((max - min) / median of its runs). Verdict: the cost within noise where on / off - 1 <=
noise (one-sided: `compare`). Expected: a rank beats at most once a second a phase (BEAT_EVERY_S), a `time.time()` and a
comparison otherwise. One line is printed a run, then one a recipe; the exit code is 1 where a run's
beats were not as set or a recipe is not within noise (--repeats 1 measures no noise: no verdict). The
result (bench/record.py's schema) goes to bench/results/heartbeats/heartbeat-cost-<date>-<card>.json
(the card: the --gpus used), heartbeat-cost-<recipe>-... where --recipes names one.

On CPU (one CPU rank of tiny-math, one run a side: the test's sizes; speeds on CPU mean nothing):

    python bench/heartbeat_cost.py --recipes sft --model tiny-math --repeats 1 --warmups 0 --set sft:max_steps=6 \\
        --set batch_size=2 --set max_examples=64 --set sft:max_length=64 --out /tmp/heartbeat-cost.json

On one GPU (random-qwen2.5-0.5b, a warm-up run and 3 runs a side of each recipe):

    python bench/heartbeat_cost.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, also when loaded by path
from record import ROOT, write_result  # noqa: E402

sys.path.insert(0, str(ROOT))  # gpuscale from this checkout when run as a script (scaling imports it too)
from benchruns import gpuscale_run, on_off  # noqa: E402
from faults import case_card, parse_assignment  # noqa: E402
from scaling import RECIPES as SCALING_FIGURES  # noqa: E402

from gpuscale.control.store import Store  # noqa: E402
from gpuscale.runs.heartbeat import BEAT_KEY, HEARTBEATS_ENV  # noqa: E402
from gpuscale.runs.run_dir import RunDir  # noqa: E402

BASELINE = ("Baseline: the same run with the ranks' heartbeats off (GPUSCALE_HEARTBEATS=0), the same call "
            "alternating with the runs that beat; nothing else differs.")
# A step of the recipe's defaults at 0.5B on one H200 takes about 0.1 s (sft) and 0.5-1.3 s (grpo-mtl,
# bench/results/grpo_mtl/): steps enough for a steady median, few enough that a recipe's 7 runs (a warm-up,
# 3 a side) are meant to fit a 10-minute call. grpo-mtl's default learning rate suits the embedded model;
# a 0.5B model wants about 1e-6 (bench/scaling.py's).
RECIPE_SETTINGS = {"sft": {"max_steps": "150"}, "grpo-mtl": {"max_steps": "20", "learning_rate": "1e-6"}}


def run_arguments(recipe: str, opts) -> list[str]:
    """The run's arguments, the same with heartbeats on and off: the script's settings, then --set's."""
    # No checkpoints either: at 0.5B one holds 6 GB (fp32 weights and Adam's moments), and a run of 150
    # steps wrote three, filling the GPU machine's disk by the fifth run.
    settings = {**RECIPE_SETTINGS[recipe], "eval_examples": "0", "save_model": "false", "checkpoint_every": "off"}
    for only, assignment in opts.assignments:
        if only in (None, recipe):
            key, _, value = assignment.partition("=")
            settings[key.strip()] = value.strip()
    arguments = ["--recipe", recipe, "--gpus", opts.gpus, "--model", opts.model]
    for key, value in settings.items():
        arguments += ["--set", f"{key}={value}"]
    return arguments


def run_env(home: Path, beats: bool) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != HEARTBEATS_ENV}
    env["GPUSCALE_HOME"] = str(home)
    if not beats:
        env[HEARTBEATS_ENV] = "0"
    return env


def beat_lines(run_dir: str) -> int:
    """The heartbeat lines the run's ranks wrote (runs/heartbeat.py)."""
    count = 0
    for path in RunDir(run_dir).metrics_files():
        for line in path.read_text().splitlines():
            try:
                count += BEAT_KEY in json.loads(line)
            except json.JSONDecodeError:
                continue
    return count


def one_run(recipe: str, beats: bool, arguments: list[str], home: Path) -> dict:
    """One run to its end: its steady step time (bench/scaling.py's figure) and the beat lines it wrote."""
    started = time.monotonic()
    run = gpuscale_run(arguments, env=run_env(home, beats))  # RunFailed: the comparison has no side
    store = Store(home, read_only=True)
    [figures] = SCALING_FIGURES[recipe].figures(run["summary"], store, run["id"])
    store.close()
    if figures["step_seconds"] is None:
        raise SystemExit(f"{recipe} run {run['id']}: no step time recorded (max_steps too small?)")
    return {"heartbeats": beats, "run": run["id"], "step_seconds": figures["step_seconds"],
            "steps": run["summary"].get("steps"), "beat_lines": beat_lines(run["run_dir"]),
            "wall_s": round(time.monotonic() - started, 1)}


def compare(runs: list[dict]) -> dict:
    """A recipe's verdict from its runs: the sides, on / off, the noise (benchruns.on_off), whether the cost,
    on / off less 1, is within it (None: one run a side, no noise measured), whether each run beat as set.
    One-sided: runs with heartbeats on that step faster than the off runs by more than the noise show that
    the runs vary more than a few a side can tell (grpo-mtl on an H200: on/off 0.898, noise 7.4%), not that
    heartbeats save time; `on_faster_beyond_noise` says so."""
    compared = on_off(runs, "heartbeats")
    noise, ratio = compared["noise"], compared["on_over_off"]
    return {**compared, "within_noise": None if noise is None else ratio - 1 <= noise,
            "on_faster_beyond_noise": None if noise is None else 1 - ratio > noise,
            "beats_as_set": all((run["beat_lines"] > 0) == run["heartbeats"] for run in runs)}


def measure(recipe: str, opts, home: Path) -> dict:
    """The recipe's warm-up runs (not compared), then its runs on, off, on, off... and their comparison."""
    arguments = run_arguments(recipe, opts)
    warmups = [timed(recipe, f"warm-up {number}/{opts.warmups}", True, arguments, home)
               for number in range(1, opts.warmups + 1)]
    runs = [{"order": number, **timed(recipe, f"run {number}/{2 * opts.repeats}", number % 2 == 1, arguments, home)}
            for number in range(1, 2 * opts.repeats + 1)]
    return {"run_arguments": arguments, "warmups": warmups, "runs": runs, **compare(runs)}


def timed(recipe: str, label: str, beats: bool, arguments: list[str], home: Path) -> dict:
    """One run, and its line."""
    run = one_run(recipe, beats, arguments, home)
    print(f"{recipe} {label}: heartbeats {'on' if beats else 'off'}: steady step {1000 * run['step_seconds']:.1f} "
          f"ms, {run['beat_lines']} beat lines, run {run['run']} ({run['wall_s']:.0f} s)", flush=True)
    return run


def verdict_line(recipe: str, f: dict) -> str:
    if not f["beats_as_set"]:
        verdict = "VOID: a run's heartbeats were not as set (beat lines with them off, or none with them on)"
    else:
        verdict = {True: "cost within noise", False: "cost NOT within noise",
                   None: "noise not measured"}[f["within_noise"]]
        if f["on_faster_beyond_noise"]:
            verdict += " (on faster than off beyond the noise: the runs vary more than their spread shows)"
    noise = ("one run a side" if f["noise"] is None else f"±{100 * f['noise']:.1f}% (spread on "
             f"{100 * f['on']['spread']:.1f}%, off {100 * f['off']['spread']:.1f}%)")
    return (f"{recipe}: heartbeats on {1000 * f['on']['median_s']:.1f} ms, off {1000 * f['off']['median_s']:.1f} ms "
            f"a step (median of {len(f['on']['step_seconds'])} runs each); on/off {f['on_over_off']:.3f}, noise "
            f"{noise}: {verdict}")


def result_name(recipes: list[str]) -> str:
    """The result file's first part: `heartbeat-cost`, `heartbeat-cost-sft` for a call of some recipes."""
    return "-".join(["heartbeat-cost", *([] if set(recipes) == set(RECIPE_SETTINGS) else recipes)])


def parse_options(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + "\n\n" + BASELINE,
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", default=",".join(RECIPE_SETTINGS),
                        help=f"comma-separated, of {', '.join(RECIPE_SETTINGS)}")
    parser.add_argument("--model", default="random-qwen2.5-0.5b")
    parser.add_argument("--gpus", default="1", help="the runs' --gpus (a count: CPU ranks where there is no GPU)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs a side (heartbeats on, off), alternating; 2 or more for a noise and a verdict")
    parser.add_argument("--set", dest="assignments", action="append", default=[], type=parse_assignment,
                        metavar="[RECIPE:]KEY=VALUE", help="a setting of every run, or of RECIPE's (repeatable)")
    parser.add_argument("--warmups", type=int, default=1,
                        help="runs of each recipe before the compared ones, not compared (a cold machine's first run)")
    parser.add_argument("--home", default=None, help="GPUSCALE_HOME of the runs (default: a new temporary one)")
    parser.add_argument("--out", default=None, help="default: bench/results/heartbeats/heartbeat-cost-<date>-"
                        "<card>.json (heartbeat-cost-<recipe>-... where --recipes names one)")
    opts = parser.parse_args(argv)
    opts.recipes = opts.recipes.split(",")
    unknown = [name for name in opts.recipes if name not in RECIPE_SETTINGS]
    if unknown:
        parser.error(f"--recipes: {unknown[0]}: not one of {', '.join(RECIPE_SETTINGS)}")
    if opts.repeats < 1 or opts.warmups < 0:
        parser.error(f"--repeats {opts.repeats} --warmups {opts.warmups}: at least 1 run a side, no fewer than 0 "
                     "warm-up runs")
    return opts


def main(argv: list[str] | None = None) -> None:
    opts = parse_options(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    home = Path(opts.home or tempfile.mkdtemp(prefix="gpuscale-heartbeat-cost-")).resolve()
    results = {recipe: measure(recipe, opts, home) for recipe in opts.recipes}
    print()
    for recipe, figures in results.items():
        print(verdict_line(recipe, figures), flush=True)
    passed = all(f["beats_as_set"] and f["within_noise"] is not False for f in results.values())
    settings = {**vars(opts), "home": str(home), "recipe_settings": RECIPE_SETTINGS,
                "assignments": [f"{r}:{a}" if r else a for r, a in opts.assignments]}
    gpus = int(opts.gpus) if opts.gpus.isdigit() else len(opts.gpus.strip(",").split(","))
    write_result("heartbeats", result_name(opts.recipes), settings, {"recipes": results, "passed": passed},
                 out=opts.out, card=case_card(gpus))
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
