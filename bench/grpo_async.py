"""grpo-mtl: the synchronous rollout against rollout=async, side by side in one call, at the same shape.

    python bench/grpo_async.py [--gpus 1,2] [--model random-qwen2.5-0.5b] [--max-staleness 1] [--generation-gpus 1]
                               [--compile] [--old-logprobs loss|forward]

For each GPU count of --gpus, real `gpuscale run --recipe grpo-mtl` runs with gpuscale's engine
at the same settings (bench/grpo_mtl.py's: `--prompts-per-step` prompts per GPU per step, each answered
`--generations` times, `--max-completion-length` tokens, `--steps` optimizer steps, no evaluation,
nothing saved): `rollout=sync`, then `rollout=async` (`max_staleness=--max-staleness`). Each run's
figures are grpo_mtl.py's, with `completions_per_s_run`: its completions over its whole training time,
the first step included (the measure of async's target), and for async the summary's staleness and
clipped share.

Ratios per GPU count: `async_over_sync` (completions_per_s_run; target >= 1.5 on 2 GPUs), the steady
ratio at the median step (`async_over_sync_steady`); where --gpus holds 1 and N, each mode's weak-scaling
efficiency (completions_per_s_run on N GPUs over N x one GPU's; async target >= 0.85 on 4 GPUs).

`rollout=async` alone overlaps on each rank's own GPU: a thread with its own CUDA stream decodes step k+1
while step k trains. At every count over --generation-gpus K (default 1; 0: none) a third run places them:
`rollout=async` with `generation_gpus=K` (engines/placement.py: K GPUs generate, the others train, the
weights sent every step), the same prompts a step over the same GPUs; `placed_over_sync` and its weak
scaling against the one-GPU synchronous run (placement needs 2 GPUs; one GPU's run is what a user has
without it). On CPU (the script's test) pass `--model tiny-math` and tiny sizes.

`--old-logprobs forward` runs async and placed with TRL's no-grad forward for the importance ratio's old
log-probs (grpo-mtl's `old_logprobs`; the default, `loss`, takes them from the loss's forward:
engines/off_policy.py). To measure what skipping that forward gains on a GPU, run the same call with and
without it, one after the other: each async and placed run's steady step (`step_seconds`; the forward was
0.11-0.28 s of 0.55-1.81 s steps, bench/RESULTS.md), `async_over_sync`/`placed_over_sync`, and that the
clipped share stays where it was (the CPU test shows one step's loss, gradients and ratio figures equal);
the `logprobs` phase's share (bench/step_phases.py, `--set rollout=async`) should drop to about 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

BASELINE = """The baseline: grpo-mtl's own synchronous rollout (rollout=sync, gpuscale's engine: every rank generates,
then trains), the fastest GRPO users have here, at the same shape, GPUs, dtype and steps, in the same call."""

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, also when loaded by path
from grpo_mtl import measure, ratio  # noqa: E402
from record import write_result  # noqa: E402

MODES = ("sync", "async", "placed")  # placed: rollout=async with generation_gpus
TARGETS = {"async_over_sync_2gpu": 1.5, "async_scaling_efficiency_4gpu": 0.85,
           "placed_over_sync_2gpu": 1.5, "placed_scaling_efficiency_4gpu": 0.85}


def modes_at(gpus: int, generation_gpus: int) -> list[str]:
    """The modes measured on `gpus` GPUs: placement where some GPUs are left to train."""
    return [mode for mode in MODES if mode != "placed" or 0 < generation_gpus < gpus]


def mode_settings(args, mode: str) -> dict:
    """The grpo-mtl settings a mode's run adds to the shared shape (bench/grpo_mtl.py's run_settings)."""
    extra = {"rollout": "sync" if mode == "sync" else "async"}
    if mode != "sync":
        extra["max_staleness"] = args.max_staleness
    if mode == "placed":
        extra["generation_gpus"] = args.generation_gpus
    if mode != "sync" and args.old_logprobs != "loss":
        extra["old_logprobs"] = args.old_logprobs
    if args.compile:
        extra["compile"] = "true"
    if args.lora_rank:
        extra["lora_rank"] = args.lora_rank
    return extra


def measure_mode(args, mode: str, gpus: int) -> dict:
    extra = mode_settings(args, mode)
    print(f"{mode}: {' '.join(f'{k}={v}' for k, v in extra.items())} on {gpus} GPU(s)", flush=True)
    return {"rollout": mode, **measure(args, "engine", gpus, extra)}


def ratios(runs: dict, counts: list[int]) -> dict:
    """async and placed over sync at each count; each mode's weak scaling against one GPU where measured
    (placed's against the one-GPU sync run: it has no one-GPU run of its own)."""
    out = {}
    for gpus in counts:
        sync = runs.get(f"sync_{gpus}gpu", {})
        for mode in ("async", "placed"):
            if f"{mode}_{gpus}gpu" not in runs:
                continue
            fast = runs[f"{mode}_{gpus}gpu"]
            out[f"{mode}_over_sync_{gpus}gpu"] = ratio(fast.get("completions_per_s_run"),
                                                       sync.get("completions_per_s_run"))
            out[f"{mode}_over_sync_steady_{gpus}gpu"] = ratio(fast.get("completions_per_s"),
                                                              sync.get("completions_per_s"))
        if gpus > 1 and 1 in counts:
            for mode in MODES:
                if f"{mode}_{gpus}gpu" not in runs:
                    continue
                one_gpu = "sync" if mode == "placed" else mode
                scaling = ratio(runs[f"{mode}_{gpus}gpu"].get("completions_per_s_run"),
                                runs.get(f"{one_gpu}_1gpu", {}).get("completions_per_s_run"))
                out[f"{mode}_scaling_efficiency_{gpus}gpu"] = scaling / gpus if scaling else None
    return out


def print_table(results: dict) -> None:
    def cell(value, form):
        return format(value, form) if value is not None else "-"

    print(f"\n{'run':<12} {'step s':>8} {'gen s':>8} {'compl/s':>9} {'run compl/s':>12} {'stale':>6} {'clipped':>8}")
    for name, r in results["runs"].items():
        if "error" in r:
            print(f"{name:<12} failed: {r['error'][:80]}")
            continue
        print(f"{name:<12} {cell(r['step_seconds'], '8.3f')} {cell(r['generation_seconds_per_step'], '8.3f')} "
              f"{cell(r['completions_per_s'], '9.1f')} {cell(r['completions_per_s_run'], '12.1f')} "
              f"{cell(r.get('sampling_staleness_last'), '6.2f')} "
              f"{cell(r.get('sampling_importance_sampling_clipped_share_last'), '8.4f')}")
    print()
    for name, value in results["ratios"].items():
        target = TARGETS.get(name)
        verdict = "" if target is None or value is None else f"{'meets' if value >= target else 'short of'} {target}"
        print(f"{name:<34} {cell(value, '.2f'):>6}  {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + "\n\n" + BASELINE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random-qwen2.5-0.5b")
    parser.add_argument("--dataset", default="tiny-math")
    parser.add_argument("--gpus", default="2", help="comma-separated GPU counts, each measured sync and async")
    parser.add_argument("--prompts-per-step", type=int, default=16, help="prompts per GPU per step")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-completion-length", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32, help="completions per GPU per training micro-batch")
    # The whole-run figure counts the first step, whose generation held the engine's start (about 16 s of a
    # 10-step run's 20 s generating on an H200: results/grpo_mtl/async-2026-11-29-h200x2.json); 40 steps
    # weigh it as a longer run would, and the 5 runs of --gpus 1,2 still fit a 10-minute call.
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps of every run")
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--generation-gpus", type=int, default=1,
                        help="GPUs that generate in the placed run, at each count above it (0: no placed run)")
    parser.add_argument("--learning-rate", type=float, default=1e-6)
    parser.add_argument("--compile", action="store_true", help="every run with compile=true (the engine's decode step "
                        "compiled by torch.compile; its compiling counts in the whole-run figure)")
    parser.add_argument("--old-logprobs", choices=("loss", "forward"), default="loss",
                        help="async and placed runs: the importance ratio's old log-probs from the loss's forward "
                        "(grpo-mtl's default) or from TRL's extra no-grad forward (to compare the two)")
    parser.add_argument("--lora-rank", type=int, default=0, help="every run with LoRA adapters of this rank "
                        "(0: a full fine-tune); run the same call with and without to set LoRA's step beside the "
                        "full fine-tune's")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--home", default=None, help="GPUSCALE_HOME of the runs (default: a new temporary one)")
    parser.add_argument("--out", default=None, help="default: bench/results/grpo_mtl/async-<date>-<card>.json")
    args = parser.parse_args()
    counts = sorted({int(count) for count in args.gpus.split(",")})
    os.environ["GPUSCALE_HOME"] = args.home or tempfile.mkdtemp(prefix="gpuscale-bench-grpo-async-")

    runs = {f"{mode}_{gpus}gpu": measure_mode(args, mode, gpus)
            for gpus in counts for mode in modes_at(gpus, args.generation_gpus)}
    results = {"runs": runs, "ratios": ratios(runs, counts), "targets": TARGETS}
    print_table(results)
    write_result("grpo_mtl", "async", vars(args), results, out=args.out)


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
