"""Scaling over the GPUs of one host: probe and power-sampling at 1, 2, 4, 8 GPUs (as many as there are).

    python bench/scaling.py --out scaling.json [--gpu-counts 1,2,4,8]

Each point is a real `gpuscale run` (CLI, supervisor, torchrun). Weak scaling: every GPU gets the same
work at every count (probe: the same batch and steps per rank; power-sampling: `--problems-per-gpu`
problems per GPU), so the efficiency is throughput(N) / (N x throughput(1)). Memory per GPU is the peak
memory NVML attributes to the run's own processes on that GPU; the spread is (max - min) / max.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from gpuscale.engines import telemetry
from gpuscale.engines.store import Store

MODELS = ("tiny-math", "random-qwen2.5-0.5b")


def gpuscale_run(args: list[str]) -> dict:
    cmd = [sys.executable, "-m", "gpuscale.app.cli", "run", *args, "--json"]
    print("$ gpuscale run", " ".join(args), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stderr[-3000:], flush=True)
        raise SystemExit("run failed")
    return json.loads(done.stdout)


def probe_args(model: str, gpus: int, opts) -> list[str]:
    return ["--recipe", "probe", "--gpus", str(gpus), "--model", model, "--batch-size", str(opts.probe_batch),
            "--set", f"steps={opts.probe_steps}", "--set", "prompt_tokens=128"]


def power_args(model: str, gpus: int, opts) -> list[str]:
    return ["--recipe", "power-sampling", "--gpus", str(gpus), "--model", model,
            "--batch-size", str(opts.problems_per_gpu), "--set", f"max_examples={opts.problems_per_gpu * gpus}",
            "--set", f"max_new_tokens={opts.max_new_tokens}", "--set", "blocks=4", "--set", "mcmc_steps=3"]


def run_memory(store: Store, run_id: int) -> list[float]:
    return [round(peak["peak_run_mem_mb"] or 0.0, 1) for peak in store.device_peaks(run_id, kinds=("gpu",))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpu-counts", default="1,2,4,8")
    parser.add_argument("--probe-batch", type=int, default=64)
    parser.add_argument("--probe-steps", type=int, default=400)
    parser.add_argument("--problems-per-gpu", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--out", default="scaling.json")
    opts = parser.parse_args()
    available = len(telemetry.visible_gpu_indices())
    counts = [n for n in map(int, opts.gpu_counts.split(",")) if n <= available]
    store = Store()
    rows = []
    recipes = (("probe", probe_args, "tokens_per_s"), ("power-sampling", power_args, "problems_per_s"))
    for recipe, build, figure in recipes:
        for model in opts.models.split(","):
            base = None
            for gpus in counts:
                run = gpuscale_run(build(model, gpus, opts))
                value = run["summary"][figure]
                base = value if gpus == 1 else base
                memory = run_memory(store, run["id"])
                spread = (max(memory) - min(memory)) / max(memory) if memory and max(memory) else None
                rows.append({"recipe": recipe, "model": model, "gpus": gpus, "figure": figure, "total": value,
                             "per_gpu": value / gpus, "efficiency": value / (gpus * base) if base else None,
                             "run_mem_mb_per_gpu": memory, "memory_spread": spread,
                             "command": "gpuscale run " + " ".join(build(model, gpus, opts))})
    with open(opts.out, "w") as handle:
        json.dump({"date": time.strftime("%Y-%m-%d"), "gpus_available": available, "rows": rows}, handle, indent=2)
    print(f"\n{'recipe':<15} {'model':<20} {'GPUs':>4} {'figure':<15} {'total':>10} {'per GPU':>10} "
          f"{'eff.':>5}  run memory per GPU (MiB), spread")
    for r in rows:
        eff = f"{r['efficiency']:.3f}" if r["efficiency"] else "-"
        spread = f"{100 * r['memory_spread']:.1f}%" if r["memory_spread"] is not None else "-"
        print(f"{r['recipe']:<15} {r['model']:<20} {r['gpus']:>4} {r['figure']:<15} {r['total']:>10.2f} "
              f"{r['per_gpu']:>10.2f} {eff:>5}  {r['run_mem_mb_per_gpu']}, {spread}")


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
