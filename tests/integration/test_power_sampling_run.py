"""power-sampling end to end on CPU: 2 ranks, the embedded default model and tasks."""

import json

from conftest import gpuscale, run_json


def test_two_rank_power_sampling_run_on_the_defaults(home):
    run = run_json("run", "--recipe", "power-sampling", "--gpus", "2", "--set", "max_examples=6", "--batch-size", "3")
    assert run["status"] == "succeeded", run["error"]
    summary = run["summary"]
    assert summary["method"] == "power" and summary["problems"] == 6
    assert 0.0 <= summary["accuracy"] <= 1.0 and 0.0 < summary["acceptance_rate"] <= 1.0
    assert summary["tokens_per_s"] > 0 and summary["problems_per_s"] > 0
    shown = run_json("show", str(run["id"]))["summary"]
    assert {"accuracy", "acceptance_rate", "tokens_per_s", "problems_per_s"} <= set(shown)
    exported = json.loads(gpuscale("export", str(run["id"])).stdout)
    results = exported["results"]
    assert [r["index"] for r in results] == list(range(6))  # both ranks' shares, merged in order
    for row in results:
        assert row["token_ids"] and isinstance(row["completion"], str) and row["gold"]
        assert row["correct"] == (row["extracted"] is not None and float(row["extracted"]) == float(row["gold"]))
    assert summary["accuracy"] == sum(r["correct"] for r in results) / 6


def test_seed_knobs_work_as_aliases(home):
    env = {"POWERSAMPLE_STEPS": "1", "POWERSAMPLE_MAX_NEW": "32", "POWERSAMPLE_MAX_EXAMPLES": "2",
           "POWERSAMPLE_NUM_GPUS": "1", "POWERSAMPLE_BATCH_SIZE": "2"}
    run = run_json("run", "--recipe", "power-sampling", env=env)
    assert run["status"] == "succeeded"
    s = run["settings"]
    assert (s["mcmc_steps"], s["max_new_tokens"], s["max_examples"], s["gpus"], s["batch_size"]) == (1, 32, 2, 1, 2)
    assert run["summary"]["problems"] == 2
