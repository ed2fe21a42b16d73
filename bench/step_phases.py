"""Where a step's time goes, measured: the named phases' coverage of a steady step for each recipe, what
the timing costs (the same runs with it on and off, one call), and for sft and grpo-mtl the split's
agreement with torch.profiler's timeline of the same steps.

    python bench/step_phases.py [--recipes sft,sft-rows512,...] [--model random-qwen2.5-0.5b] [--gpus 1]
                                [--repeats 3] [--warmups 1] [--profile-after 3] [--profile-steps 5]
                                [--set [NAME:]KEY=VALUE ...] [--home DIR] [--out FILE]

Every run is a real `gpuscale run` (CLI, supervisor, launcher, ranks) in a GPUSCALE_HOME of the script's:
`--recipe R --gpus G --model M`, RECIPE_RUNS' settings (only what bounds the run's length and turns off
its evaluation and checkpoints; `sft-rows512` is sft at rows_per_step=512), `--set` after them, the
recipe's defaults otherwise. Per recipe:

- On and off: runs alternating timing on (the default) and off (GPUSCALE_STEP_PHASES=0,
  engines/step_phases.py's bench aid), --repeats of each after --warmups not compared. A run's figure is
  its steady step: the median interval between rank 0's logged steps (the first WARM_UP_STEPS left out),
  one figure for every recipe whatever else it logs. on / off and the noise (the larger of the two
  sides' spreads, (max - min) / median). An off run that logged a phase figure voids the comparison.
  With --alternate K, also one run that times K logged steps, then leaves K untimed, and so on
  (GPUSCALE_STEP_PHASES=alternate:K): on / off of its own timed and untimed steps' median intervals
  (its steady steps), and its noise, how far each half of its steps puts on / off from the whole's.
  Runs of the same settings differ from run to run by more than the 2% target (bench/RESULTS.md), so
  where this run is made its figure is the verdict's; a phase figure logged for an untimed step voids it.
- Coverage, from the runs with timing on: the share of a steady step the named phases cover (1 -
  `other`), the run's summary (every rank's steady steps together) and the least of any rank's.
- Profiler agreement (sft and sft-rows512, grpo-mtl): one more run with timing on, whose ranks run
  logged steps --profile-after + 1 ... + --profile-steps under torch.profiler (a sitecustomize, as
  bench/profile_step.py's: bench/profile_rollout.py's rank_sitecustomize). Each change of phase is also
  a zero-length profiler annotation; the profiler's split cuts its own timeline at them: on a GPU a
  cut is the later of its annotation and the end of the last kernel, copy or memset launched before it
  (a CUDA event on the stream completes then; device work of every stream counts, NCCL's too, so a
  gradient all-reduce that overlaps the backward pass past its last kernel moves a cut later than the
  compute stream's event: a difference the comparison shows), on CPU the annotation itself. Agreement, per rank: the
  largest |ours - the profiler's| over the phases, as a share of the window (ours: the phase seconds the
  rank logged for those steps). Target: at most 10% of the step.

Targets: coverage >= 95% for every recipe, on / off <= 1.02, agreement within 10%. One line is
printed a run, then one a recipe; the exit code is 1 where a target is missed or a comparison void. The
result (bench/record.py's schema) goes to bench/results/phases/step-phases-<date>-<card>.json
(step-phases-<recipe>-... where --recipes names one).

On CPU (tiny-math, one run a side, sft only; speeds on CPU mean nothing):

    python bench/step_phases.py --recipes sft --model tiny-math --repeats 1 --warmups 0 --profile-after 1 \\
        --profile-steps 2 --set sft:max_steps=6 --set batch_size=2 --set max_examples=64 --set sft:max_length=64

On one GPU (random-qwen2.5-0.5b, every recipe at its defaults; a recipe's 8 runs take about 5-8 minutes,
so where a call is limited to 10 minutes, one recipe a call):

    python bench/step_phases.py
    python bench/step_phases.py --recipes sft            # results/phases/step-phases-sft-<date>-<card>.json
    python bench/step_phases.py --recipes probe --repeats 0 --alternate 1   # the cost from one run's own steps
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, also when loaded by path
from record import ROOT, write_result  # noqa: E402

sys.path.insert(0, str(ROOT))  # gpuscale from this checkout when run as a script
from benchruns import gpuscale_run, on_off  # noqa: E402
from faults import case_card, parse_assignment  # noqa: E402
from profile_rollout import rank_sitecustomize  # noqa: E402

from gpuscale.data.step_phases import OTHER, WARM_UP_STEPS, mean_step, phases_of, shares  # noqa: E402
from gpuscale.engines.step_phases import PHASES_ENV, timed_step  # noqa: E402
from gpuscale.runs.run_dir import RunDir  # noqa: E402

BASELINE = ("Baseline: the same run with the step phases' timing off (GPUSCALE_STEP_PHASES=0), the same call "
            "alternating with the runs that time them; with --alternate K, also the untimed steps of one run that "
            "times K logged steps and leaves K untimed; nothing else differs. The profiler's split is "
            "torch.profiler's timeline of the same steps.")

NO_EVALUATION = {"eval_examples": "0", "save_model": "false", "checkpoint_every": "off"}
# name -> (recipe, settings): each recipe at its defaults, its length bounded (a step of sft at 0.5B on one
# H200 takes about 0.1 s, grpo-mtl's 0.5-1.3 s: bench/heartbeat_cost.py's; eggroll's default population about
# 16 s: results/phases/step-phases-eggroll-cut-*.log.txt, so 5 steps, 3 of them steady), grpo-mtl's learning
# rate the one a 0.5B model wants (bench/scaling.py's).
RECIPE_RUNS = {
    "sft": ("sft", {"max_steps": "100", **NO_EVALUATION}),
    "sft-rows512": ("sft", {"max_steps": "40", "rows_per_step": "512", **NO_EVALUATION}),
    "rft": ("rft", {"max_examples": "256", "max_steps": "20", **NO_EVALUATION}),
    "grpo-mtl": ("grpo-mtl", {"max_steps": "20", "learning_rate": "1e-6", **NO_EVALUATION}),
    "eggroll": ("eggroll", {"steps": "5", **NO_EVALUATION}),
    # At its defaults (3,072 tokens, 16 blocks of 10 MCMC steps) a random model never ends an answer, and
    # one batch of 32 problems did not end in 330 s on an H200: bench/power_sampling.py's shape instead
    # (96 tokens, 4 blocks), 8 problems a batch, a batch a step: 8 steps and the warm-up batch (32 problems,
    # 4 steps, left `--alternate 1` 2 steady steps, no noise measured; that run took 70 s on an H200).
    "power-sampling": ("power-sampling", {"max_examples": "64", "batch_size": "8", "max_new_tokens": "96",
                                          "blocks": "4", "checkpoint_every": "off"}),
    "probe": ("probe", {"checkpoint_every": "off"}),
}
PROFILED = ("sft", "sft-rows512", "grpo-mtl")
COVERAGE_AT_LEAST, COST_AT_MOST, AGREEMENT_WITHIN = 0.95, 1.02, 0.10

# The ranks' side of the profiled run: logged steps AFTER+1 ... AFTER+STEPS under torch.profiler, every
# change of phase a zero-length annotation `gpuscale.phase/<the phase from here on>`, the timeline written to
# <OUT>/rank<R>.trace.json.gz.
SITECUSTOMIZE = '''
import os

def _patch():
    import torch
    from gpuscale.engines import step_phases
    after = int(os.environ["GPUSCALE_PHASES_PROFILE_AFTER"])
    last = after + int(os.environ["GPUSCALE_PHASES_PROFILE_STEPS"])
    out = os.environ["GPUSCALE_PHASES_PROFILE_OUT"]
    state = {"profiler": None}

    def annotate(timer):
        if state["profiler"] is not None:
            with torch.profiler.record_function("gpuscale.phase/" + timer._marks[-1][1]):
                pass

    mark, finish = step_phases.StepPhases._mark, step_phases.StepPhases.finish

    def marked(self, name):
        mark(self, name)
        annotate(self)

    def finished(self, step):
        if step == after and self._marks:  # started before the window's first mark is made
            from torch.profiler import ProfilerActivity, profile
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            state["profiler"] = profile(activities=activities)
            state["profiler"].__enter__()
        finish(self, step)
        annotate(self)
        if step == last and state["profiler"] is not None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # after the window: its kernels all in the timeline
            profiler, state["profiler"] = state["profiler"], None
            profiler.__exit__(None, None, None)
            path = os.path.join(out, f"rank{os.environ.get('RANK', '0')}.trace.json")
            profiler.export_chrome_trace(path)
            with open(path, "rb") as raw, __import__("gzip").open(path + ".gz", "wb") as packed:
                packed.write(raw.read())
            os.remove(path)

    step_phases.StepPhases._mark, step_phases.StepPhases.finish = marked, finished
'''
ANNOTATION = "gpuscale.phase/"
DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


# ---- a run's figures --------------------------------------------------------------------------------


def rank_records(run_dir: str, rank: int) -> list[dict]:
    lines = RunDir(run_dir).metrics(rank).read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def step_intervals(records: list[dict], warm_up: int = WARM_UP_STEPS) -> list[tuple[int, float]]:
    """(logged step, seconds since the logged step before it) of a rank's logged steps (a record with a
    figure besides its phases'), the first `warm_up` intervals left out."""
    bookkeeping = {"t", "rank", "step", "beat", "total", "summary", "partial"}
    logged = [r for r in records if set(r) - bookkeeping - {k for k in r if k.startswith("phase_seconds_")}]
    return [(b["step"], b["t"] - a["t"]) for a, b in zip(logged, logged[1:])][warm_up:]


def logged_step_seconds(records: list[dict], warm_up: int = WARM_UP_STEPS) -> float | None:
    """The median interval between a rank's logged steps, the first `warm_up` left out; None where none is left."""
    intervals = [seconds for _, seconds in step_intervals(records, warm_up)]
    return statistics.median(intervals) if intervals else None


def steps_by_rank(run_dir: str, ranks: int) -> dict[int, dict[int, dict[str, float]]]:
    """rank -> logged step -> its phase seconds (a step's phases may come in a line of their own)."""
    found: dict[int, dict[int, dict[str, float]]] = {}
    for rank in range(ranks):
        for record in rank_records(run_dir, rank):
            seconds = phases_of(record)
            if seconds:
                found.setdefault(rank, {}).setdefault(record["step"], {}).update(seconds)
    return found


def coverage(run: dict) -> dict:
    """The named phases' share of a steady step: the summary's (all ranks) and the least rank's."""
    by_rank = steps_by_rank(run["run_dir"], run["summary"].get("world_size", 1))
    ranks = {rank: 1 - shares(mean_step([steps[s] for s in sorted(steps)][WARM_UP_STEPS:] or [{}])).get(OTHER, 0.0)
             for rank, steps in by_rank.items() if len(steps) > WARM_UP_STEPS}
    summary = run["summary"].get("step_phases")
    return {"covered": None if not summary else 1 - summary.get(OTHER, 0.0),
            "least_rank": min(ranks.values()) if ranks else None, "by_rank": ranks}


def one_run(name: str, timing: bool, arguments: list[str], home: Path, extra_env: dict | None = None) -> dict:
    env = {key: value for key, value in os.environ.items() if key != PHASES_ENV}
    env.update(GPUSCALE_HOME=str(home), **(extra_env or {}))
    if not timing:
        env[PHASES_ENV] = "0"
    started = time.monotonic()
    run = gpuscale_run(arguments, env=env)
    step = logged_step_seconds(rank_records(run["run_dir"], 0))
    if step is None:
        raise SystemExit(f"{name} run {run['id']}: too few logged steps for a steady step (max_steps too small?)")
    phased = steps_by_rank(run["run_dir"], run["summary"].get("world_size", 1))
    return {"timing": timing, "run": run["id"], "run_dir": run["run_dir"], "summary": run["summary"],
            "step_seconds": step, "phase_lines": sum(len(steps) for steps in phased.values()),
            "wall_s": round(time.monotonic() - started, 1)}


# ---- the profiler's split ---------------------------------------------------------------------------


def profile_env(out: str, after: int, steps: int) -> dict[str, str]:
    """What SITECUSTOMIZE reads: where the traces go, and the logged steps after+1 ... after+steps profiled."""
    return {"GPUSCALE_PHASES_PROFILE_OUT": out, "GPUSCALE_PHASES_PROFILE_AFTER": str(after),
            "GPUSCALE_PHASES_PROFILE_STEPS": str(steps)}


def phase_marks(trace: dict) -> list[tuple[float, str]]:
    """(microseconds, the phase from there on) of each of SITECUSTOMIZE's annotations, in order: the CPU's
    (on a GPU the profiler also draws each range on the device's timeline, as `gpu_user_annotation`: not
    a mark)."""
    return sorted((e["ts"], e["name"].removeprefix(ANNOTATION)) for e in trace["traceEvents"]
                  if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e["name"].startswith(ANNOTATION))


def profiler_split(trace: dict) -> dict[str, float]:
    """Phase -> seconds on the profiler's timeline (the module's docstring): cut at each phase
    annotation, on a GPU at the later of the annotation and the end of the device work launched before it."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    marks = phase_marks(trace)
    launches = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    work = sorted((launches[e["args"]["correlation"]], e["ts"] + e["dur"]) for e in events
                  if e.get("cat") in DEVICE_WORK and e.get("args", {}).get("correlation") in launches)
    cuts, done, index = [], 0.0, 0
    for at, _ in marks:
        while index < len(work) and work[index][0] < at:
            done, index = max(done, work[index][1]), index + 1
        cuts.append(max(at, done))
    split: dict[str, float] = {}
    for (start, (_, name)), end in zip(zip(cuts, marks), cuts[1:]):
        split[name] = split.get(name, 0.0) + (end - start) / 1e6
    return split


def agreement(ours: dict[str, float], theirs: dict[str, float]) -> dict:
    """The largest difference of a phase's seconds between the two splits, as a share of our window."""
    window = sum(ours.values())
    names = sorted(set(ours) | set(theirs))
    worst = max(names, key=lambda n: abs(ours.get(n, 0.0) - theirs.get(n, 0.0)))
    return {"ours": ours, "profiler": theirs, "window_s": window, "worst_phase": worst,
            "largest_difference": abs(ours.get(worst, 0.0) - theirs.get(worst, 0.0)) / window if window else None}


def profiled(name: str, arguments: list[str], home: Path, opts) -> dict:
    """The profiled run: each rank's split and the profiler's over the window's steps."""
    with tempfile.TemporaryDirectory(prefix="gpuscale-phases-profile-") as folder:
        Path(folder, "sitecustomize.py").write_text(rank_sitecustomize(SITECUSTOMIZE, "GPUSCALE_PHASES_PROFILE_OUT"))
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [folder, os.environ.get("PYTHONPATH")])),
               **profile_env(folder, opts.profile_after, opts.profile_steps)}
        run = one_run(name, True, arguments, home, env)
        window = range(opts.profile_after + 1, opts.profile_after + opts.profile_steps + 1)
        ranks = {}
        for rank, steps in steps_by_rank(run["run_dir"], run["summary"].get("world_size", 1)).items():
            path = Path(folder, f"rank{rank}.trace.json.gz")
            if not path.exists():
                raise SystemExit(f"{name} run {run['run']}: rank {rank} wrote no profile (fewer logged steps than "
                                 f"{window.stop - 1}?)")
            ours = {}
            for step in window:
                for phase, seconds in steps.get(step, {}).items():
                    ours[phase] = ours.get(phase, 0.0) + seconds
            with gzip.open(path) as packed:
                ranks[rank] = agreement(ours, profiler_split(json.load(packed)))
    worst = max(figures["largest_difference"] or 0.0 for figures in ranks.values())
    print(f"{name} profiled run {run['run']}: the splits differ by at most {worst:.1%} of the window "
          f"(steps {window.start}-{window.stop - 1})", flush=True)
    return {"run": run["run"], "steps": [window.start, window.stop - 1], "by_rank": ranks,
            "largest_difference": worst, "within": worst <= AGREEMENT_WITHIN}


# ---- one run timing K steps, then leaving K untimed ----------------------------------------------


def within_run(intervals: list[tuple[int, float]], k: int) -> float | None:
    """on / off of the median timed and untimed step intervals (timed: `timed_step(step, k)`); None where a
    side has none."""
    sides = [[seconds for step, seconds in intervals if timed_step(step, k) == timed] for timed in (True, False)]
    return statistics.median(sides[0]) / statistics.median(sides[1]) if all(sides) else None


def alternating(name: str, arguments: list[str], home: Path, k: int) -> dict:
    """One run under GPUSCALE_STEP_PHASES=alternate:K: on / off from its own steady steps, free of the
    spread between runs, and its noise: how far each half of its steps puts on / off from the whole's."""
    run = one_run(name, True, arguments, home, {PHASES_ENV: f"alternate:{k}"})
    intervals = step_intervals(rank_records(run["run_dir"], 0))
    ratio = within_run(intervals, k)
    halves = [within_run(part, k) for part in (intervals[:len(intervals) // 2], intervals[len(intervals) // 2:])]
    noise = None if None in (ratio, *halves) else max(abs(half - ratio) for half in halves)
    phased = steps_by_rank(run["run_dir"], run["summary"].get("world_size", 1)).get(0, {})
    as_set = bool(phased) and all(timed_step(step, k) for step in phased)
    print(f"{name} alternating run {run['run']} (alternate:{k}): on/off {ratio if ratio is None else f'{ratio:.3f}'}"
          f" over {len(intervals)} steady steps ({run['wall_s']:.0f} s)", flush=True)
    return {"run": run["run"], "alternate": k, "steady_steps": len(intervals), "on_over_off": ratio,
            "halves": halves, "noise": noise, "timing_as_set": as_set, "coverage": coverage(run),
            "wall_s": run["wall_s"]}


# ---- a recipe ---------------------------------------------------------------------------------------


def run_arguments(name: str, opts) -> list[str]:
    recipe, settings = RECIPE_RUNS[name]
    settings = dict(settings)
    for only, assignment in opts.assignments:
        if only in (None, name, recipe):
            key, _, value = assignment.partition("=")
            settings[key.strip()] = value.strip()
    arguments = ["--recipe", recipe, "--gpus", opts.gpus, "--model", opts.model]
    for key, value in settings.items():
        arguments += ["--set", f"{key}={value}"]
    return arguments


def compare(runs: list[dict]) -> dict:
    """on / off and the noise (benchruns.on_off), whether each run's timing was as set (phase figures
    logged on one side only)."""
    return {**on_off(runs, "timing"),
            "timing_as_set": all((run["phase_lines"] > 0) == run["timing"] for run in runs)}


def measure(name: str, opts, home: Path) -> dict:
    arguments = run_arguments(name, opts)
    for number in range(1, opts.warmups + 1):
        timed(name, f"warm-up {number}/{opts.warmups}", True, arguments, home)
    runs = [{"order": number, **timed(name, f"run {number}/{2 * opts.repeats}", number % 2 == 1, arguments, home)}
            for number in range(1, 2 * opts.repeats + 1)]
    on_runs = [coverage(run) for run in runs if run["timing"]]
    within = alternating(name, arguments, home, opts.alternate) if opts.alternate else None
    if within:
        on_runs.append(within["coverage"])
    figures = {"run_arguments": arguments, **(compare(runs) if runs else {"timing_as_set": True}),
               "coverage": min((c["covered"] for c in on_runs if c["covered"] is not None), default=None),
               "coverage_least_rank": min((c["least_rank"] for c in on_runs if c["least_rank"] is not None),
                                          default=None),
               "coverage_runs": on_runs,
               "runs": [{k: v for k, v in run.items() if k not in ("summary", "run_dir")} for run in runs]}
    if within:
        figures["alternating"] = within
        figures["timing_as_set"] = figures["timing_as_set"] and within["timing_as_set"]
    if name in PROFILED:
        figures["profiler"] = profiled(name, arguments, home, opts)
    figures["targets_met"] = targets_met(figures)
    return figures


def cost(f: dict) -> dict:
    """The on / off the verdict reads: the alternating run's where there is one (no spread between runs in
    it), else the runs'."""
    return f.get("alternating") or f


def targets_met(f: dict) -> bool:
    covered = f["coverage"] is not None and f["coverage_least_rank"] >= COVERAGE_AT_LEAST <= f["coverage"]
    c = cost(f)
    cheap = c["on_over_off"] is not None and (c["on_over_off"] <= COST_AT_MOST or
                                              (c["noise"] is not None and c["on_over_off"] - 1 <= c["noise"]))
    agrees = f.get("profiler", {}).get("within", True)
    return bool(f["timing_as_set"] and covered and cheap and agrees)


def timed(name: str, label: str, timing: bool, arguments: list[str], home: Path) -> dict:
    run = one_run(name, timing, arguments, home)
    print(f"{name} {label}: timing {'on' if timing else 'off'}: steady step {1000 * run['step_seconds']:.1f} ms, "
          f"{run['phase_lines']} steps with phases, run {run['run']} ({run['wall_s']:.0f} s)", flush=True)
    return run


def verdict_line(name: str, f: dict) -> str:
    covered = "no phases" if f["coverage"] is None else (f"named phases cover {f['coverage']:.1%} (least rank "
                                                          f"{f['coverage_least_rank']:.1%})")
    c = cost(f)
    source = " in one alternating run" if "alternating" in f else ""
    noise = "no noise measured" if c["noise"] is None else f"noise ±{c['noise']:.1%}"
    profiler = "" if "profiler" not in f else (f"; profiler's split within {f['profiler']['largest_difference']:.1%}"
                                               " of the window")
    void = "" if f["timing_as_set"] else "; VOID: a run's phase figures were not as set"
    ratio = "-" if c["on_over_off"] is None else f"{c['on_over_off']:.3f}"
    return (f"{name}: {covered}; on/off {ratio}{source} ({noise}){profiler}{void}: "
            f"{'met' if f['targets_met'] else 'NOT met'}")


def result_name(names: list[str]) -> str:
    return "-".join(["step-phases", *([] if set(names) == set(RECIPE_RUNS) else names)])


def parse_options(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + "\n\n" + BASELINE,
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", default=",".join(RECIPE_RUNS),
                        help=f"comma-separated, of {', '.join(RECIPE_RUNS)}")
    parser.add_argument("--model", default="random-qwen2.5-0.5b")
    parser.add_argument("--gpus", default="1", help="the runs' --gpus (a count: CPU ranks where there is no GPU)")
    parser.add_argument("--repeats", type=int, default=3, help="runs a side (timing on, off), alternating "
                        "(0: none, with --alternate)")
    parser.add_argument("--alternate", type=int, default=0, metavar="K",
                        help="also one run timing K logged steps, then leaving K untimed: on / off from its own "
                        "steps (the verdict's)")
    parser.add_argument("--warmups", type=int, default=1, help="runs of each recipe before the compared ones")
    parser.add_argument("--profile-after", type=int, default=3, help="logged steps before the profiled window")
    parser.add_argument("--profile-steps", type=int, default=5, help="logged steps in the profiled window")
    parser.add_argument("--set", dest="assignments", action="append", default=[], type=parse_assignment,
                        metavar="[NAME:]KEY=VALUE", help="a setting of every run, or of NAME's (or its recipe's)")
    parser.add_argument("--home", default=None, help="GPUSCALE_HOME of the runs (default: a new temporary one)")
    parser.add_argument("--out", default=None, help="default: bench/results/phases/step-phases-<date>-<card>.json")
    opts = parser.parse_args(argv)
    opts.recipes = opts.recipes.split(",")
    unknown = [name for name in opts.recipes if name not in RECIPE_RUNS]
    if unknown:
        parser.error(f"--recipes: {unknown[0]}: not one of {', '.join(RECIPE_RUNS)}")
    if (opts.repeats < (0 if opts.alternate > 0 else 1) or opts.alternate < 0 or opts.warmups < 0
            or opts.profile_after < WARM_UP_STEPS or opts.profile_steps < 1):
        parser.error("--repeats at least 1 (0 with --alternate K >= 1), --profile-steps at least 1, --warmups at "
                     f"least 0, --profile-after at least {WARM_UP_STEPS} (the warm-up step is no steady one)")
    return opts


def main(argv: list[str] | None = None) -> None:
    opts = parse_options(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    home = Path(opts.home or tempfile.mkdtemp(prefix="gpuscale-step-phases-")).resolve()
    results = {name: measure(name, opts, home) for name in opts.recipes}
    print()
    for name, figures in results.items():
        print(verdict_line(name, figures), flush=True)
    passed = all(figures["targets_met"] for figures in results.values())
    settings = {**vars(opts), "home": str(home), "recipe_runs": RECIPE_RUNS,
                "assignments": [f"{r}:{a}" if r else a for r, a in opts.assignments]}
    gpus = int(opts.gpus) if opts.gpus.isdigit() else len(opts.gpus.strip(",").split(","))
    write_result("phases", result_name(opts.recipes), settings, {"recipes": results, "passed": passed},
                 out=opts.out, card=case_card(gpus))
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
