"""Probe on the GPU machine: tokens/s per GPU at 1 and N GPUs, NVML samples, supervisor CPU use.

    python bench/probe_gpus.py --gpus 2 [--model random-qwen2.5-0.5b]

Runs `gpuscale run --recipe probe` (the real CLI, supervisor and torchrun) once on GPU 0 alone and once
on the first N GPUs with the same per-GPU settings, then reads the run history for what the
supervisor recorded: NVML samples of each GPU (memory, the run's own memory, utilization) and the
supervisor's own CPU use at the chosen telemetry interval.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from gpuscale.control.store import Store

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, also when loaded by path
from record import write_result  # noqa: E402


def run_probe(gpus: int, args) -> dict:
    cmd = [
        sys.executable, "-m", "gpuscale.app.cli", "run", "--recipe", "probe", "--gpus", str(gpus),
        "--model", args.model, "--batch-size", str(args.batch_size), "--precision", "bf16",
        "--set", f"steps={args.steps}", "--set", f"prompt_tokens={args.prompt_tokens}",
        "--set", f"telemetry_interval={args.interval}", "--json",
    ]
    print("$", " ".join(cmd[2:]), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stderr[-3000:])
        raise SystemExit(f"probe on {gpus} GPU(s) failed")
    return json.loads(done.stdout)


def gpu_figures(store: Store, run_id: int) -> dict:
    return {f"gpu{peak['idx']}": {key: value for key, value in peak.items() if key not in ("kind", "idx")}
            for peak in store.device_peaks(run_id, kinds=("gpu",))}


BASELINE = """No baseline of other code: the N-GPU probe run is set against the same probe run on GPU 0 alone, same
per-GPU settings."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] + "\n\n" + BASELINE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--model", default="random-qwen2.5-0.5b")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--out", default=None, help="default: bench/results/probe/probe_gpus-<date>-<card>.json")
    args = parser.parse_args()
    store = Store()
    results = {"runs": {}}
    for gpus in sorted({1, args.gpus}):
        run = run_probe(gpus, args)
        results["runs"][gpus] = {"summary": run["summary"], "gpus": gpu_figures(store, run["id"]), "id": run["id"]}
    write_result("probe", "probe_gpus", vars(args), results, out=args.out)
    one = results["runs"][1]["summary"]["tokens_per_s"]
    print(f"\n{'GPUs':>4} {'tok/s total':>12} {'tok/s per GPU':>30} {'scaling':>8} {'sup. CPU %':>10}")
    for gpus, run in results["runs"].items():
        s = run["summary"]
        print(f"{gpus:>4} {s['tokens_per_s']:>12,.0f} {str(s['tokens_per_s_per_rank']):>30} "
              f"{s['tokens_per_s'] / (gpus * one):>8.3f} {s['supervisor_cpu_percent']:>10.3f}")
    for gpus, run in results["runs"].items():
        for key, g in run["gpus"].items():
            print(f"  {gpus} GPU run, {key} {g['name']}: peak used {g['peak_mem_used_mb']:,.0f} of "
                  f"{g['mem_total_mb']:,.0f} MiB, run's own {g['peak_run_mem_mb']:,.0f} MiB, "
                  f"mean util {g['mean_util']:.0f}%, {g['samples']} samples")


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
