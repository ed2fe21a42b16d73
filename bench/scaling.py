"""Weak scaling of every recipe over the GPUs of one host: 1, 2, 4, 8 GPUs (as many as there are).

    python bench/scaling.py [--gpu-counts 1,2,4,8] [--recipes probe,eggroll] [--models tiny-math]
    python bench/scaling.py --cpu --gpu-counts 1,2 ...     # ranks as CPU processes (the script's test)
    python bench/scaling.py --recipes rft,grpo-mtl --append --out FILE.json   # a sweep in several parts

Each point is a real `gpuscale run` (CLI, supervisor, torchrun or accelerate). Weak scaling: every GPU
gets the same work at every count (the per-GPU size knobs below: a rank's batch, its prompts,
problems, questions or members, and the same number of steps), so

    efficiency(N) = total(N) / (N x total(1))

where total is the run's throughput in the recipe's own unit, all GPUs together:
- probe: tokens/s of its timed decode steps (summary `tokens_per_s`);
- power-sampling: problems/s (summary `problems_per_s`);
- eggroll: members/s (summary `members_per_s`: the population over the median ES step);
- rft: generated samples/s of its generation phase (summary `samples_per_s`); its SFT phase's step
  time and tokens/s are in the row too (`train_*`);
- grpo-mtl, sft: tokens/s at the median step, `tokens_per_s_steady` = (the trainer's token count /
  steps) / median step time, so that a short run's first step (optimizer state, graph capture) does
  not weigh on it.

Training recipes (eggroll, rft's SFT phase, grpo-mtl, sft) also give the time per optimizer step
(`step_seconds`: the median, the first step left out; eggroll and grpo-mtl from their summaries,
rft and sft from the step times rank 0 logged to the Store) and the share of it spent communicating:

    comm_share(N) = (step(N) - step(1)) / step(N)

With the same per-device work at every count, a step on N GPUs does the same compute as on one; what
it adds is the communication the recipe cannot hide (DDP's gradient all-reduce beyond what overlaps
the backward, eggroll's fitness all-gather, TRL's metric gathers) and the waiting for the slowest
rank. comm_share therefore measures exposed communication plus waiting, not bytes on the wire; it
can be slightly negative from noise. eggroll also times its own collective: `gather_seconds` (the
fitness all-gather, waiting included, median over steps).

Memory per GPU is the peak memory NVML attributes to the run's own processes on each GPU (the Store's
device peaks; with --cpu, each rank's peak RSS); `memory_spread` = (max - min) / max.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpuscale.runs import telemetry
from gpuscale.runs.store import Store

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, also when loaded by path
from benchruns import RunFailed, gpuscale_run  # noqa: E402
from record import figures_of, write_result  # noqa: E402

MODELS = ("tiny-math", "random-qwen2.5-0.5b")


# ---- each recipe's command (weak scaling: per-GPU work fixed) --------------------------------------


def sets(**settings) -> list[str]:
    out = []
    for key, value in settings.items():
        out += ["--set", f"{key}={str(value).lower() if isinstance(value, bool) else value}"]
    return out


def probe_args(o, gpus: int) -> list[str]:
    return ["--batch-size", str(o.probe_batch), *sets(steps=o.probe_steps, prompt_tokens=128)]


def power_args(o, gpus: int) -> list[str]:
    return ["--batch-size", str(o.problems_per_gpu),
            *sets(max_examples=o.problems_per_gpu * gpus, max_new_tokens=o.max_new_tokens, blocks=4, mcmc_steps=3)]


def eggroll_args(o, gpus: int) -> list[str]:
    rows_per_gpu = o.eggroll_members_per_gpu * o.eggroll_prompts  # every local member in one engine call
    return ["--batch-size", str(rows_per_gpu),
            *sets(population=o.eggroll_members_per_gpu * gpus, prompts_per_step=o.eggroll_prompts,
                  max_new_tokens=o.eggroll_max_new_tokens, steps=o.train_steps, eval_examples=gpus, eval_every=0,
                  save_model=False)]


def rft_args(o, gpus: int) -> list[str]:
    # A random model answers noise: include_gold gives the SFT phase a set to train on (its speed counts).
    return ["--batch-size", str(o.rft_questions_per_call),
            *sets(max_examples=o.rft_questions_per_gpu * gpus, samples_per_question=o.rft_samples,
                  max_new_tokens=o.max_new_tokens, include_gold=True, max_steps=o.train_steps,
                  train_batch_size=o.sft_batch, max_length=256, eval_examples=0, save_model=False)]


def grpo_args(o, gpus: int) -> list[str]:
    prompts = o.grpo_prompts_per_gpu * gpus
    return ["--batch-size", str(o.grpo_batch),
            *sets(generator="engine", num_generations=o.grpo_generations, prompts_per_step=prompts,
                  max_completion_length=o.grpo_completion_length, max_steps=o.train_steps, learning_rate=1e-6,
                  eval_examples=0, save_model=False, max_examples=prompts * o.train_steps)]


def sft_args(o, gpus: int) -> list[str]:
    return ["--batch-size", str(o.sft_batch),
            *sets(max_steps=o.train_steps, max_length=256, eval_examples=0, save_model=False,
                  max_examples=o.sft_batch * gpus * o.train_steps)]


# ---- each recipe's figures --------------------------------------------------------------------------


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


def probe_figures(summary: dict, store: Store, run_id: int) -> dict:
    return {"figure": "tokens_per_s", "total": summary["tokens_per_s"]}


def power_figures(summary: dict, store: Store, run_id: int) -> dict:
    return {"figure": "problems_per_s", "total": summary["problems_per_s"]}


def eggroll_figures(summary: dict, store: Store, run_id: int) -> dict:
    return {"figure": "members_per_s", "total": summary["members_per_s"],
            "step_seconds": summary["step_seconds_median"], "gather_seconds": summary.get("gather_seconds_median")}


def rft_figures(summary: dict, store: Store, run_id: int) -> dict:
    step = logged_step_seconds(store, run_id)
    return {"figure": "samples_per_s", "total": summary["samples_per_s"],
            "samples_per_s_steady": summary.get("samples_per_s_steady"),
            "step_seconds": step, "train_tokens_per_s_steady": steady_tokens_per_s(summary, step)}


def grpo_figures(summary: dict, store: Store, run_id: int) -> dict:
    step = summary["step_seconds_median"]
    return {"figure": "tokens_per_s_steady", "total": steady_tokens_per_s(summary, step), "step_seconds": step,
            "generation_seconds_per_step": summary.get("generation_seconds_per_step")}


def sft_figures(summary: dict, store: Store, run_id: int) -> dict:
    step = logged_step_seconds(store, run_id)
    return {"figure": "tokens_per_s_steady", "total": steady_tokens_per_s(summary, step), "step_seconds": step}


@dataclass(frozen=True)
class RecipeBench:
    arguments: Callable  # (opts, gpus) -> the run's arguments after --recipe/--gpus/--model
    figures: Callable  # (summary, store, run_id) -> {"figure", "total", ...}
    training: bool


RECIPES = {
    "probe": RecipeBench(probe_args, probe_figures, training=False),
    "power-sampling": RecipeBench(power_args, power_figures, training=False),
    "eggroll": RecipeBench(eggroll_args, eggroll_figures, training=True),
    "rft": RecipeBench(rft_args, rft_figures, training=True),
    "grpo-mtl": RecipeBench(grpo_args, grpo_figures, training=True),
    "sft": RecipeBench(sft_args, sft_figures, training=True),
}


# ---- runs and rows ----------------------------------------------------------------------------------


def run_memory(store: Store, run_id: int, kind: str) -> list[float]:
    """Peak memory of the run's own processes per GPU (per rank's RSS on CPU), in MiB."""
    return [round(peak["peak_run_mem_mb"] or 0.0, 1) for peak in store.device_peaks(run_id, kinds=(kind,))]


def measure(recipe: str, model: str, gpus: int, opts, env: dict) -> dict:
    bench = RECIPES[recipe]
    arguments = ["--recipe", recipe, "--gpus", str(gpus), "--model", model, *bench.arguments(opts, gpus)]
    command = "gpuscale run " + " ".join(arguments)
    try:
        run = gpuscale_run(arguments, env)
    except RunFailed as failure:  # recorded as a row; the sweep goes on
        print(f"  -> failed: {failure}", flush=True)
        return {"recipe": recipe, "model": model, "gpus": gpus, "figure": None, "total": None, "per_gpu": None,
                "run_mem_mb_per_gpu": [], "memory_spread": None, "error": str(failure), "command": command}
    store = Store(read_only=True)  # the run is over: reading takes no write lock
    figures = bench.figures(run["summary"], store, run["id"])
    memory = run_memory(store, run["id"], "rank" if opts.cpu else "gpu")
    store.close()
    spread = (max(memory) - min(memory)) / max(memory) if memory and max(memory) else None
    row = {"recipe": recipe, "model": model, "gpus": gpus, **figures,
           "per_gpu": figures["total"] / gpus if figures["total"] else None,
           "run_mem_mb_per_gpu": memory, "memory_spread": spread, "run": run["id"], "command": command}
    print(f"  -> {row['total'] or 0:.2f} {row['figure']}" +
          (f", step {row['step_seconds']:.3f} s" if row.get("step_seconds") else ""), flush=True)
    return row


def add_scaling(rows: list[dict]) -> None:
    """Efficiency against the 1-GPU row of the same recipe and model; comm_share for training recipes."""
    ones = {(r["recipe"], r["model"]): r for r in rows if r["gpus"] == 1}
    for row in rows:
        one = ones.get((row["recipe"], row["model"]))
        row["efficiency"] = row["total"] / (row["gpus"] * one["total"]) if one and one["total"] and row["total"] \
            else None
        if RECIPES[row["recipe"]].training:
            step, base = row.get("step_seconds"), one.get("step_seconds") if one else None
            row["comm_share"] = (step - base) / step if step and base and row["gpus"] > 1 else None


def merged(earlier: list[dict], new: list[dict]) -> list[dict]:
    """The earlier rows that the new ones do not replace (same recipe, model and count), then the new."""
    def key(row: dict) -> tuple:
        return row["recipe"], row["model"], row["gpus"]

    replaced = {key(row) for row in new}
    return [row for row in earlier if key(row) not in replaced] + new


def print_table(rows: list[dict]) -> None:
    def cell(value, form: str) -> str:
        return format(value, form) if value is not None else "-"

    print(f"\n{'recipe':<15} {'model':<20} {'GPUs':>4} {'figure':<20} {'total':>10} {'per GPU':>10} {'eff.':>6} "
          f"{'step s':>8} {'comm':>6}  run memory per GPU (MiB), spread")
    for r in rows:
        if "error" in r:
            print(f"{r['recipe']:<15} {r['model']:<20} {r['gpus']:>4} failed: {r['error'][:80]}")
            continue
        spread = f"{100 * r['memory_spread']:.1f}%" if r["memory_spread"] is not None else "-"
        comm = f"{100 * r['comm_share']:.1f}%" if r.get("comm_share") is not None else "-"
        print(f"{r['recipe']:<15} {r['model']:<20} {r['gpus']:>4} {r['figure']:<20} {cell(r['total'], '10.2f')} "
              f"{cell(r['per_gpu'], '10.2f')} {cell(r['efficiency'], '6.3f')} {cell(r.get('step_seconds'), '8.3f')} "
              f"{comm:>6}  {r['run_mem_mb_per_gpu']}, {spread}")


def parse_options(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + "\n\n" + BASELINE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu-counts", default="1,2,4,8", help="counts above the visible GPUs are skipped")
    parser.add_argument("--recipes", default=",".join(RECIPES), help=f"any of {', '.join(RECIPES)}")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--cpu", action="store_true", help="ranks as CPU processes (no GPU is used or needed)")
    size = parser.add_argument_group("per-GPU sizes (the same at every count)")
    size.add_argument("--probe-batch", type=int, default=64)
    size.add_argument("--probe-steps", type=int, default=200)
    size.add_argument("--problems-per-gpu", type=int, default=64, help="power-sampling")
    size.add_argument("--max-new-tokens", type=int, default=96, help="power-sampling and rft's generation")
    size.add_argument("--eggroll-members-per-gpu", type=int, default=32)
    size.add_argument("--eggroll-prompts", type=int, default=8)
    size.add_argument("--eggroll-max-new-tokens", type=int, default=32)
    size.add_argument("--rft-questions-per-gpu", type=int, default=16)
    size.add_argument("--rft-questions-per-call", type=int, default=8)
    size.add_argument("--rft-samples", type=int, default=8, help="samples per question")
    size.add_argument("--grpo-prompts-per-gpu", type=int, default=8)
    size.add_argument("--grpo-generations", type=int, default=8)
    size.add_argument("--grpo-completion-length", type=int, default=64)
    size.add_argument("--grpo-batch", type=int, default=32, help="completions per GPU per micro-batch")
    size.add_argument("--sft-batch", type=int, default=16, help="sequences per GPU per step (sft and rft's SFT)")
    size.add_argument("--train-steps", type=int, default=5,
                      help="steps of every training recipe (eggroll, rft's SFT, grpo-mtl, sft); the first is left out")
    parser.add_argument("--out", default=None, help="default: bench/results/scaling/weak-scaling-<date>-<card>.json")
    parser.add_argument("--append", action="store_true", help="keep the rows already in --out (a sweep split "
                        "into several invocations); a row of the same recipe, model and count is replaced")
    opts = parser.parse_args(argv)
    if opts.append and not opts.out:
        parser.error("--append needs --out (the file whose rows to keep)")
    unknown = set(opts.recipes.split(",")) - set(RECIPES)
    if unknown:
        parser.error(f"--recipes: unknown {sorted(unknown)}")
    return opts


BASELINE = """No baseline of other code: each recipe at N GPUs is set against the same recipe on 1 GPU (weak
scaling efficiency)."""


def main() -> None:
    opts = parse_options()
    env = dict(os.environ)
    if opts.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""  # gpuscale then runs CPU ranks on gloo
        gpus = []
    else:
        gpus = telemetry.list_gpus()
    requested = [int(n) for n in opts.gpu_counts.split(",")]
    counts = requested if opts.cpu else [n for n in requested if n <= len(gpus)]
    if skipped := sorted(set(requested) - set(counts)):
        print(f"skipped GPU counts {skipped}: {len(gpus)} GPU(s) visible", flush=True)
    rows = [measure(recipe, model, n, opts, env)
            for recipe in opts.recipes.split(",") for model in opts.models.split(",") for n in counts]
    if opts.append and os.path.exists(opts.out):
        rows = merged(figures_of(json.loads(Path(opts.out).read_text()))["rows"], rows)
    add_scaling(rows)
    device = gpus[0]["name"] if gpus else "cpu"
    print_table(rows)
    write_result("scaling", "weak-scaling", vars(opts), {"gpus_available": len(gpus), "device_name": device,
                                                         "rows": rows},
                 out=opts.out, card="cpu" if opts.cpu else None)


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
