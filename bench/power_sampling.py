"""Power sampling: gpuscale's batched MCMC against the reference structure, and 2 GPUs against 1.

    python bench/power_sampling.py [--gpus 2] [--reference-problems 8]

Every measurement is a real `gpuscale run --recipe power-sampling` (CLI, supervisor, torchrun) at the
same algorithm settings (alpha, max_new_tokens, blocks, mcmc_steps); only `method`, the number of
problems and the GPUs differ. The figure compared is problems per second of sampling (model loading
and the recipe's short warm-up excluded), from each run's summary; the table also gives the rate with
the warm-up counted, and each run's first and later batch times (read from its metrics records).
The reference method handles one problem at a time, so its rate does not depend on how many problems
it is given; it gets few, to keep the benchmark short.

With --accuracy N it also runs greedy, plain temperature-1 sampling and power sampling on N test
problems of the data set and prints their accuracies (the table of bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, also when loaded by path
from record import write_result  # noqa: E402


def run(method: str, gpus: int, problems: int, args, extra: list[str] = ()) -> dict:
    cmd = [
        sys.executable, "-m", "gpuscale.app.cli", "run", "--recipe", "power-sampling", "--gpus", str(gpus),
        "--model", args.model, "--dataset", args.dataset, "--batch-size", str(args.batch_size),
        "--set", f"method={method}", "--set", f"max_examples={problems}", "--set", f"alpha={args.alpha}",
        "--set", f"max_new_tokens={args.max_new_tokens}", "--set", f"blocks={args.blocks}",
        "--set", f"mcmc_steps={args.mcmc_steps}", "--set", f"seed={args.seed}", "--set", f"chains={args.chains}",
        *extra, "--json",
    ]
    print("$ gpuscale", " ".join(cmd[3:]), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stderr[-4000:], flush=True)
        raise SystemExit(f"{method} on {gpus} GPU(s) failed")
    run = json.loads(done.stdout)
    summary = {**run["summary"], "batches": batch_timings(run["run_dir"])}
    if summary["problems"] < problems:
        print(f"  note: {summary['problems']} problems ran, not {problems}: the data set has no more", flush=True)
    print(f"  -> {summary['problems_per_s']:.3f} problems/s, accuracy {summary['accuracy']:.3f}, "
          f"acceptance {summary['acceptance_rate']}; seconds per batch by rank: "
          f"{ {rank: [round(s, 2) for s in t['seconds']] for rank, t in summary['batches'].items()} }", flush=True)
    return summary


def batch_timings(run_dir: str) -> dict:
    """Each rank's seconds per batch, from the timestamps of its metrics records (step 0 is written
    just before the timed loop starts): shows the first batch's one-time costs apart from the rest."""
    timings = {}
    for path in sorted(Path(run_dir, "metrics").glob("rank*.jsonl")):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        steps = sorted((r["step"], r["t"], r.get("samples", 0)) for r in records if "step" in r)
        timings[path.stem] = {
            "seconds": [t1 - t0 for (_, t0, _), (_, t1, _) in zip(steps, steps[1:])],
            "samples": [n for _, _, n in steps[1:]],
        }
    return timings


def with_warm_up(summary: dict) -> float:
    """Problems per second counting the warm-up too (a fixed cost per process, paid in parallel)."""
    return summary["problems"] / (summary["sampling_seconds"] + summary["warm_up_seconds"])


def first_and_later_batches(summary: dict) -> str:
    """Slowest rank's first batch and the median of the later ones: equal when the warm-up caught
    every one-time cost."""
    firsts = [rank["seconds"][0] for rank in summary["batches"].values() if rank["seconds"]]
    later = sorted(s for rank in summary["batches"].values() for s in rank["seconds"][1:])
    return f"{max(firsts):.2f} / {later[len(later) // 2]:.2f}" if later else f"{max(firsts):.2f} / -"


def speed(args) -> dict:
    figures = {"reference_1gpu": run("reference", 1, args.reference_problems, args),
               "gpuscale_1gpu": run("power", 1, args.problems, args)}
    if args.gpus > 1:
        figures[f"gpuscale_{args.gpus}gpu"] = run("power", args.gpus, args.problems, args)
    return figures


def accuracy(args) -> dict:
    # Accuracy does not depend on compilation; skipping it saves a compile per run.
    fast = ["--set", "compile=false"]
    return {
        "greedy": run("greedy", args.gpus, args.accuracy, args, fast),
        "sample_t1": run("sample", args.gpus, args.accuracy, args, ["--set", "temperature=1.0", *fast]),
        "power": run("power", args.gpus, args.accuracy, args, fast),
    }


BASELINE = """Baseline: `method=reference`, power_sample_reference (the users' structure: one chain, one problem at
a time, a transformers generate() per block and per MCMC step), a real run at the same algorithm
settings. bench/reference_parity.py times it against the paper's public code's structure; beyond
that it is not tuned here (no StaticCache/torch.compile for its generate() calls)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] + "\n\n" + BASELINE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-math")
    parser.add_argument("--dataset", default="tiny-math")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--problems", type=int, default=1024,
                        help="problems for the batched runs (at most the data set's size: "
                             "tiny-math has 2000 test problems)")
    parser.add_argument("--reference-problems", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=256, help="problems per batch per GPU")
    parser.add_argument("--alpha", type=float, default=4.0)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--mcmc-steps", type=int, default=10)
    parser.add_argument("--chains", type=int, default=1, help="chains per problem (more work per problem)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--accuracy", type=int, default=0, help="also the accuracy table on this many problems")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--out", default=None, help="default: bench/results/power_sampling/<what>-<date>-<card>.json")
    args = parser.parse_args()
    results = {}
    if not args.skip_speed:
        results["speed"] = speed(args)
    if args.accuracy:
        results["accuracy"] = accuracy(args)
    what = "-".join(part for part, done in (("speed", "speed" in results), ("accuracy", "accuracy" in results)) if done)
    write_result("power_sampling", what or "nothing", vars(args), results, out=args.out)
    if "speed" in results:
        figures = results["speed"]
        base, one = figures["reference_1gpu"]["problems_per_s"], figures["gpuscale_1gpu"]["problems_per_s"]
        one_warm = with_warm_up(figures["gpuscale_1gpu"])
        print(f"\n{'run':<16} {'problems/s':>11} {'vs reference':>13} {'vs 1 GPU':>9} "
              f"{'incl. warm-up':>14} {'vs 1 GPU':>9} {'warm-up s':>10} {'batch 1 / later s':>18}")
        for name, summary in figures.items():
            rate, warm = summary["problems_per_s"], with_warm_up(summary)
            print(f"{name:<16} {rate:>11.3f} {rate / base:>12.1f}x {rate / one:>8.2f}x {warm:>14.3f} "
                  f"{warm / one_warm:>8.2f}x {summary['warm_up_seconds']:>10.2f} "
                  f"{first_and_later_batches(summary):>18}")
    if "accuracy" in results:
        print(f"\n{'method':<10} {'accuracy':>9}  per domain")
        for name, summary in results["accuracy"].items():
            domains = {k.removeprefix("accuracy_"): round(v, 3)
                       for k, v in summary.items() if k.startswith("accuracy_")}
            print(f"{name:<10} {summary['accuracy']:>9.3f}  {domains}")


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
