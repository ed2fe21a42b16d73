"""Strong and weak scaling of every recipe over the GPUs of one host: 1, 2, 4 GPUs by default (any counts).

    python bench/scaling.py [--gpu-counts 1,2,4] [--recipes probe,eggroll] [--models random-qwen2.5-0.5b,tiny-math]
    python bench/scaling.py --cpu --gpu-counts 1,2 ...     # ranks as CPU processes (the script's test)
    python bench/scaling.py --recipes rft,grpo-mtl --append --out FILE.json   # a sweep in several parts

Each point is a real `gpuscale run` (CLI, supervisor, torchrun or accelerate). The per-call sizes (a
rank's engine batch, its micro-batch) are the same at every count and in both modes; what changes is
how much of it a rank does:
- weak scaling: every GPU gets the same work at every count (the per-GPU sizes below: prompts,
  problems, questions or members, the same number of steps);
- strong scaling: the same total work at every count, the weak run's at the largest count (M GPUs).
  On N GPUs a rank does M/N times the weak share: more engine calls, or, in training, M/N micro-batches
  of gradient accumulation, so that an optimizer step holds the same rows. Its M-GPU point is the weak
  one (one run serves both). Every count must divide M.

In both modes

    efficiency(N) = total(N) / (N x total(1))

against the 1-GPU run of the same recipe, model and mode, where total is the run's throughput in the
recipe's own unit (its catalogue figure), all GPUs together:
- probe: the node check's decode tokens/s through the generation engine at the batch, all ranks
  together (summary `throughput_tokens_per_s_rank_<r>`); weak scaling only: its ranks share no work,
  and more decode steps a rank (strong scaling's way of giving one rank more) make every step longer
  (a longer KV cache), not more of the same. The decode loop's `tokens_per_s` (the model's own
  forward, launch-bound at batch 64 on an H200) is kept beside it;
- power-sampling: problems/s (summary `problems_per_s`);
- eggroll: members/s (summary `members_per_s`: the population over the median ES step);
- rft generation: generated samples/s of its generation phase without each rank's first call
  (summary `samples_per_s_steady`; the first call captures CUDA graphs, and at a few calls a rank it
  was most of the phase: 68 against 12 samples/s on one H200); `samples_per_s` is kept beside it;
- rft sft (the same run's training phase), grpo-mtl, sft: tokens/s at the median step,
  `tokens_per_s_steady` = (the trainer's token count / steps) / median step time, so that a short run's
  first step (optimizer state, graph capture) does not weigh on it.

Training recipes also give the time per optimizer step (`step_seconds`: the median, the first step left
out; eggroll and grpo-mtl from their summaries, rft and sft from the step times rank 0 logged to the
Store). The share of time in communication (`comm_share`) is given where the run times its own
collective apart: eggroll, whose step laps its scoring (load and score; with fitness=correctness also
generate) before its `gather` phase (the fitness all-gather, waiting for the slowest rank included):
gather over the median step. A run whose summary has no `score_seconds_median` (made before the
teacher-forced fitness lapped its scoring) held the scoring in `gather` too. No other recipe times its
collectives (DDP's gradient all-reduce overlaps the backward; probe's and power-sampling's ranks do not
talk while they decode): comm_share is then "not measured". What weak
scaling shows instead, for every recipe with a step time:

    step_overhead(N) = (step(N) - step(1)) / step(N)

the same per-GPU work at every count, so what a step on N GPUs adds is the communication it cannot hide
and the waiting for the slowest rank (exposed communication plus waiting, not bytes on the wire; it can
be slightly negative from noise).

Targets (bench/RESULTS.md's, at random-qwen2.5-0.5b, 1 GPU -> each larger count): weak-scaling efficiency >= 0.9
for every recipe; strong-scaling efficiency >= 0.85 for power-sampling, rft generation, eggroll and
grpo-mtl. Each is printed met / not met / not measured and stored in the JSON's `targets`.

Memory per GPU is the peak memory NVML attributes to the run's own processes on each GPU (the Store's
device peaks; with --cpu, each rank's peak RSS); `memory_spread` = (max - min) / max. `wall_s` is the
whole `gpuscale run` (start-up included), to plan a sweep's time.

`--side-by-side` runs the points of one GPU count at once on disjoint GPUs (four 1-GPU runs on a
4-GPU host, then two 2-GPU runs), to fit a sweep into less machine time; each row's `beside` says how
many other runs shared the host (its CPU cores, PCIe and host memory, never its GPUs) while it ran.
On 4 x H200 a 1-GPU run with three beside it once ran 1.5-2x slower than alone (bench/RESULTS.md;
likely their OpenMP threads, capped since), so it checks itself (`SideBySideCheck`): its first point
runs alone, then again beside others; below 0.95 of its figure alone, that round is dropped and the
sweep goes on one run at a time (the JSON's `side_by_side_check`). Without it (the default) every run
has the host to itself.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from gpuscale.control import telemetry
from gpuscale.control.store import Store
from gpuscale.data.node_check import per_rank_name

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, also when loaded by path
from benchruns import RunFailed, gpuscale_run  # noqa: E402
from record import card, default_path, figures_of, write_result  # noqa: E402

MODELS = ("random-qwen2.5-0.5b", "tiny-math")
TARGET_MODEL = "random-qwen2.5-0.5b"  # the targets above are at this size
MODES = ("weak", "strong")
WEAK_TARGET = 0.9  # every bench
STRONG_TARGET = 0.85  # the generation-bound benches and grpo-mtl only
STRONG_TARGETED = ("power-sampling", "rft generation", "eggroll", "grpo-mtl")


# ---- each recipe's command: per-GPU work x share (1 weak; M/N strong), per-call sizes fixed --------


def sets(**settings) -> list[str]:
    out = []
    for key, value in settings.items():
        out += ["--set", f"{key}={str(value).lower() if isinstance(value, bool) else value}"]
    return out


def probe_args(o, gpus: int, share: int) -> list[str]:
    return ["--batch-size", str(o.probe_batch), *sets(steps=o.probe_steps, prompt_tokens=128)]


def power_args(o, gpus: int, share: int) -> list[str]:
    return ["--batch-size", str(o.problems_per_gpu),
            *sets(max_examples=o.problems_per_gpu * gpus * share, max_new_tokens=o.max_new_tokens, blocks=4,
                  mcmc_steps=3)]


def eggroll_args(o, gpus: int, share: int) -> list[str]:
    rows_per_call = o.eggroll_members_per_gpu * o.eggroll_prompts  # the weak share's members in one engine call
    fitness = sets(fitness=o.eggroll_fitness) if o.eggroll_fitness else []  # else the recipe's default
    return ["--batch-size", str(rows_per_call), *fitness,
            *sets(population=o.eggroll_members_per_gpu * gpus * share, prompts_per_step=o.eggroll_prompts,
                  max_new_tokens=o.eggroll_max_new_tokens, steps=o.train_steps, eval_examples=gpus, eval_every=0,
                  save_model=False)]


def rft_args(o, gpus: int, share: int) -> list[str]:
    # A random model answers noise: include_gold gives the SFT phase a set to train on (its speed counts),
    # about one row a question. A GPU's weak share of them is cut into train_steps micro-batches: the
    # SFT is one epoch of whole micro-batches at every count. A micro-batch larger than the rows left
    # for a rank makes the data loader fill it with rows repeated from the start (accelerate's
    # even_batches: 2- and 4-GPU ranks trained on twice a 1-GPU run's rows a step); one epoch of several
    # steps keeps the data loader's restart (its collectives, where there are ranks) out of the timed steps.
    return ["--batch-size", str(o.rft_questions_per_call),
            *sets(max_examples=o.rft_questions_per_gpu * gpus * share, samples_per_question=o.rft_samples,
                  max_new_tokens=o.max_new_tokens, include_gold=True, max_steps=o.train_steps,
                  train_batch_size=max(1, o.rft_questions_per_gpu // o.train_steps), gradient_accumulation=share,
                  max_length=256, eval_examples=0, save_model=False)]


def grpo_args(o, gpus: int, share: int) -> list[str]:
    # batch_size is the micro-batch: the step's completions beyond it are accumulated.
    prompts = o.grpo_prompts_per_gpu * gpus * share
    return ["--batch-size", str(o.grpo_batch),
            *sets(generator="engine", num_generations=o.grpo_generations, prompts_per_step=prompts,
                  max_completion_length=o.grpo_completion_length, max_steps=o.train_steps, learning_rate=1e-6,
                  eval_examples=0, save_model=False, max_examples=prompts * o.train_steps)]


def sft_args(o, gpus: int, share: int) -> list[str]:
    return ["--batch-size", str(o.sft_batch),
            *sets(max_steps=o.train_steps, gradient_accumulation=share, max_length=256, eval_examples=0,
                  save_model=False, max_examples=o.sft_batch * gpus * share * o.train_steps)]


# ---- each recipe's figures: one part per measured phase ---------------------------------------------


def typical(values: list[float]) -> float | None:
    """The median, the first value left out when there are more (warm-up, graph capture)."""
    return statistics.median(values[1:] or values) if values else None


def logged_step_seconds(store: Store, run_id: int) -> float | None:
    """The median optimizer step time rank 0 logged (the TRL bridge's `step_time_ms`, one per step)."""
    times = [m["value"] / 1000 for m in store.metrics(run_id, "step_time_ms") if m["rank"] == 0]
    return typical(times)


def steady_tokens_per_s(summary: dict, step_seconds: float | None) -> float | None:
    steps, tokens = summary.get("steps"), summary.get("train_tokens")
    return tokens / steps / step_seconds if steps and tokens and step_seconds else None


def share_of(part: float | None, whole: float | None) -> float | None:
    return part / whole if part is not None and whole else None


def probe_figures(summary: dict, store: Store, run_id: int) -> list[dict]:
    ranks = range(summary["world_size"])
    return [{"figure": "throughput_tokens_per_s",
             "total": sum(summary[per_rank_name("throughput_tokens_per_s", rank)] for rank in ranks),
             "decode_loop_tokens_per_s": summary["tokens_per_s"]}]


def power_figures(summary: dict, store: Store, run_id: int) -> list[dict]:
    return [{"figure": "problems_per_s", "total": summary["problems_per_s"]}]


def eggroll_figures(summary: dict, store: Store, run_id: int) -> list[dict]:
    """Its step's `gather` phase is the fitness all-gather (and the waiting for the slowest rank) where
    the scoring laps its own phases before it (`score_seconds_median` in the summary); in a run made
    before gold_logprob's scoring was lapped it also holds the scoring: no communication share then."""
    step, gather = summary["step_seconds_median"], summary.get("gather_seconds_median")
    timed_apart = "score_seconds_median" in summary
    return [{"figure": "members_per_s", "total": summary["members_per_s"], "step_seconds": step,
             "gather_seconds": gather, "comm_share": share_of(gather, step) if timed_apart else None}]


def rft_figures(summary: dict, store: Store, run_id: int) -> list[dict]:
    """Two parts of one run: the generation (its samples/s) and the SFT on what it kept."""
    step = logged_step_seconds(store, run_id)
    return [{"phase": "generation", "figure": "samples_per_s_steady", "total": summary["samples_per_s_steady"],
             "samples_per_s": summary["samples_per_s"]},
            {"phase": "sft", "figure": "tokens_per_s_steady", "total": steady_tokens_per_s(summary, step),
             "step_seconds": step}]


def grpo_figures(summary: dict, store: Store, run_id: int) -> list[dict]:
    step = summary["step_seconds_median"]
    return [{"figure": "tokens_per_s_steady", "total": steady_tokens_per_s(summary, step), "step_seconds": step,
             "generation_seconds_per_step": summary.get("generation_seconds_per_step")}]


def sft_figures(summary: dict, store: Store, run_id: int) -> list[dict]:
    step = logged_step_seconds(store, run_id)
    return [{"figure": "tokens_per_s_steady", "total": steady_tokens_per_s(summary, step), "step_seconds": step}]


@dataclass(frozen=True)
class RecipeBench:
    arguments: Callable  # (opts, gpus, share) -> the run's arguments after --recipe/--gpus/--model
    figures: Callable  # (summary, store, run_id) -> [{"figure", "total", ...}, one per phase]
    phases: tuple[str | None, ...] = (None,)
    strong: bool = True  # whether strong scaling means anything for it


RECIPES = {
    "probe": RecipeBench(probe_args, probe_figures, strong=False),
    "power-sampling": RecipeBench(power_args, power_figures),
    "eggroll": RecipeBench(eggroll_args, eggroll_figures),
    "rft": RecipeBench(rft_args, rft_figures, phases=("generation", "sft")),
    "grpo-mtl": RecipeBench(grpo_args, grpo_figures),
    "sft": RecipeBench(sft_args, sft_figures),
}


# ---- runs and rows ----------------------------------------------------------------------------------


def bench_name(row: dict) -> str:
    """`rft generation`, `rft sft`, or the recipe where a run has one part."""
    return f"{row['recipe']} {row['phase']}" if row.get("phase") else row["recipe"]


def strong_shares(counts: list[int]) -> dict[int, int]:
    """Each count's share of the strong-scaling work, in weak shares: M/N (M the largest count)."""
    most = max(counts)
    uneven = [n for n in counts if most % n]
    if uneven:
        raise ValueError(f"--gpu-counts: {','.join(map(str, counts))}: strong scaling splits the work of {most} "
                         f"GPUs evenly, and {uneven} do not divide {most} (drop them or run --modes weak)")
    return {n: most // n for n in counts}


def run_memory(store: Store, run_id: int, kind: str) -> list[float]:
    """Peak memory of the run's own processes per GPU (per rank's RSS on CPU), in MiB."""
    return [round(peak["peak_run_mem_mb"] or 0.0, 1) for peak in store.device_peaks(run_id, kinds=(kind,))]


def measure(recipe: str, model: str, gpus: int, share: int, opts, env: dict,
            devices: tuple[int, ...] = ()) -> list[dict]:
    """One run's rows, one per phase the recipe measures (without their mode); on `devices` (GPU
    indices) if given, else on the first `gpus` GPUs."""
    bench = RECIPES[recipe]
    # GPU indices as `--gpus` takes them ("3," is GPU 3 alone; a bare "3" would be a count of three)
    where = ",".join(map(str, devices)) + ("," if len(devices) == 1 else "") if devices else str(gpus)
    arguments = ["--recipe", recipe, "--gpus", where, "--model", model, *bench.arguments(opts, gpus, share),
                 *(part for setting in opts.settings for part in ("--set", setting))]
    command = "gpuscale run " + " ".join(arguments)
    base = {"recipe": recipe, "model": model, "gpus": gpus, "share": share}
    started = time.perf_counter()
    try:
        run = gpuscale_run(arguments, env)
    except RunFailed as failure:  # recorded as rows; the sweep goes on
        print(f"  -> failed: {failure}", flush=True)
        return [{**base, "phase": phase, "figure": None, "total": None, "per_gpu": None, "run_mem_mb_per_gpu": [],
                 "memory_spread": None, "error": str(failure), "command": command} for phase in bench.phases]
    wall = round(time.perf_counter() - started, 1)
    store = Store(read_only=True)  # the run is over: reading takes no write lock
    parts = bench.figures(run["summary"], store, run["id"])
    memory = run_memory(store, run["id"], "rank" if opts.cpu else "gpu")
    store.close()
    spread = (max(memory) - min(memory)) / max(memory) if memory and max(memory) else None
    rows = [{**base, "phase": None, **part, "per_gpu": part["total"] / gpus if part["total"] else None,
             "run_mem_mb_per_gpu": memory, "memory_spread": spread, "run": run["id"], "wall_s": wall,
             "command": command} for part in parts]
    for row in rows:
        print(f"  -> {bench_name(row)}: {row['total'] or 0:.2f} {row['figure']}" +
              (f", step {row['step_seconds']:.3f} s" if row.get("step_seconds") else "") + f", {wall} s", flush=True)
    return rows


def measured_points(rows: list[dict]) -> dict[tuple, list[dict]]:
    """(recipe, model, count, share) -> the rows of a run that ended without error (its phases), as
    `measure` returns them: the points an --append sweep need not run again."""
    done: dict[tuple, list[dict]] = {}
    failed = {point_key(row) for row in rows if row.get("error")}
    for row in rows:
        key = point_key(row)
        if key not in failed and not any(same["phase"] == row.get("phase") for same in done.get(key, [])):
            done.setdefault(key, []).append({name: value for name, value in row.items() if name not in SCALED})
    return done


def point_key(row: dict) -> tuple:
    return row["recipe"], row["model"], row["gpus"], row.get("share", 1)


SCALED = ("mode", "efficiency", "step_overhead")  # what a row gains in the sweep and add_scaling


def next_round(points: list[tuple], devices: list[int]) -> list[tuple[tuple, tuple[int, ...]]]:
    """The points (recipe, model, count, share) to run at once next, each with its GPU indices: with
    `devices`, as many points of the smallest count as fit side by side on disjoint slices of them;
    without, the first point alone on the first GPUs (its indices left empty)."""
    if not devices:
        return [(points[0], ())]
    count = min(point[2] for point in points)
    same = [point for point in points if point[2] == count][:len(devices) // count]
    return [(point, tuple(devices[slot * count:(slot + 1) * count])) for slot, point in enumerate(same)]


def run_round(round_: list[tuple[tuple, tuple[int, ...]]], opts, env: dict) -> dict[tuple, list[dict]]:
    """Each point's rows, the points run at once; `beside` = how many other runs shared the host."""
    def one(entry):
        (recipe, model, count, share), devices = entry
        rows = measure(recipe, model, count, share, opts, env, devices=devices)
        return [{**row, "beside": len(round_) - 1} for row in rows]

    with ThreadPoolExecutor(max_workers=len(round_)) as pool:
        return {entry[0]: rows for entry, rows in zip(round_, pool.map(one, round_), strict=True)}


SIDE_BY_SIDE_AGREEMENT = 0.95  # a point beside others must keep this share of its figure alone


@dataclass
class SideBySideCheck:
    """--side-by-side checks itself: the first point (of the smallest count) runs alone, then again
    in the first side-by-side round. Below SIDE_BY_SIDE_AGREEMENT of its figure alone (or without a
    figure to compare), that round's runs are discarded and the sweep goes on one run at a time."""

    point: tuple | None = None
    alone: float | None = None
    beside: float | None = None

    @property
    def ratio(self) -> float | None:
        return self.beside / self.alone if self.alone and self.beside else None

    @property
    def passed(self) -> bool:
        return self.ratio is not None and self.ratio >= SIDE_BY_SIDE_AGREEMENT

    def record(self) -> dict | None:
        if self.point is None:
            return None
        return {"point": list(self.point), "alone": self.alone, "beside": self.beside, "ratio": self.ratio,
                "agreement": SIDE_BY_SIDE_AGREEMENT, "passed": self.passed if self.beside is not None else None}


def sweep(opts, counts: list[int], env: dict,
          after_each: Callable[[list[dict], SideBySideCheck], None] = lambda rows, check: None,
          earlier: list[dict] = (), devices: list[int] = ()) -> tuple[list[dict], SideBySideCheck]:
    """Every recipe x model x mode x count; a point whose command another already ran (the strong
    run at the largest count is the weak one), or that `earlier` rows measured (--append), takes that
    run's rows. `devices` (GPU indices) runs each count's points side by side (`next_round`), checked by
    `SideBySideCheck`. `after_each` gets the rows so far and the check after every round (the result
    file is rewritten, so a sweep cut by a time limit keeps its runs)."""
    shares = {"weak": dict.fromkeys(counts, 1), "strong": strong_shares(counts) if "strong" in opts.modes else {}}
    plan = [(mode, (recipe, model, n, shares[mode][n]))
            for recipe in opts.recipes for model in opts.models
            for mode in (m for m in opts.modes if m == "weak" or RECIPES[recipe].strong) for n in counts]
    done = measured_points(list(earlier))
    queue = list(dict.fromkeys(key for _, key in plan if key not in done))
    devices, check = list(devices), SideBySideCheck()

    def rows_so_far() -> list[dict]:
        return [{**row, "mode": mode} for mode, key in plan if key in done for row in done[key]]

    if devices and queue:
        check.point = min(queue, key=lambda key: key[2])
        done.update(run_round([(check.point, ())], opts, env))
        check.alone = done[check.point][0]["total"]
        queue.remove(check.point)
        after_each(rows_so_far(), check)
    while queue:
        recheck = bool(devices) and check.beside is None
        round_ = next_round([check.point, *queue] if recheck else queue, devices)
        results = run_round(round_, opts, env)
        if recheck:
            check.beside = results.pop(check.point)[0]["total"]
            if not check.passed:
                print(f"side by side: {check.point} reached {check.ratio} of its figure alone (at least "
                      f"{SIDE_BY_SIDE_AGREEMENT} needed): this round's runs are dropped; one run at a time "
                      "from here", flush=True)
                devices = []
                after_each(rows_so_far(), check)
                continue
        done.update(results)
        queue = [key for key in queue if key not in done]
        after_each(rows_so_far(), check)
    return rows_so_far(), check


def row_key(row: dict) -> tuple:
    return row["recipe"], row.get("phase"), row["model"], row.get("mode", "weak"), row["gpus"]


def table_order(row: dict) -> tuple:
    """By recipe (as RECIPES lists them), phase, model, mode and count."""
    return list(RECIPES).index(row["recipe"]), row.get("phase") or "", *row_key(row)[2:]


def add_scaling(rows: list[dict]) -> None:
    """Efficiency against the 1-GPU row of the same bench, model and mode; weak scaling's step
    overhead where there is a step time; comm_share kept where the run reported it, else None."""
    ones = {row_key(r)[:4]: r for r in rows if r["gpus"] == 1}
    for row in rows:
        one = ones.get(row_key(row)[:4])
        row["efficiency"] = row["total"] / (row["gpus"] * one["total"]) if one and one["total"] and row["total"] \
            else None
        row.setdefault("comm_share", None)
        if row.get("mode", "weak") == "weak" and row["gpus"] > 1:
            step, base = row.get("step_seconds"), one.get("step_seconds") if one else None
            row["step_overhead"] = (step - base) / step if step and base else None
        else:
            row["step_overhead"] = None


def target_of(row: dict) -> float | None:
    """The issue's efficiency target for the row's bench and mode; None where it sets none."""
    if row["model"] != TARGET_MODEL:
        return None
    if row.get("mode", "weak") == "weak":
        return WEAK_TARGET
    return STRONG_TARGET if bench_name(row) in STRONG_TARGETED else None


def targets(rows: list[dict]) -> list[dict]:
    """Per bench and mode with a target: the lowest efficiency over the counts above 1 against it
    (met, not met, or None where no count above 1 was measured: a failed run, a single count)."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if target_of(row) is not None and row["gpus"] > 1:
            groups.setdefault(row_key(row)[:4], []).append(row)
    verdicts = []
    for group in groups.values():
        first = group[0]
        measured = [row for row in group if row.get("efficiency") is not None]
        worst = min(measured, key=lambda row: row["efficiency"]) if len(measured) == len(group) else None
        target = target_of(first)
        verdicts.append({"bench": bench_name(first), "model": first["model"], "mode": first.get("mode", "weak"),
                         "target": target,
                         "gpus": sorted(row["gpus"] for row in group),
                         "worst_efficiency": worst["efficiency"] if worst else None,
                         "worst_at_gpus": worst["gpus"] if worst else None,
                         "met": worst["efficiency"] >= target if worst else None})
    return verdicts


def merged(earlier: list[dict], new: list[dict]) -> list[dict]:
    """The earlier rows that the new ones do not replace (same bench, model, mode and count), then the new."""
    replaced = {row_key(row) for row in new}
    return [row for row in earlier if row_key(row) not in replaced] + new


def percent(value: float | None, missing: str = "-") -> str:
    return f"{100 * value:.1f}%" if value is not None else missing


def print_table(rows: list[dict], verdicts: list[dict]) -> None:
    def cell(value, form: str) -> str:
        return format(value, form) if value is not None else "-".rjust(int(form.split(".")[0]))

    print(f"\n{'bench':<16} {'model':<20} {'mode':<6} {'GPUs':>4} {'figure':<20} {'total':>10} {'per GPU':>10} "
          f"{'eff.':>6} {'step s':>8} {'comm':>12} {'overhead':>8} {'wall s':>6} {'beside':>6}  "
          "run memory per GPU (MiB), spread")
    for r in rows:
        head = f"{bench_name(r):<16} {r['model']:<20} {r.get('mode', 'weak'):<6} {r['gpus']:>4}"
        if "error" in r:
            print(f"{head} failed: {r['error'][:80]}")
            continue
        print(f"{head} {r['figure']:<20} {cell(r['total'], '10.2f')} {cell(r['per_gpu'], '10.2f')} "
              f"{cell(r['efficiency'], '6.3f')} {cell(r.get('step_seconds'), '8.3f')} "
              f"{percent(r.get('comm_share'), 'not measured'):>12} {percent(r.get('step_overhead')):>8} "
              f"{cell(r.get('wall_s'), '6.0f')} {r.get('beside', 0):>6}  {r['run_mem_mb_per_gpu']}, "
              f"{percent(r['memory_spread'])}")
    print(f"\ntargets (efficiency 1 GPU -> N, {TARGET_MODEL}):")
    for v in verdicts:
        verdict = "not measured" if v["met"] is None else "met" if v["met"] else "not met"
        worst = f"lowest {v['worst_efficiency']:.3f} at {v['worst_at_gpus']} GPUs" if v["met"] is not None else \
            f"GPUs {v['gpus']}: a run failed or had no 1-GPU row"
        print(f"  {v['mode']:<6} {v['bench']:<16} >= {v['target']:.2f}  {worst:<28}  {verdict}")
    if not verdicts:
        print(f"  none: no {TARGET_MODEL} row above 1 GPU")


BASELINE = """Baseline: each recipe on 1 GPU, the same recipe, model and mode (strong or weak scaling) in the same
invocation; no other code is compared."""


def parse_options(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + "\n\n" + BASELINE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu-counts", default="1,2,4",
                        help="any counts (8 included); counts above the visible GPUs are skipped")
    parser.add_argument("--recipes", default=",".join(RECIPES), help=f"any of {', '.join(RECIPES)}")
    parser.add_argument("--models", default=TARGET_MODEL,
                        help=f"comma-separated; the targets are at {TARGET_MODEL}; tiny-math (the embedded model) too")
    parser.add_argument("--modes", default=",".join(MODES), help="weak, strong or both")
    parser.add_argument("--cpu", action="store_true", help="ranks as CPU processes (no GPU is used or needed)")
    parser.add_argument("--side-by-side", action="store_true",
                        help="run the points of one GPU count at once on disjoint GPUs (less machine time; the "
                        "runs share the host's CPU, PCIe and memory, each row's `beside` says with how many); "
                        "checked against one point run alone, and dropped for one run at a time if it slows them")
    size = parser.add_argument_group("per-GPU sizes of weak scaling (strong: the largest count's total)")
    size.add_argument("--probe-batch", type=int, default=256)
    size.add_argument("--probe-steps", type=int, default=200)
    size.add_argument("--problems-per-gpu", type=int, default=64, help="power-sampling")
    size.add_argument("--max-new-tokens", type=int, default=96, help="power-sampling and rft's generation")
    size.add_argument("--eggroll-members-per-gpu", type=int, default=32)
    size.add_argument("--eggroll-prompts", type=int, default=8)
    size.add_argument("--eggroll-max-new-tokens", type=int, default=32, help="with --eggroll-fitness correctness")
    size.add_argument("--eggroll-fitness", choices=("correctness", "gold_logprob"), default=None,
                      help="default: the recipe's (gold_logprob: teacher forcing, nothing sampled); correctness "
                      "samples answers and times the fitness all-gather apart (its comm share)")
    size.add_argument("--rft-questions-per-gpu", type=int, default=320, help="10 engine calls a GPU at the "
                      "default per call (the steady rate leaves the first out); its SFT: train-steps micro-batches")
    size.add_argument("--rft-questions-per-call", type=int, default=32)
    size.add_argument("--rft-samples", type=int, default=8, help="samples per question")
    size.add_argument("--grpo-prompts-per-gpu", type=int, default=8)
    size.add_argument("--grpo-generations", type=int, default=8)
    size.add_argument("--grpo-completion-length", type=int, default=64)
    size.add_argument("--grpo-batch", type=int, default=32, help="completions per GPU per micro-batch")
    size.add_argument("--sft-batch", type=int, default=128, help="sequences per GPU per micro-batch (sft; rft's "
                      "SFT: --rft-questions-per-gpu over --train-steps): enough to fill a step on the card (at 16 a "
                      "0.5B step is bound by the CPU, not the GPU)")
    size.add_argument("--train-steps", type=int, default=5,
                      help="steps of every training recipe (eggroll, rft's SFT, grpo-mtl, sft); the first is left out")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting for every run, after the bench's own (repeatable; every recipe swept must "
                        "know it): the same sweep with one thing changed, e.g. pad_to_multiple_of=0; give it "
                        "another --out, since --append keeps a point whatever its settings")
    parser.add_argument("--out", default=None, help="default: bench/results/scaling/scaling-<date>-<card>.json; "
                        "rewritten after every run, so a sweep cut by a time limit keeps what it measured")
    parser.add_argument("--append", action="store_true", help="keep the rows already in --out (a sweep split "
                        "into several invocations): a point they measured without error is not run again; one "
                        "that failed is, and its new row replaces the old")
    opts = parser.parse_args(argv)
    if opts.append and not opts.out:
        parser.error("--append needs --out (the file whose rows to keep)")
    if opts.side_by_side and opts.cpu:
        parser.error("--side-by-side: runs GPU points on disjoint GPUs; CPU ranks (--cpu) have none to split")
    opts.recipes, opts.models, opts.modes = (value.split(",") for value in (opts.recipes, opts.models, opts.modes))
    for field, chosen, known in (("--recipes", opts.recipes, RECIPES), ("--modes", opts.modes, MODES)):
        if unknown := sorted(set(chosen) - set(known)):
            parser.error(f"{field}: unknown {unknown} (known: {', '.join(known)})")
    try:
        counts = [int(n) for n in opts.gpu_counts.split(",")]
    except ValueError:
        counts = [0]
    if min(counts) < 1:
        parser.error(f"--gpu-counts: {opts.gpu_counts}: not a comma-separated list of counts of at least 1")
    opts.gpu_counts = counts
    if "strong" in opts.modes:
        try:
            strong_shares(opts.gpu_counts)
        except ValueError as error:
            parser.error(str(error))
    return opts


def main() -> None:
    opts = parse_options()
    env = dict(os.environ)
    if opts.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""  # gpuscale then runs CPU ranks on gloo
        gpus = []
    else:
        gpus = telemetry.list_gpus()
    counts = opts.gpu_counts if opts.cpu else [n for n in opts.gpu_counts if n <= len(gpus)]
    if skipped := sorted(set(opts.gpu_counts) - set(counts)):
        print(f"skipped GPU counts {skipped}: {len(gpus)} GPU(s) visible", flush=True)
    if not counts:
        sys.exit(f"--gpu-counts: {opts.gpu_counts}: none fits the {len(gpus)} GPU(s) visible")
    earlier = figures_of(json.loads(Path(opts.out).read_text()))["rows"] \
        if opts.append and os.path.exists(opts.out) else []
    found_card = "cpu" if opts.cpu else card()
    out = opts.out or default_path("scaling", "scaling", datetime.datetime.now(datetime.UTC).isoformat(), found_card)
    device = gpus[0]["name"] if gpus else "cpu"

    def save(new: list[dict], check: SideBySideCheck, show: bool = False) -> None:
        rows = sorted(merged(earlier, new), key=table_order)  # earlier rows among the new ones
        add_scaling(rows)
        verdicts = targets(rows)
        if show:
            print_table(rows, verdicts)
            if check.point is not None:
                print(f"side by side: {check.record()}")
        write_result("scaling", "scaling", vars(opts), {"gpus_available": len(gpus), "device_name": device,
                                                        "rows": rows, "targets": verdicts,
                                                        "side_by_side_check": check.record()},
                     out=out, card=found_card)

    try:
        devices = [gpu["index"] for gpu in gpus] if opts.side_by_side else []
        rows, check = sweep(opts, counts, env, after_each=save, earlier=earlier, devices=devices)
    except ValueError as error:  # the counts left after skipping do not split the strong work evenly
        print(error, file=sys.stderr)
        sys.exit(2)
    save(rows, check, show=True)


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
