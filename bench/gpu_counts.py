"""The GPU-count matrix: every recipe's defaults on 1, 2, 3 and 4 GPUs run, or are refused before launch.

    python bench/gpu_counts.py [--counts 1,2,3,4] [--recipes sft,rft,...] [--model M] [--gpu-ids 0,1,2,3]
                               [--parallel] [--json PATH]

Each case is a real `gpuscale run` (CLI, supervisor, torchrun or accelerate, the ranks) in a GPUSCALE_HOME of
its own, with the recipe's defaults and nothing but the GPU count and `--model`, except how long it lasts
(`SHORT`: steps, evaluation, saving; the counts a step shares over the ranks, and what sizes them, are the
defaults). A default that does not split over the count is moved before launch (recipes/shared/rank_split.py);
the case records what moved (`fitted_to_ranks`). Verdict: the run succeeded with that many ranks.

Beside them, for each count that some value does not split over, a `given` case sets that value (`GIVEN`):
it must be refused before anything starts, exit 2 within `REFUSED_WITHIN_S`, naming the setting.

With --parallel, cases run at once, each on GPUs of its own from --gpu-ids (a GPU named twice is shared by
two cases). The result (bench/record.py's schema) goes to bench/results/faults/gpu-counts-<date>-<card>.json;
the exit code is 1 unless every case passed. On CPU, `--counts` are CPU ranks (the CPU test of the same
matrix is tests/integration/test_rank_counts.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, also when loaded by path
from faults import GpuPool  # noqa: E402
from record import write_result  # noqa: E402
from resume_kill import cli  # noqa: E402

from gpuscale.recipes.shared.registry import get_recipe  # noqa: E402
from gpuscale.runs.devices import visible_gpu_indices  # noqa: E402

BASELINE = "No baseline: the target is absolute (a default run on any GPU count runs, or is refused before launch)."
REFUSED_WITHIN_S = 5.0
SHORT = {  # how long a run lasts, nothing else
    "grpo-mtl": ["max_steps=2", "eval_examples=8", "save_model=false"],
    "sft": ["max_steps=2", "eval_examples=8", "save_model=false"],
    # A model of random weights answers nothing right: rft trains on the gold answers too, or has nothing to
    # train on (a refusal of the model, not of the GPU count; seen on H200 at random-qwen2.5-0.5b).
    "rft": ["max_examples=64", "max_steps=2", "eval_examples=8", "save_model=false", "include_gold=true"],
    "eggroll": ["steps=1", "eval_examples=0", "save_model=false"],
    # Random weights never end an answer: MCMC over the whole default length took minutes.
    "power-sampling": ["max_examples=16", "max_new_tokens=32"],
    "probe": [],
}
# A value that splits over no count but 1 and a few others, given: refused on the counts it does not split over.
GIVEN = {"grpo-mtl": "prompts_per_step=16", "sft": "rows_per_step=8", "rft": "rows_per_step=32",
         "eggroll": "population=2048"}


@dataclass(frozen=True)
class Case:
    recipe: str
    count: int
    given: str | None = None  # a setting the user gave (a `given` case), or None: the defaults

    @property
    def name(self) -> str:
        return f"{self.recipe}-{self.count}" + (f"-{self.given}" if self.given else "")


def splits(case: Case) -> bool:
    """Whether the given value splits over the case's count (the value over the count, in pairs for eggroll)."""
    value = int(case.given.split("=")[1])
    per_value = recipe_default("grpo-mtl", "num_generations") if case.recipe == "grpo-mtl" else 1
    multiple = case.count * (2 if case.recipe == "eggroll" and case.count % 2 else 1)
    return (value * per_value) % multiple == 0


def recipe_default(recipe: str, field: str):
    return get_recipe(recipe).settings_cls.model_fields[field].default


def cases(recipes: list[str], counts: list[int]) -> list[Case]:
    found = [Case(recipe, count) for recipe in recipes for count in counts]
    found += [Case(recipe, count, GIVEN[recipe]) for recipe in recipes if recipe in GIVEN for count in counts
              if not splits(Case(recipe, count, GIVEN[recipe]))]
    return found


def run_case(case: Case, opts, gpus: str, home: Path) -> dict:
    env = {**os.environ, "GPUSCALE_HOME": str(home)}
    arguments = ["run", "--recipe", case.recipe, "--gpus", gpus, "--model", opts.model,
                 *(f"--set={setting}" for setting in SHORT[case.recipe] + ([case.given] if case.given else []))]
    started = time.monotonic()
    code, run, error = cli(*arguments, env=env, timeout=opts.case_timeout)
    wall = time.monotonic() - started
    figures = {"case": case.name, "recipe": case.recipe, "count": case.count, "gpus": gpus, "given": case.given,
               "arguments": arguments, "exit_code": code, "wall_s": round(wall, 2)}
    if case.given:
        field = case.given.split("=")[0]
        refusal = error.splitlines()[-1] if error else ""
        figures.update(refusal=refusal, passed=code == 2 and wall <= REFUSED_WITHIN_S
                       and refusal.startswith(f"gpuscale: error: {field}: "))
        return figures
    summary = (run or {}).get("summary") or {}
    figures.update(run=(run or {}).get("id"), status=(run or {}).get("status"), error=(run or {}).get("error") or
                   (error[-800:] if code else None), world_size=summary.get("world_size"),
                   fitted_to_ranks=summary.get("fitted_to_ranks"))
    figures["passed"] = code == 0 and figures["status"] == "succeeded" and figures["world_size"] == case.count
    return figures


def verdict_line(f: dict) -> str:
    head = f"{f['case']} ({f['gpus']}): {'PASS' if f['passed'] else 'FAIL'} in {f['wall_s']:.1f} s"
    if f["given"]:
        return f"{head}: exit {f['exit_code']}: {f['refusal']}"
    fitted = f"; fitted: {f['fitted_to_ranks']}" if f.get("fitted_to_ranks") else ""
    error = f"; error: {f['error']}" if f["error"] else ""
    return f"{head}: {f['status']}, world size {f['world_size']}{fitted}{error}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__ + "\n" + BASELINE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", default="1,2,3,4")
    parser.add_argument("--recipes", default=",".join(SHORT))
    parser.add_argument("--model", default="random-qwen2.5-0.5b")
    parser.add_argument("--gpu-ids", default=None, help="the GPUs the cases share (default: every visible one)")
    parser.add_argument("--parallel", action="store_true")
    parser.add_argument("--case-timeout", type=float, default=900.0)
    parser.add_argument("--json", default=None)
    opts = parser.parse_args()
    counts = [int(count) for count in opts.counts.split(",")]
    pool_ids = [int(i) for i in opts.gpu_ids.split(",")] if opts.gpu_ids else visible_gpu_indices()
    pool = GpuPool(pool_ids)
    todo = cases(opts.recipes.split(","), counts)
    root = Path(tempfile.mkdtemp(prefix="gpuscale-gpu-counts-"))

    def one(case: Case) -> dict:
        taken = pool.take(case.count)
        try:
            gpus = ",".join(map(str, taken)) + ("," if len(taken) == 1 else "") if taken else str(case.count)
            figures = run_case(case, opts, gpus, root / case.name)
        finally:
            pool.give_back(taken)
        print(verdict_line(figures), flush=True)
        return figures

    settings = {"counts": counts, "recipes": opts.recipes, "model": opts.model, "pool": pool_ids,
                "parallel": opts.parallel, "short": SHORT, "given": GIVEN, "baseline": BASELINE}
    out = Path(opts.json) if opts.json else None
    results = []
    with ThreadPoolExecutor(max_workers=len(todo) if opts.parallel else 1) as workers:
        for finished in as_completed([workers.submit(one, case) for case in todo]):
            results.append(finished.result())
            # Written after every case: a call cut short by its time limit keeps the cases it ran.
            done = {"cases": results, "cases_left": len(todo) - len(results),
                    "passed": all(result["passed"] for result in results) and len(results) == len(todo)}
            out = write_result("faults", "gpu-counts", settings, done, out=out, card=None if pool_ids else "cpu")
    print(f"{sum(r['passed'] for r in results)} of {len(results)} cases passed")
    sys.exit(0 if done["passed"] else 1)


if __name__ == "__main__":
    main()
