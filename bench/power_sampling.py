"""Power sampling: gpuscale's batched MCMC against the reference structure, and 2 GPUs against 1.

    python bench/power_sampling.py --out power_sampling.json [--gpus 2] [--reference-problems 8]

Every measurement is a real `gpuscale run --recipe power-sampling` (CLI, supervisor, torchrun) at the
same algorithm settings (alpha, max_new_tokens, blocks, mcmc_steps); only `method`, the number of
problems and the GPUs differ. The figure compared is problems per second of sampling (model loading
excluded), from each run's summary. The reference method handles one problem at a time, so its rate
does not depend on how many problems it is given; it gets few, to keep the benchmark short.

With --accuracy N it also runs greedy, plain temperature-1 sampling and power sampling on N test
problems of the data set and prints their accuracies (the table of bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def run(method: str, gpus: int, problems: int, args, extra: list[str] = ()) -> dict:
    cmd = [
        sys.executable, "-m", "gpuscale.app.cli", "run", "--recipe", "power-sampling", "--gpus", str(gpus),
        "--model", args.model, "--dataset", args.dataset, "--batch-size", str(args.batch_size),
        "--set", f"method={method}", "--set", f"max_examples={problems}", "--set", f"alpha={args.alpha}",
        "--set", f"max_new_tokens={args.max_new_tokens}", "--set", f"blocks={args.blocks}",
        "--set", f"mcmc_steps={args.mcmc_steps}", "--set", f"seed={args.seed}", *extra, "--json",
    ]
    print("$ gpuscale", " ".join(cmd[3:]), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stderr[-4000:], flush=True)
        raise SystemExit(f"{method} on {gpus} GPU(s) failed")
    summary = json.loads(done.stdout)["summary"]
    print(f"  -> {summary['problems_per_s']:.3f} problems/s, accuracy {summary['accuracy']:.3f}, "
          f"acceptance {summary['acceptance_rate']}", flush=True)
    return summary


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny-math")
    parser.add_argument("--dataset", default="tiny-math")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--problems", type=int, default=1024, help="problems for the batched runs")
    parser.add_argument("--reference-problems", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=256, help="problems per batch per GPU")
    parser.add_argument("--alpha", type=float, default=4.0)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--mcmc-steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--accuracy", type=int, default=0, help="also the accuracy table on this many problems")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--out", default="power_sampling.json")
    args = parser.parse_args()
    results = {"date": time.strftime("%Y-%m-%d"), "settings": vars(args)}
    if not args.skip_speed:
        results["speed"] = speed(args)
    if args.accuracy:
        results["accuracy"] = accuracy(args)
    with open(args.out, "w") as handle:
        json.dump(results, handle, indent=2)
    if "speed" in results:
        figures = results["speed"]
        base, one = figures["reference_1gpu"]["problems_per_s"], figures["gpuscale_1gpu"]["problems_per_s"]
        print(f"\n{'run':<18} {'problems/s':>11} {'vs reference':>13} {'vs 1 GPU':>9}")
        for name, summary in figures.items():
            rate = summary["problems_per_s"]
            print(f"{name:<18} {rate:>11.3f} {rate / base:>12.1f}x {rate / one:>8.2f}x")
    if "accuracy" in results:
        print(f"\n{'method':<10} {'accuracy':>9}  per domain")
        for name, summary in results["accuracy"].items():
            domains = {k.removeprefix("accuracy_"): round(v, 3) for k, v in summary.items() if k.startswith("accuracy_")}
            print(f"{name:<10} {summary['accuracy']:>9.3f}  {domains}")


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
