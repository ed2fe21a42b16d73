"""Where one optimizer step of a TRL-trained recipe goes, on every rank of a real `gpuscale run`.

The run is started as a user would (the settings after `--`; default: bench/scaling.py's grpo-mtl
point at random-qwen2.5-0.5b on 4 GPUs). A `sitecustomize` module put on the ranks' PYTHONPATH adds a
callback to every transformers Trainer: optimizer step --step (after the first steps' warm-up) runs
under torch.profiler, from `on_step_begin` to `on_step_end` (so grpo-mtl's generation, the micro-batches'
forward and backward, DDP's all-reduce, clipping and the optimizer are all inside). Each rank writes
`<out>.rank<R>.txt`: the step's wall time, then the profiler's operators by CPU time and by GPU time;
with --trace also `<out>.rank<R>.trace.json.gz`, the step's timeline (chrome://tracing, Perfetto), which
shows on which rank a collective waited and for what. Comparing the 1-GPU and the 4-GPU files of the
same per-GPU work shows what the larger count adds.

    python bench/profile_step.py --out grpo-4gpu            # writes grpo-4gpu.rank0.txt ... rank3.txt
    python bench/profile_step.py --out sft-1gpu -- --recipe sft --gpus 1 --model tiny-math ...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_rollout import rank_sitecustomize, run_with_sitecustomize  # noqa: E402

BASELINE = """No baseline: a profile of gpuscale's own training step (bench/scaling.py measures its throughput
against the same recipe on 1 GPU)."""

DEFAULT_RUN = ["--recipe", "grpo-mtl", "--gpus", "4", "--model", "random-qwen2.5-0.5b", "--batch-size", "32",
               "--set", "generator=engine", "--set", "num_generations=8", "--set", "prompts_per_step=32",
               "--set", "max_completion_length=64", "--set", "max_steps=5", "--set", "learning_rate=1e-6",
               "--set", "eval_examples=0", "--set", "save_model=false", "--set", "max_examples=160"]

# Imported by every Python process that has the folder on its path (the ranks): adds the callback.
SITECUSTOMIZE = '''
import os, time

def _patch():
    import transformers
    target, out = int(os.environ["GPUSCALE_PROFILE_STEP"]), os.environ["GPUSCALE_PROFILE_OUT"]
    trace = os.environ.get("GPUSCALE_PROFILE_TRACE") == "1"
    rank = os.environ.get("RANK", "0")

    class ProfileOneStep(transformers.TrainerCallback):
        profiler, started = None, 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step + 1 != target:
                return
            import torch
            from torch.profiler import ProfilerActivity, profile
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.started = time.perf_counter()
            self.profiler = profile(activities=activities)
            self.profiler.__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            if self.profiler is None or state.global_step != target:
                return
            import torch
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            wall = time.perf_counter() - self.started
            self.profiler.__exit__(None, None, None)
            averages = self.profiler.key_averages()
            if trace:
                import gzip, shutil
                timeline = f"{out}.rank{rank}.trace.json"
                self.profiler.export_chrome_trace(timeline)
                with open(timeline, "rb") as raw, gzip.open(timeline + ".gz", "wb") as packed:
                    shutil.copyfileobj(raw, packed)
                os.remove(timeline)
            self.profiler = None
            with open(f"{out}.rank{rank}.txt", "w") as handle:
                handle.write(f"rank {rank}, optimizer step {target}: wall {wall:.4f} s (under the profiler)\\n\\n")
                handle.write("by CPU time (the operator and what it called):\\n")
                handle.write(averages.table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=70))
                handle.write("\\n\\nby self GPU time:\\n")
                handle.write(averages.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70))

    original_init = transformers.Trainer.__init__

    def init_with_profiler(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.add_callback(ProfileOneStep())

    transformers.Trainer.__init__ = init_with_profiler
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] + "\n\n" + BASELINE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="the profiles' stem: <out>.rank<R>.txt per rank")
    parser.add_argument("--step", type=int, default=3, help="which optimizer step to profile (1 = the first)")
    parser.add_argument("--trace", action="store_true", help="also each rank's timeline of the step, gzipped")
    parser.add_argument("run", nargs=argparse.REMAINDER, help="-- then `gpuscale run` arguments (default: "
                        "bench/scaling.py's grpo-mtl point on 4 GPUs, 5 steps)")
    args = parser.parse_args()
    run = [part for part in args.run if part != "--"] or DEFAULT_RUN
    sitecustomize = rank_sitecustomize(SITECUSTOMIZE, "GPUSCALE_PROFILE_OUT")
    code = run_with_sitecustomize(sitecustomize, run, {"GPUSCALE_PROFILE_OUT": str(args.out.resolve()),
                                                       "GPUSCALE_PROFILE_STEP": str(args.step),
                                                       "GPUSCALE_PROFILE_TRACE": "1" if args.trace else "0"})
    written = sorted(args.out.parent.glob(f"{args.out.name}.rank*.txt"))
    if not written:
        raise SystemExit(f"no profile written (run exit {code}; fewer than {args.step} optimizer steps?)")
    print(written[0].read_text()[:3000])


if __name__ == "__main__":
    main()
