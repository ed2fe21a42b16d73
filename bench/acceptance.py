"""The GPU acceptance run: every recipe through `gpuscale run` with its defaults, on the GPUs found,
several seeds at once; then the GPU-marked tests; one table and one result file.

For each recipe (grpo-mtl twice: mtl none and pcgrad; power-sampling against its temperature-1
baseline, `method=sample`) and each seed, one run with nothing set but the seed (and, for
power sampling, how many problems). Runs of different seeds share the GPUs (`--jobs` at a time).
The table: status, wall time, peak memory per GPU, held-out accuracy greedy and at temperature 1
before and after (power sampling: its accuracy against the baseline's), whether every logged figure
and the summary are finite, and whether the saved model loads and generates with plain
transformers. Means and spreads over the seeds follow. Written with bench/record.py to
bench/results/acceptance/.

Usage: python bench/acceptance.py [--gpus N] [--seeds 0,1,2] [--jobs 7] [--skip-tests]
       [--only RECIPE ...] [--set RECIPE:key=value ...]   (--set: for quick CPU checks, not acceptance)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import ROOT, write_result  # noqa: E402

# (label, recipe, settings beyond the seed). Power sampling's only setting is the problem count: its
# default is the whole 2,000-problem test split, more than its comparison needs.
# Longest first: with every run started at once, the last to end sets the wall time.
JOBS = (
    ("grpo-mtl pcgrad", "grpo-mtl", {"mtl": "pcgrad"}),
    ("grpo-mtl", "grpo-mtl", {}),
    ("rft", "rft", {}),
    ("eggroll", "eggroll", {}),
    ("sft", "sft", {}),
    ("power-sampling", "power-sampling", {"max_examples": 500}),
    ("power-sampling baseline", "power-sampling", {"max_examples": 500, "method": "sample"}),
)
ACCURACIES = ("accuracy_greedy_before", "accuracy_greedy_after", "accuracy_sampled_before", "accuracy_sampled_after")


def launch(label: str, recipe: str, settings: dict, seed: int, gpus: str, home: Path,
           prefix: str = "acceptance") -> dict:
    """One `gpuscale run` to its end; the run as `--json` prints it, with the wall time. Its label in
    the history is PREFIX-LABEL-seedN."""
    argv = [sys.executable, "-m", "gpuscale.app.cli", "run", "--recipe", recipe, "--gpus", gpus, "--json",
            "--label", f"{prefix}-{label.replace(' ', '-')}-seed{seed}"]
    for key, value in {**settings, "seed": seed}.items():
        argv += ["--set", f"{key}={value}"]
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "GPUSCALE_HOME": str(home)})
    wall = time.perf_counter() - started
    try:
        run = json.loads(done.stdout)
    except json.JSONDecodeError:
        run = {"status": f"no result (exit {done.returncode})", "error": done.stderr.strip()[-300:]}
    return {"label": label, "recipe": recipe, "seed": seed, "wall_s": wall, "run": run}


def finite(value) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(finite(v) for v in value.values())
    if isinstance(value, list):
        return all(finite(v) for v in value)
    return True


def nan_free(run: dict) -> bool:
    """Every figure the ranks logged, and the summary, finite."""
    folder = Path(run.get("run_dir") or "")
    for path in folder.glob("metrics/rank*.jsonl"):
        for line in path.read_text().splitlines():
            if line.strip() and not finite(json.loads(line)):
                return False
    return finite(run.get("summary") or {})


def saved_model_generates(summary: dict) -> bool | None:
    """Whether the run's saved model loads with plain transformers and generates (None: none saved)."""
    model_dir = summary.get("model_dir")
    if not model_dir:
        return None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
        ids = tokenizer("What is 2 + 3?", return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=8, do_sample=False)
        return out.shape[1] > ids.shape[1]
    except Exception as error:  # the table says no; the reason goes to the log
        print(f"{model_dir}: {type(error).__name__}: {error}", file=sys.stderr)
        return False


def row_of(result: dict) -> dict:
    run = result["run"]
    summary = run.get("summary") or {}
    peak = summary.get("peak_run_mem_mb")
    return {
        "label": result["label"], "seed": result["seed"], "run_id": run.get("id"), "status": run.get("status"),
        "error": run.get("error"), "wall_s": round(result["wall_s"], 1),
        "peak_mem_mb": peak if isinstance(peak, dict) else None,
        **{name: summary.get(name) for name in ACCURACIES},
        "accuracy": summary.get("accuracy"),
        "nan_free": nan_free(run) if run.get("run_dir") else False,
        "saved_model_generates": saved_model_generates(summary),
    }


def seed_statistics(rows: list[dict]) -> dict:
    """Per job: mean and spread (sample standard deviation) over the seeds of each accuracy and of
    the gains (after - before), in points."""
    stats = {}
    for label in dict.fromkeys(row["label"] for row in rows):
        mine = [row for row in rows if row["label"] == label]
        figures = {name: [row[name] for row in mine] for name in (*ACCURACIES, "accuracy", "wall_s")}
        for kind in ("greedy", "sampled"):
            figures[f"gain_{kind}"] = [row[f"accuracy_{kind}_after"] - row[f"accuracy_{kind}_before"]
                                       if isinstance(row[f"accuracy_{kind}_after"], (int, float))
                                       and isinstance(row[f"accuracy_{kind}_before"], (int, float)) else None
                                       for row in mine]
        stats[label] = {name: spread(values) for name, values in figures.items() if any(v is not None for v in values)}
    return stats


def spread(values: list) -> dict:
    numbers = [v for v in values if isinstance(v, (int, float))]
    return {"mean": statistics.fmean(numbers), "sd": statistics.stdev(numbers) if len(numbers) > 1 else 0.0,
            "n": len(numbers)} if numbers else {"n": 0}


def print_table(rows: list[dict], stats: dict) -> None:
    def pct(value):
        return f"{100 * value:5.1f}" if isinstance(value, (int, float)) else "    —"

    print(f"{'run':<26}{'seed':>5} {'status':<10}{'wall s':>7}  {'peak MB per GPU':<18}"
          f"{'greedy before→after':>21}{'T=1 before→after':>19}{'acc':>7}  nan-free  model")
    for row in rows:
        peak = " ".join(f"{v:,.0f}" for v in (row["peak_mem_mb"] or {}).values()) or "—"
        model = {None: "—", True: "loads+gen", False: "FAILS"}[row["saved_model_generates"]]
        print(f"{row['label']:<26}{row['seed']:>5} {str(row['status']):<10}{row['wall_s']:>7.0f}  {peak:<18}"
              f"{pct(row['accuracy_greedy_before']):>13} → {pct(row['accuracy_greedy_after'])}"
              f"{pct(row['accuracy_sampled_before']):>11} → {pct(row['accuracy_sampled_after'])}"
              f"{pct(row['accuracy']):>7}  {'yes' if row['nan_free'] else 'NO':<9} {model}")
        if row["status"] != "succeeded" and row["error"]:
            print(f"    {row['error']}")
    print("\nmean ± sd over seeds (points):")
    for label, figures in stats.items():
        shown = ", ".join(f"{name} {100 * f['mean']:+.1f} ± {100 * f['sd']:.1f}" if name.startswith("gain")
                          else f"{name} {100 * f['mean']:.1f} ± {100 * f['sd']:.1f}"
                          for name, f in figures.items() if f["n"] and name != "wall_s")
        print(f"  {label}: {shown}; wall {figures['wall_s']['mean']:.0f} s")


def gpu_tests() -> dict:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/gpu", "-p", "no:cacheprovider"],
                          capture_output=True, text=True, cwd=ROOT)
    tail = (done.stdout + done.stderr).strip().splitlines()[-1:] or [""]
    print(f"\nGPU-marked tests: exit {done.returncode}: {tail[0]}")
    return {"exit_code": done.returncode, "last_line": tail[0], "seconds": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default=None, help="GPUs per run (default: every GPU found; CPU: 2 ranks)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--jobs", type=int, default=7, help="runs at once (they share the GPUs). 21 at once on "
                        "one H100 ran 7 of them out of memory: runs sized `auto` at the same moment each "
                        "take half of the memory they see free")
    parser.add_argument("--partial", default=None, help="append each run's row to this JSON-lines file as it ends")
    parser.add_argument("--only", nargs="*", default=None, help="labels of the jobs to run (default all)")
    parser.add_argument("--set", action="append", default=[], metavar="LABEL:KEY=VALUE",
                        help="a setting for one job (quick checks on CPU; an acceptance run sets none)")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--home", default=None, help="GPUSCALE_HOME of the runs (default: a fresh folder)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

    gpus = args.gpus or str(torch.cuda.device_count() or 2)
    home = Path(args.home or ROOT / ".acceptance" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    extra: dict[str, dict] = {}
    for item in args.set:
        label, _, pair = item.partition(":")
        key, _, value = pair.partition("=")
        extra.setdefault(label, {})[key] = value
    jobs = [(label, recipe, {**settings, **extra.get(label, {})}, int(seed))
            for seed in args.seeds.split(",") for label, recipe, settings in JOBS
            if args.only is None or label in args.only]
    started = time.perf_counter()

    def run_and_keep(job) -> dict:
        row = row_of(launch(*job, gpus, home))
        if args.partial:
            with open(args.partial, "a") as handle:
                handle.write(json.dumps(row) + "\n")
        return row

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        rows = sorted(pool.map(run_and_keep, jobs), key=lambda row: (row["label"], row["seed"]))
    stats = seed_statistics(rows)
    print_table(rows, stats)
    tests = None if args.skip_tests else gpu_tests()
    total = time.perf_counter() - started
    print(f"\nacceptance: {total:.0f} s in all on {gpus} GPU(s) per run")
    write_result("acceptance", f"acceptance-{gpus}gpu", {"gpus": gpus, "seeds": args.seeds, "jobs": args.jobs,
                                                        "set": args.set, "only": args.only},
                 {"runs": rows, "seed_statistics": stats, "gpu_tests": tests, "seconds": total}, out=args.out)


if __name__ == "__main__":
    main()
