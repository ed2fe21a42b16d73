"""Where grpo-mtl's generation time goes: one engine rollout of a real `gpuscale run --recipe grpo-mtl`,
profiled inside its rank.

The run is started as a user would (the settings after `--`, or bench/train_speed.py's GRPO shape); a
`sitecustomize` module put on the ranks' PYTHONPATH wraps `EngineRollout.__call__` so that call
number --call (after the CUDA graphs of the first calls are captured) runs under torch.profiler. The
rank writes, to --out: the call's wall time, the time inside `engine.generate`, the engine's state
(weights' dtype, compiled or not, CUDA graphs held, whether the fused decode is in use) before and
after the call, and the profiler's kernel table sorted by GPU time. Nothing of the run changes but
the one profiled call's speed.

    python bench/profile_rollout.py --out rollout-profile.txt
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

BASELINE = """No baseline: a profile of gpuscale's own rollout (bench/train_speed.py --only grpo sets it against
stock GRPOTrainer)."""

DEFAULT_RUN = ["--recipe", "grpo-mtl", "--gpus", "1", "--model", "random-qwen2.5-0.5b", "--precision", "bf16",
               "--set", "generator=engine", "--set", "num_generations=8", "--set", "prompts_per_step=16",
               "--set", "max_completion_length=128", "--set", "max_steps=6", "--set", "learning_rate=1e-6",
               "--set", "temperature=1.0", "--set", "beta=0.0", "--set", "eval_examples=0",
               "--set", "save_model=false", "--set", "max_examples=96"]

# Imported by every Python process that has the folder on its path (the ranks): wraps the rollout.
SITECUSTOMIZE = '''
import os, time

def _patch():
    from gpuscale.engines import rollout
    target, out = int(os.environ["GPUSCALE_PROFILE_CALL"]), os.environ["GPUSCALE_PROFILE_OUT"]
    original, calls = rollout.EngineRollout.__call__, [0]

    def engine_state(self):
        e = self.engine
        if e is None:
            return "no engine yet"
        return (f"dtype {e.dtype}, compile {e.compile}, cuda_graphs {e.cuda_graphs}, graphs held {len(e._graphs)}, "
                f"fused decode {getattr(e, '_use_fused', None)}, model training {e.model.training}")

    def profiled(self, prompts, trainer):
        calls[0] += 1
        if calls[0] != target:
            return original(self, prompts, trainer)
        import torch
        from torch.profiler import ProfilerActivity, profile
        def sync():
            if torch.cuda.is_available():
                torch.cuda.synchronize()

        before = engine_state(self)
        generate_seconds = [0.0]
        real_generate = type(self.engine).generate

        def timed_generate(engine, *args, **kwargs):
            started = time.perf_counter()
            try:
                return real_generate(engine, *args, **kwargs)
            finally:
                sync()
                generate_seconds[0] += time.perf_counter() - started

        type(self.engine).generate = timed_generate
        sync()
        started = time.perf_counter()
        try:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            with profile(activities=activities) as prof:
                result = original(self, prompts, trainer)
                sync()
        finally:
            type(self.engine).generate = real_generate
        wall = time.perf_counter() - started
        with open(out, "w") as handle:
            handle.write(f"rollout call {target}: {len(prompts)} rows, wall {wall:.4f} s (under the profiler), "
                         f"engine.generate {generate_seconds[0]:.4f} s\\n")
            handle.write(f"engine before: {before}\\nengine after:  {engine_state(self)}\\n\\n")
            handle.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70))
            handle.write("\\n\\nby self GPU time:\\n")
            handle.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30,
                                                   max_name_column_width=70))
        return result

    rollout.EngineRollout.__call__ = profiled
'''

# The end of every bench sitecustomize: `_patch()` in the ranks alone (python [-u] -m gpuscale.recipes), and
# only where the script's variable ({switch}) is set: the front end, the supervisor and the launcher have
# the folder on their path too, and would each import the engine or transformers for nothing.
RANKS_ONLY = '''
def _rank():
    import sys
    argv = sys.orig_argv
    return "-m" in argv and argv[argv.index("-m") + 1:][:1] == ["gpuscale.recipes"]

if os.environ.get("{switch}") and _rank():
    _patch()
'''


def rank_sitecustomize(patch: str, switch: str) -> str:
    """A sitecustomize whose `_patch()` (defined in `patch`, which imports os) runs in the ranks only,
    where the environment variable `switch` is set."""
    return patch + RANKS_ONLY.replace("{switch}", switch)


def run_with_sitecustomize(code: str, run: list[str], env_extra: dict[str, str]) -> int:
    """`gpuscale run RUN` with `code` as the ranks' sitecustomize (a folder put first on PYTHONPATH) and
    `env_extra` in their environment; the run's exit code."""
    with tempfile.TemporaryDirectory(prefix="gpuscale-profile-") as folder:
        Path(folder, "sitecustomize.py").write_text(code)
        path = os.pathsep.join(filter(None, [folder, os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path, **env_extra}
        return subprocess.run([sys.executable, "-m", "gpuscale.app.cli", "run", *run], env=env).returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] + "\n\n" + BASELINE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="the profile's text file")
    parser.add_argument("--call", type=int, default=4, help="which rollout call to profile (1 = the first)")
    parser.add_argument("run", nargs=argparse.REMAINDER, help="-- then `gpuscale run` arguments (default: "
                        "bench/train_speed.py's GRPO shape, 6 steps)")
    args = parser.parse_args()
    run = [part for part in args.run if part != "--"] or DEFAULT_RUN
    sitecustomize = rank_sitecustomize(SITECUSTOMIZE, "GPUSCALE_PROFILE_OUT")
    code = run_with_sitecustomize(sitecustomize, run, {"GPUSCALE_PROFILE_OUT": str(args.out.resolve()),
                                                       "GPUSCALE_PROFILE_CALL": str(args.call)})
    if not args.out.exists():
        raise SystemExit(f"no profile written (run exit {code}; fewer than {args.call} rollout calls?)")
    print(args.out.read_text()[:3000])


if __name__ == "__main__":
    main()
