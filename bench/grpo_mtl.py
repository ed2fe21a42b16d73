"""grpo-mtl: time per GRPO step of stock GRPOTrainer (TRL's `model.generate`), of TRL's continuous
batching and of gpuscale's engine, and the engine on N GPUs, from real `gpuscale run --recipe grpo-mtl`
runs at the same settings.

    python bench/grpo_mtl.py [--gpus 2] [--model random-qwen2.5-0.5b] [--skip continuous]

Runs: generator=transformers, generator=continuous and generator=engine on one GPU,
and generator=engine on --gpus GPUs. Every run: `--prompts-per-step` prompts per GPU per step, each
answered `--generations` times, `--max-completion-length` tokens, `--steps` optimizer steps, no
evaluation, nothing saved. The multi-GPU run is weak scaling: prompts_per_step grows with the GPUs,
so every GPU generates and trains on the same completions per step as the single GPU does.

Figures per run, from the run's summary:
- `step_seconds`: the median wall time of an optimizer step, the first step left out (it builds the
  optimizer state and the engine's buffers, captures CUDA graphs): the summary's `step_seconds_median`;
- `generation_seconds_per_step`: the median generation part of a step (same steps);
- `tokens_per_s`: the summary's (TRL's token count, prompts and completions of every rank, over the
  whole training time, first step included) and `tokens_per_s_steady` (tokens per step over the
  median step time);
- `mfu` (the summary's, 6 x parameters x tokens/s per GPU over the card's bf16 peak) and
  `mfu_steady` (the same at the steady tokens/s);
- `completions_per_s`: completions per step over the median step time; `completions_per_s_run`: the
  run's completions over its whole training time (first step included).

Ratios: step time transformers / engine (target >= 3), generation transformers / engine (>= 8),
step time continuous / engine (>= 1.5), and the N-GPU engine's completions/s over the 1-GPU engine's
(>= 1.8 for N = 2; `scaling_efficiency` divides it by N).

A random model (`random-qwen2.5-0.5b`, Qwen2.5-0.5B's shape) answers noise and practically never
emits EOS, so every completion has the full length: good for timing, and the same work for every
generator. On CPU (the script's test) pass `--model tiny-math` and tiny sizes; the ranks are CPU
processes then and MFU is empty.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, also when loaded by path
from benchruns import RunFailed, gpuscale_run  # noqa: E402
from record import write_result  # noqa: E402

GENERATORS = ("transformers", "continuous", "engine")
OFF_POLICY = ("sampling_staleness_last", "sampling_importance_sampling_clipped_share_last")


def run_settings(args, generator: str, gpus: int, extra: dict | None = None) -> list[str]:
    """The `gpuscale run` arguments of one run (weak scaling: prompts per step x GPUs), `extra` settings on top."""
    prompts = args.prompts_per_step * gpus
    settings = {
        "generator": generator, "num_generations": args.generations, "prompts_per_step": prompts,
        "max_completion_length": args.max_completion_length, "max_steps": args.steps,
        "learning_rate": args.learning_rate, "temperature": 1.0, "beta": 0.0,
        "eval_examples": 0, "save_model": "false", "seed": args.seed,
        # Enough prompts for every step; tokenizing the whole split would only slow the start.
        "max_examples": prompts * args.steps,
        **(extra or {}),
    }
    cmd = ["--recipe", "grpo-mtl", "--gpus", str(gpus), "--model", args.model, "--dataset", args.dataset,
           "--precision", args.precision, "--batch-size", str(args.batch_size)]
    for key, value in settings.items():
        cmd += ["--set", f"{key}={value}"]
    return cmd


def measure(args, generator: str, gpus: int, extra: dict | None = None) -> dict:
    """One run and its figures (see the module docstring)."""
    arguments = run_settings(args, generator, gpus, extra)
    try:
        run = gpuscale_run(arguments)
    except RunFailed as failure:  # recorded; the other runs still give their figures
        print(f"  -> failed: {failure}", flush=True)
        return {"generator": generator, "gpus": gpus, "error": str(failure),
                "command": "gpuscale run " + " ".join(arguments)}
    s = run["summary"]
    step = s["step_seconds_median"]
    completions = args.prompts_per_step * gpus * args.generations
    tokens_per_step = s["train_tokens"] / s["steps"] if s["steps"] else 0.0
    steady = tokens_per_step / step if step else None
    mfu = s.get("mfu")
    figures = {
        "run": run["id"], "generator": generator, "gpus": gpus, "steps": s["steps"],
        "step_seconds": step, "generation_seconds_per_step": s["generation_seconds_per_step"],
        "training_seconds_per_step": s.get("training_seconds_per_step"),
        "completions_per_step": completions, "completions_per_s": completions / step if step else None,
        "completions_per_s_run": completions * s["steps"] / s["train_seconds"] if s["train_seconds"] else None,
        "tokens_per_step": tokens_per_step, "tokens_per_s": s["tokens_per_s"], "tokens_per_s_steady": steady,
        "mfu": mfu, "mfu_steady": mfu * steady / s["tokens_per_s"] if mfu and steady and s["tokens_per_s"] else None,
        "generation_seconds": s["generation_seconds"], "train_seconds": s["train_seconds"],
        "command": "gpuscale run " + " ".join(arguments),
        **{name: s[name] for name in OFF_POLICY if name in s},  # rollout=async's
    }
    print(f"  -> step {step:.3f} s (generation {figures['generation_seconds_per_step']:.3f} s), "
          f"{figures['completions_per_s']:.1f} completions/s, {steady:.0f} tokens/s steady", flush=True)
    return figures


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator and denominator else None


def ratios(runs: dict, gpus: int) -> dict:
    """The issue's comparisons, None where a run was skipped."""
    engine, transformers = runs.get("engine_1gpu", {}), runs.get("transformers_1gpu", {})
    continuous = runs.get("continuous_1gpu", {})
    many = runs.get(f"engine_{gpus}gpu", {}) if gpus > 1 else {}
    scaling = ratio(many.get("completions_per_s"), engine.get("completions_per_s"))
    return {
        "step_transformers_over_engine": ratio(transformers.get("step_seconds"), engine.get("step_seconds")),
        "generation_transformers_over_engine": ratio(transformers.get("generation_seconds_per_step"),
                                                     engine.get("generation_seconds_per_step")),
        "step_continuous_over_engine": ratio(continuous.get("step_seconds"), engine.get("step_seconds")),
        "engine_gpus": gpus if many else None,
        "engine_scaling": scaling,
        "engine_scaling_tokens": ratio(many.get("tokens_per_s_steady"), engine.get("tokens_per_s_steady")),
        "scaling_efficiency": scaling / gpus if scaling else None,
    }


TARGETS = {"step_transformers_over_engine": 3.0, "generation_transformers_over_engine": 8.0,
           "step_continuous_over_engine": 1.5, "engine_scaling": 1.8}


def print_table(results: dict) -> None:
    def cell(value, form):
        return format(value, form) if value is not None else "-"

    print(f"\n{'run':<18} {'step s':>8} {'gen s':>8} {'train s':>8} {'compl/s':>9} {'tokens/s':>9} {'MFU':>7}")
    for name, r in results["runs"].items():
        if "error" in r:
            print(f"{name:<18} failed: {r['error'][:80]}")
            continue
        mfu = cell(100 * r["mfu_steady"], ".2f") + "%" if r["mfu_steady"] is not None else "-"
        print(f"{name:<18} {cell(r['step_seconds'], '8.3f')} {cell(r['generation_seconds_per_step'], '8.3f')} "
              f"{cell(r['training_seconds_per_step'], '8.3f')} {cell(r['completions_per_s'], '9.1f')} "
              f"{cell(r['tokens_per_s_steady'], '9.0f')} {mfu:>7}")
    print()
    for name, target in TARGETS.items():
        value = results["ratios"][name]
        verdict = "not measured" if value is None else ("meets" if value >= target else "short of") + f" {target}x"
        print(f"{name:<38} {cell(value, '.2f'):>6}  ({verdict})")


BASELINE = """Baseline: stock TRL GRPOTrainer with its own generation, `generator=transformers` (TRL's
model.generate: eager, dynamic cache, no torch.compile) and `generator=continuous` (TRL's transformers
continuous batching), real runs at the same settings as the engine's. Not put at its best: its
micro-batch (--batch-size) and prompts per step are the engine's, not swept for it; TRL's vLLM
generation is not measured."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + "\n\n" + BASELINE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random-qwen2.5-0.5b")
    parser.add_argument("--dataset", default="tiny-math")
    parser.add_argument("--gpus", type=int, default=2, help="GPUs of the multi-GPU engine run (1: none)")
    parser.add_argument("--prompts-per-step", type=int, default=16, help="prompts per GPU per step")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-completion-length", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32, help="completions per GPU per training micro-batch")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps of every run (the first is left out)")
    parser.add_argument("--learning-rate", type=float, default=1e-6)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip", default="", help="comma-separated generators to leave out "
                        "(transformers, continuous, engine-multi)")
    parser.add_argument("--home", default=None, help="GPUSCALE_HOME of the runs (default: a new temporary one)")
    parser.add_argument("--out", default=None, help="default: bench/results/grpo_mtl/speed-<date>-<card>.json")
    args = parser.parse_args()
    os.environ["GPUSCALE_HOME"] = args.home or tempfile.mkdtemp(prefix="gpuscale-bench-grpo-")
    skip = {name.strip() for name in args.skip.split(",") if name.strip()}
    unknown = skip - {*GENERATORS, "engine-multi"}
    if unknown:
        parser.error(f"--skip: unknown {sorted(unknown)}")

    runs: dict[str, dict] = {}
    for generator in GENERATORS:
        if generator not in skip:
            runs[f"{generator}_1gpu"] = measure(args, generator, 1)
    if args.gpus > 1 and "engine-multi" not in skip:
        runs[f"engine_{args.gpus}gpu"] = measure(args, "engine", args.gpus)
    results = {"runs": runs, "ratios": ratios(runs, args.gpus), "targets": TARGETS}
    print_table(results)
    write_result("grpo_mtl", "speed", vars(args), results, out=args.out)


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
