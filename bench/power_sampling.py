"""Power sampling: gpuscale's batched MCMC against the reference structure, and 2 GPUs against 1.

    python bench/power_sampling.py [--gpus 2] [--reference-problems 8]

Every measurement is a real `gpuscale run --recipe power-sampling` (CLI, supervisor, torchrun) at the
same algorithm settings (alpha, max_new_tokens, blocks, mcmc_steps); only `method`, the number of
problems and the GPUs differ. The figure compared is problems per second of sampling (model loading
and the recipe's short warm-up excluded), from each run's summary; the table also gives the rate with
the warm-up counted, and each run's first and later batch times (read from its metrics records).
The reference method handles one problem at a time, so its rate does not depend on how many problems
it is given; it gets few, to keep the benchmark short.

With --accuracy N it also runs power sampling and its rivals on the same N test problems at the same
token budget (max_new_tokens): greedy decoding, token-level sampling at T = 1/alpha (the rival the
method claims to beat: low temperature sharpens each token's distribution, p^alpha sharpens whole
answers) and plain temperature-1 sampling, and prints their accuracies (overall and per domain).
With --pass-at-k as well, each sampling method draws --pass-at-k-chains (16) independent chains a
problem and the table gives pass@k for k = 1, 2, 4, 8, 16 (the recipe's summary, Chen et al.'s
unbiased estimator; all k in the JSON): power sampling's other claim is that it keeps diversity.
Greedy is deterministic, so it draws one chain and its pass@k is its accuracy at every k.
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


def run(method: str, gpus: int, problems: int, args, extra: list[str] = (), chains: int | None = None) -> dict:
    cmd = [
        sys.executable, "-m", "gpuscale.app.cli", "run", "--recipe", "power-sampling", "--gpus", str(gpus),
        "--model", args.model, "--dataset", args.dataset, "--batch-size", str(args.batch_size),
        "--set", f"method={method}", "--set", f"max_examples={problems}", "--set", f"alpha={args.alpha}",
        "--set", f"max_new_tokens={args.max_new_tokens}", "--set", f"blocks={args.blocks}",
        "--set", f"mcmc_steps={args.mcmc_steps}", "--set", f"seed={args.seed}",
        "--set", f"chains={chains or args.chains}",
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


# The accuracy runs: name -> (method, settings beyond the shared ones); `low_temperature` is T = 1/alpha.
def accuracy_runs(args) -> dict[str, tuple[str, dict]]:
    return {
        "greedy": ("greedy", {}),
        "sample_t1": ("sample", {"temperature": 1.0}),
        "sample_low_t": ("sample", {"temperature": 1.0 / args.alpha}),
        "power": ("power", {}),
    }


def accuracy(args) -> dict:
    """Every method on the same problems, alpha and token budget; with --pass-at-k the sampling methods
    draw --pass-at-k-chains chains a problem (greedy one: its chains would all be the same answer)."""
    results = {}
    for name, (method, settings) in accuracy_runs(args).items():
        chains = args.pass_at_k_chains if args.pass_at_k and method != "greedy" else args.chains
        # Accuracy does not depend on compilation; skipping it saves a compile per run.
        settings = {**settings, "compile": "false"}
        extra = [part for key, value in settings.items() for part in ("--set", f"{key}={value}")]
        results[name] = run(method, args.gpus, args.accuracy, args, extra, chains=chains)
    return results


LABELS = {"greedy": "greedy", "sample_t1": "T=1", "sample_low_t": "T=1/alpha", "power": "power"}
SHOWN_KS = ("1", "2", "4", "8", "16")


def pass_at_k_of(name: str, summary: dict) -> dict[str, float]:
    """A run's pass@k by k: the summary's, or for greedy (one deterministic answer a problem) its
    accuracy at every k; empty for a sampling run of one chain."""
    if name == "greedy" and summary.get("chains", 1) == 1:
        return dict.fromkeys(SHOWN_KS, summary["accuracy"])
    return summary.get("pass_at_k", {})


def accuracy_lines(results: dict, alpha: float) -> list[str]:
    """The accuracy table: a row per method (T=1/alpha with its value), overall and per domain, and
    pass@k where the runs drew several chains."""
    ks = [k for k in SHOWN_KS if any(k in pass_at_k_of(n, s) for n, s in results.items() if n != "greedy")]
    lines = [f"{'method':<18} {'accuracy':>9} " + "".join(f"{'pass@' + k:>9}" for k in ks) + "  per domain"]
    for name, summary in results.items():
        label = LABELS.get(name, name) + (f" ({1 / alpha:g})" if name == "sample_low_t" else "")
        by_k = pass_at_k_of(name, summary)
        domains = {key.removeprefix("accuracy_"): round(value, 3)
                   for key, value in summary.items() if key.startswith("accuracy_") and value is not None}
        passes = "".join(f"{by_k[k]:>9.3f}" if k in by_k else f"{'—':>9}" for k in ks)
        lines.append(f"{label:<18} {summary['accuracy']:>9.3f} {passes}  {domains}")
    if ks:
        lines.append("accuracy: every chain's answer counted (= pass@1); greedy: one deterministic answer a problem, "
                     "so pass@k = its accuracy")
    return lines


BASELINE = """Baselines, each a real run at the same algorithm settings:
- speed: `method=reference`, power_sample_reference (the users' structure: one chain, one problem at
  a time, a transformers generate() per block and per MCMC step). bench/reference_parity.py times it
  against the paper's public code's structure; beyond that it is not tuned here (no
  StaticCache/torch.compile for its generate() calls).
- accuracy (--accuracy N, --pass-at-k): power sampling's rivals on the same problems, seed and token
  budget (max_new_tokens), each on the same batched generation engine at the same batch size:
  `method=greedy` (deterministic: nothing to tune, one chain a problem); `method=sample
  temperature=1/alpha`, token-level low-temperature sampling at the exponent power sampling targets
  (the comparison of Karan & Du 2025; its proposal uses the same temperature); `method=sample
  temperature=1.0`, plain sampling from the model. None is tuned beyond that (no top-k/top-p,
  no other temperature)."""


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
    parser.add_argument("--accuracy", type=int, default=0,
                        help="also the accuracy table on this many problems: greedy, T=1, T=1/alpha, power")
    parser.add_argument("--pass-at-k", action="store_true",
                        help="with --accuracy: each sampling method draws --pass-at-k-chains chains a problem; "
                             "the table adds pass@1, 2, 4, 8, 16")
    parser.add_argument("--pass-at-k-chains", type=int, default=16, help="chains a problem for --pass-at-k")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--out", default=None, help="default: bench/results/power_sampling/<what>-<date>-<card>.json")
    args = parser.parse_args()
    if args.pass_at_k and not args.accuracy:
        parser.error("--pass-at-k: needs --accuracy N (the problems pass@k is measured on)")
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
        print("\n" + "\n".join(accuracy_lines(results["accuracy"], args.alpha)))


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
