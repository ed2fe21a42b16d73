"""The GPU acceptance run: every recipe through `gpuscale run` with its defaults, on the GPUs found,
several seeds at once, and the GPU-marked tests alongside; one table and one result file.

For each recipe (grpo-mtl twice: mtl none and pcgrad; power-sampling against its temperature-1
baseline, `method=sample`) and each seed, one run with nothing set but the seed (and, for
power sampling, how many problems). Runs of different seeds share the GPUs (`--jobs` at a time, all
by default). Two run settings that say how runs share the machine, not how a recipe learns, are
set for every run: `gpus` (with `--gpus 1` on a machine of several GPUs, each run is pinned to one
of them in turn) and `gpu_memory_share` (runs sized `auto` that start together each take their
share of the card instead of half of it: at the same moment they all see the same free memory).
The table: status, wall time, peak memory per GPU, the energy its GPUs used (kJ, from NVML's energy
counter: the summary's energy_j) and per correct held-out answer (J), held-out accuracy greedy and at
temperature 1 before and after (power sampling: its accuracy against the baseline's), whether every logged figure
and the summary are finite, and whether the saved model loads and generates with plain
transformers. Means and spreads over the seeds follow, per domain too, and each recipe's learning
target (TARGETS) met or not. Written with bench/record.py to bench/results/acceptance/.

Usage: python bench/acceptance.py [--gpus N] [--seeds 0,1,2] [--jobs N] [--skip-tests]
       [--only LABEL ...] [--set LABEL:key=value ...]   (--set: for quick CPU checks, not acceptance)
       python bench/acceptance.py --gpus N --from-partial FILE [FILE ...]   (the table of finished rows)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import ROOT, write_result  # noqa: E402

from gpuscale.runs.settings import AUTO_MEMORY_SHARE  # noqa: E402  (the control plane: no torch)

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
# Jobs whose batch is sized `auto` from the memory free when they start (gpu_memory_share applies).
AUTO_SIZED = {"grpo-mtl", "grpo-mtl pcgrad", "rft", "power-sampling", "power-sampling baseline"}
# Learning targets, mean gain over the seeds in points of accuracy on the held-out problems:
# label -> (T=1 gain at least, greedy gain at least, per domain too).
TARGETS = {
    "grpo-mtl": (8, 0, True),
    "grpo-mtl pcgrad": (8, 0, True),
    "rft": (8, 3, False),
    "eggroll": (5, 0, False),
    "sft": (8, None, False),
}
POWER_TARGET = 15  # points of power sampling's accuracy over its temperature-1 baseline
MODEL_CHECK_LOCK = threading.Lock()


def shared_threads(runs_at_once: int) -> None:
    """Give every run started from here its share of the host's cores as OpenMP threads (unless the
    caller set OMP_NUM_THREADS). Runs that start together all find the machine idle, so each would
    take every core (runs/supervisor.py's omp_threads): with 20 runs on 16 cores, each rank's
    OpenMP barriers then wait on descheduled threads. Like gpu_memory_share, it says how runs share
    the machine, not how a recipe learns."""
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, runs_at_once))))


def launch(label: str, recipe: str, settings: dict, seed: int, home: Path, prefix: str = "acceptance") -> dict:
    """One `gpuscale run` to its end; the run as `--json` prints it, with the wall time. Its label in
    the history is PREFIX-LABEL-seedN."""
    argv = [sys.executable, "-m", "gpuscale.app.cli", "run", "--recipe", recipe, "--json",
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
        # One at a time: from_pretrained sets torch's default dtype for the whole process while it builds
        # the model, so two runs' checks in the pool's threads raced (a bf16 model built half in fp32).
        with MODEL_CHECK_LOCK:
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
        # NVML's energy counter over the run (runs/telemetry.py's EnergyMeter); None, and why, without one.
        "energy_j": summary.get("energy_j"), "energy_j_per_correct_answer": summary.get("energy_j_per_correct_answer"),
        "energy_unavailable": summary.get("energy_unavailable"),
        **{name: summary.get(name) for name in ACCURACIES},
        "domains": domain_figures(summary),
        "accuracy": summary.get("accuracy"),
        "nan_free": nan_free(run) if run.get("run_dir") else False,
        "saved_model_generates": saved_model_generates(summary),
    }


def domain_figures(summary: dict) -> dict:
    """A summary's per-domain accuracies (accuracy_greedy_<domain>_before, ...)."""
    return {name: value for name, value in summary.items()
            if name.startswith(("accuracy_greedy_", "accuracy_sampled_")) and name not in ACCURACIES}


def seed_statistics(rows: list[dict]) -> dict:
    """Per job: mean and spread (sample standard deviation) over the seeds of each accuracy and of
    the gains (after - before), overall ("gain_greedy") and per domain ("gain_greedy_<domain>")."""
    stats = {}
    for label in dict.fromkeys(row["label"] for row in rows):
        mine = [row for row in rows if row["label"] == label]
        figures = {name: [row[name] for row in mine] for name in (*ACCURACIES, "accuracy", "wall_s")}
        domains = sorted({name.split("_", 2)[2].rsplit("_", 1)[0] for row in mine for name in row.get("domains") or {}})
        for kind in ("greedy", "sampled"):
            figures[f"gain_{kind}"] = [gain(row, f"accuracy_{kind}") for row in mine]
            for domain in domains:
                figures[f"gain_{kind}_{domain}"] = [gain(row.get("domains") or {}, f"accuracy_{kind}_{domain}")
                                                    for row in mine]
        stats[label] = {name: spread(values) for name, values in figures.items() if any(v is not None for v in values)}
    return stats


def gain(figures: dict, stem: str) -> float | None:
    after, before = figures.get(f"{stem}_after"), figures.get(f"{stem}_before")
    return after - before if isinstance(after, (int, float)) and isinstance(before, (int, float)) else None


def targets_met(rows: list[dict], stats: dict) -> dict:
    """Each target of TARGETS (and POWER_TARGET): the figures it reads and whether it is met. A job is
    met only if every seed succeeded and every figure is finite."""
    verdicts = {}
    for label, (sampled_min, greedy_min, per_domain) in TARGETS.items():
        if label not in stats:
            continue
        figures = stats[label]
        checks = {"gain_sampled": sampled_min, "gain_greedy": greedy_min}
        if per_domain:
            checks.update({name: sampled_min if "sampled" in name else greedy_min
                           for name in figures if name.startswith(("gain_sampled_", "gain_greedy_"))})
        shown = {name: round(100 * figures[name]["mean"], 1) if figures.get(name, {}).get("n") else None
                 for name, floor in checks.items() if floor is not None}
        met = all(value is not None and value >= checks[name] for name, value in shown.items())
        verdicts[label] = {"points": shown, "met": met and all_ran(rows, label)}
    power, baseline = stats.get("power-sampling", {}), stats.get("power-sampling baseline", {})
    if power.get("accuracy", {}).get("n") and baseline.get("accuracy", {}).get("n"):
        lead = round(100 * (power["accuracy"]["mean"] - baseline["accuracy"]["mean"]), 1)
        verdicts["power-sampling"] = {"points": {"lead_over_sampling": lead},
                                      "met": lead >= POWER_TARGET and all_ran(rows, "power-sampling")
                                      and all_ran(rows, "power-sampling baseline")}
    return verdicts


def all_ran(rows: list[dict], label: str) -> bool:
    return all(row["status"] == "succeeded" and row["nan_free"] for row in rows if row["label"] == label)


def spread(values: list) -> dict:
    numbers = [v for v in values if isinstance(v, (int, float))]
    return {"mean": statistics.fmean(numbers), "sd": statistics.stdev(numbers) if len(numbers) > 1 else 0.0,
            "n": len(numbers)} if numbers else {"n": 0}


def print_table(rows: list[dict], stats: dict) -> None:
    def pct(value):
        return f"{100 * value:5.1f}" if isinstance(value, (int, float)) else "    —"

    def number(value, scale: float = 1.0):
        return f"{value / scale:,.1f}" if isinstance(value, (int, float)) else "—"

    print(f"{'run':<26}{'seed':>5} {'status':<10}{'wall s':>7}  {'peak MB per GPU':<18}"
          f"{'energy kJ':>10}{'J/correct':>10}"
          f"{'greedy before→after':>21}{'T=1 before→after':>19}{'acc':>7}  nan-free  model")
    for row in rows:
        peak = " ".join(f"{v:,.0f}" for v in (row["peak_mem_mb"] or {}).values()) or "—"
        model = {None: "—", True: "loads+gen", False: "FAILS"}[row["saved_model_generates"]]
        # `—*`: not measured, the reason below the row; `—` alone: a row written before the energy figures.
        energy = number(row.get("energy_j"), 1000.0) + ("*" if row.get("energy_unavailable") else "")
        print(f"{row['label']:<26}{row['seed']:>5} {str(row['status']):<10}{row['wall_s']:>7.0f}  {peak:<18}"
              f"{energy:>10}{number(row.get('energy_j_per_correct_answer')):>10}"
              f"{pct(row['accuracy_greedy_before']):>13} → {pct(row['accuracy_greedy_after'])}"
              f"{pct(row['accuracy_sampled_before']):>11} → {pct(row['accuracy_sampled_after'])}"
              f"{pct(row['accuracy']):>7}  {'yes' if row['nan_free'] else 'NO':<9} {model}")
        if row["status"] != "succeeded" and row["error"]:
            print(f"    {row['error']}")
        if row.get("energy_unavailable"):
            print(f"    * energy not measured: {row['energy_unavailable']}")
    print("\nmean ± sd over seeds (points):")
    for label, figures in stats.items():
        shown = ", ".join(f"{name} {100 * f['mean']:+.1f} ± {100 * f['sd']:.1f}" if name.startswith("gain")
                          else f"{name} {100 * f['mean']:.1f} ± {100 * f['sd']:.1f}"
                          for name, f in figures.items() if f["n"] and name != "wall_s")
        print(f"  {label}: {shown}; wall {figures['wall_s']['mean']:.0f} s")


def print_targets(verdicts: dict) -> None:
    print("\nlearning targets (mean gain, points):")
    for label, verdict in verdicts.items():
        shown = ", ".join(f"{name} {value:+.1f}" if value is not None else f"{name} —"
                          for name, value in verdict["points"].items())
        print(f"  {label}: {'MET' if verdict['met'] else 'NOT MET'}: {shown}")


def gpu_tests() -> dict:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/gpu", "-p", "no:cacheprovider"],
                          capture_output=True, text=True, cwd=ROOT)
    tail = (done.stdout + done.stderr).strip().splitlines()[-1:] or [""]
    print(f"\nGPU-marked tests: exit {done.returncode}: {tail[0]}", flush=True)
    return {"exit_code": done.returncode, "last_line": tail[0], "seconds": time.perf_counter() - started}


BASELINE = """No baseline: an acceptance run, not a comparison with other code. Each recipe runs at its defaults and is
checked against its learning target (TARGETS); power sampling's accuracy is set beside its own
temperature-1 sampling run (method=sample), the recipe's reference point, not a speed baseline."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] + "\n\n" + BASELINE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", default=None, help="GPUs per run (default: every GPU found; CPU: 2 ranks)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--jobs", type=int, default=None, help="runs at once (default all; they share the GPUs, "
                        "runs sized `auto` each taking their share of a card's free memory)")
    parser.add_argument("--partial", default=None, help="append each run's row to this JSON-lines file as it ends")
    parser.add_argument("--only", nargs="*", default=None, help="labels of the jobs to run (default all)")
    parser.add_argument("--set", action="append", default=[], metavar="LABEL:KEY=VALUE",
                        help="a setting for one job (quick checks on CPU; an acceptance run sets none)")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--home", default=None, help="GPUSCALE_HOME of the runs (default: a fresh folder)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--from-partial", nargs="+", default=None, metavar="FILE",
                        help="run nothing: the table, targets and result file of the rows --partial files "
                             "hold (a check cut short by a time limit still reports what ended; a check "
                             "run in parts, --only each, is reported as one)")
    args = parser.parse_args()
    if args.from_partial:
        report_partial(args)
        return

    import torch
    import transformers  # its lazy imports are not thread-safe: resolve them before the pool's threads do

    transformers.AutoModelForCausalLM, transformers.AutoTokenizer  # noqa: B018
    found = torch.cuda.device_count()
    gpus = args.gpus or str(found or 2)
    home = Path(args.home or ROOT / ".acceptance" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    extra: dict[str, dict] = {}
    for item in args.set:
        label, _, pair = item.partition(":")
        key, _, value = pair.partition("=")
        extra.setdefault(label, {})[key] = value
    jobs = [(label, recipe, {**settings, **extra.get(label, {})}, int(seed))
            for seed in args.seeds.split(",") for label, recipe, settings in JOBS
            if args.only is None or label in args.only]
    at_once = min(args.jobs or len(jobs), len(jobs))
    jobs = [(label, recipe, {**machine_settings(index, gpus, found, jobs[:at_once]), **settings}, seed)
            for index, (label, recipe, settings, seed) in enumerate(jobs)]
    shared_threads(at_once)
    started = time.perf_counter()

    def run_and_keep(job) -> dict:
        label, recipe, settings, seed = job
        row = row_of(launch(label, recipe, settings, seed, home))
        if args.partial:
            with open(args.partial, "a") as handle:
                handle.write(json.dumps(row) + "\n")
        return row

    # The GPU-marked tests run alongside the runs, on a worker of their own (so `--jobs` counts runs
    # only): they are small, and the wall time of the whole check is the longest run's either way.
    with ThreadPoolExecutor(max_workers=at_once) as pool, ThreadPoolExecutor(max_workers=1) as beside:
        tests = None if args.skip_tests else beside.submit(gpu_tests)
        rows = sorted(pool.map(run_and_keep, jobs), key=lambda row: (row["label"], row["seed"]))
        tests = tests and tests.result()
    stats, verdicts = report(rows)
    total = time.perf_counter() - started
    print(f"\nacceptance: {total:.0f} s in all, {gpus} GPU(s) per run, {at_once} runs at once")
    write_result("acceptance", f"acceptance-{gpus}gpu", {"gpus": gpus, "seeds": args.seeds, "jobs": at_once,
                                                        "set": args.set, "only": args.only},
                 {"runs": rows, "seed_statistics": stats, "targets": verdicts, "gpu_tests": tests,
                  "seconds": total}, out=args.out)


def report(rows: list[dict]) -> tuple[dict, dict]:
    """The seed statistics and the targets' verdicts of the rows, both printed."""
    stats = seed_statistics(rows)
    verdicts = targets_met(rows, stats)
    print_table(rows, stats)
    print_targets(verdicts)
    return stats, verdicts


def report_partial(args) -> None:
    lines = [line for path in args.from_partial for line in Path(path).read_text().splitlines() if line.strip()]
    rows = sorted((json.loads(line) for line in lines), key=lambda row: (row["label"], row["seed"]))
    stats, verdicts = report(rows)
    write_result("acceptance", f"acceptance-{args.gpus}gpu-partial",
                 {"gpus": args.gpus, "seeds": args.seeds, "from_partial": args.from_partial},
                 {"runs": rows, "seed_statistics": stats, "targets": verdicts}, out=args.out)


def machine_settings(index: int, gpus: str, found: int, first_wave: list) -> dict:
    """How run `index` shares the machine: its GPUs (one GPU per run on a machine of several: pinned to
    GPU index % found, so the runs spread over the cards) and, for runs sized `auto`, the share of the
    card's free memory that leaves room for every auto-sized run that starts at the same moment."""
    pinned = found > 1 and gpus == "1"
    settings = {"gpus": f"{index % found}," if pinned else gpus}
    cards = found if pinned else 1
    auto_per_card = math.ceil(sum(job[0] in AUTO_SIZED for job in first_wave) / cards)
    if auto_per_card > 1:
        settings["gpu_memory_share"] = round(AUTO_MEMORY_SHARE / auto_per_card, 3)
    return settings


if __name__ == "__main__":
    main()
