"""Issue 15: is `gpuscale tune`'s batch as fast as the best of a full sweep, at a fraction of its cost?

In one process on one device (the first GPU, else the CPU), for one recipe, model and shape:
1. `gpuscale tune`'s search (recipes/shared/device_trials.py `tune_recipe`: doubling, bisection, a confirming
   trial), timed from loading the model to its choice;
2. a full sweep: every power of two and every midpoint between two (1, 2, 3, 4, 6, 8, 12, ...) up to
   --max-batch (default: the run's work per rank where the recipe knows it), brought down to the sizes
   the recipe allows (a training recipe's divisors of its step, eggroll's whole members), up to the
   first out of memory or the memory cap; each batch size measured as a short real run would be:
   trials until --sweep-items of work in the figure's unit (problems, tokens, members, samples), at
   least --min-sweep-batches of them, so each figure is work / seconds. The sweep's time counts
   loading its model once, as the tuning's does.

It prints and writes (bench/results/tune/, or --out) the sweep table, the tuning's trials, the tuned batch's throughput
against the sweep's best (target: within 10%) and the tuning's time against the sweep's (target:
under 10%; this ratio depends on --sweep-items, which stands for the length of the run being tuned,
and is printed with it).

On the GPU machine (one GPU), each meant to end within about two minutes (estimates, not measured:
where one runs longer, lower --max-batch):

    python bench/tune.py --recipe power-sampling --model tiny-math --set max_new_tokens=256 \
        --set blocks=4 --set mcmc_steps=3 --max-batch 256 --sweep-items 1 --min-sweep-batches 1
    python bench/tune.py --recipe power-sampling --model random-qwen2.5-0.5b --set max_new_tokens=256 \
        --set blocks=4 --set mcmc_steps=3 --max-batch 128 --sweep-items 1 --min-sweep-batches 1
        # (nearer three minutes: a batch at this shape takes seconds)
    python bench/tune.py --recipe probe --model random-qwen2.5-0.5b --set prompt_tokens=512 \
        --max-batch 512 --sweep-items 1024
    python bench/tune.py --recipe eggroll --model tiny-math --sweep-items 1 --min-sweep-batches 1
    python bench/tune.py --recipe eggroll --model random-qwen2.5-0.5b --set population=32 \
        --set prompts_per_step=8 --sweep-items 1 --min-sweep-batches 1
    python bench/tune.py --recipe rft --model random-qwen2.5-0.5b --max-batch 32 --sweep-items 1 \
        --min-sweep-batches 1
    python bench/tune.py --recipe sft --model random-qwen2.5-0.5b --set gradient_accumulation=8 \
        --sweep-items 1
    python bench/tune.py --recipe grpo-mtl --model random-qwen2.5-0.5b --sweep-items 1

On CPU (its test, tests/integration/test_tune_cli.py):

    python bench/tune.py --recipe probe --max-batch 4 --sweep-items 8 --set steps=2 --set prompt_tokens=4
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, also when loaded by path
from record import one_card, write_result  # noqa: E402


def sweep_sizes(max_batch: int, allowed: list[int] | None = None) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, 16, 24, ...: powers of two and the midpoints between them; where the
    recipe allows only some sizes (a training recipe's divisors of its step, eggroll's whole members),
    each one brought down to the nearest allowed size, and the largest allowed size too."""
    sizes, power = [1], 2
    while power <= max_batch:
        sizes += [size for size in (power * 3 // 4, power) if size > sizes[-1]]
        power *= 2
    sizes = [size for size in sizes if size <= max_batch]
    if allowed is None:
        return sizes
    allowed = [size for size in allowed if size <= max_batch]
    snapped = {max((a for a in allowed if a <= size), default=None) for size in sizes} | {max(allowed, default=None)}
    return sorted(size for size in snapped if size is not None)


def run_sweep(recipe, settings, device, args) -> tuple[list[dict], float]:
    """Each batch size over --sweep-items items of work; stops at the first that does not fit."""
    import torch

    from gpuscale.engines.batch_search import Trial
    from gpuscale.engines.distributed import RankContext, resolve_dtype
    from gpuscale.recipes.shared.device_trials import device_memory_bytes, measured
    from gpuscale.recipes.shared.rank_batches import run_ranks

    torch_device = torch.device(device.torch_name)
    limit = args.memory_cap * device_memory_bytes(torch_device)
    rows, started = [], time.perf_counter()
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as scratch:
        ctx = RankContext(0, 0, 1, torch_device, resolve_dtype(settings.precision, torch_device), Path(scratch))
        sized = recipe.for_device(settings, torch_device.type == "cuda", run_ranks(settings))
        with recipe.trial_session(sized, ctx) as trial:
            for size in sweep_sizes(args.max_batch, recipe.tune_batch_sizes(sized, run_ranks(settings))):
                # Trials until --sweep-items of work (in the figure's unit: problems, tokens, members...)
                # and at least --min-sweep-batches of them; a trial's work is its throughput x its time.
                each = [measured(trial, size, torch_device)]
                while each[-1].failure is None and (len(each) < args.min_sweep_batches or sum(
                        t.throughput * t.step_seconds for t in each) < args.sweep_items):
                    each.append(measured(trial, size, torch_device))
                batches = len(each)
                failed = next((t for t in each if t.failure), None)
                peak = max((t.peak_memory_bytes or 0) for t in each)
                seconds = sum(t.step_seconds for t in each if t.failure is None)
                work = sum(t.throughput * t.step_seconds for t in each if t.failure is None)
                row = Trial(size, throughput=None if failed else work / seconds, peak_memory_bytes=peak,
                            step_seconds=None if failed else seconds / batches,
                            failure=failed.failure if failed else None, phase="sweep",
                            over_cap=not failed and peak > limit).as_dict()
                rows.append({**row, "batches": batches})
                print(f"sweep: batch {size}: " + (row["failure"] or f"{row['throughput']:.4g}/s, "
                      f"{peak / 1e9:.2f} GB{' (over the cap)' if row['over_cap'] else ''}"), file=sys.stderr,
                      flush=True)
                if failed or row["over_cap"]:
                    break
    return rows, time.perf_counter() - started


BASELINE = """Baseline: a full sweep of batch sizes (every power of two and every midpoint, up to --max-batch or the
first out of memory), each measured as a short real run would be; its best batch is the figure the
tuned batch is set against, so the baseline is at its best by construction over the sizes swept."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] + "\n\n" + BASELINE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--model", default="tiny-math")
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--set", dest="assignments", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--max-batch", type=int, help="default: the run's work per rank where the recipe knows "
                        "it, else 2048")
    parser.add_argument("--memory-cap", type=float, default=0.9)
    parser.add_argument("--sweep-items", type=int, default=1024, help="items of work per swept batch size")
    parser.add_argument("--min-sweep-batches", type=int, default=2)
    parser.add_argument("--out", help="default: bench/results/tune/<recipe>-<model>-<date>-<card>.json")
    args = parser.parse_args(argv)

    from gpuscale.app.batch_choice import pick_device
    from gpuscale.control import telemetry
    from gpuscale.recipes.shared.device_trials import default_max_batch, tune_recipe
    from gpuscale.recipes.shared.registry import get_recipe
    from gpuscale.runs.settings import parse_assignments, resolve_settings

    recipe = get_recipe(args.recipe)
    overrides = {"model": args.model, "precision": args.precision, **parse_assignments(args.assignments)}
    settings = resolve_settings(recipe.settings_cls, overrides=overrides, environ={})
    device = pick_device(telemetry.visible_gpu_indices()[:1])
    figure = recipe.tuning.figure
    args.max_batch = args.max_batch or min(2048, default_max_batch(recipe, settings, on_gpu=device.index is not None))

    outcome = tune_recipe(recipe, settings, device, memory_cap=args.memory_cap, max_batch=args.max_batch,
                          progress=lambda t: print(f"tune: {t}", file=sys.stderr, flush=True))
    sweep, sweep_seconds = run_sweep(recipe, settings, device, args)
    fitting = [row for row in sweep if row["failure"] is None and not row["over_cap"]]
    best = max(fitting, key=lambda row: row["throughput"]) if fitting else None
    chosen = outcome.result.batch_size
    at_chosen = next((row for row in sweep if row["batch_size"] == chosen), None)
    report = {
        "recipe": recipe.name, "model": args.model, "figure": figure, "device": device.name,
        "precision": outcome.key.precision, "shape": json.loads(outcome.key.shape), "host": socket.gethostname(),
        "sweep_items": args.sweep_items, "sweep": sweep, "sweep_seconds": sweep_seconds,
        "tune_trials": [trial.as_dict() for trial in outcome.result.trials], "tune_seconds": outcome.seconds,
        "tuned_batch": chosen, "tuned_trial_throughput": outcome.result.chosen.throughput if chosen else None,
        # The tuned batch's throughput as the sweep measured it (a tuned batch between two swept sizes
        # is compared through its own trial figure).
        "tuned_sweep_throughput": at_chosen["throughput"] if at_chosen else None,
        "sweep_best_batch": best["batch_size"] if best else None,
        "sweep_best_throughput": best["throughput"] if best else None,
    }
    tuned = report["tuned_sweep_throughput"] or report["tuned_trial_throughput"]
    report["tuned_vs_best"] = tuned / best["throughput"] if tuned and best else None
    report["tune_time_share"] = outcome.seconds / sweep_seconds if sweep_seconds else None
    report["within_10_percent"] = bool(report["tuned_vs_best"] and report["tuned_vs_best"] >= 0.9)
    report["under_10_percent_of_sweep_time"] = bool(report["tune_time_share"] and report["tune_time_share"] < 0.1)
    print(json.dumps(report, indent=2))
    print(f"{recipe.name} on {device.name}: tuned batch {chosen} at {tuned or 0:.4g} {figure} vs the sweep's best "
          f"batch {report['sweep_best_batch']} at {report['sweep_best_throughput'] or 0:.4g} "
          f"({(report['tuned_vs_best'] or 0):.0%}); tuning {outcome.seconds:.1f} s vs sweep {sweep_seconds:.1f} s "
          f"({(report['tune_time_share'] or 0):.1%})", file=sys.stderr)
    write_result("tune", f"{recipe.name}-{args.model}", vars(args), report, out=args.out,
                 card="cpu" if device.index is None else one_card(device.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
