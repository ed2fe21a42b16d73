"""The GPU-count matrix on CPU ranks (3 gloo ranks, more than CI's 2 cores: slower, no less true): every
recipe whose step the ranks share, and power sampling's uneven shards of problems, asked for with its
defaults and nothing but the rank count, runs; a default that
the ranks cannot share moved before launch (recipes/shared/rank_split.py) and said at launch and in the
summary. Only how long a run lasts is cut (steps, evaluation, saving, the examples loaded: sft's default loads
all 8,000 of tiny-math's training rows on each rank, eggroll's its 200,000 problems): the shapes that must
split, and what sizes them, are the defaults. The probe's ranks each time their own steps. The refusals of
given values are in test_bad_input.py; the matrix of 1 to 8 ranks of every recipe's defaults, on GPU and CPU
values, in tests/unit/test_rank_split.py."""

from __future__ import annotations

import json

import pytest

from conftest import gpuscale

pytestmark = pytest.mark.e2e

RANKS = "3"  # over which none of grpo-mtl's, sft's, rft's and eggroll's defaults splits
SHORT = {  # the run's length only
    "grpo-mtl": ["max_steps=1", "eval_examples=2", "save_model=false", "max_completion_length=8"],
    "sft": ["max_steps=1", "eval_examples=2", "save_model=false", "max_new_tokens=8", "max_examples=64"],
    "rft": ["max_examples=9", "max_steps=1", "eval_examples=2", "save_model=false", "max_new_tokens=16"],
    "eggroll": ["steps=1", "eval_examples=0", "save_model=false", "max_new_tokens=8", "max_examples=64"],
    "power-sampling": ["max_examples=4", "max_new_tokens=8"],  # 4 problems over 3 ranks: shards of 2, 1 and 1
}
FITTED = {
    "grpo-mtl": "prompts_per_step 64 -> 63: the default's 64 prompts x 4 generations = 256 completions do not "
                "split over 3 ranks; --set prompts_per_step=N chooses",
    "sft": "rows_per_step 8 -> 9: the default's 8 rows a step do not split over 3 ranks; --set rows_per_step=N chooses",
    "rft": "rows_per_step 32 -> 33: the default's 32 rows a step do not split over 3 ranks; --set rows_per_step=N "
           "chooses",
    # A device default: the rank resolves it, and fits it (Recipe.device_values_fitted).
    "eggroll": "population 64 -> 66: the default's 64 members in antithetic pairs do not split over 3 ranks; "
               "--set population=N chooses",
}


@pytest.mark.parametrize("recipe", list(SHORT))
def test_the_defaults_run_on_three_ranks(home, recipe):
    args = ["run", "--recipe", recipe, "--gpus", RANKS, *(f"--set={setting}" for setting in SHORT[recipe]), "--json"]
    result = gpuscale(*args)
    assert result.returncode == 0, result.stderr
    run = json.loads(result.stdout)
    assert run["status"] == "succeeded", run["error"]
    if recipe == "power-sampling":  # its summary counts problems; the uneven shards are all back
        assert run["summary"]["problems"] == 4
    else:
        assert run["summary"]["world_size"] == 3
    fitted = FITTED.get(recipe)
    assert run["summary"].get("fitted_to_ranks") == fitted
    if fitted and recipe != "eggroll":  # said at launch; eggroll's by its rank 0, in its log
        assert f"run {run['id']}: {fitted}" in result.stderr.splitlines()
    elif fitted:
        assert fitted in (home / "runs" / str(run["id"]) / "logs" / "rank0.log").read_text().splitlines()
    if fitted:
        assert f"  fitted_to_ranks: {fitted}" in gpuscale("show", str(run["id"])).stdout.splitlines()
